"""Reliability under misbehaving clients (issue 20, items 3 and 4), against a real server:
a session cap, staging of silent workers, registration and token validation, message size,
L1 size flags."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import msgspec
import pytest

from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.client import MPClient
from lmcache.v1.multiprocess.protocol import RemoteError

_ids = itertools.count()


def _model() -> str:
    return f"rel-{os.getpid()}-{next(_ids)}"


def _l1(srv, mp) -> dict:
    return mp.status(srv)["storage_manager"]["l1"]


def _chunks_left_after_clear(c: MPClient, mp, model: str) -> int:
    """Clear (locked chunks stay), then count the prompt's chunks still cached."""
    c.call("clear")
    rid = f"probe-{next(_ids)}"
    hits = mp.lookup_hits(c, model=model, rid=rid)
    c.call("end_session", rid)
    return hits


# --- item 3: sessions are capped ------------------------------------------------------------


def test_sessions_beyond_the_cap_end_the_least_recently_used(lmcache_server, mp):
    srv = lmcache_server("--max-sessions", "2")
    model = _model()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model)
    try:
        assert ctx.submit_store(mp.key("stored", model=model), list(range(1, 33))).result(20)
        assert mp.lookup_hits(c, model=model, rid="locker") == 2  # "locker" read-locks both
        c.call("clear")
        assert mp.lookup_hits(c, model=model, rid="check") == 2  # locked chunks survive clear
        c.call("end_session", "check")
        # A client that never ends its sessions: each new one pushes the oldest out.
        for i in range(5):
            assert mp.lookup_hits(c, model="never-registered", rid=f"leak-{i}") == 0
        st = mp.status(srv)
        assert st["active_sessions"] <= 2
        assert mp.metric(srv, "lmcache_mp_sessions_evicted_total") >= 4
        # "locker" was ended like an expired session: its locks are gone with it.
        assert _chunks_left_after_clear(c, mp, model) == 0
        assert "session table full (--max-sessions 2)" in srv.log()
    finally:
        ctx.close()
        c.close()


def test_max_sessions_flag_is_validated():
    from lmcache.cli.errors import CLIError
    from lmcache.cli.server import build_configs

    assert build_configs(_parse())[0].max_sessions == 10000
    assert build_configs(_parse("--max-sessions", "0"))[0].max_sessions == 0  # no cap
    with pytest.raises(CLIError, match=r"^--max-sessions must be >= 0 \(got -1\)"):
        build_configs(_parse("--max-sessions", "-1"))


# --- item 3: a dead worker's staging --------------------------------------------------------


def test_a_silent_worker_that_never_pinged_releases_its_staging_long_before_its_grace(
    lmcache_server, mp
):
    srv = lmcache_server(
        "--shm-name",
        f"rel{os.getpid()}",
        "--worker-reap-timeout-seconds",
        "2",
        "--worker-registration-grace-seconds",
        "3600",
        "--retrieve-lease-seconds",
        "0",
    )
    model = _model()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model=model)
    try:
        assert ctx.mode == "SHM"
        assert ctx.submit_store(mp.key("stored", model=model), list(range(1, 33))).result(20)
        # The worker reserves slots for a store and starts a read, then dies without a word
        # (it never pinged, so the reaper would keep it registered for an hour).
        other = [t + 100000 for t in mp.TOKENS]
        reply = c.call("prepare_store", mp.key("half", model=model, tokens=other), ctx.instance_id)
        assert len(reply["context"]["slots"]) == 2
        assert mp.lookup_hits(c, model=model, rid="reading") == 2
        assert c.call("prepare_retrieve", mp.key("reading", model=model), ctx.instance_id)[
            "success"
        ]
        assert _l1(srv, mp)["write_locked_count"] == 2
        mp.wait_for(
            lambda: _l1(srv, mp)["write_locked_count"] == 0,
            "the silent worker's store reservations released",
        )
        c.call("end_session", "reading")  # the scheduler is done: only the read held them
        assert _chunks_left_after_clear(c, mp, model) == 0
        assert ctx.instance_id in mp.status(srv)["registered_non_cuda_instance_ids"]
        assert mp.metric(srv, "lmcache_mp_reclaimed_staging_total") == 2
        assert "silent for more than 2 s: released its 1 unfinished store(s)" in srv.log()
    finally:
        ctx.close()
        c.close()


