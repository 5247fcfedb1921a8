"""The `resp` / `redis` adapter against a real redis-server
(docs/design/storage-engine.md#backend-resp)."""

from __future__ import annotations

import os
import select
import socket
import time

import pytest
import torch

from lmcache.storage.redis import RESPL2AdapterConfig
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.config import (
    get_l2_adapter_config_class,
    get_registered_l2_adapter_types,
    get_type_name_for_config,
    parse_l2_adapter_dict,
)
from lmcache.v1.distributed.l2_adapters.key_codec import object_key_to_string


def _resp(h, server, **extra):
    return h.build("resp", host="127.0.0.1", port=server.port, num_workers=2, **extra)


def test_type_and_alias_registered():
    assert {"resp", "redis"} <= set(get_registered_l2_adapter_types())
    cfg = parse_l2_adapter_dict(1, {"type": "redis", "host": "h", "port": 1})
    assert isinstance(cfg, RESPL2AdapterConfig)
    assert get_type_name_for_config(cfg) == "resp"


def test_round_trip_keys_and_values_are_0_5_6_format(h, adapters, redis_server):
    a = _resp(h, redis_server)
    adapters.append(a)
    keys = [
        ObjectKey(bytes([0, 1, 2, 3]), "llama", 255),
        ObjectKey(bytes.fromhex("deadbeef"), "meta-llama/Llama-3", 42, 0, "alice"),
        ObjectKey(bytes([9]), "llama", 1, 26),
    ]
    objs = [h.make_obj(n, seed=i) for i, n in enumerate([1, 4096, 70_000])]
    res = h.store(a, keys, objs)
    assert res.is_successful() and res.bytes_transferred() == 1 + 4096 + 70_000
    raw = redis_server.client()
    assert sorted(raw.cmd("KEYS", "*")) == sorted(
        [
            b"llama@000000ff@0@00010203",
            b"meta-llama/Llama-3@0000002a@0@deadbeef@alice",
            b"llama@00000001@1a@09",
        ]
    )
    for k, o in zip(keys, objs, strict=False):
        assert raw.cmd("GET", object_key_to_string(k)) == bytes(
            o.byte_array
        )  # raw bytes, no header
        assert raw.cmd("TTL", object_key_to_string(k)) == -1  # no expiry
    bm = h.lookup(a, keys + [ObjectKey(b"\x01", "llama", 0)])
    assert [bm.test(i) for i in range(4)] == [True, True, True, False]
    a.submit_unlock(keys)
    dst = [h.empty_like(o) for o in objs]
    bm = h.load(a, keys, dst)
    assert [bm.test(i) for i in range(3)] == [True, True, True]
    for o, d in zip(objs, dst, strict=False):
        assert bytes(d.byte_array) == bytes(o.byte_array)


def test_value_written_by_another_client_loads(h, adapters, redis_server):
    """A database filled by LMCache 0.5.6 (same key string, raw bytes) is readable."""
    raw = redis_server.client()
    payload = os.urandom(8192)
    raw.cmd("SET", "Qwen/Qwen3-8B@01010000@0@00000abc", payload)
    a = _resp(h, redis_server)
    adapters.append(a)
    dst = h.make_obj(8192, seed=-1)
    k = ObjectKey(bytes.fromhex("00000abc"), "Qwen/Qwen3-8B", 0x01010000)
    assert h.load(a, [k], [dst]).test(0) is True
    assert bytes(dst.byte_array) == payload


def test_missing_and_wrong_size_values_miss_only_that_key(h, adapters, redis_server):
    a = _resp(h, redis_server)
    adapters.append(a)
    keys = [h.key(i) for i in range(4)]
    objs = [h.make_obj(1000, seed=i) for i in range(4)]
    h.store(a, keys[:3], objs[:3])
    redis_server.client().cmd("SET", object_key_to_string(keys[1]), b"x" * 999)  # wrong size
    dst = [h.empty_like(o) for o in objs]
    bm = h.load(a, keys, dst)  # [ok, wrong size, ok, missing]
    assert [bm.test(i) for i in range(4)] == [True, False, True, False]
    assert bytes(dst[2].byte_array) == bytes(objs[2].byte_array)  # the stream stayed in sync


def test_unequal_sizes_and_large_values_in_one_batch(h, adapters, redis_server):
    a = _resp(h, redis_server)
    adapters.append(a)
    sizes = [7, 16 << 20, 4096, 1 << 20, 3]
    keys = [h.key(i) for i in range(len(sizes))]
    objs = [h.make_obj(n, seed=i) for i, n in enumerate(sizes)]
    assert h.store(a, keys, objs).bytes_transferred() == sum(sizes)
    dst = [h.empty_like(o) for o in objs]
    bm = h.load(a, keys, dst)
    assert bm.popcount() == len(sizes)
    for o, d in zip(objs, dst, strict=False):
        assert torch.equal(o.raw_tensor[: o.get_size()], d.raw_tensor[: d.get_size()])


