"""Conformance of every operation (docs/design/protocol.md#operations) against a real `lmcache
server` over real sockets."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import pickle
import time

import httpx
import msgspec
import pytest
import torch

from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.client import LMCacheTimeoutError, MPClient
from lmcache.v1.multiprocess.protocol import RemoteError
from lmcache.v1.multiprocess.token_hasher import tokens_to_be_bytes

_models = itertools.count()


def _model() -> str:
    return f"model-{os.getpid()}-{next(_models)}"


@pytest.fixture(scope="module")
def srv(lmcache_server_module):
    """A server on the copy path (no SHM)."""
    return lmcache_server_module()


@pytest.fixture(scope="module")
def srv_shm(lmcache_server_module):
    return lmcache_server_module("--shm-name", f"conf{os.getpid()}")


@pytest.fixture(scope="module")
def srv_short(lmcache_server_module):
    """Short session TTL and reaping timeouts (2 s), with SHM."""
    return lmcache_server_module(
        "--shm-name",
        f"short{os.getpid()}",
        "--session-ttl-seconds",
        "2",
        "--worker-reap-timeout-seconds",
        "2",
        "--worker-registration-grace-seconds",
        "2",
    )


@pytest.fixture
def client(srv):
    c = MPClient(srv.rpc_url, default_timeout=20)
    yield c
    c.close()


# --- 4-6: framing -----------------------------------------------------------------------


def test_get_chunk_size_echoes_uid_and_op_bytes(srv, mp):
    peer = mp.RawPeer(srv.rpc_url)
    try:
        for op in (21, "get_chunk_size"):
            uid, op_b = msgspec.msgpack.encode(77), msgspec.msgpack.encode(op)
            peer.send([uid, op_b])
            frames = peer.recv()
            assert frames == [uid, op_b, msgspec.msgpack.encode(256)]
    finally:
        peer.close()


def test_noop_and_ping(client):
    assert client.noop() == "OK"
    assert client.ping(None) is True
    assert client.ping(123456789) is True


def test_replies_without_payload_have_three_frames(srv, mp):
    peer = mp.RawPeer(srv.rpc_url)
    try:
        frames = peer.request(8, P.to_builtins(mp.key("noreg", worker_id=None, model=_model())), 1)
        assert frames is not None and len(frames) == 2  # DEALER sees [uid, op]: no payload frame
        frames = peer.request(9, "never-looked-up")
        assert len(frames) == 3 and msgspec.msgpack.decode(frames[2]) == 0
    finally:
        peer.close()


# --- 7-9: lookups ---------------------------------------------------------------------------


@pytest.mark.parametrize("negotiate", [False, True], ids=["pickle", "raw_v1"])
def test_lookup_after_store_then_query_once(srv, mp, negotiate):
    model = _model()
    kv = mp.make_kv()
    c, ctx = mp.worker(srv.rpc_url, kv, negotiate=negotiate, model=model)
    try:
        assert ctx.mode == ("raw_v1" if negotiate else "pickle")
        assert ctx.submit_store(mp.key("s1", model=model), list(range(1, 33))).result(20) is True
        rid = "q-" + model
        assert mp.lookup_hits(c, model=model, rid=rid) == 2
        assert c.call("query_prefetch_status", rid) == 0  # delivered exactly once
        assert c.call("query_prefetch_status", "unknown-" + model) == 0
        changed = [999, *mp.TOKENS[1:]]
        assert mp.lookup_hits(c, tokens=changed, model=model) == 0
        first_only = mp.TOKENS[:256] + [7] * 256
        assert mp.lookup_hits(c, tokens=first_only, model=model) == 1
    finally:
        ctx.close()
        c.close()


def test_token_ids_as_u32be_bytes_hash_like_the_int_list(srv, mp):
    """A 0.5.6-style worker stores with int lists; a negotiated client looks up with uint32
    big-endian bytes (token_ids_u32be): same chunk hashes, same hits. And the reverse."""
    for store_negotiated in (False, True):
        model = _model()
        c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), negotiate=store_negotiated, model=model)
        other = MPClient(srv.rpc_url, default_timeout=20)
        try:
            assert ctx.submit_store(mp.key("tb", model=model), list(range(1, 33))).result(20)
            if not store_negotiated:
                assert P.FEATURE_TOKEN_IDS_U32BE in other.negotiate_default_features()
            assert mp.lookup_hits(other, model=model) == 2
            as_bytes = mp.key("raw-" + model, model=model, worker_id=None)
            as_bytes.token_ids = tokens_to_be_bytes(mp.TOKENS)
            assert other.call("lookup", as_bytes, 1) is None
            assert other.call("wait_prefetch_status", "raw-" + model, 10.0) == 2
        finally:
            other.close()
            ctx.close()
            c.close()


def test_client_sends_token_bytes_only_after_negotiating():
    """What MPClient puts on the wire, read by a bare ROUTER: int lists by default (what
    0.5.6 servers expect), uint32 big-endian bytes once token_ids_u32be is enabled."""
    import zmq

    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    key = mp_key_with_tokens([1, 2])
    c = MPClient(f"tcp://127.0.0.1:{port}", default_timeout=1)
    try:
        c.submit("lookup", key, 1)
        c.features = frozenset({P.FEATURE_TOKEN_IDS_U32BE})
        c.submit("lookup", key, 1)
        seen = []
        for _ in range(2):
            assert router.poll(5000)
            frames = router.recv_multipart()
            seen.append(msgspec.msgpack.decode(frames[3])["token_ids"])
        assert seen == [[1, 2], bytes([0, 0, 0, 1, 0, 0, 0, 2])]
    finally:
        c.close()
        router.close(linger=0)


def mp_key_with_tokens(tokens: list[int]) -> P.IPCCacheServerKey:
    return P.IPCCacheServerKey(
        model_name="m", world_size=1, worker_id=None, token_ids=tokens, start=0,
        end=len(tokens), request_id="r", num_kv_readers=1,
    )  # fmt: skip


def test_token_bytes_of_a_partial_token_are_rejected(srv, mp):
    with MPClient(srv.rpc_url, default_timeout=20) as c:
        c.negotiate_default_features()
        bad = mp.key("odd", worker_id=None)
        bad.token_ids = b"\x00\x00\x01"
        with pytest.raises(RemoteError, match="whole uint32 values"):
            c.call("lookup", bad, 1)


def test_status_query_sent_right_after_lookup_sees_it(srv, mp):
    """lookup and status queries run in order on the loop thread: a wait sent without
    waiting for the lookup's ack still finds the lookup (pipelined, one round trip)."""
    model = _model()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model)
    try:
        assert ctx.submit_store(mp.key("p", model=model), list(range(1, 33))).result(20)
        for i in range(20):
            rid = f"pipe-{i}-{model}"
            ack = c.submit("lookup", mp.key(rid, model=model, worker_id=None), 1)
            assert c.call("wait_prefetch_status", rid, 10.0) == 2
            assert ack.result(10) is None
            c.call("end_session", rid)
    finally:
        ctx.close()
        c.close()


