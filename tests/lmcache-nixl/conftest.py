"""Fixtures of the lmcache-nixl tests: a real L1 arena, real NIXL (POSIX on a temp directory,
OBJ against a moto S3 server on a free loopback port) and arena-backed memory objects."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from testsupport.l2 import L2_HELPERS

pytest.importorskip("lmcache.storage.nixl", reason="lmcache-nixl is not installed")

PAGE = 4096


def _nixl_missing() -> str:
    try:
        from lmcache.storage.nixl._nixl_api import nixl_api

        nixl_api()
    except ImportError as exc:
        return f"nixl is not installed: {exc}"
    return ""


NIXL_MISSING = _nixl_missing()


@pytest.fixture
def nixl() -> None:
    """Skips the test where NIXL is absent (CI installs nixl==1.5.1, so it runs there)."""
    if NIXL_MISSING:
        pytest.skip(NIXL_MISSING)


@pytest.fixture
def arena():
    """A real L1 allocator (4 MiB, 4096-byte pages) whose arena the adapters register."""
    from lmcache.v1.distributed.l1_memory import L1Allocator

    alloc = L1Allocator(4 << 20, PAGE, prefault="off")
    yield alloc
    alloc.close()


def arena_obj(alloc: Any, nbytes: int, seed: int) -> Any:
    """A MemoryObj carved from the arena, filled with seeded random bytes."""
    obj = alloc.allocate([torch.Size([nbytes])], [torch.uint8])
    g = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g))
    return obj


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on a free loopback port: ``(endpoint_url, boto3 client)``."""
    pytest.importorskip("moto.server", reason="moto[server] is not installed")
    import boto3
    from moto.server import ThreadedMotoServer

    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="test",
        aws_secret_access_key="test",
        region_name="us-east-1",
    )
    yield endpoint, client
    srv.stop()


@pytest.fixture
def s3_bucket(s3_server):
    endpoint, client = s3_server
    name = f"nixl-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return endpoint, client, name


@pytest.fixture
def nx() -> Any:
    """The helpers of this directory (importlib mode: test modules cannot import conftest)."""
    return SimpleNamespace(
        PAGE=PAGE,
        arena_obj=arena_obj,
        obj_backend_params=obj_backend_params,
        l2_helpers=L2_HELPERS,  # the engine and KV-cache helpers of the server tests
    )


def obj_backend_params(endpoint: str, bucket: str) -> dict[str, str]:
    return {
        "endpoint_override": endpoint,
        "bucket": bucket,
        "access_key": "test",
        "secret_key": "test",
        "region": "us-east-1",
        "scheme": "http",
        "use_virtual_addressing": "false",
    }


@pytest.fixture(params=["POSIX", "OBJ"])
def store_spec(request, tmp_path) -> dict[str, Any]:
    """A nixl_store JSON spec for each backend that runs on CPU (OBJ against moto)."""
    if request.param == "POSIX":
        params = {"file_path": str(tmp_path / "slots"), "use_direct_io": "false"}
        params["file_size"] = str(8 * PAGE)
        return {"type": "nixl_store", "backend": "POSIX", "pool_size": 4, "backend_params": params}
    endpoint, _, bucket = request.getfixturevalue("s3_bucket")
    return {
        "type": "nixl_store",
        "backend": "OBJ",
        "pool_size": 32,
        "backend_params": obj_backend_params(endpoint, bucket),
    }