def test_pipelined_batches_of_many_keys(h, adapters, redis_server):
    a = _resp(h, redis_server, pipeline_depth=16)
    adapters.append(a)
    keys = [h.key(i) for i in range(300)]
    objs = [h.make_obj(512 + i, seed=i) for i in range(300)]
    assert h.store(a, keys, objs).is_successful()
    assert redis_server.client().cmd("DBSIZE") == 300
    bm = h.lookup(a, keys)
    assert bm.popcount() == 300
    dst = [h.empty_like(o) for o in objs]
    assert h.load(a, keys, dst).popcount() == 300
    assert all(bytes(o.byte_array) == bytes(d.byte_array) for o, d in zip(objs, dst, strict=False))


def test_large_values_split_windows_and_stay_in_sync(h, adapters, redis_server):
    """Windows also end at 1 MiB of values: a mix of values above, at and below that bound on
    one connection must round-trip byte-exactly, and a wrong-size value inside a large window
    misses only that key."""
    a = h.build("resp", host="127.0.0.1", port=redis_server.port, num_workers=1, pipeline_depth=16)
    adapters.append(a)
    sizes = [3 << 19, 10, 1 << 20, 300_000, 300_000, 300_000, 300_000, 7, 1 << 19, 1 << 19, 5]
    keys = [h.key(i) for i in range(len(sizes))]
    objs = [h.make_obj(n, seed=i) for i, n in enumerate(sizes)]
    assert h.store(a, keys, objs).bytes_transferred() == sum(sizes)
    raw = redis_server.client()
    assert raw.cmd("STRLEN", object_key_to_string(keys[0])) == 3 << 19
    dst = [h.empty_like(o) for o in objs]
    dst[4] = h.make_obj(300_001)  # wrong size: a miss for this key only
    bm = h.load(a, keys, dst)
    assert [bm.test(i) for i in range(len(sizes))] == [i != 4 for i in range(len(sizes))]
    for i, (o, d) in enumerate(zip(objs, dst, strict=False)):
        if i != 4:
            assert bytes(o.byte_array) == bytes(d.byte_array)


def test_delete_skips_locked_keys_and_updates_usage(h, adapters, redis_server):
    a = _resp(h, redis_server, max_capacity_gb=1)
    adapters.append(a)
    keys = [h.key(i) for i in range(3)]
    h.store(a, keys, [h.make_obj(100, seed=i) for i in range(3)])
    assert a.get_usage().total_bytes_used == 300
    assert h.lookup(a, [keys[0]]).test(0) is True  # locked
    a.delete(keys)
    raw = redis_server.client()
    assert raw.cmd("EXISTS", object_key_to_string(keys[0])) == 1
    assert raw.cmd("EXISTS", object_key_to_string(keys[1])) == 0
    assert a.get_usage().total_bytes_used == 100
    a.submit_unlock([keys[0]])
    a.delete([keys[0]])
    assert raw.cmd("DBSIZE") == 0 and a.get_usage().total_bytes_used == 0


def test_auth_and_database_index(h, adapters, redis_server_with_password):
    srv = redis_server_with_password
    good = h.build("resp", host="127.0.0.1", port=srv.port, password="s3cret", db=3)
    adapters.append(good)
    k = h.key(1)
    obj = h.make_obj(256)
    assert h.store(good, [k], [obj]).is_successful()
    raw = srv.client()
    assert raw.cmd("DBSIZE") == 0  # db 0 untouched
    raw.cmd("SELECT", 3)
    assert raw.cmd("GET", object_key_to_string(k)) == bytes(obj.byte_array)

    bad = h.build("resp", host="127.0.0.1", port=srv.port, password="wrong", num_workers=1)
    adapters.append(bad)
    res = h.store(bad, [h.key(2)], [obj])
    assert not res.is_successful()  # a failure completion, not a hang
    assert h.lookup(bad, [k]).test(0) is False


