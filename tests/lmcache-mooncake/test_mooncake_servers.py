"""Real `lmcache server` processes sharing one Mooncake Store: a storage-only node holds the
shared segment (the servers contribute none), B serves byte-equal what A stored, and when the
node or the master dies the servers keep serving from L1, say so in /healthcheck, serve nothing
wrong (misses) and recover when it is back."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest
import torch

from lmcache.v1.distributed.l2_adapters.key_codec import string_to_object_key

_prompts = itertools.count(1)


def _health(srv) -> httpx.Response:
    return httpx.get(srv.http_url + "/healthcheck", timeout=5)


def _flags(cluster) -> tuple[str, ...]:
    return (
        "--l2-adapter",
        json.dumps(cluster.adapter(segment="0")),
        "--supported-transfer-mode",
        "auto",
    )


def _model_keys(cluster, model: str) -> list[str]:
    return [k for k in cluster.object_names() if k.startswith(model + "@")]


def _new_prompt(base: str) -> tuple[str, int]:
    """A prompt no store used before, under a model name of its own (so the chunks on the
    master can be counted per prompt)."""
    n = next(_prompts)
    return f"{base}-{n}", 10 + n * 1000


def _store_until_landed(h, cluster, srv, base: str) -> tuple[str, int]:
    """Store new prompts through ``srv`` until one has all 4 chunks in Mooncake (right after a
    node or master returns, a write may still fail: it stays in L1 and is not retried)."""
    for _ in range(10):
        model, first = _new_prompt(base)
        _store(h, srv, model, first)
        if h.wait_until(lambda m=model: len(_model_keys(cluster, m)) >= 4, 10):
            return model, first
    raise AssertionError("no prompt reached Mooncake whole:\n" + srv.log()[-4000:])


def _store_until_healthy(h, srv, base: str) -> bool:
    """Store new prompts until ``srv`` says it is healthy again (a store that succeeds is what
    clears a store failure)."""
    return h.wait_until(
        lambda: (_store(h, srv, *_new_prompt(base)) or True) and _health(srv).status_code == 200,
        60,
    )


def _store(h, srv, model: str, first: int) -> None:
    engine = h.Engine(srv.rpc_url, model, h.kv_cache(first, zeros=False))
    try:
        assert engine.ctx.submit_store(
            engine.key(f"s{first}", first_token=first), h.BLOCK_IDS
        ).result(60)
    finally:
        engine.close()


def _read(h, srv, model: str, first: int) -> int:
    """Look the prompt up through ``srv`` (L1, then L2), retrieve what it found, check every
    retrieved block byte-equal against what was stored; returns the chunks found."""
    kv = h.kv_cache(first, zeros=True)
    engine = h.Engine(srv.rpc_url, model, kv)
    rid = f"r{first}-{next(_prompts)}"
    try:
        engine.client.call("lookup", engine.key(rid, worker_id=None, first_token=first), 1)
        hits = engine.client.call("wait_prefetch_status", rid, 30.0)
        if hits:
            assert engine.ctx.submit_retrieve(
                engine.key(rid, first_token=first), h.BLOCK_IDS
            ).result(60)
    finally:
        engine.close()
    expected = h.kv_cache(first, zeros=False)
    n_blocks = hits * 256 // 16  # chunk of 256 tokens, blocks of 16
    for e, t in zip(expected, kv, strict=True):
        for b in h.BLOCK_IDS[:n_blocks]:
            assert torch.equal(e[:, b], t[:, b]), "a retrieved block differs from what was stored"
        for b in h.BLOCK_IDS[n_blocks:]:
            assert int(t[:, b].float().abs().sum()) == 0, "a block past the hits was written"
    return hits


def _wait_stored(h, cluster, model: str, n: int) -> None:
    assert h.wait_until(lambda: len(_model_keys(cluster, model)) >= n, 60), (
        f"only {len(_model_keys(cluster, model))} of {n} chunks reached Mooncake"
    )


@pytest.fixture(scope="module")
def node(mooncake):
    return mooncake.start_node("64MB")


def test_b_serves_what_a_stored_from_the_storage_node_after_a_is_gone(
    h, mooncake, node, lmcache_server
):
    """A stores; A stops (its data does not leave with it: A contributes no segment, the
    storage node holds the chunks); B serves them byte-equal."""
    model, first = _new_prompt("mc-xsrv")
    a = lmcache_server(*_flags(mooncake))
    b = lmcache_server(*_flags(mooncake))
    _store(h, a, model, first)
    _wait_stored(h, mooncake, model, 4)
    names = _model_keys(mooncake, model)
    assert len(names) == 4 and all(string_to_object_key(k) is not None for k in names)
    assert a.stop() == 0
    assert _read(h, b, model, first) == 4


def test_a_killed_storage_node_the_servers_serve_from_l1_report_it_and_recover(
    h, fresh_mooncake, lmcache_server
):
    cluster = fresh_mooncake
    node = cluster.start_node("64MB")
    a = lmcache_server(*_flags(cluster))
    b = lmcache_server(*_flags(cluster))
    m1, p1 = _new_prompt("mc-nodekill")
    _store(h, a, m1, p1)
    _wait_stored(h, cluster, m1, 4)

    node.kill()  # the node holding every stored chunk
    assert _read(h, a, m1, p1) == 4  # A still has the chunks in L1
    # A store now finds no live segment: A says so.
    assert h.wait_until(
        lambda: (
            (_store(h, a, *_new_prompt("mc-nodekill")) or True) and _health(a).status_code == 503
        ),
        60,
    ), a.log()[-3000:]
    reason = _health(a).json()["reason"]
    assert "L2 adapter #0 (mooncake_store)" in reason, reason
    assert "code -800 (transfer failed" in reason or "code -200 (no space" in reason, reason
    # B never held the chunks: whatever Mooncake's index still says, B serves nothing wrong.
    assert _read(h, b, m1, p1) == 0

    cluster.restart_node(node)
    assert _store_until_healthy(h, a, "mc-nodekill"), a.log()[-3000:]
    m2, p2 = _store_until_landed(h, cluster, a, "mc-nodekill")
    assert _read(h, b, m2, p2) == 4


def test_a_restarted_master_loses_its_index_and_the_servers_recover(
    h, fresh_mooncake, lmcache_server
):
    cluster = fresh_mooncake
    cluster.start_node("64MB")
    a = lmcache_server(*_flags(cluster))
    b = lmcache_server(*_flags(cluster))
    m1, p1 = _new_prompt("mc-masterkill")
    _store(h, a, m1, p1)
    _wait_stored(h, cluster, m1, 4)

    cluster.master.kill()
    # The idle health probe finds the master gone.
    assert h.wait_until(lambda: _health(a).status_code == 503, 60), a.log()[-3000:]
    reason = _health(a).json()["reason"]
    assert "L2 adapter #0 (mooncake_store)" in reason and "code -900" in reason, reason
    assert _read(h, a, m1, p1) == 4  # from L1
    assert _read(h, b, m1, p1) == 0  # the master is gone: a miss, nothing wrong

    cluster.start_master()  # same ports, empty index; the clients mount their segments again
    assert h.wait_until(lambda: len(cluster.segments()) >= 1, 30)
    assert _read(h, b, m1, p1) == 0  # the old index is gone with the old master
    assert _store_until_healthy(h, a, "mc-masterkill"), a.log()[-3000:]
    m2, p2 = _store_until_landed(h, cluster, a, "mc-masterkill")
    assert _read(h, b, m2, p2) == 4
