"""A real redis-server on a free loopback port (or a real 3-master Redis Cluster); the engines
and the RESP client that inspects them are in testsupport.resp_engines."""

from __future__ import annotations

import socket
import threading

import pytest
from testsupport.resp_engines import REDIS_CLI, REDIS_SERVER, RedisCluster, RedisServer

pytest.importorskip("lmcache.storage.redis", reason="lmcache-redis is not installed")


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