def test_server_killed_mid_batch_fails_then_recovers(h, adapters, redis_server, sigstop):
    a = _resp(h, redis_server, socket_timeout_s=5.0)
    adapters.append(a)
    keys = [h.key(i) for i in range(64)]
    objs = [h.make_obj(1 << 20, seed=i % 4) for i in range(64)]
    # A stopped server accepts bytes into its socket buffer but never replies, so the batch
    # is provably still in flight when the server dies.
    sigstop(redis_server.proc.pid)
    tid = a.submit_store_task(keys, objs)
    done: dict = {}
    select.select([a.get_store_event_fd()], [], [], 0.5)
    done.update(a.pop_completed_store_tasks())
    assert tid not in done  # no reply can have come: the task is in flight
    redis_server.kill()  # SIGKILL works on a stopped process
    deadline = time.monotonic() + 30
    while tid not in done and time.monotonic() < deadline:
        select.select([a.get_store_event_fd()], [], [], 0.2)
        done.update(a.pop_completed_store_tasks())
    assert tid in done  # a completion arrives: no hang, no crash
    assert not done[tid].is_successful()  # the in-flight batch is reported as failed
    assert done[tid].bytes_transferred() < sum(o.get_size() for o in objs)
    # While the server is down every task completes as a failure or a miss.
    assert not h.store(a, [h.key(1000)], [h.make_obj(10)]).is_successful()
    assert h.lookup(a, [keys[0]]).test(0) is False
    assert h.load(a, [keys[0]], [h.empty_like(objs[0])]).test(0) is False
    # ... and the adapter says so, with the cause (issue 20: a dead L2 was invisible).
    st = a.report_status()
    assert st["is_healthy"] is False and st["healthy"] is False
    assert "redis" in st["last_error"] and st["last_error_time"] > 0
    assert "store" in st["failing_ops"]
    assert "redis" in done[tid].error  # the failed store says why

    redis_server.start()  # same port: workers reconnect with backoff
    ok = h.wait_until(lambda: h.store(a, [h.key(2000)], [h.make_obj(10)]).is_successful(), 20)
    assert ok
    # Every kind of operation that failed while the server was down works again.
    assert h.lookup(a, [h.key(2000)]).test(0) is True
    a.submit_unlock([h.key(2000)])
    assert h.load(a, [h.key(2000)], [h.make_obj(10, seed=-1)]).test(0) is True
    st = a.report_status()
    assert st["is_healthy"] is True and st["last_success_time"] >= st["last_error_time"]
    small = [h.make_obj(300, seed=i) for i in range(8)]
    assert h.store(a, keys[:8], small).is_successful()
    dst = [h.empty_like(o) for o in small]
    assert h.load(a, keys[:8], dst).popcount() == 8


def test_unreachable_server_completes_with_failures(h, adapters):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    a = h.build("resp", host="127.0.0.1", port=port, num_workers=1)
    adapters.append(a)
    assert not h.store(a, [h.key(1)], [h.make_obj(10)]).is_successful()
    assert h.lookup(a, [h.key(1)]).test(0) is False


def test_unreachable_host_is_reported_once_without_any_traffic(h, adapters, caplog):
    """Issue 20: an unreachable backend used to be invisible until traffic failed. The idle
    health check finds it at start, warns once naming host and cause, and keeps it unhealthy."""
    caplog.set_level("WARNING", logger="lmcache")
    a = h.build("resp", host="nonexistent.invalid", port=6379, health_check_interval_s=0.2)
    adapters.append(a)
    assert h.wait_until(lambda: a.report_status()["last_error"] is not None, 20)
    # several health checks later: still unhealthy, still one warning
    first = a.report_status()["last_error_time"]
    assert h.wait_until(lambda: a.report_status()["failures"] >= 3, 20)
    st = a.report_status()
    assert st["is_healthy"] is False and st["last_success_time"] is None
    assert "nonexistent.invalid" in st["last_error"] and st["last_error_time"] >= first
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "resp at nonexistent.invalid:6379" in warnings[0]
    assert "cannot resolve nonexistent.invalid" in warnings[0]