def test_lookup_with_a_wait_answers_the_hit_count_in_its_own_reply(srv, mp):
    """lookup_wait: the lookup's reply carries what the status query would have answered,
    consumed as a query consumes it; a client without the feature gets 0.5.6 behaviour."""
    model = _model()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model)
    try:
        assert P.FEATURE_LOOKUP_WAIT in c.features
        assert ctx.submit_store(mp.key("w", model=model), list(range(1, 33))).result(20)
        assert c.call("lookup", mp.key("w1", model=model, worker_id=None), 1, 10.0) == 2
        assert c.call("query_prefetch_status", "w1") == 0  # consumed by the lookup's reply
        c.call("end_session", "w1")
        miss = mp.key("w2", model=model, worker_id=None, tokens=list(range(7, 7 + 512)))
        assert c.lookup_hits(miss, 10.0) == 0
        with MPClient(srv.rpc_url, default_timeout=20) as old:  # no features: two requests
            assert old.lookup_hits(mp.key("w3", model=model, worker_id=None)) == 2
            assert old.call("lookup", mp.key("w4", model=model, worker_id=None), 1) is None
            assert old.call("wait_prefetch_status", "w4", 10.0) == 2
        for rid in ("w2", "w3", "w4"):
            c.call("end_session", rid)
    finally:
        ctx.close()
        c.close()


def test_transfer_ops_are_timed_per_phase(srv_shm, mp):
    model = _model()
    before = {
        ph: mp.metric(srv_shm, "lmcache_mp_transfer_phase_seconds_count", phase=ph)
        for ph in ("prepare_store", "commit_store", "prepare_retrieve", "commit_retrieve")
    }
    c, ctx = mp.worker(srv_shm.rpc_url, mp.make_kv(), model=model)
    try:
        assert ctx.mode == "SHM"
        assert ctx.submit_store(mp.key("ph", model=model), list(range(1, 33))).result(20)
        rid = "ph-r-" + model
        assert mp.lookup_hits(c, model=model, rid=rid) == 2
        assert ctx.submit_retrieve(mp.key(rid, model=model), list(range(1, 33))).result(20)
    finally:
        ctx.close()
        c.close()
    for ph, n in before.items():  # commit_retrieve is not awaited: it may land just after
        mp.wait_for(
            lambda ph=ph, n=n: (
                mp.metric(srv_shm, "lmcache_mp_transfer_phase_seconds_count", phase=ph) == n + 1
            ),
            f"{ph} timed once",
            10,
        )


