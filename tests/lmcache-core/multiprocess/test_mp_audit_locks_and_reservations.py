"""Lock shares and SHM reservations as /status counts them (docs/design/protocol.md#operations,
docs/design/protocol.md#liveness, docs/design/protocol.md#sessions): free_lookup_locks, session
expiry, end_session, unregister and write-TTL expiry."""

from __future__ import annotations

import itertools
import os

import pytest

_n = itertools.count()


def _model() -> str:
    return f"audit-{os.getpid()}-{next(_n)}"


def _l1(mp, srv) -> dict:
    return mp.status(srv)["storage_manager"]["l1"]


@pytest.fixture(scope="module")
def srv(lmcache_server_module):
    return lmcache_server_module()


def test_free_lookup_locks_releases_exactly_its_own_shares(srv, mp):
    model = _model()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model)
    try:
        assert ctx.submit_store(mp.key("s", model=model), list(range(1, 33))).result(20)
        assert _l1(mp, srv)["read_locked_count"] == 0
        a = "a-" + model
        assert mp.lookup_hits(c, model=model, rid=a) == 2
        assert _l1(mp, srv)["read_locked_count"] == 2
        empty = mp.key(a, model=model, worker_id=None, start=256, end=256)
        assert c.call("free_lookup_locks", empty, 1) is None
        assert _l1(mp, srv)["read_locked_count"] == 2  # start == end frees nothing
        # only chunk 1: one share of one key
        assert (
            c.call("free_lookup_locks", mp.key(a, model=model, worker_id=None, start=256), 1)
            is None
        )
        assert _l1(mp, srv)["read_locked_count"] == 1
        assert c.call("free_lookup_locks", mp.key(a, model=model, worker_id=None), 1) is None
        assert _l1(mp, srv)["read_locked_count"] == 0
        # a second session holds both keys; freeing the first session again takes nothing of it
        b = "b-" + model
        assert mp.lookup_hits(c, model=model, rid=b) == 2
        assert _l1(mp, srv)["read_locked_count"] == 2
        assert c.call("free_lookup_locks", mp.key(a, model=model, worker_id=None), 1) is None
        assert _l1(mp, srv)["read_locked_count"] == 2
        assert c.call("free_lookup_locks", mp.key(b, model=model, worker_id=None), 1) is None
        assert _l1(mp, srv)["read_locked_count"] == 0
    finally:
        ctx.close()
        c.close()


def test_end_session_frees_leftover_shares(srv, mp):
    model = _model()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model)
    try:
        assert ctx.submit_store(mp.key("s", model=model), list(range(1, 33))).result(20)
        rid = "e-" + model
        assert mp.lookup_hits(c, model=model, rid=rid) == 2
        assert _l1(mp, srv)["read_locked_count"] == 2
        assert c.call("end_session", rid) is None
        assert _l1(mp, srv)["read_locked_count"] == 0
        assert c.call("clear", False) is None  # nothing holds them any more
        assert mp.lookup_hits(c, model=model) == 0
    finally:
        ctx.close()
        c.close()


def test_session_expiry_releases_its_lock_shares(lmcache_server, mp):
    srv = lmcache_server("--session-ttl-seconds", "2")
    model = _model()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model)
    try:
        assert ctx.submit_store(mp.key("s", model=model), list(range(1, 33))).result(20)
        # "live" locks chunk 0 only; "idle" locks chunks 0 and 1
        assert mp.lookup_hits(c, model=model, rid="live", tokens=range(1, 257)) == 1
        assert mp.lookup_hits(c, model=model, rid="idle") == 2
        assert _l1(mp, srv)["read_locked_count"] == 2
        touch = mp.key("live", model=model, tokens=range(1, 257), worker_id=None, start=0, end=0)

        def idle_expired() -> bool:
            c.call("free_lookup_locks", touch, 1)  # keeps "live" in use
            return _l1(mp, srv)["read_locked_count"] == 1

        mp.wait_for(idle_expired, "the idle session's shares released", timeout=20)
        c.call("free_lookup_locks", touch, 1)
        assert _l1(mp, srv)["read_locked_count"] == 1  # "live" still holds chunk 0
    finally:
        ctx.close()
        c.close()


@pytest.fixture(scope="module")
def srv_shm(lmcache_server_module):
    return lmcache_server_module(
        "--shm-name", f"auditres{os.getpid()}", "--l1-write-ttl-seconds", "2"
    )


def _half_written(mp, srv, model):
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model)
    assert ctx.mode == "SHM"
    reply = c.call("prepare_store", mp.key("half", model=model), ctx.instance_id)
    assert len(reply["context"]["slots"]) == 2
    ctx._slot_views(reply["context"]["slots"])[0].fill_(1.0)
    assert _l1(mp, srv)["write_locked_count"] == 2
    return c, ctx


def test_unregister_discards_pending_shm_reservation(srv_shm, mp):
    model = _model()
    c, ctx = _half_written(mp, srv_shm, model)
    try:
        before = _l1(mp, srv_shm)["total_object_count"]
        assert c.call("unregister_kv_cache_engine_driven_context", ctx.instance_id) is None
        assert _l1(mp, srv_shm)["write_locked_count"] == 0
        assert _l1(mp, srv_shm)["total_object_count"] == before
        assert mp.lookup_hits(c, model=model) == 0
    finally:
        ctx.close()
        c.close()


def test_write_ttl_expiry_discards_pending_shm_reservation(srv_shm, mp):
    model = _model()
    c, ctx = _half_written(mp, srv_shm, model)
    try:
        before = _l1(mp, srv_shm)["total_object_count"]
        mp.wait_for(
            lambda: _l1(mp, srv_shm)["write_locked_count"] == 0, "the reservation expired", 20
        )
        # a commit after the deadline must not publish the half-written chunks
        k = mp.key("half", model=model)
        assert c.call("commit_store", k, ctx.instance_id, b"") is not True
        assert _l1(mp, srv_shm)["total_object_count"] == before
        assert mp.lookup_hits(c, model=model) == 0
    finally:
        ctx.close()
        c.close()
