"""Lookups served from L2 through the server: pending query replies, L2 hits, HTTP listing."""

from __future__ import annotations

import json

import httpx
import torch

from lmcache.v1.multiprocess import protocol as P

# ~200 KB/s: loading two 32 KiB chunks back from L2 takes a noticeable moment
MOCK_L2 = json.dumps({"type": "mock", "max_size_gb": 0.1, "mock_bandwidth_gb": 0.0002})


def _store_then_keep_only_in_l2(srv, mp, c, ctx, model):
    """Store two chunks, wait for the write-behind copy in L2, then clear L1 alone."""
    assert ctx.submit_store(mp.key("s", model=model), list(range(1, 33))).result(20)
    mp.wait_for(
        lambda: mp.status(srv)["storage_manager"]["l2_adapters"][0]["usage_bytes"] >= 2 * 32768,
        "the write-behind store to L2 finished",
        30,
    )
    assert c.call("clear", True) is None  # L1 only; L2 keeps the chunks


def test_lookup_loads_from_l2_after_l1_is_cleared(lmcache_server, mp):
    srv = lmcache_server("--l2-adapter", MOCK_L2)
    model = "l2-model"
    kv = mp.make_kv()
    c, ctx = mp.worker(srv.rpc_url, kv, model=model)
    try:
        _store_then_keep_only_in_l2(srv, mp, c, ctx, model)
        peer = mp.RawPeer(srv.rpc_url)
        try:
            rid = "from-l2"
            assert (
                peer.request(8, P.to_builtins(mp.key(rid, model=model, worker_id=None)), 1)
                is not None
            )
            frames = peer.request(9, rid)
            assert len(frames) == 2  # pending: a reply without payload
        finally:
            peer.close()
        assert c.call("wait_prefetch_status", rid, 30.0) == 2
        assert mp.metric(srv, "lmcache_mp_lookup_hit_l2_keys_total") == 2
        dest = mp.make_kv(zeros=True)
        c2, ctx2 = mp.worker(srv.rpc_url, dest, model=model)
        assert ctx2.submit_retrieve(mp.key(rid, model=model), list(range(1, 33))).result(20)
        assert all(torch.equal(a[:, 1:33], b[:, 1:33]) for a, b in zip(kv, dest, strict=True))
        ctx2.close()
        c2.close()
        listing = httpx.get(srv.http_url + "/cache/objects", params={"tier": "l2"})
        adapters = httpx.get(srv.http_url + "/config/adapters").json()["adapters"]
        if listing.status_code == 200:  # adapters that cannot list answer 503 (as 0.5.6)
            body = listing.json()
            assert body["adapter"] == adapters[0]["type_name"] and len(body["entries"]) == 2
        else:
            assert listing.status_code == 503
        adapters = httpx.get(srv.http_url + "/config/adapters").json()["adapters"]
        assert len(adapters) == 1
    finally:
        ctx.close()
        c.close()


def test_l1_resident_lookup_is_answered_without_the_l2_path(lmcache_server, mp):
    # With an L2 adapter configured, a lookup whose keys are all in L1 is served
    # synchronously from L1: the first query after the lookup ack already has the result.
    srv = lmcache_server("--l2-adapter", MOCK_L2)
    model = "l2-model-l1hit"
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model)
    peer = mp.RawPeer(srv.rpc_url)
    try:
        assert ctx.submit_store(mp.key("s", model=model), list(range(1, 33))).result(20)
        rid = "l1-hit"
        key = P.to_builtins(mp.key(rid, model=model, worker_id=None))
        assert peer.request(8, key, 1) is not None
        frames = peer.request(9, rid)
        assert len(frames) == 3 and P.decode(frames[2]) == 2
        assert mp.metric(srv, "lmcache_mp_lookup_hit_l1_keys_total") == 2
        assert mp.metric(srv, "lmcache_mp_lookup_hit_l2_keys_total") == 0
    finally:
        peer.close()
        ctx.close()
        c.close()


def test_lookup_with_a_wait_parks_until_l2_loads_and_a_short_wait_leaves_the_status(
    lmcache_server, mp
):
    srv = lmcache_server("--l2-adapter", MOCK_L2)
    model = "l2-wait"
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model)
    try:
        assert P.FEATURE_LOOKUP_WAIT in c.features
        _store_then_keep_only_in_l2(srv, mp, c, ctx, model)
        # no wait left: the reply is nil at once and the status stays to be queried
        assert c.call("lookup", mp.key("short", model=model, worker_id=None), 1, 0.0) is None
        assert c.call("wait_prefetch_status", "short", 30.0) == 2
        c.call("end_session", "short")
        assert c.call("clear", True) is None
        # a long enough wait: the reply comes once L2 has loaded the chunks
        assert c.lookup_hits(mp.key("long", model=model, worker_id=None), 30.0) == 2
        assert c.call("query_prefetch_status", "long") == 0
        c.call("end_session", "long")
    finally:
        ctx.close()
        c.close()