def test_lookup_unregistered_model_early_exit(srv, client, mp):
    before = mp.metric(srv, "lmcache_mp_lookup_early_exit_requests_total", reason="no_gpu_context")
    assert mp.lookup_hits(client, model=_model()) == 0
    after = mp.metric(srv, "lmcache_mp_lookup_early_exit_requests_total", reason="no_gpu_context")
    assert after == before + 1


# --- 10-13: stores and retrieves ------------------------------------------------------------


def test_all_or_nothing_retrieve_engine_driven(srv, mp):
    model = _model()
    kv = mp.make_kv()
    c, ctx = mp.worker(srv.rpc_url, kv, model=model)
    try:
        assert ctx.submit_store(mp.key("a", model=model, end=256), list(range(1, 17))).result(20)
        rid = "r-" + model
        assert mp.lookup_hits(c, model=model, rid=rid) == 1
        reply = c.call("prepare_retrieve", mp.key(rid, model=model), ctx.instance_id)
        assert reply["success"] is False
        dest = mp.make_kv(zeros=True)
        c2, ctx2 = mp.worker(srv.rpc_url, dest, model=model)
        assert (
            ctx2.submit_retrieve(mp.key(rid, model=model), list(range(1, 33))).result(20) is False
        )
        assert all(int(t.abs().sum()) == 0 for t in dest)
        ctx2.close()
        c2.close()
    finally:
        ctx.close()
        c.close()


def test_all_or_nothing_retrieve_cpu_shm(srv, mp):
    model = _model()
    kv = mp.make_kv()
    c, ctx = mp.worker(srv.rpc_url, kv, mode="lmcache_driven", model=model)
    try:
        assert ctx.submit_store(mp.key("a", model=model, end=256), list(range(1, 17))).result(20)
        rid = "r-" + model
        assert mp.lookup_hits(c, model=model, rid=rid) == 1
        dest = mp.make_kv(zeros=True)
        c2, ctx2 = mp.worker(srv.rpc_url, dest, mode="lmcache_driven", model=model)
        assert (
            ctx2.submit_retrieve(mp.key(rid, model=model), list(range(1, 33))).result(20) is False
        )
        assert all(int(t.abs().sum()) == 0 for t in dest)
        ctx2.close()
        c2.close()
    finally:
        ctx.close()
        c.close()


def test_duplicate_store_returns_true(srv, mp):
    model = _model()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model, negotiate=False)
    try:
        for _ in range(2):
            assert ctx.submit_store(mp.key("d", model=model), list(range(1, 33))).result(20) is True
    finally:
        ctx.close()
        c.close()


def test_pickle_commit_with_wrong_shape_is_false(srv, mp):
    model = _model()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model, negotiate=False)
    try:
        k = mp.key("w", model=model)
        assert c.call("prepare_store", k, ctx.instance_id) == {"context": {}}
        bad = pickle.dumps([torch.zeros(3, 3, dtype=torch.float16)] * 2)
        assert c.call("commit_store", k, ctx.instance_id, bad) is False
        assert mp.lookup_hits(c, model=model) == 0
    finally:
        ctx.close()
        c.close()


class _Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_pickle_with_forbidden_global_is_rejected(srv, mp, tmp_path):
    model = _model()
    marker = tmp_path / "pwned"
    before = mp.metric(srv, "lmcache_mp_rejected_payloads_total")
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model, negotiate=False)
    try:
        k = mp.key("e", model=model)
        c.call("prepare_store", k, ctx.instance_id)
        assert (
            c.call("commit_store", k, ctx.instance_id, pickle.dumps([_Evil(str(marker))])) is False
        )
        assert not marker.exists()
        assert c.noop() == "OK"
        assert mp.metric(srv, "lmcache_mp_rejected_payloads_total") == before + 1
        assert mp.lookup_hits(c, model=model) == 0
    finally:
        ctx.close()
        c.close()


# --- 14-17: errors and registration ------------------------------------------------------------


