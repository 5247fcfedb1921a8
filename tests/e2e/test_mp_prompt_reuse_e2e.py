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


LAYOUTS = ("NHD", "HND", "MLA")


@pytest.mark.parametrize(
    "mode,server",
    [
        ("engine_driven", "shm_server"),
        ("engine_driven", "copy_server"),
        ("lmcache_driven", "copy_server"),
    ],
)
def test_second_engine_gets_identical_kv(request, mode, server):
    srv = request.getfixturevalue(server)
    model = f"e2e-{mode}-{server}-{next(_n)}"
    layouts = ",".join(LAYOUTS)
    stored = _wait([_run(srv.rpc_url, "store", layouts=layouts, mode=mode, model=model, seed=7)])[0]
    assert [r["stored"] for r in stored] == [True] * 3
    # the second engine process looks the prompt up itself (takes the locks), then retrieves
    got = _wait(
        [
            _run(
                srv.rpc_url,
                "retrieve",
                layouts=layouts,
                mode=mode,
                model=model,
                seed=7,
                request_id="second",
                lookup_readers=1,
            )
        ]
    )[0]
    for r in got:
        assert r["hit"] == 4, r
        assert (r["retrieved"], r["identical"], r["untouched"]) == (True, True, True), r


def test_tp2_every_rank_stores_and_retrieves_its_shard(shm_server):
    model = f"e2e-tp2-{next(_n)}"
    _wait(
        [
            _run(shm_server.rpc_url, "store", model=model, world_size=2, worker_id=r, seed=100 + r)
            for r in range(2)
        ]
    )
    got = _tp2_retrieve(shm_server.rpc_url, model=model, request_id="tp2")
    assert got[0][0]["hit"] == 4
    assert all(g[0]["identical"] and g[0]["retrieved"] for g in got)
    # a prompt only one rank stored is a miss for the whole model
    half = f"e2e-tp2-half-{next(_n)}"
    _wait([_run(shm_server.rpc_url, "store", model=half, world_size=2, worker_id=0, seed=3)])
    assert _lookup(shm_server.rpc_url, f"{half}-NHD", 2, 1, "half-NHD") == 0


def test_mla_tp2_one_writer_two_readers(shm_server):
    model = f"e2e-mla-tp2-{next(_n)}"
    # MLA: KV is replicated across TP, the kv world size is 1 and only rank 0 writes
    _wait([_run(shm_server.rpc_url, "store", layouts="MLA", model=model, seed=11)])
    # rank 0's process also plays the scheduler: one lookup with two readers per key
    first = _wait(
        [
            _run(
                shm_server.rpc_url,
                "retrieve",
                layouts="MLA",
                model=model,
                seed=11,
                request_id="mla",
                lookup_readers=2,
            )
        ]
    )
    assert first[0][0]["hit"] == 4
    second = _wait(
        [
            _run(
                shm_server.rpc_url,
                "retrieve",
                layouts="MLA",
                model=model,
                seed=11,
                request_id="mla",
            )
        ]
    )
    assert all(g[0]["identical"] for g in first + second)


def _tp2_retrieve(url: str, *, model: str, request_id: str, **kw) -> list[list[dict]]:
    """TP=2 retrieve: rank 0's process looks up for both ranks (as vLLM's scheduler does on
    rank 0), then each rank retrieves its own shard."""
    rank0 = _wait(
        [
            _run(
                url,
                "retrieve",
                model=model,
                world_size=2,
                worker_id=0,
                seed=100,
                request_id=request_id,
                lookup_readers=1,
                **kw,
            )
        ]
    )
    rank1 = _wait(
        [
            _run(
                url,
                "retrieve",
                model=model,
                world_size=2,
                worker_id=1,
                seed=101,
                request_id=request_id,
                **kw,
            )
        ]
    )
    return rank0 + rank1


@pytest.fixture(scope="module")
def engine_driven_server(lmcache_server_module):
    return lmcache_server_module("--supported-transfer-mode", "engine_driven")


def test_tp2_on_a_fake_device_against_an_engine_driven_server(engine_driven_server):
    """docs/design/platform.md#fake-devices: workers on a fake accelerator, server with only
    engine_driven."""
    url = engine_driven_server.rpc_url
    model = f"e2e-fake-tp2-{next(_n)}"
    kw = {"mode": "engine_driven", "fake_device": "fakeacc"}
    stored = _wait(
        [
            _run(url, "store", model=model, world_size=2, worker_id=r, seed=100 + r, **kw)
            for r in range(2)
        ]
    )
    assert all(s[0]["stored"] and s[0]["device"] == "fakeacc" for s in stored), stored
    got = _tp2_retrieve(url, model=model, request_id="fake", **kw)
    assert got[0][0]["hit"] == 4
    for g in got:
        r = g[0]
        assert r["device"] == "fakeacc" and r["mode"] in ("raw_v1", "pickle"), r
        assert (r["retrieved"], r["identical"], r["untouched"]) == (True, True, True), r
