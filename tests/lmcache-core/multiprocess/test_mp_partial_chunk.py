"""The ``partial_chunk`` feature (docs/design/protocol.md#partial-chunk): a prompt's tokens past
its last whole chunk are kept as a tail object, found by a lookup after the whole chunks and
loaded block for block. Against a real ``lmcache server``: chunk 256, engine block 16."""

from __future__ import annotations

import pytest
import torch

from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.client import MPClient
from lmcache.v1.multiprocess.protocol import RequestError
from lmcache.v1.multiprocess.token_hasher import (
    NONE_HASH,
    chunk_hashes,
    tail_hash,
    tokens_to_be_bytes,
)

CHUNK, BLOCK = 256, 16
PARTIAL = P.SUPPORTED_FEATURES + (P.FEATURE_PARTIAL_CHUNK,)


def toks(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(n)]


# ---------------------------------------------------------------------------- units
def test_tail_hash_never_equals_a_whole_chunk_hash():
    t = toks(512)
    whole = chunk_hashes(t, CHUNK)
    raw = tokens_to_be_bytes(t)
    # the same tokens as a whole chunk and as a (hypothetical) full-length tail differ
    assert tail_hash(NONE_HASH, raw[: CHUNK * 4]) != whole[0]
    # chained to its parent, counted by length: every candidate length has its own key
    tails = {tail_hash(whole[0], raw[CHUNK * 4 : (CHUNK + n) * 4]) for n in range(16, 256, 16)}
    assert len(tails) == 15
    assert tail_hash(whole[0], raw[CHUNK * 4 : (CHUNK + 16) * 4]) != tail_hash(
        NONE_HASH, raw[CHUNK * 4 : (CHUNK + 16) * 4]
    )
    # whole-chunk hashes are untouched by the feature (0.5.6's h1, docs/design/protocol.md#token-hashing)
    assert chunk_hashes(list(range(1, 513)), CHUNK)[1].hex().startswith("0b709854")


def test_feature_is_opt_in_and_keys_may_end_in_a_tail_only_with_it():
    assert P.FEATURE_PARTIAL_CHUNK not in P.SUPPORTED_FEATURES  # default clients never get it
    assert P.FEATURE_PARTIAL_CHUNK in P.OFFERED_FEATURES
    k = P.IPCCacheServerKey(
        model_name="m", worker_id=0, world_size=1, token_ids=toks(300), start=0, end=272,
        request_id="r",
    )  # fmt: skip
    with pytest.raises(RequestError, match="not aligned to chunk_size 256"):
        P.validate_key(k, chunk_aligned=True, chunk_size=CHUNK)
    P.validate_key(k, chunk_aligned=True, chunk_size=CHUNK, partial=True)
    k.start = 16  # the start stays chunk-aligned
    with pytest.raises(RequestError):
        P.validate_key(k, chunk_aligned=True, chunk_size=CHUNK, partial=True)


# ---------------------------------------------------------------------------- server
def _client(url: str, partial: bool) -> MPClient:
    c = MPClient(url, default_timeout=20)
    got = c.negotiate_default_features(PARTIAL if partial else P.SUPPORTED_FEATURES)
    assert (P.FEATURE_PARTIAL_CHUNK in got) is partial
    return c


def _lock_and_hit(mp, client, tokens, rid) -> int:
    return mp.lookup_hits(client, tokens=tokens, rid=rid)


@pytest.mark.parametrize("mode", ["copy", "shm", "lmcache_driven"])
def test_3000_token_prompt_reuses_2992_tokens(lmcache_server, mp, shm_suffix, mode):
    shm = ["--shm-name", f"pc{shm_suffix}"] if mode == "shm" else []
    srv = lmcache_server("--chunk-size", str(CHUNK), *shm)
    transfer = "lmcache_driven" if mode == "lmcache_driven" else "engine_driven"
    kv = mp.make_kv(num_blocks=200, block_size=BLOCK, seed=3)
    wclient, ctx = mp.worker(srv.rpc_url, kv, mode=transfer)
    wclient.negotiate_default_features(PARTIAL)  # as the connector's link does
    sched = _client(srv.rpc_url, partial=True)
    old = _client(srv.rpc_url, partial=False)  # an LMCache 0.5.6-style client
    prompt = toks(3000)
    blocks = list(range(1, 188))  # 187 blocks of 16 = 2992 tokens
    try:
        # the prompt's whole chunks and its tail (3000 floored to the block: 2992) in one store
        store = mp.key("s", tokens=prompt, end=2992)
        assert ctx.submit_store(store, [blocks]).result(20) is True
        assert mp.status(srv)["storage_manager"]["l1"]["total_object_count"] == 12

        assert _lock_and_hit(mp, sched, prompt, "hit") == 2992  # tokens, not chunks
        assert _lock_and_hit(mp, old, prompt, "old") == 11  # whole chunks, as 0.5.6
        # a longer prompt (the next turn): chunk 11 is not whole in the cache, its tail is
        assert _lock_and_hit(mp, sched, prompt + toks(100, seed=9), "turn") == 2992
        # a prompt differing inside the tail finds the whole chunks only
        other = list(prompt)
        other[2990] += 1
        assert _lock_and_hit(mp, sched, other, "diff") == 2816
        # the metrics count what vLLM loads: tails in the hit keys and tokens of their tier
        hit_tokens = 2992 + 11 * CHUNK + 2992 + 2816
        counted = {
            "lmcache_mp_lookup_hit_tokens_total": hit_tokens,
            "lmcache_mp_lookup_hit_l1_tokens_total": hit_tokens,
            "lmcache_mp_lookup_hit_l1_keys_total": 12 + 11 + 12 + 11,
            "lmcache_mp_lookup_hit_tail_tokens_total": 2 * (2992 - 11 * CHUNK),
            "lmcache_mp_lookup_hit_l2_keys_total": 0,
        }
        assert {name: mp.metric(srv, name) for name in counted} == counted

        # load it into a fresh engine: bytes identical, block for block
        kv2 = mp.make_kv(num_blocks=200, block_size=BLOCK, zeros=True)
        wclient2, ctx2 = mp.worker(srv.rpc_url, kv2, mode=transfer)
        wclient2.negotiate_default_features(PARTIAL)
        try:
            ret = mp.key("hit", tokens=prompt, end=2992)
            assert ctx2.submit_retrieve(ret, [blocks]).result(20) is True
            for a, b in zip(kv, kv2, strict=True):
                # block axis 1 for NHD [2, blocks, bs, heads, hs]
                assert torch.equal(a[:, 1:188], b[:, 1:188])
                assert not b[:, 188:].any()  # nothing past the tail was written
        finally:
            ctx2.close()
            wclient2.close()
        for rid in ("hit", "old", "turn", "diff"):
            sched.call("end_session", rid, timeout=10)
        mp.wait_for(
            lambda: mp.status(srv)["storage_manager"]["l1"]["read_locked_count"] == 0,
            "every lookup lock released",
        )
    finally:
        ctx.close()
        for c in (wclient, sched, old):
            c.close()