def test_num_kv_readers_zero_rejected(srv, mp):
    k = mp.key("z", worker_id=None, readers=0)
    with MPClient(srv.rpc_url) as c:
        with pytest.raises(LMCacheTimeoutError):
            c.submit("lookup", k, 1).result(2)
        assert c.negotiate_default_features() == {
            "error_replies",
            "raw_payload_v1",
            "token_ids_u32be",
            "ordered_lookup",
            "lookup_wait",
            "retrieve_deadline",
        }
        with pytest.raises(RemoteError) as exc:
            c.submit("lookup", k, 1).result(5)
        assert exc.value.code == "INVALID_ARGUMENT" and "num_kv_readers" in exc.value.message


def test_unknown_op_then_service_continues(srv, mp):
    with MPClient(srv.rpc_url) as c:
        with pytest.raises(LMCacheTimeoutError):
            c.submit(999).result(1)
        c.negotiate_default_features()
        with pytest.raises(RemoteError) as exc:
            c.submit(999).result(5)
        assert exc.value.code == "UNKNOWN_OP"
        with pytest.raises(RemoteError) as exc:
            c.submit(29).result(5)  # known LATER op (p2p)
        assert exc.value.code == "NOT_SUPPORTED"
        assert c.noop() == "OK"


def test_garbage_frames_do_not_stop_service(srv, mp):
    peer = mp.RawPeer(srv.rpc_url)
    try:
        peer.send([b"\xc1\xc1"])  # too few frames
        peer.send([b"\xc1", b"\xc1", b"\xc1"])  # undecodable uid/op
        peer.send([msgspec.msgpack.encode(1), msgspec.msgpack.encode(21), b"extra"])  # wrong count
        peer.send(
            [msgspec.msgpack.encode(2), msgspec.msgpack.encode(8), b"\x93\x01"]
        )  # bad key type
        assert peer.recv(1.0) is None
    finally:
        peer.close()
    with MPClient(srv.rpc_url) as c:
        assert c.noop() == "OK"


def test_prepare_store_unregistered_instance(srv, mp):
    k = mp.key("u")
    with MPClient(srv.rpc_url) as c:
        assert set(c.get_experimental()) >= {"error_replies", "raw_payload_v1"}
        with pytest.raises(LMCacheTimeoutError):
            c.submit("prepare_store", k, 424242).result(1.5)
        c.negotiate_default_features()
        with pytest.raises(RemoteError) as exc:
            c.submit("prepare_store", k, 424242).result(5)
        assert exc.value.code == "NOT_REGISTERED" and exc.value.retryable


def test_registration_is_idempotent(srv, mp):
    model = _model()
    kv = mp.make_kv()
    for mode, unreg in (("engine_driven", 15), ("lmcache_driven", 2)):
        c, ctx = mp.worker(srv.rpc_url, kv, mode=mode, model=model)
        try:
            ctx.register(model, 1)  # again, same id
            ids = mp.status(srv)
            key = "non_cuda_context_meta" if mode == "engine_driven" else "cache_context_meta"
            assert str(ctx.instance_id) in ids[key]
            assert c.call(unreg, 987654321) is None  # unknown id is fine
            assert c.call(unreg, ctx.instance_id) is None
            assert c.call(unreg, ctx.instance_id) is None
        finally:
            ctx.close()
            c.close()


# --- 20-24: L1 pressure, sessions, locks ----------------------------------------------------


def test_store_larger_than_l1_is_false(lmcache_server, mp):
    srv = lmcache_server("--l1-size-gb", "0.001", "--l1-init-size-gb", "0")
    model = _model()
    # one chunk is 2*3*256*4*64*2 bytes = 768 KiB: it fits the ~1 MiB L1, the request's two
    # do not (a layout whose single chunk exceeds L1 is refused at registration)
    kv = mp.make_kv(num_layers=3, heads=4, head_size=64)
    c, ctx = mp.worker(srv.rpc_url, kv, model=model)
    try:
        before = mp.metric(srv, "lmcache_mp_l1_allocation_failure_chunks_total")
        assert ctx.submit_store(mp.key("big", model=model), list(range(1, 33))).result(20) is False
        after = mp.metric(srv, "lmcache_mp_l1_allocation_failure_chunks_total")
        assert after > before, srv.log()
    finally:
        ctx.close()
        c.close()


def test_new_tokens_under_same_request_id_are_rehashed(srv, mp):
    model = _model()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model)
    try:
        tokens_b = [5, *mp.TOKENS[1:]]
        assert ctx.submit_store(mp.key("R", model=model), list(range(1, 33))).result(20)
        assert ctx.submit_store(
            mp.key("R", model=model, tokens=tokens_b), list(range(1, 33))
        ).result(20)
        assert mp.lookup_hits(c, tokens=tokens_b, model=model) == 2
    finally:
        ctx.close()
        c.close()