# --- item 4: registration and keys ------------------------------------------------------------


def test_a_layout_whose_chunk_exceeds_l1_is_refused_naming_the_flag(lmcache_server, mp):
    srv = lmcache_server("--l1-size-gb", "0.25")
    model = _model()
    huge = P.RegisterEngineDrivenContextPayload(
        instance_id=4242,
        model_name=model,
        world_size=1,
        block_size=16,
        num_layers=1_000_000,
        hidden_dim_size=1_000_000,  # ~1e15 bytes per chunk
        dtype_str="bfloat16",
    )
    with MPClient(srv.rpc_url, default_timeout=20) as c:
        c.negotiate_default_features()
        with pytest.raises(RemoteError) as exc:
            c.call("register_kv_cache_engine_driven_context", huge)
        assert exc.value.code == "INVALID_ARGUMENT"
        msg = exc.value.message
        assert "more than the whole L1 (268435456 bytes)" in msg and "--l1-size-gb" in msg
        assert c.noop() == "OK"  # the server keeps running
    st = mp.status(srv)
    assert 4242 not in st["registered_non_cuda_instance_ids"]
    assert not any(k.startswith(model) for k in st["layouts"])


def test_tokens_outside_uint32_are_refused_before_any_layout_exists(lmcache_server, mp):
    srv = lmcache_server()
    tokens = [1, 2, 1 << 32, 4]
    k = mp.key("big-token", worker_id=None, tokens=tokens, end=len(tokens), model=_model())
    with MPClient(srv.rpc_url, default_timeout=20) as c:
        # error replies, but tokens as an int list (as every 0.5.6 client sends them)
        c.negotiate_default_features((P.FEATURE_ERROR_REPLIES,))
        with pytest.raises(RemoteError) as exc:
            c.call("lookup", k, 1)
        assert exc.value.code == "INVALID_ARGUMENT"
        assert "4294967296 is outside [0, 2^32)" in exc.value.message
        assert c.call("query_prefetch_status", "big-token") == 0  # no job left pending
        assert c.noop() == "OK"


def test_a_message_larger_than_l1_is_refused_without_buffering_it(lmcache_server, mp):
    srv = lmcache_server("--l1-size-gb", "0.0625")  # 64 MiB: messages up to 80 MiB
    peer = mp.RawPeer(srv.rpc_url)
    try:
        enabled = peer.request("negotiate_features", [P.FEATURE_ERROR_REPLIES])
        assert msgspec.msgpack.decode(enabled[2]) == [P.FEATURE_ERROR_REPLIES]

        def noop_with_extra_frame(size: int) -> list[bytes] | None:
            peer.uid += 1
            uid = msgspec.msgpack.encode(peer.uid)
            peer.send([uid, msgspec.msgpack.encode("noop"), bytes(size)])
            return peer.recv(5.0)

        # A small extra frame is a bad request, and gets the error reply saying so ...
        small = noop_with_extra_frame(1024)
        assert small is not None and b"BAD_REQUEST" in small[2]
        # ... a frame beyond the limit never reaches the server: the peer is disconnected.
        assert noop_with_extra_frame(81 << 20) is None
        # The peer reconnects by itself and the server goes on serving.
        assert msgspec.msgpack.decode(peer.request("noop", timeout=10)[2]) == "OK"
    finally:
        peer.close()


# --- item 4: L1 size flags --------------------------------------------------------------------


def _parse(*argv: str):
    import argparse

    from lmcache.cli.server import add_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parser.parse_args(list(argv))


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", "server", *args, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, LMCACHE_TRACK_USAGE="false"),
    )


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_l1_size_that_is_not_a_positive_number_exits_2_naming_the_flag(value):
    out = _cli("--l1-size-gb", value, "--http-port", "0")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--l1-size-gb must be a positive, finite number of GiB" in out.stderr
    assert "Traceback" not in out.stderr


def test_l1_larger_than_the_machine_exits_2_naming_the_flag():
    out = _cli("--l1-size-gb", "1000000", "--http-port", "0")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--l1-size-gb 1e+06 is too large for this machine" in out.stderr  # 1 PiB
    assert "pass a smaller --l1-size-gb" in out.stderr and "Traceback" not in out.stderr
