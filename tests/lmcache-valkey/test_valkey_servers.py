"""Two real `lmcache server` processes share one Redis Cluster / Valkey Cluster through the
``valkey`` type: B serves, byte-equal, what A stored; a master SIGKILLed mid-run leaves both
serving from L1, names the node in /status and /healthcheck, serves nothing wrong and
recovers when the node is back; a reshard mid-run loses nothing."""

from __future__ import annotations

import json
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from testsupport.resp_engines import REDIS_CLI, ask
from testsupport.waiting import eventually

NUM_TOKENS, BLOCK = 1024, 16
CHUNKS = 4  # the server's 256-token chunks in one prompt
BLOCKS = NUM_TOKENS // BLOCK


def _adapter(cluster, **extra) -> str:
    cfg = {"type": "valkey", "startup_nodes": cluster.startup_nodes, "cluster_mode": True}
    cfg.update(num_workers=4, request_timeout=1.0, health_check_interval_s=0.3, **extra)
    return json.dumps(cfg)


@pytest.fixture(scope="module")
def pair(lmcache_server_module, cluster):
    """Servers A and B on the cluster (per cluster engine, for the module)."""
    flags = ("--l2-adapter", _adapter(cluster), "--supported-transfer-mode", "auto")
    with ThreadPoolExecutor(2) as pool:  # both start at once: half the wait
        a, b = pool.map(lambda _: lmcache_server_module(*flags), range(2))
    yield a, b
    for srv in (a, b):  # before the next engine's pair starts
        srv.stop()


def _store(h, srv, model: str, seed: int) -> None:
    """Store prompt ``seed`` (its own tokens, its own KV bytes) through ``srv``."""
    eng = h.Engine(srv.rpc_url, model, h.kv_cache(seed, zeros=False))
    try:
        assert eng.ctx.submit_store(
            eng.key(f"st-{seed}", first_token=1000 * seed), h.BLOCK_IDS
        ).result(60)
    finally:
        eng.close()