def test_free_lookup_locks_releases_the_tail(lmcache_server, mp):
    srv = lmcache_server("--chunk-size", str(CHUNK))
    kv = mp.make_kv(num_blocks=40, block_size=BLOCK, seed=4)
    wclient, ctx = mp.worker(srv.rpc_url, kv)
    wclient.negotiate_default_features(PARTIAL)
    sched = _client(srv.rpc_url, partial=True)
    prompt = toks(400, seed=5)
    try:
        assert ctx.submit_store(mp.key("s", tokens=prompt, end=400), [list(range(1, 26))]).result(
            20
        )
        assert _lock_and_hit(mp, sched, prompt, "f") == 400
        assert mp.status(srv)["storage_manager"]["l1"]["read_locked_count"] == 2
        # the scheduler frees up to the hit, which ends in the tail
        sched.call("free_lookup_locks", mp.key("f", tokens=prompt, end=400, worker_id=None), 1)
        mp.wait_for(
            lambda: mp.status(srv)["storage_manager"]["l1"]["read_locked_count"] == 0,
            "chunk and tail unlocked",
        )
        sched.call("end_session", "f", timeout=10)
    finally:
        ctx.close()
        wclient.close()
        sched.close()


def test_a_tail_only_in_l2_is_found_and_loaded(lmcache_server, mp):
    l2 = '{"type": "mock", "max_size_gb": 0.1, "mock_bandwidth_gb": 10.0}'
    srv = lmcache_server("--chunk-size", str(CHUNK), "--l2-adapter", l2)
    kv = mp.make_kv(num_blocks=40, block_size=BLOCK, seed=6)
    wclient, ctx = mp.worker(srv.rpc_url, kv)
    wclient.negotiate_default_features(PARTIAL)
    sched = _client(srv.rpc_url, partial=True)
    prompt = toks(400, seed=8)
    blocks = list(range(1, 26))
    try:
        assert ctx.submit_store(mp.key("s", tokens=prompt, end=400), [blocks]).result(20)
        mp.wait_for(
            lambda: mp.status(srv)["storage_manager"]["l2_adapters"][0]["usage_bytes"] >= 2 * 32768,
            "the chunk and the tail written behind to L2",
            30,
        )
        assert sched.call("clear", True, timeout=10) is None  # L1 only
        assert mp.status(srv)["storage_manager"]["l1"]["total_object_count"] == 0
        assert _lock_and_hit(mp, sched, prompt, "l2") == 400
        counted = {  # the chunk and the tail came from L2: both counted there
            "lmcache_mp_lookup_hit_l2_keys_total": 2,
            "lmcache_mp_lookup_hit_l2_tokens_total": 400,
            "lmcache_mp_lookup_hit_l1_keys_total": 0,
            "lmcache_mp_lookup_hit_tail_tokens_total": 400 - CHUNK,
        }
        assert {name: mp.metric(srv, name) for name in counted} == counted
        dest = mp.make_kv(num_blocks=40, block_size=BLOCK, zeros=True)
        c2, ctx2 = mp.worker(srv.rpc_url, dest)
        c2.negotiate_default_features(PARTIAL)
        try:
            assert ctx2.submit_retrieve(mp.key("l2", tokens=prompt, end=400), [blocks]).result(20)
            assert all(torch.equal(a[:, 1:26], b[:, 1:26]) for a, b in zip(kv, dest, strict=True))
        finally:
            ctx2.close()
            c2.close()
        sched.call("end_session", "l2", timeout=10)
    finally:
        ctx.close()
        wclient.close()
        sched.close()
