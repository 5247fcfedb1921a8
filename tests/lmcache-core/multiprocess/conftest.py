"""Helpers for MP server tests: a raw DEALER peer, key builders, engine-simulating workers."""

from __future__ import annotations

import itertools
import os
import re
import time

import httpx
import msgspec
import pytest
import torch
import zmq
from testsupport.waiting import eventually

from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.client import MPClient
from lmcache.v1.multiprocess.transfer_context import create_transfer_context

TOKENS = list(range(1, 513))
_ids = itertools.count(1000)


class RawPeer:
    """A bare DEALER: sends exact frames, receives exact frames (or None on silence)."""

    def __init__(self, url: str) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(url)
        self.uid = 0

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout: float = 5.0) -> list[bytes] | None:
        if self.sock.poll(int(timeout * 1000)):
            return self.sock.recv_multipart()
        return None

    def request(self, op, *payloads, timeout: float = 5.0) -> list[bytes] | None:
        self.uid += 1
        uid = msgspec.msgpack.encode(self.uid)
        self.send([uid, msgspec.msgpack.encode(op), *(P.encode(p) for p in payloads)])
        return self.recv(timeout)

    def close(self) -> None:
        self.sock.close(linger=0)


def key(
    request_id: str,
    *,
    tokens=None,
    start=0,
    end=512,
    worker_id=0,
    world_size=1,
    model="m",
    readers=1,
    **kw,
):
    return P.IPCCacheServerKey(
        model_name=model,
        world_size=world_size,
        worker_id=worker_id,
        token_ids=list(tokens if tokens is not None else TOKENS),
        start=start,
        end=end,
        request_id=request_id,
        num_kv_readers=readers,
        **kw,
    )


def lookup_hits(client: MPClient, tokens=None, model="m", world_size=1, rid=None, end=None) -> int:
    """lookup then query: the hit prefix in chunks (and the session's locks stay held)."""
    rid = rid or f"lookup-{next(_ids)}"
    toks = list(tokens if tokens is not None else TOKENS)
    k = key(
        rid,
        tokens=toks,
        end=len(toks) if end is None else end,
        worker_id=None,
        world_size=world_size,
        model=model,
    )
    assert client.call("lookup", k, 1, timeout=10) is None
    for _ in range(200):
        r = client.call("query_prefetch_status", rid, timeout=10)
        if r is not None:
            return r
        time.sleep(0.01)
    raise AssertionError("prefetch never finished")


def make_kv(
    layout: str = "NHD",
    num_layers: int = 2,
    num_blocks: int = 64,
    block_size: int = 16,
    heads: int = 2,
    head_size: int = 8,
    dtype=torch.float16,
    seed: int = 0,
    zeros: bool = False,
):
    g = torch.Generator().manual_seed(seed)
    if layout == "MLA":
        shape = (num_blocks, block_size, head_size)
    elif layout == "HND":
        shape = (2, num_blocks, heads, block_size, head_size)
    else:
        shape = (2, num_blocks, block_size, heads, head_size)
    out = []
    for _ in range(num_layers):
        t = torch.zeros(shape, dtype=dtype) if zeros else torch.randn(shape, generator=g).to(dtype)
        out.append(t)
    return out


def worker(
    url: str,
    kv,
    *,
    mode="engine_driven",
    negotiate=True,
    model="m",
    world_size=1,
    instance_id=None,
    layout_hints=None,
):
    """(client, context) of a registered engine-simulating worker."""
    client = MPClient(url, default_timeout=20)
    if not negotiate:  # behave like an LMCache 0.5.6 client: never negotiate
        client.negotiate_default_features = lambda *a, **k: frozenset()  # type: ignore[method-assign]
    ctx = create_transfer_context(
        kv,
        instance_id=instance_id or next(_ids),
        req_client=client,
        mode=mode,
        layout_hints=layout_hints,
    )
    ctx.register(model, world_size)
    return client, ctx


def metric(srv, name: str, **labels) -> float:
    text = httpx.get(srv.http_url + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z0-9_:]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if not m or m.group(1) != name:
            continue
        lbl = m.group(2) or ""
        if all(f'{k}="{v}"' in lbl for k, v in labels.items()):
            total += float(m.group(3))
    return total


def status(srv) -> dict:
    return httpx.get(srv.http_url + "/status", timeout=5).json()


def wait_for(cond, what: str, timeout: float = 15.0, interval: float = 0.1) -> None:
    """Wait for server state that appears asynchronously (a reap, a write-behind, an
    eviction); fails naming what never happened. A bound on waiting, not a speed check."""
    eventually(cond, what, timeout, interval)


@pytest.fixture
def shm_suffix() -> str:
    return f"t{os.getpid()}_{next(_ids)}"


class _Helpers:
    """Test files use the helpers through the ``mp`` fixture (conftest modules are not importable)."""

    TOKENS = TOKENS
    RawPeer = RawPeer
    key = staticmethod(key)
    lookup_hits = staticmethod(lookup_hits)
    make_kv = staticmethod(make_kv)
    worker = staticmethod(worker)
    metric = staticmethod(metric)
    status = staticmethod(status)
    wait_for = staticmethod(wait_for)


@pytest.fixture(scope="session")
def mp() -> type[_Helpers]:
    return _Helpers