def test_free_lookup_locks_and_clear(srv, mp):
    model = _model()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model)
    try:
        assert ctx.submit_store(mp.key("f", model=model), list(range(1, 33))).result(20)
        rid = "free-" + model
        assert mp.lookup_hits(c, model=model, rid=rid) == 2
        # locked objects survive clear(force=false)
        assert c.call("clear", False) is None
        assert mp.lookup_hits(c, model=model) == 2
        k = mp.key(rid, model=model, worker_id=None)
        assert (
            c.call("free_lookup_locks", mp.key(rid, model=model, worker_id=None, start=0, end=0), 1)
            is None
        )
        assert c.call("free_lookup_locks", k, 1) is None
        assert c.call("free_lookup_locks", k, 1) is None  # repeated: no-op
        # the second lookup above still holds locks until its session ends
        assert c.call("clear", False) is None
        hits_after = mp.lookup_hits(c, model=model)
        assert hits_after in (0, 2)
        assert c.call("clear", True) is None
        assert mp.lookup_hits(c, model=model) == 0
    finally:
        ctx.close()
        c.close()


def test_clear_after_free_removes_objects(srv, mp):
    model = _model()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model)
    try:
        assert ctx.submit_store(mp.key("f", model=model), list(range(1, 33))).result(20)
        rid = "free2-" + model
        assert mp.lookup_hits(c, model=model, rid=rid) == 2
        assert c.call("free_lookup_locks", mp.key(rid, model=model, worker_id=None), 1) is None
        assert c.call("clear", False) is None
        assert mp.lookup_hits(c, model=model) == 0
    finally:
        ctx.close()
        c.close()


def test_session_ttl_counts_from_last_use(srv_short, mp):
    srv = srv_short
    model = _model()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model)
    try:
        assert ctx.submit_store(mp.key("s", model=model), list(range(1, 33))).result(20)
        live = mp.key("live", model=model, worker_id=None)
        idle = mp.key("idle", model=model, worker_id=None)
        c.call("lookup", live, 1)
        c.call("lookup", idle, 1)
        for _ in range(10):  # touch "live" every 0.5 s for 5 s
            c.call(
                "free_lookup_locks", mp.key("live", model=model, worker_id=None, start=0, end=0), 1
            )
            time.sleep(0.5)
        # "idle" expired (its result is gone), "live" still has its unconsumed result
        assert c.call("query_prefetch_status", "idle") == 0
        assert c.call("query_prefetch_status", "live") == 2
    finally:
        ctx.close()
        c.close()


# --- 18-19: reaping ----------------------------------------------------------------------------


def test_reaping_by_liveness(lmcache_server, mp):
    srv = lmcache_server(
        "--worker-reap-timeout-seconds", "2", "--worker-registration-grace-seconds", "2"
    )
    kv = mp.make_kv()
    c1, silent = mp.worker(srv.rpc_url, kv)
    c2, alive = mp.worker(srv.rpc_url, kv)
    c3, never = mp.worker(srv.rpc_url, kv)
    try:
        c1.ping(silent.instance_id)
        for _ in range(10):
            c2.ping(alive.instance_id)
            time.sleep(0.5)
        ids = mp.status(srv)["registered_non_cuda_instance_ids"]
        assert alive.instance_id in ids
        assert silent.instance_id not in ids
        assert never.instance_id not in ids
        assert mp.metric(srv, "lmcache_mp_reaped_instances_total", mode="engine_driven") >= 2
    finally:
        for c, x in ((c1, silent), (c2, alive), (c3, never)):
            x.close()
            c.close()


def test_reaping_discards_pending_shm_reservation(lmcache_server, mp):
    srv = lmcache_server(
        "--shm-name",
        f"reap{os.getpid()}",
        "--worker-reap-timeout-seconds",
        "1",
        "--worker-registration-grace-seconds",
        "1",
    )
    model = _model()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model)
    try:
        assert ctx.mode == "SHM"
        reply = c.call("prepare_store", mp.key("half", model=model), ctx.instance_id)
        assert len(reply["context"]["slots"]) == 2
        mp.wait_for(
            lambda: ctx.instance_id not in mp.status(srv)["registered_non_cuda_instance_ids"],
            "the unregistered worker left the registry",
            10,
        )
        # the model's layout stays dormant, so the lookup is a real miss, not an early exit
        assert mp.lookup_hits(c, model=model) == 0
    finally:
        ctx.close()
        c.close()


