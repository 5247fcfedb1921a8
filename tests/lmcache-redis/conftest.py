"""A real redis-server on a free loopback port (or a real 3-master Redis Cluster), plus a
minimal RESP client to inspect it."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from testsupport.ports import free_port

pytest.importorskip("lmcache.storage.redis", reason="lmcache-redis is not installed")

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def _load_helpers() -> Any:
    path = Path(__file__).resolve().parent.parent / "native" / "l2_helpers.py"
    spec = importlib.util.spec_from_file_location("_lmcache_l2_test_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Helpers


Helpers = _load_helpers()


@pytest.fixture
def h() -> Any:
    return Helpers


@pytest.fixture
def adapters():
    """Collects adapters to close at teardown."""
    made: list[Any] = []
    yield made
    for a in made:
        a.close()


class RawRedis:
    """Just enough RESP2 to check what the adapter wrote."""

    def __init__(self, port: int, password: str = "") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buf = b""
        if password:
            assert self.cmd("AUTH", password) == "OK"

    def close(self) -> None:
        self.sock.close()

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n: int) -> bytes:
        while len(self.buf) < n + 2:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("closed")
            self.buf += chunk
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


class CountingProxy:
    """A TCP relay in front of redis-server that counts the reads it gets from clients:
    a client that waits for each reply needs at least one read per command."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.client_reads = 0
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(conn, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, conn, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        try:
            while chunk := src.recv(1 << 20):
                if from_client:
                    with self._lock:
                        self.client_reads += 1
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


class RedisServer:
    def __init__(self, tmp_path: Any, password: str = "") -> None:
        self.port = free_port()
        self.password = password
        self.dir = tmp_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--protected-mode",
            "no",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while True:
            try:
                r = RawRedis(self.port, self.password)
                r.cmd("PING")
                r.close()
                return
            except (OSError, ConnectionError, RuntimeError):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def client(self) -> RawRedis:
        return RawRedis(self.port, self.password)


@pytest.fixture
def redis_server(tmp_path):
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def counting_proxy(redis_server):
    proxy = CountingProxy(redis_server.port)
    yield proxy
    proxy.close()


@pytest.fixture
def redis_server_with_password(tmp_path):
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path, password="s3cret")
    server.start()
    yield server
    server.kill()


class RedisCluster:
    """Three redis-server masters in cluster mode on free loopback ports, slots spread over
    all three by ``redis-cli --cluster create``."""

    def __init__(self, tmp_path: Any, masters: int = 3) -> None:
        self.dir = tmp_path
        self.ports: list[int] = []
        while len(self.ports) < masters:
            port = self._free_cluster_port()
            taken = {q for p in self.ports for q in (p, p + 10000)}
            if port not in taken and port + 10000 not in taken:
                self.ports.append(port)
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        for port in self.ports:
            args = [
                REDIS_SERVER,
                "--port",
                str(port),
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                str(self.dir / f"nodes-{port}.conf"),
                "--dir",
                str(self.dir),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--protected-mode",
                "no",
            ]
            proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.procs.append(proc)
        for port, proc in zip(self.ports, self.procs, strict=True):
            self._wait(lambda p=port: self.ask(p, "PING") == "PONG", proc, port, "start")
        create = subprocess.run(
            [REDIS_CLI, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports)]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if create.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {create.stdout}{create.stderr}")
        for port, proc in zip(self.ports, self.procs, strict=True):
            self._wait(
                lambda p=port: b"cluster_state:ok" in self.ask(p, "CLUSTER", "INFO"),
                proc,
                port,
                "reach cluster_state:ok",
            )

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

    @staticmethod
    def ask(port: int, *args: Any) -> Any:
        """One command to the node on ``port``."""
        r = RawRedis(port)
        try:
            return r.cmd(*args)
        finally:
            r.close()

    @staticmethod
    def _wait(cond: Any, proc: subprocess.Popen, port: int, what: str) -> None:
        deadline = time.monotonic() + 30
        while True:
            try:
                if cond():
                    return
            except (OSError, ConnectionError, RuntimeError):
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"cluster node on port {port} did not {what}")
            time.sleep(0.05)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server / redis-cli not installed (apt-get install redis-server)")
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.kill()