def test_idle_health_check_sees_the_server_die_and_come_back(h, adapters, redis_server):
    a = _resp(h, redis_server, health_check_interval_s=0.2)
    adapters.append(a)
    assert h.wait_until(lambda: a.report_status()["last_success_time"] is not None, 20)
    assert a.report_status()["is_healthy"] is True
    redis_server.kill()
    assert h.wait_until(lambda: not a.report_status()["is_healthy"], 20)
    # the next checks cannot reconnect, and say where and why
    refused = f"cannot connect to redis at 127.0.0.1:{redis_server.port}: Connection refused"
    assert h.wait_until(lambda: refused in a.report_status()["last_error"], 20)
    assert not a.report_status()["is_healthy"]
    redis_server.start()
    assert h.wait_until(lambda: a.report_status()["is_healthy"], 30)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"port": 1}, "host must be a non-empty string"),
        ({"host": "", "port": 1}, "host must be a non-empty string"),
        ({"host": "h"}, "port must be a positive integer"),
        ({"host": "h", "port": 0}, "port must be a positive integer"),
        ({"host": "h", "port": 1, "num_workers": 0}, "num_workers must be a positive integer"),
        ({"host": "h", "port": 1, "max_capacity_gb": -1}, "max_capacity_gb must be a non-negative"),
        (
            {"host": "h", "port": 1, "pipeline_depth": 0},
            "pipeline_depth must be a positive integer",
        ),
    ],
)
def test_config_errors(fields, message, monkeypatch):
    for var in ("LMCACHE_RESP_HOST", "LMCACHE_RESP_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="^" + message):
        get_l2_adapter_config_class("resp").from_dict({"type": "resp", **fields})


def test_env_fallbacks(monkeypatch):
    monkeypatch.setenv("LMCACHE_RESP_HOST", "redis.internal")
    monkeypatch.setenv("LMCACHE_RESP_PORT", "6380")
    monkeypatch.setenv("LMCACHE_RESP_PASSWORD", "pw")
    cfg = get_l2_adapter_config_class("resp").from_dict({"type": "resp"})
    assert (cfg.host, cfg.port, cfg.password, cfg.num_workers) == ("redis.internal", 6380, "pw", 8)
    explicit = get_l2_adapter_config_class("resp").from_dict(
        {"type": "resp", "host": "a", "port": 1}
    )
    assert (explicit.host, explicit.port) == ("a", 1)


def test_host_name_resolution(h, adapters, redis_server):
    """`localhost` goes through getaddrinfo; an address that refuses (e.g. ::1 when redis
    listens on 127.0.0.1 only) is skipped for the next one."""
    a = h.build("resp", host="localhost", port=redis_server.port, num_workers=1)
    adapters.append(a)
    assert h.store(a, [h.key(1)], [h.make_obj(64)]).is_successful()


def test_silent_server_times_out_instead_of_hanging(h, adapters):
    """A peer that accepts but never answers: socket_timeout_s turns it into failures."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    try:
        a = h.build(
            "resp",
            host="127.0.0.1",
            port=listener.getsockname()[1],
            num_workers=1,
            socket_timeout_s=0.5,
        )
        adapters.append(a)
        assert not h.store(a, [h.key(1)], [h.make_obj(64)], timeout=30).is_successful()
        assert h.lookup(a, [h.key(1)], timeout=30).test(0) is False
    finally:
        listener.close()


def test_protocol_desync_resets_the_connection(h, adapters, redis_server):
    """A reply the client cannot parse fails that task; the next task runs on a fresh
    connection and succeeds."""
    import threading

    peer = socket.socket()
    peer.bind(("127.0.0.1", 0))
    peer.listen(16)
    replies = iter([b"?garbage\r\n"])
    stop = threading.Event()

    def serve() -> None:
        # Answer the first command with garbage, then relay to the real redis-server.
        while not stop.is_set():
            try:
                conn, _ = peer.accept()
            except OSError:
                return
            data = conn.recv(1 << 16)
            bad = next(replies, None)
            if bad is not None:
                conn.sendall(bad)
                conn.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", redis_server.port))
            upstream.sendall(data)

            def pump(src, dst):
                try:
                    while chunk := src.recv(1 << 16):
                        dst.sendall(chunk)
                except OSError:
                    pass

            threading.Thread(target=pump, args=(upstream, conn), daemon=True).start()
            threading.Thread(target=pump, args=(conn, upstream), daemon=True).start()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        a = h.build("resp", host="127.0.0.1", port=peer.getsockname()[1], num_workers=1)
        adapters.append(a)
        assert h.lookup(a, [h.key(1)]).test(0) is False  # garbage reply: a failed lookup
        assert h.wait_until(lambda: h.store(a, [h.key(2)], [h.make_obj(32)]).is_successful(), 20)
        assert redis_server.client().cmd("EXISTS", object_key_to_string(h.key(2))) == 1
    finally:
        stop.set()
        peer.close()


def test_commands_are_pipelined(h, adapters, redis_server, counting_proxy):
    """64 lookups on one connection: one round trip per key (0.5.6) needs >= 64 reads at the
    server side; pipelining 16 deep needs about 4."""
    a = h.build(
        "resp", host="127.0.0.1", port=counting_proxy.port, num_workers=1, pipeline_depth=16
    )
    adapters.append(a)
    keys = [h.key(i) for i in range(64)]
    h.store(a, keys, [h.make_obj(64, seed=i) for i in range(64)])
    before = counting_proxy.client_reads
    assert h.lookup(a, keys).popcount() == 64
    assert counting_proxy.client_reads - before < 32
