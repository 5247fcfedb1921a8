"""End to end: one engine process stores a prompt's KV, another process with the same prompt
gets the hit and retrieves byte-identical KV into its own paged cache (NHD, HND, MLA, TP=2)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.client import MPClient

SIM = Path(__file__).with_name("mp_engine_sim.py")
_n = itertools.count()


@pytest.fixture(scope="module")
def shm_server(lmcache_server_module):
    return lmcache_server_module("--shm-name", f"e2e{os.getpid()}")


@pytest.fixture(scope="module")
def copy_server(lmcache_server_module):
    return lmcache_server_module("--supported-transfer-mode", "auto")


def _run(url: str, role: str, **kw) -> subprocess.Popen:
    args = [sys.executable, str(SIM), role, "--url", url]
    for k, v in kw.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait(procs: list[subprocess.Popen]) -> list[dict]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, f"engine process failed:\n{stdout}\n{stderr[-3000:]}"
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _lookup(
    url: str, model: str, world_size: int, readers: int, rid: str, num_tokens: int = 1024
) -> int:
    with MPClient(url, default_timeout=30) as c:
        key = P.IPCCacheServerKey(
            model_name=model,
            world_size=world_size,
            worker_id=None,
            token_ids=list(range(10, 10 + num_tokens)),
            start=0,
            end=num_tokens,
            request_id=rid,
            num_kv_readers=readers,
        )
        c.call("lookup", key, world_size)
        return c.call("wait_prefetch_status", rid, 30.0)


@pytest.mark.parametrize(
    "layout,mode,server",
    [
        ("NHD", "engine_driven", "shm_server"),
        ("HND", "engine_driven", "shm_server"),
        ("MLA", "engine_driven", "shm_server"),
        ("NHD", "engine_driven", "copy_server"),
        ("HND", "lmcache_driven", "copy_server"),
        ("MLA", "lmcache_driven", "copy_server"),
    ],
)
def test_second_engine_gets_identical_kv(request, layout, mode, server):
    srv = request.getfixturevalue(server)
    model = f"e2e-{layout}-{mode}-{next(_n)}"
    stored = _wait([_run(srv.rpc_url, "store", layout=layout, mode=mode, model=model, seed=7)])
    assert stored[0]["stored"] is True
    rid = f"second-{model}"
    assert _lookup(srv.rpc_url, model, 1, 1, rid) == 4
    got = _wait(
        [
            _run(
                srv.rpc_url,
                "retrieve",
                layout=layout,
                mode=mode,
                model=model,
                seed=7,
                request_id=rid,
            )
        ]
    )
    assert got[0] == {**got[0], "retrieved": True, "identical": True, "untouched": True}


def test_tp2_every_rank_stores_and_retrieves_its_shard(shm_server):
    model = f"e2e-tp2-{next(_n)}"
    _wait(
        [
            _run(shm_server.rpc_url, "store", model=model, world_size=2, worker_id=r, seed=100 + r)
            for r in range(2)
        ]
    )
    rid = f"tp2-{model}"
    assert _lookup(shm_server.rpc_url, model, 2, 1, rid) == 4
    got = _wait(
        [
            _run(
                shm_server.rpc_url,
                "retrieve",
                model=model,
                world_size=2,
                worker_id=r,
                seed=100 + r,
                request_id=rid,
            )
            for r in range(2)
        ]
    )
    assert all(g["identical"] and g["retrieved"] for g in got)


def test_tp2_missing_rank_is_a_miss(shm_server):
    model = f"e2e-tp2-half-{next(_n)}"
    _wait([_run(shm_server.rpc_url, "store", model=model, world_size=2, worker_id=0, seed=3)])
    assert _lookup(shm_server.rpc_url, model, 2, 1, f"half-{model}") == 0


def test_mla_tp2_one_writer_two_readers(shm_server):
    model = f"e2e-mla-tp2-{next(_n)}"
    # MLA: KV is replicated across TP, kv world size 1; only rank 0 writes
    _wait([_run(shm_server.rpc_url, "store", layout="MLA", model=model, seed=11)])
    rid = f"mla-{model}"
    assert _lookup(shm_server.rpc_url, model, 1, 2, rid) == 4
    got = _wait(
        [
            _run(shm_server.rpc_url, "retrieve", layout="MLA", model=model, seed=11, request_id=rid)
            for _ in range(2)
        ]
    )
    assert all(g["identical"] for g in got)
