"""L1 manager states, codes, TTLs and transfer pins (docs/design/storage-engine.md#l1-manager,
demand eviction docs/design/storage-engine.md#eviction-fixes)."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
import torch

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import EvictionConfig, L1ManagerConfig, L1MemoryManagerConfig
from lmcache.v1.distributed.eviction import L1EvictionController
from lmcache.v1.distributed.internal_api import L1Error, L1ManagerInterface, L1ManagerListener
from lmcache.v1.distributed.l1_manager import L1Manager

LAYOUT = MemoryLayoutDesc([torch.Size([1024])], [torch.float32])  # 4 KiB objects
S = L1Error.SUCCESS


def key(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(ObjectKey.IntHash2Bytes(i), "m", 0, cache_salt=salt)


def make_l1(slots: int = 16, write_ttl: float = 600, read_ttl: float = 300) -> L1Manager:
    mem = L1MemoryManagerConfig(slots * 4096, use_lazy=False, align_bytes=4096, shm_name="")
    return L1Manager(L1ManagerConfig(mem, write_ttl_seconds=write_ttl, read_ttl_seconds=read_ttl))


@pytest.fixture
def l1():
    m = make_l1()
    yield m
    m.close()


def write(l1: L1Manager, keys, value=1.0, tag=""):
    res = l1.reserve_write(keys, [False] * len(keys), LAYOUT, tag)
    for k in keys:
        assert res[k][0] is S
        res[k][1].tensor.fill_(value)
    assert all(e is S for e in l1.finish_write(keys, tag).values())


class Recorder(L1ManagerListener):
    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_l1_"):
            return lambda keys: object.__getattribute__(self, "events").append((name, list(keys)))
        return object.__getattribute__(self, name)


def test_reserve_finish_and_conflicts(l1):
    k = key(1)
    res = l1.reserve_write([k], [False], LAYOUT)
    assert res[k][0] is S
    # staged: invisible to readers, not writable by the same tag
    assert l1.reserve_read([k])[k][0] is L1Error.KEY_NOT_EXIST
    assert l1.reserve_write([k], [False], LAYOUT)[k][0] is L1Error.KEY_NOT_WRITABLE
    # another tag may stage the same key
    other = l1.reserve_write([k], [False], LAYOUT, tag="prefetch:1")
    assert other[k][0] is S
    assert l1.finish_write([k])[k] is S
    assert l1.reserve_write([k], [False], LAYOUT)[k][0] is L1Error.KEY_NOT_WRITABLE  # resident
    # the other tag's copy is discarded but still SUCCESS
    assert l1.finish_write([k], tag="prefetch:1")[k] is S
    assert l1.finish_write([key(2)])[key(2)] is L1Error.KEY_NOT_EXIST
    assert l1.memcheck()


def test_abort_frees_the_buffer(l1):
    k = key(1)
    l1.reserve_write([k], [False], LAYOUT)
    used = l1.get_memory_usage()[0]
    assert l1.finish_write_and_delete([k])[k] is S
    assert l1.get_memory_usage()[0] == used - 4096
    assert l1.finish_write_and_delete([k])[k] is L1Error.KEY_NOT_EXIST


def test_read_locks_and_unsafe_read(l1):
    k = key(1)
    write(l1, [k], 7.0)
    assert l1.unsafe_read([k])[k][0] is L1Error.KEY_NOT_READABLE
    err, obj = l1.reserve_read([k], read_locks=2)[k]
    assert err is S and obj.tensor[0].item() == 7.0
    assert l1.unsafe_read([k])[k][0] is S
    assert l1.delete([k])[k] is L1Error.KEY_IS_LOCKED
    assert l1.finish_read([k], 2)[k] is S
    assert l1.finish_read([k])[k] is L1Error.KEY_IN_WRONG_STATE
    assert l1.delete([k])[k] is S
    assert l1.delete([k])[k] is L1Error.KEY_NOT_EXIST


@pytest.mark.parametrize("one_pass", [True, False], ids=["manager", "interface_default"])
def test_reserve_read_prefix_locks_and_touches_only_the_common_prefix(l1, one_pass):
    rows = [[key(c) for c in range(4)], [key(10 + c) for c in range(4)]]
    write(l1, rows[0] + [rows[1][0], rows[1][1], rows[1][3]])  # rank 1 lacks chunk 2
    rec = Recorder()
    l1.register_listener(rec)
    reserve = (
        l1.reserve_read_prefix if one_pass else partial(L1ManagerInterface.reserve_read_prefix, l1)
    )
    assert reserve(rows, 2) == 2
    prefix = [rows[0][0], rows[0][1], rows[1][0], rows[1][1]]
    touched = [keys for name, keys in rec.events if name == "on_l1_keys_accessed"]
    assert touched == [prefix]
    assert not any(l1.is_read_locked(k) for k in (rows[0][2], rows[0][3], rows[1][3]))
    assert all(l1.finish_read([k])[k] is S for k in prefix)
    assert all(l1.is_read_locked(k) for k in prefix)  # locked twice
    l1.finish_read(prefix)
    assert not any(l1.is_read_locked(k) for k in prefix)
    # measuring only (NO_LOCK prefetches): the same prefix, nothing stays locked
    assert l1.reserve_read_prefix(rows, 1, keep_locks=False) == 2
    assert not any(l1.is_read_locked(k) for row in rows for k in row if l1.contains(k))
    assert l1.reserve_read_prefix([[key(99)]], 1) == 0 and l1.reserve_read_prefix([], 1) == 0


def test_read_locks_clamped_to_128(l1):
    k = key(1)
    write(l1, [k])
    l1.reserve_read([k], read_locks=1000)
    l1.finish_read([k], read_locks=128)
    assert not l1.is_read_locked(k)


def test_temporary_object_freed_at_last_finish_read(l1):
    k = key(1)
    l1.reserve_write([k], [True], LAYOUT, tag="prefetch:9")
    assert l1.finish_write_and_reserve_read([k], read_locks=2, tag="prefetch:9")[k][0] is S
    l1.finish_read([k])
    assert l1.contains(k)
    l1.finish_read([k])
    assert not l1.contains(k) and l1.get_memory_usage()[0] == 0


def test_finish_write_and_reserve_read_locks_existing_copy(l1):
    k = key(1)
    l1.reserve_write([k], [True], LAYOUT, tag="prefetch:1")  # staged first...
    write(l1, [k], 5.0)  # ...then another writer made it resident
    err, obj = l1.finish_write_and_reserve_read([k], tag="prefetch:1")[k]
    assert err is S and obj.tensor[0].item() == 5.0
    assert l1.is_read_locked(k)
    assert l1.get_memory_usage()[0] == 4096  # the staged copy was freed


def test_write_ttl_expiry_paths():
    l1 = make_l1(write_ttl=0.05)
    try:
        k = key(1)
        first = l1.reserve_write([k], [False], LAYOUT)[k][1]
        time.sleep(0.08)
        assert l1.is_key_evictable(k)  # an expired reservation is evictable
        # same tag reuses the expired buffer
        again = l1.reserve_write([k], [False], LAYOUT)[k][1]
        assert again.metadata.address == first.metadata.address
        time.sleep(0.08)
        assert l1.finish_write([k])[k] is L1Error.KEY_IN_WRONG_STATE
        assert l1.get_memory_usage()[0] == 0  # reclaimed
        l1.reserve_write([k], [False], LAYOUT)
        time.sleep(0.08)
        assert l1.delete([k])[k] is L1Error.KEY_NOT_EXIST  # delete reclaims expired staging
        assert l1.get_memory_usage()[0] == 0
    finally:
        l1.close()


@pytest.mark.parametrize("finish", ["finish_write", "finish_write_and_reserve_read"])
def test_an_expired_reservation_is_reported_gone_to_listeners(finish):
    """Trackers learn of a key at reserve_write; when its reservation expired before the
    finish, both finishes tell them it is gone (else an eviction or prefetch tracker keeps a
    key L1 no longer has)."""
    l1 = make_l1(write_ttl=0.05)
    try:
        rec = Recorder()
        l1.register_listener(rec)
        k = key(1)
        l1.reserve_write([k], [True], LAYOUT, tag="prefetch:3")
        time.sleep(0.08)  # the reservation expires
        result = getattr(l1, finish)([k], tag="prefetch:3")[k]
        err = result[0] if isinstance(result, tuple) else result
        assert err is L1Error.KEY_IN_WRONG_STATE
        assert ("on_l1_keys_deleted_by_manager", [k]) in rec.events
        assert l1.get_memory_usage()[0] == 0 and not l1.contains(k)
    finally:
        l1.close()


def test_expired_read_lock_is_reclaimed():
    l1 = make_l1(read_ttl=0.5)
    try:
        k = key(1)
        write(l1, [k])
        l1.reserve_read([k])
        assert not l1.is_key_evictable(k)
        time.sleep(0.6)
        assert l1.is_key_evictable(k)
        assert l1.delete([k])[k] is S
    finally:
        l1.close()


def test_delete_live_staging_needs_force(l1):
    k = key(1)
    l1.reserve_write([k], [False], LAYOUT)
    assert l1.delete([k])[k] is L1Error.KEY_IS_LOCKED
    assert l1.delete([k], force=True)[k] is S
    assert l1.get_memory_usage()[0] == 0


def test_pinned_buffer_survives_ttl_expiry_and_delete():
    l1 = make_l1(slots=2, read_ttl=0.05)
    try:
        k = key(1)
        write(l1, [k], 9.0)
        obj = l1.reserve_read([k])[k][1]
        l1.pin_objects([obj])
        time.sleep(0.08)  # read lock expired while an adapter still reads the buffer
        assert l1.delete([k])[k] is S
        assert not l1.contains(k)
        assert l1.report_status()["pinned_bytes"] == 4096
        # the pinned slot is not reused: only one slot is left
        res = l1.reserve_write([key(2), key(3)], [False, False], LAYOUT)
        assert [res[key(2)][0], res[key(3)][0]].count(S) == 1
        assert obj.tensor[0].item() == 9.0  # bytes intact
        l1.unpin_objects([obj])
        assert l1.report_status()["pinned_bytes"] == 0
        assert l1.reserve_write([key(3)], [False], LAYOUT)[key(3)][0] is S
        assert l1.memcheck()
    finally:
        l1.close()


def test_pinned_staging_is_not_reused_by_next_writer():
    l1 = make_l1(slots=4, write_ttl=0.05)
    try:
        k = key(1)
        obj = l1.reserve_write([k], [True], LAYOUT, tag="prefetch:1")[k][1]
        l1.pin_objects([obj])  # an adapter is loading into it
        time.sleep(0.08)
        new = l1.reserve_write([k], [True], LAYOUT, tag="prefetch:1")[k][1]
        assert new.metadata.address != obj.metadata.address
        l1.unpin_objects([obj])
        assert l1.memcheck()
    finally:
        l1.close()


def test_listener_events(l1):
    rec = Recorder()
    l1.register_listener(rec)
    k = key(1)
    l1.reserve_write([k, key(2)], [False, True], LAYOUT)
    l1.finish_write([k, key(2)])
    l1.touch_keys([k])
    l1.delete([k])
    names = [e[0] for e in rec.events]
    assert names == [
        "on_l1_keys_reserved_write",
        "on_l1_keys_write_finished",
        "on_l1_keys_accessed",
        "on_l1_keys_deleted_by_manager",
    ]
    assert rec.events[1][1] == [k]  # temporary keys never fire write_finished


def test_listeners_get_the_events_they_override_also_when_registered_late(l1):
    class Touches(L1ManagerListener):
        def __init__(self):
            self.touched = []

        def on_l1_keys_accessed(self, keys):
            self.touched.append(list(keys))

    first = Touches()
    l1.register_listener(first)
    k = key(1)
    write(l1, [k])
    l1.touch_keys([k])  # the event's handlers are looked up (and kept) here
    late, rec = Touches(), Recorder()
    l1.register_listener(late)
    l1.register_listener(rec)
    l1.touch_keys([k])
    assert first.touched == [[k], [k]]
    assert late.touched == [[k]]
    assert rec.events == [("on_l1_keys_accessed", [k])]


def test_status_fields(l1):
    write(l1, [key(1)])
    st = l1.report_status()
    for field in (
        "total_object_count",
        "write_locked_count",
        "read_locked_count",
        "memory_used_bytes",
        "memory_total_bytes",
        "memory_usage_ratio",
        "write_ttl_seconds",
        "read_ttl_seconds",
        "pinned_bytes",
        "is_healthy",
    ):
        assert field in st
    assert st["total_object_count"] == 1 and st["is_healthy"] is True


def test_demand_eviction_below_watermark():
    l1 = make_l1(slots=8)
    L1EvictionController(l1, EvictionConfig("LRU", trigger_watermark=0.99), interval_s=60)
    try:
        write(l1, [key(i) for i in range(8)])
        res = l1.reserve_write([key(10), key(11)], [False, False], LAYOUT)
        assert all(res[k][0] is S for k in (key(10), key(11)))
        # headroom of one alignment unit per key: 4 slots freed; later chunks go first
        assert [l1.contains(key(i)) for i in range(8)] == [True] * 4 + [False] * 4
    finally:
        l1.close()


def test_noop_never_demand_evicts():
    l1 = make_l1(slots=2)
    L1EvictionController(l1, EvictionConfig("noop"), interval_s=60)
    try:
        write(l1, [key(0), key(1)])
        assert l1.reserve_write([key(5)], [False], LAYOUT)[key(5)][0] is L1Error.OUT_OF_MEMORY
    finally:
        l1.close()


def test_l1_full_of_read_locked_objects_never_loses_data():
    l1 = make_l1(slots=4)
    L1EvictionController(l1, EvictionConfig("LRU"), interval_s=60)
    try:
        keys = [key(i) for i in range(4)]
        for i, k in enumerate(keys):
            write(l1, [k], float(i))
        l1.reserve_read(keys)
        res = l1.reserve_write([key(9)], [False], LAYOUT)
        assert res[key(9)][0] is L1Error.OUT_OF_MEMORY
        got = l1.reserve_read(keys)
        assert [got[k][1].tensor[0].item() for k in keys] == [0.0, 1.0, 2.0, 3.0]
        assert l1.memcheck()
    finally:
        l1.close()


def test_partial_oom_only_for_keys_that_do_not_fit():
    l1 = make_l1(slots=3)
    try:
        res = l1.reserve_write([key(i) for i in range(5)], [False] * 5, LAYOUT)
        codes = [res[key(i)][0] for i in range(5)]
        assert codes.count(S) == 3 and codes.count(L1Error.OUT_OF_MEMORY) == 2
    finally:
        l1.close()


def test_concurrent_writers_and_readers_keep_invariants():
    l1 = make_l1(slots=64)
    L1EvictionController(l1, EvictionConfig("LRU"), interval_s=60)
    errors = []

    def worker(base: int) -> None:
        try:
            for i in range(200):
                k = key(base * 1000 + i % 40)
                r = l1.reserve_write([k], [False], LAYOUT)
                if r[k][0] is S:
                    r[k][1].tensor.fill_(float(base))
                    l1.finish_write([k])
                got = l1.reserve_read([k])
                if got[k][0] is S:
                    assert got[k][1].tensor[0].item() == float(base)
                    l1.finish_read([k])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(b,)) for b in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors
        assert l1.memcheck()
    finally:
        l1.close()


def test_lazy_l1_commits_next_region_before_demand_eviction():
    """docs/design/storage-engine.md#eviction-fixes: a lazy L1 whose committed prefix is full
    commits the next region instead of evicting resident keys (the background grower is off, so only
    the write path grows it)."""
    from lmcache.v1.distributed.l1_memory import L1Allocator

    alloc = L1Allocator(
        16 * 4096,
        4096,
        lazy=True,
        init_size=4 * 4096,
        commit_step=4 * 4096,
        grow_in_background=False,
    )
    mem = L1MemoryManagerConfig(16 * 4096, use_lazy=True, align_bytes=4096, shm_name="")
    l1 = L1Manager(L1ManagerConfig(mem), allocator=alloc)
    rec = Recorder()
    l1.register_listener(rec)
    L1EvictionController(l1, EvictionConfig("LRU", trigger_watermark=0.99), interval_s=60)
    try:
        assert alloc.committed_size == 4 * 4096 < alloc.size
        write(l1, [key(i) for i in range(4)], value=3.0)  # the committed prefix is full
        res = l1.reserve_write([key(10)], [False], LAYOUT)
        assert res[key(10)][0] is S
        assert alloc.committed_size > 4 * 4096
        assert all(l1.contains(key(i)) for i in range(4))  # nothing was demand-evicted
        assert not [e for e in rec.events if e[0] == "on_l1_keys_deleted_by_manager"]
        assert l1.report_status()["demand_evicted_keys"] == 0
        assert l1.finish_write([key(10)])[key(10)] is S
        assert l1.memcheck()
    finally:
        l1.close()