@contextlib.contextmanager
def _worker_with_stored_prompt(url: str, mp, kv=None):
    """(client, context, model) of a registered SHM worker that stored mp.TOKENS (2 chunks
    from blocks 1..32); both are closed afterwards."""
    model = _model()
    c, ctx = mp.worker(url, mp.make_kv() if kv is None else kv, model=model)
    try:
        assert ctx.mode == "SHM"
        assert ctx.submit_store(mp.key("s", model=model), list(range(1, 33))).result(20)
        yield c, ctx, model
    finally:
        ctx.close()
        c.close()


def _chunks_left_after_clear(c: MPClient, mp, model: str) -> int:
    """Clear (locked chunks stay), then count the prompt's chunks still cached."""
    c.call("clear")
    rid = f"probe-{next(_models)}"
    hits = mp.lookup_hits(c, model=model, rid=rid)
    c.call("end_session", rid)  # the probe's own locks go with it
    return hits


@pytest.mark.parametrize("lease", ["3600", "1"])
def test_dropped_worker_keeps_its_shm_read_locked_for_the_lease(lmcache_server, mp, lease):
    srv = lmcache_server(
        "--shm-name",
        f"lease{lease}_{os.getpid()}",
        "--worker-reap-timeout-seconds",
        "1",
        "--worker-registration-grace-seconds",
        "1",
        "--retrieve-lease-seconds",
        lease,
    )
    with _worker_with_stored_prompt(srv.rpc_url, mp) as (c, ctx, model):
        assert mp.lookup_hits(c, model=model, rid="lease") == 2
        reply = c.call("prepare_retrieve", mp.key("lease", model=model), ctx.instance_id)
        assert reply["success"] and reply["context"]["lease_s"] == float(lease)
        # The worker goes silent mid-copy and is reaped: its slots must not be reused while
        # a copy started under the lease may still be reading them ...
        mp.wait_for(
            lambda: ctx.instance_id not in mp.status(srv)["registered_non_cuda_instance_ids"],
            "the silent worker reaped",
            10,
        )
        if lease == "3600":
            assert _chunks_left_after_clear(c, mp, model) == 2
        else:  # ... and are released once the lease is over
            mp.wait_for(
                lambda: _chunks_left_after_clear(c, mp, model) == 0,
                "the read released when its lease ended",
                30,
                interval=0.5,
            )


def test_a_dropped_worker_releases_the_shares_of_its_failed_read(srv_shm, mp):
    model = _model()
    c, ctx = mp.worker(srv_shm.rpc_url, mp.make_kv(), model=model)
    c2, ctx2 = mp.worker(srv_shm.rpc_url, mp.make_kv(), model=model)  # keeps the model known
    try:
        assert ctx.submit_store(mp.key("a", model=model, end=256), list(range(1, 17))).result(20)
        assert mp.lookup_hits(c, model=model, rid="fails") == 1
        key = mp.key("fails", model=model)  # both chunks: the second is missing
        assert c.call("prepare_retrieve", key, ctx.instance_id)["success"] is False
        assert _chunks_left_after_clear(c, mp, model) == 1  # the worker owes its share
        ctx.unregister()  # ... and goes away without commit_retrieve: nothing copies, so
        assert _chunks_left_after_clear(c2, mp, model) == 0  # no lease keeps it locked
    finally:
        for x in (ctx, c, ctx2, c2):
            x.close()


def test_a_dropped_worker_releases_only_its_own_share_of_a_read(lmcache_server, mp):
    # Two lookups hold a lock each; the worker reading under the first is dropped, then the
    # first request ends: the second request's lock must survive both.
    srv = lmcache_server("--shm-name", f"share{os.getpid()}", "--retrieve-lease-seconds", "0")
    with _worker_with_stored_prompt(srv.rpc_url, mp) as (c, ctx, model):
        assert mp.lookup_hits(c, model=model, rid="first") == 2
        assert mp.lookup_hits(c, model=model, rid="second") == 2
        reply = c.call("prepare_retrieve", mp.key("first", model=model), ctx.instance_id)
        assert reply["success"] and "lease_s" not in reply["context"]
        ctx.unregister()
        c.call("end_session", "first")
        assert _chunks_left_after_clear(c, mp, model) == 2  # "second" still holds them
        c.call("end_session", "second")
        assert _chunks_left_after_clear(c, mp, model) == 0