def _fetch(h, srv, model: str, seed: int, tag: str) -> int:
    """Look prompt ``seed`` up through ``srv`` and retrieve the chunks found; asserts they
    are byte-equal to what was stored and that nothing else was written. Returns the hits."""
    kv = h.kv_cache(seed, zeros=True)
    eng = h.Engine(srv.rpc_url, model, kv)
    rid = f"get-{seed}-{tag}"
    try:
        eng.client.call("lookup", eng.key(rid, worker_id=None, first_token=1000 * seed), 1)
        hits = int(eng.client.call("wait_prefetch_status", rid, 30.0))
        if hits:
            n = hits * BLOCKS // CHUNKS
            key = eng.key(rid, first_token=1000 * seed, end=hits * NUM_TOKENS // CHUNKS)
            assert eng.ctx.submit_retrieve(key, h.BLOCK_IDS[:n]).result(60)
    finally:
        eng.close()
    expected = h.kv_cache(seed, zeros=False)
    n = hits * BLOCKS // CHUNKS
    for e, t in zip(expected, kv, strict=True):
        for b in h.BLOCK_IDS[:n]:
            assert torch.equal(e[:, b], t[:, b]), f"block {b} of prompt {seed} differs"
        for b in h.BLOCK_IDS[n:]:
            assert not t[:, b].any(), f"block {b} of prompt {seed} written without a hit"
    return hits


def _status(srv) -> dict:
    return httpx.get(f"{srv.http_url}/status", timeout=10).json()


def _adapter_status(srv) -> dict:
    return _status(srv)["storage_manager"]["l2_adapters"][0]["status"]


def _store_stats(srv) -> dict:
    return next(iter(_status(srv)["storage_manager"]["store_controllers"].values()))


def _settled(srv) -> bool:
    st = _store_stats(srv)
    return st["in_flight_tasks"] == 0 and st["pending_keys"] == 0


def test_b_serves_what_a_stored(h, pair, cluster):
    a, b = pair
    model = f"share-{cluster.binary.rsplit('/', 1)[-1]}"
    before = cluster.dbsize()
    _store(h, a, model, seed=1)
    eventually(lambda: cluster.dbsize() >= before + CHUNKS, "A's chunks in the cluster", 60)
    eventually(lambda: _settled(a), "A's stores settled", 30)
    assert _fetch(h, b, model, seed=1, tag="b") == CHUNKS
    assert _store_stats(a)["failed_keys"] == 0 and _store_stats(b)["failed_keys"] == 0


def test_master_killed_mid_run_then_back(h, pair, cluster):
    a, b = pair
    model = f"kill-{cluster.binary.rsplit('/', 1)[-1]}"
    _store(h, a, model, seed=2)
    eventually(lambda: _settled(a), "A's first stores settled", 30)
    failed_before = _store_stats(a)["failed_keys"]
    victim = cluster.ports[2]
    node = f"127.0.0.1:{victim}"
    cluster.kill_node(victim)
    try:
        eventually(lambda: node in _adapter_status(a)["down_nodes"], f"A names {node}", 30)
        hc = httpx.get(f"{a.http_url}/healthcheck", timeout=10)
        assert hc.status_code == 503 and node in hc.text
        for seed in (3, 4, 5):
            _store(h, a, model, seed=seed)
        eventually(lambda: _settled(a), "A's stores during the outage settled", 60)
        assert _store_stats(a)["failed_keys"] > failed_before
        # A keeps serving its prompts from L1, complete and byte-equal
        for seed in (2, 3, 4, 5):
            assert _fetch(h, a, model, seed=seed, tag="a-down") == CHUNKS
        # B finds a prefix at most, and what it serves is right (checked in _fetch)
        for seed in (2, 3):
            assert _fetch(h, b, model, seed=seed, tag="b-down") <= CHUNKS
    finally:
        cluster.restart_node(victim)
    eventually(lambda: _adapter_status(a)["down_nodes"] == [], "A sees the node back", 30)
    seeds = iter(range(10, 60))

    def stored_and_served() -> bool:
        failed, seed = _store_stats(a)["failed_keys"], next(seeds)
        _store(h, a, model, seed=seed)
        eventually(lambda: _settled(a), "settled", 30)
        clean = _store_stats(a)["failed_keys"] == failed
        return _fetch(h, b, model, seed=seed, tag="b-back") == CHUNKS and clean

    eventually(stored_and_served, "a prompt stored after recovery is served by B", 60, 0.5)
    eventually(
        lambda: httpx.get(f"{a.http_url}/healthcheck", timeout=10).status_code == 200,
        "A healthy again",
        40,
        0.5,
    )


def test_reshard_mid_run_loses_nothing(h, pair, cluster):
    a, b = pair
    model = f"reshard-{cluster.binary.rsplit('/', 1)[-1]}"
    for seed in (20, 21):
        _store(h, a, model, seed=seed)
    eventually(lambda: _settled(a), "first stores settled", 30)
    failed_before = _store_stats(a)["failed_keys"]
    src, dst = cluster.ports[0], cluster.ports[1]
    ids = {p: ask(p, "CLUSTER", "MYID").decode() for p in (src, dst)}
    reshard = subprocess.Popen(
        [REDIS_CLI, "--cluster", "reshard", f"127.0.0.1:{src}"]
        + ["--cluster-from", ids[src], "--cluster-to", ids[dst]]
        + ["--cluster-slots", "1000", "--cluster-yes", "--cluster-pipeline", "5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    served: list[int] = []

    def read_during() -> None:
        for seed in (20, 21):
            served.append(_fetch(h, b, model, seed=seed, tag="during"))

    reader = threading.Thread(target=read_during)
    reader.start()
    for seed in (22, 23, 24):  # stores while slots move
        _store(h, a, model, seed=seed)
    reader.join(120)
    out, _ = reshard.communicate(timeout=120)
    assert reshard.returncode == 0, out
    cluster.wait_ok()
    eventually(lambda: _settled(a), "stores during the reshard settled", 60)
    assert _store_stats(a)["failed_keys"] == failed_before
    assert served == [CHUNKS, CHUNKS]
    for seed in (20, 21, 22, 23, 24):
        assert _fetch(h, b, model, seed=seed, tag="after") == CHUNKS
