"""Fixtures of the lmcache-mooncake tests: a real ``mooncake_master`` on free loopback ports
(P2PHANDSHAKE metadata, no etcd), storage-only nodes (Mooncake's ``mooncake_client``, which
holds a segment of the shared pool) and the adapter configs that reach them.

Mooncake's transfer engine listens on all interfaces for its handshake and data ports
(0.3.13.post1 has no setting for that); every address we pass is 127.0.0.1.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from testsupport.ports import free_port
from testsupport.waiting import eventually

pytest.importorskip("lmcache.storage.mooncake", reason="lmcache-mooncake is not installed")


def _tool(name: str) -> str | None:
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


MASTER = _tool("mooncake_master")
NODE = _tool("mooncake_client")
#: Seconds the master keeps a silent client's segment (its objects) before dropping it.
CLIENT_TTL_S = 2
#: Milliseconds a read or write protects an object from removal (Mooncake's default: 10 s).
LEASE_TTL_MS = 1000


def _mooncake_missing() -> str:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return (
            f"Mooncake's client does not import ({exc}): apt-get install -y libibverbs1 && "
            "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1"
        )
    if not MASTER or not NODE:
        return "mooncake_master / mooncake_client are not installed"
    return ""


MISSING = _mooncake_missing()
needs_mooncake = pytest.mark.skipif(bool(MISSING), reason=MISSING)


class _Proc:
    """A subprocess with its output in a temp file."""

    def __init__(self, argv: list[str], name: str) -> None:
        self.argv = argv
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        fd, self._log_path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        self._log = os.fdopen(fd, "wb")

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def log(self) -> str:
        return Path(self._log_path).read_text(errors="replace")

    def cleanup(self) -> None:
        self.stop()
        self._log.close()
        Path(self._log_path).unlink(missing_ok=True)


class MooncakeCluster:
    """One ``mooncake_master`` on 127.0.0.1 and the storage-only nodes a test adds."""

    def __init__(self) -> None:
        self.rpc_port, self.metrics_port = free_port(), free_port()
        self.addr = f"127.0.0.1:{self.rpc_port}"
        assert MASTER is not None
        self.master = _Proc(
            [
                MASTER,
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc_port}",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={self.metrics_port}",
                f"--client_ttl={CLIENT_TTL_S}",
                f"--default_kv_lease_ttl={LEASE_TTL_MS}",
            ],
            "mooncake-master",
        )
        self.nodes: list[_Proc] = []

    # --- master -----------------------------------------------------------------------------

    def start_master(self) -> None:
        self.master.start()
        eventually(self._serving, "mooncake_master answers /metrics", timeout=30, interval=0.1)

    def _serving(self) -> bool:
        try:
            self.http("/metrics")
            return True
        except OSError:
            return False

    def http(self, path: str) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}{path}"
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()

    def object_names(self) -> list[str]:
        return [k for k in self.http("/get_all_keys").splitlines() if k.strip()]

    def segments(self) -> list[str]:
        return [s for s in self.http("/get_all_segments").splitlines() if s.strip()]

    # --- storage-only nodes -------------------------------------------------------------------

    def start_node(self, size: str = "64MB", port: int | None = None) -> _Proc:
        """A storage-only node: Mooncake's ``mooncake_client`` holding ``size`` of the pool."""
        assert NODE is not None
        before = len(self.segments())
        node = _Proc(
            [
                NODE,
                "--host=127.0.0.1",
                f"--port={port or free_port()}",
                f"--global_segment_size={size}",
                f"--master_server_address={self.addr}",
                "--metadata_server=P2PHANDSHAKE",
                "--protocol=tcp",
            ],
            "mooncake-node",
        )
        node.start()
        self.nodes.append(node)
        eventually(
            lambda: len(self.segments()) > before or not node.alive(),
            "the storage node mounted its segment",
            timeout=30,
            interval=0.1,
        )
        assert node.alive(), node.log()[-3000:]
        return node

    def restart_node(self, node: _Proc) -> None:
        before = len(self.segments())
        node.start()
        eventually(
            lambda: len(self.segments()) > before,
            "the restarted storage node mounted its segment",
            timeout=30,
            interval=0.1,
        )

    # --- adapter config -----------------------------------------------------------------------

    def adapter(self, segment: str = "0", **extra: Any) -> dict[str, Any]:
        """The ``--l2-adapter`` of a server that stores into the pool; ``segment`` is what it
        contributes itself (0: its data lives on the storage nodes)."""
        return {
            "type": "mooncake_store",
            "local_hostname": "127.0.0.1",
            "metadata_server": "P2PHANDSHAKE",
            "master_server_addr": self.addr,
            "protocol": "tcp",
            "global_segment_size": segment,
            "local_buffer_size": "16MB",
            **extra,
        }

    def cleanup(self) -> None:
        for n in self.nodes:
            n.cleanup()
        self.master.cleanup()


def _running_cluster() -> Any:
    if MISSING:
        pytest.skip(MISSING)
    cluster = MooncakeCluster()
    cluster.start_master()
    yield cluster
    cluster.cleanup()


@pytest.fixture(scope="module")
def mooncake() -> Any:
    """A running master (module scope); tests add their own nodes."""
    yield from _running_cluster()


@pytest.fixture
def fresh_mooncake() -> Any:
    """A master of the test's own (for tests that kill it)."""
    yield from _running_cluster()