@pytest.mark.parametrize("ended_by", ["end_session", "ttl"])
def test_a_session_ending_during_an_shm_read_leaves_its_slots_locked_until_commit(
    lmcache_server, mp, ended_by
):
    ttl = "2" if ended_by == "ttl" else "600"
    srv = lmcache_server("--shm-name", f"{ended_by}{os.getpid()}", "--session-ttl-seconds", ttl)
    with _worker_with_stored_prompt(srv.rpc_url, mp) as (c, ctx, model):
        assert mp.lookup_hits(c, model=model, rid="reading") == 2
        key = mp.key("reading", model=model)
        assert c.call("prepare_retrieve", key, ctx.instance_id)["success"]
        # The scheduler is done with the request, or it went idle past its TTL ...
        if ended_by == "end_session":
            c.call("end_session", "reading")
        else:
            mp.wait_for(lambda: mp.status(srv)["active_sessions"] == 0, "the sessions expired")
        assert _chunks_left_after_clear(c, mp, model) == 2  # ... the worker still copies
        assert c.call("commit_retrieve", key, ctx.instance_id) is True
        assert _chunks_left_after_clear(c, mp, model) == 0


def test_a_read_of_an_ended_session_leaves_the_next_session_of_its_request_id_alone(srv_shm, mp):
    with _worker_with_stored_prompt(srv_shm.rpc_url, mp) as (c, ctx, model):
        assert mp.lookup_hits(c, model=model, rid="again") == 2
        key = mp.key("again", model=model)
        assert c.call("prepare_retrieve", key, ctx.instance_id)["success"]
        c.call("end_session", "again")
        assert mp.lookup_hits(c, model=model, rid="again") == 2  # a new session, new locks
        assert c.call("commit_retrieve", key, ctx.instance_id) is True
        assert _chunks_left_after_clear(c, mp, model) == 2  # the new session still holds them
        c.call("end_session", "again")
        assert _chunks_left_after_clear(c, mp, model) == 0


def test_a_failed_read_of_an_ended_session_leaves_the_next_session_alone(srv_shm, mp):
    model = _model()
    c, ctx = mp.worker(srv_shm.rpc_url, mp.make_kv(), model=model)
    try:
        assert ctx.submit_store(mp.key("a", model=model, end=256), list(range(1, 17))).result(20)
        assert mp.lookup_hits(c, model=model, rid="half") == 1
        key = mp.key("half", model=model)  # both chunks: the second is missing
        assert c.call("prepare_retrieve", key, ctx.instance_id)["success"] is False
        c.call("end_session", "half")
        assert mp.lookup_hits(c, model=model, rid="half") == 1
        assert c.call("commit_retrieve", key, ctx.instance_id) is False
        assert _chunks_left_after_clear(c, mp, model) == 1  # the new session still holds it
        c.call("end_session", "half")
        assert _chunks_left_after_clear(c, mp, model) == 0
    finally:
        ctx.close()
        c.close()


@pytest.mark.parametrize("lease", ["3600", "0"])
def test_worker_awaits_commit_retrieve_only_without_a_running_lease(
    lmcache_server, mp, monkeypatch, lease
):
    from lmcache.v1.multiprocess.transfer_context import worker_transfer

    srv = lmcache_server("--shm-name", f"lw{lease}{os.getpid()}", "--retrieve-lease-seconds", lease)
    kv = mp.make_kv()
    with _worker_with_stored_prompt(srv.rpc_url, mp, kv) as (c, ctx, model):
        awaited, sent = [], []
        real_call, real_submit = c.call, c.submit
        monkeypatch.setattr(
            c, "call", lambda op, *a, **k: awaited.append(op) or real_call(op, *a, **k)
        )
        monkeypatch.setattr(c, "submit", lambda op, *a: sent.append(op) or real_submit(op, *a))
        for i, clock_jumps in enumerate((False, True)):
            for t in kv:
                t[:, 33:].zero_()  # blocks 33..63 take the retrieve
            if clock_jumps:  # a copy that outlasts any lease (a stalled worker)
                monkeypatch.setattr(
                    worker_transfer,
                    "_lease_clock",
                    functools.partial(next, itertools.count(0, 10**6)),
                )
            rid = f"lw-{i}-{model}"
            assert mp.lookup_hits(c, model=model, rid=rid) == 2
            awaited.clear(), sent.clear()
            ids = [*range(33, 64), 0]  # the last block of the prompt lands in block 0
            assert ctx.submit_retrieve(mp.key(rid, model=model), ids).result(20)
            assert all(torch.equal(t[:, 33:64], t[:, 1:32]) for t in kv)
            if lease != "0" and not clock_jumps:
                assert "commit_retrieve" in sent and "commit_retrieve" not in awaited
            else:
                assert "commit_retrieve" in awaited
        # Not awaited is still delivered: the server released the worker's read share.
        mp.wait_for(
            lambda: mp.metric(srv, "lmcache_mp_num_finished_retrieves_total") >= 2,
            "both commits handled",
            10,
        )


# --- 25-27: CLI defaults, SHM, HTTP -------------------------------------------------------------


def test_no_flag_start_defaults(lmcache_server, mp):
    srv = lmcache_server(test_defaults=False)
    st = mp.status(srv)
    assert st["l1_size_bytes"] == 4 << 30
    assert st["eviction_policy"] == "LRU"
    assert st["transfer_modes"] == ["lmcache_driven", "engine_driven"]
    # The engine-driven SHM pool is on by default, named after the port.
    assert st["engine_driven"]["shm_enabled"] is True
    assert os.path.exists(f"/dev/shm/lmcache_l1_pool_{srv.port}")


def test_shm_registration_and_disabled_reason(lmcache_server, srv_shm, mp):
    c, ctx = mp.worker(srv_shm.rpc_url, mp.make_kv())
    try:
        reply = c.call(
            "register_kv_cache_engine_driven_context",
            P.RegisterEngineDrivenContextPayload(
                instance_id=ctx.instance_id,
                model_name="m",
                world_size=1,
                block_size=16,
                num_layers=2,
                hidden_dim_size=16,
                dtype_str="float16",
            ),
        )
        assert reply["shm_name"] == f"lmcache_l1_pool_conf{os.getpid()}" and reply["pool_size"] > 0
    finally:
        ctx.close()
        c.close()


def test_shm_larger_than_dev_shm_is_reported(lmcache_server, mp):
    free = os.statvfs("/dev/shm")
    too_big_gb = str((free.f_bavail * free.f_frsize) // (1 << 30) + 1)
    # Also larger than RAM here: a lazy L1 must still start (it commits pages on use).
    big = lmcache_server(
        "--shm-name", f"big{os.getpid()}", "--l1-size-gb", too_big_gb, "--l1-init-size-gb", "0"
    )
    st = mp.status(big)
    assert (
        st["engine_driven"]["shm_enabled"] is False and st["engine_driven"]["shm_disabled_reason"]
    )
    assert "SHM" in big.log() and "WARNING" in big.log()


def test_http_endpoints(srv, mp):
    base = srv.http_url
    assert httpx.get(base + "/").json() == {"status": "ok", "service": "LMCache HTTP API"}
    assert httpx.get(base + "/healthcheck").json() == {"status": "healthy"}
    assert httpx.get(base + "/cache/objects", params={"tier": "l1"}).status_code == 400
    assert httpx.get(base + "/cache/objects", params={"tier": "l2"}).status_code == 503
    assert "lmcache_mp_l1_eviction_loop_ticks_total" in httpx.get(base + "/metrics").text
    assert httpx.post(base + "/run_script", json={}).status_code == 404
    env = httpx.get(base + "/env").json()
    assert all(v == "***" for k, v in env.items() if "SECRET" in k.upper())
    assert httpx.post(base + "/cache/clear", json={"tier": "l1"}).json() == {
        "status": "ok",
        "cleared": {"tier": "l1"},
    }


def test_metrics_show_the_process_the_collector_and_the_frozen_start_up_heap(srv, mp):
    # What 0.5.6's default registry shows besides its own names (process_*, python_gc_*),
    # and how much of the heap start-up took out of garbage collection (full passes over
    # all of it stalled every request for ~0.2 s).
    assert mp.metric(srv, "process_resident_memory_bytes") > 0
    assert mp.metric(srv, "process_cpu_seconds_total") > 0
    assert "python_gc_collections_total" in httpx.get(srv.http_url + "/metrics").text
    assert mp.metric(srv, "lmcache_mp_gc_frozen_objects") > 10000


def test_l1_evictions_reach_metrics(lmcache_server, mp):
    # ~2.5 chunks of 4 MiB fit: later stores must evict earlier, unlocked chunks
    srv = lmcache_server("--l1-size-gb", "0.01", "--l1-init-size-gb", "0")
    model = _model()
    kv = mp.make_kv(num_layers=4, heads=16, head_size=64)
    c, ctx = mp.worker(srv.rpc_url, kv, model=model)
    try:
        assert mp.metric(srv, "lmcache_mp_l1_evicted_chunks_total") == 0
        for i in range(4):
            tokens = [i * 100000 + t for t in mp.TOKENS]
            ctx.submit_store(
                mp.key(f"ev{i}", model=model, tokens=tokens), list(range(1, 33))
            ).result(20)
        mp.wait_for(
            lambda: mp.metric(srv, "lmcache_mp_l1_evicted_chunks_total") >= 1,
            "an L1 eviction counted in /metrics",
            10,
        )
    finally:
        ctx.close()
        c.close()
