"""``nixl_store`` against real NIXL (docs/design/storage-engine.md#backend-nixl,
docs/design/storage-engine.md#backends): POSIX slot files on a temp directory and OBJ against a moto
S3 server. Round trip, pins that survive delete, buffers outside the arena or misaligned that fail
cleanly, slots freed by failures, capacity for eviction."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest
import torch

from lmcache.v1.distributed.l2_adapters.config import (
    create_l2_adapter_from_registry,
    parse_l2_adapter_dict,
)
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

pytestmark = pytest.mark.usefixtures("nixl")

PAGE = 4096  # the conftest arena's page


def _build(spec, alloc, adapters):
    a = create_l2_adapter_from_registry(parse_l2_adapter_dict(1, spec), alloc.memory_desc())
    adapters.append(a)
    return a


def _posix_spec(tmp_path, pool_size=4, file_pages=8, direct="false"):
    return {
        "type": "nixl_store",
        "backend": "POSIX",
        "pool_size": pool_size,
        "backend_params": {
            "file_path": str(tmp_path / "slots"),
            "use_direct_io": direct,
            "file_size": str(file_pages * PAGE),
        },
    }


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE)


def test_round_trip_lookup_load_and_usage(nx, h, store_spec, arena, adapters):
    a = _build(store_spec, arena, adapters)
    rec = h.Recorder()
    a.register_listener(rec)
    sizes = [PAGE, 5000, 3 * PAGE - 7]
    keys = [h.key(i) for i in range(3)]
    src = [nx.arena_obj(arena, n, seed=i) for i, n in enumerate(sizes)]
    res = h.store(a, keys, src)
    charged = [_pages(n) * PAGE for n in sizes]
    assert res.is_successful() and res.bytes_transferred() == sum(charged)
    assert rec.stored == list(zip(keys, charged, strict=True))
    assert a.get_usage().total_bytes_used == sum(charged)

    bm = h.lookup(a, [keys[0], h.key(99), keys[2]])
    assert bm.test(0) is True and bm.test(1) is False and bm.test(2) is True
    a.submit_unlock([keys[0], keys[2]])

    dst = [nx.arena_obj(arena, n, seed=100 + i) for i, n in enumerate(sizes)]
    bm = h.load(a, keys + [h.key(99)], dst + [nx.arena_obj(arena, 10, seed=7)])
    assert [bm.test(i) for i in range(4)] == [True, True, True, False]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(s.tensor, d.tensor)
    assert rec.accessed == keys

    status = a.report_status()
    assert status["is_healthy"] is True and status["healthy"] is True
    assert status["last_error"] is None and status["last_success_time"] is not None
    assert status["slots_used"] == sum(_pages(n) for n in sizes)
    assert status["slots_total"] * PAGE == a.get_usage().total_capacity_bytes


def test_duplicate_store_writes_nothing(nx, h, store_spec, arena, adapters):
    a = _build(store_spec, arena, adapters)
    key = h.key(1)
    assert h.store(a, [key], [nx.arena_obj(arena, 100, seed=1)]).bytes_transferred() == PAGE
    used = a.report_status()["slots_used"]
    again = h.store(a, [key], [nx.arena_obj(arena, 100, seed=2)])
    assert again.is_successful() and again.bytes_transferred() == 0
    assert a.report_status()["slots_used"] == used
    assert a.get_usage().total_bytes_used == PAGE


def test_pinned_keys_survive_delete_until_unlocked(nx, h, store_spec, arena, adapters):
    a = _build(store_spec, arena, adapters)
    rec = h.Recorder()
    a.register_listener(rec)
    keys = [h.key(i) for i in range(2)]
    src = [nx.arena_obj(arena, 2 * PAGE, seed=i) for i in range(2)]
    assert h.store(a, keys, src).is_successful()
    assert h.lookup(a, [keys[0]]).test(0) is True
    assert h.lookup(a, [keys[0]]).test(0) is True  # pinned twice

    a.delete(keys)  # keys[1] is not pinned: it goes; keys[0] stays
    assert rec.deleted == [keys[1]]
    assert a.report_status()["slots_used"] == 2 and a.is_pinned(keys[0])
    dst = nx.arena_obj(arena, 2 * PAGE, seed=9)
    assert h.load(a, [keys[0]], [dst]).test(0) is True
    assert torch.equal(dst.tensor, src[0].tensor)

    a.submit_unlock([keys[0]])
    a.delete([keys[0]])
    assert rec.deleted == [keys[1]]  # still pinned once
    a.submit_unlock([keys[0], h.key(42)])  # an unknown key is harmless
    a.delete([keys[0]])
    assert rec.deleted == [keys[1], keys[0]]
    assert a.report_status()["slots_used"] == 0 and a.get_usage().total_bytes_used == 0
    assert h.lookup(a, keys).popcount() == 0


def _misaligned(alloc, nbytes: int, offset: int) -> TensorMemoryObj:
    """A view into the arena that starts ``offset`` bytes past a page boundary."""
    base = alloc.allocate([torch.Size([nbytes + PAGE])], [torch.uint8])
    start = base.metadata.address + offset
    raw = alloc.arena_tensor()[start : start + nbytes]
    meta = MemoryObjMetadata(
        shape=torch.Size([nbytes]),
        dtype=torch.uint8,
        address=start,
        phy_size=nbytes + PAGE - offset,
        ref_count=1,
    )
    obj = TensorMemoryObj(raw_data=raw, metadata=meta)
    obj._keep = base
    return obj


def test_buffers_outside_the_arena_or_misaligned_fail_their_keys_cleanly(
    nx, h, store_spec, arena, adapters
):
    a = _build(store_spec, arena, adapters)
    good, outside, shifted = h.key(1), h.key(2), h.key(3)
    src_good = nx.arena_obj(arena, 3000, seed=1)
    res = h.store(
        a,
        [good, outside, shifted],
        [src_good, h.make_obj(3000, seed=2), _misaligned(arena, 3000, 100)],
    )
    # The task reports the failure; the good key is stored all the same, nothing raised.
    assert not res.is_successful()
    assert h.lookup(a, [good, outside, shifted]).get_indices_list() == [0]
    a.submit_unlock([good])
    assert a.report_status()["slots_used"] == 1

    dst_good = nx.arena_obj(arena, 3000, seed=5)
    outside_dst = h.make_obj(3000, seed=6)
    bm = h.load(a, [good, good], [dst_good, outside_dst])
    assert bm.test(0) is True and bm.test(1) is False
    assert torch.equal(dst_good.tensor, src_good.tensor)
    assert torch.count_nonzero(outside_dst.tensor) > 0  # never written

    status = a.report_status()
    assert "outside the registered L1 arena" in status["last_error"]
    assert status["is_healthy"] is True  # a caller's bad buffer is not a backend fault


def test_a_slot_bigger_than_the_object_is_required(h, tmp_path, arena, adapters):
    a = _build(_posix_spec(tmp_path), arena, adapters)
    base = arena.allocate([torch.Size([2 * PAGE])], [torch.uint8])
    # An object claiming 5000 bytes in a one-page slot: a transfer would overrun its neighbour.
    meta = MemoryObjMetadata(
        shape=torch.Size([5000]),
        dtype=torch.uint8,
        address=base.metadata.address,
        phy_size=PAGE,
        ref_count=1,
    )
    raw = arena.arena_tensor()[base.metadata.address : base.metadata.address + 5000]
    res = h.store(a, [h.key(1)], [TensorMemoryObj(raw_data=raw, metadata=meta)])
    assert not res.is_successful()
    assert "a transfer moves whole pages" in a.report_status()["last_error"]
    assert a.report_status()["slots_used"] == 0


def test_full_pool_fails_the_key_and_delete_makes_room(nx, h, tmp_path, arena, adapters):
    a = _build(_posix_spec(tmp_path, pool_size=1, file_pages=4), arena, adapters)
    assert a.supports_global_eviction and a.get_usage().total_capacity_bytes == 4 * PAGE
    first = [h.key(i) for i in range(2)]
    assert (
        h.store(
            a, first, [nx.arena_obj(arena, 2 * PAGE, seed=i) for i in range(2)]
        ).bytes_transferred()
        == 4 * PAGE
    )
    assert a.get_usage().usage_fraction == 1.0
    extra = nx.arena_obj(arena, PAGE, seed=3)
    assert not h.store(a, [h.key(3)], [extra]).is_successful()
    assert "no free slots" in a.report_status()["last_error"]
    a.delete([first[0]])
    assert h.store(a, [h.key(3)], [extra]).bytes_transferred() == PAGE
    dst = nx.arena_obj(arena, PAGE, seed=8)
    assert h.load(a, [h.key(3)], [dst]).test(0) is True and torch.equal(dst.tensor, extra.tensor)


def test_failed_transfer_frees_its_slots_and_marks_unhealthy(
    nx, h, tmp_path, arena, adapters, caplog
):
    a = _build(_posix_spec(tmp_path, pool_size=2), arena, adapters)
    # Swap the slot files for read-only /dev/null behind NIXL's back: every WRITE now fails.
    ro = os.open("/dev/null", os.O_RDONLY)
    try:
        for fd in a._storage._fds:
            os.dup2(ro, fd)
    finally:
        os.close(ro)
    caplog.set_level(logging.WARNING)
    for i in range(5):
        res = h.store(a, [h.key(i)], [nx.arena_obj(arena, 2 * PAGE, seed=i)])
        assert not res.is_successful() and res.bytes_transferred() == 0
    status = a.report_status()
    assert status["slots_used"] == 0 and status["stored_object_count"] == 0
    assert status["is_healthy"] is False and status["healthy"] is False
    assert "transfer" in status["last_error"] and status["last_error_time"] is not None
    assert h.lookup(a, [h.key(0)]).test(0) is False
    # Five failures in a row log one warning, not five.
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1


def test_obj_backend_recovers_after_its_bucket_returns(nx, h, s3_bucket, arena, adapters):
    endpoint, client, bucket = s3_bucket
    spec = {
        "type": "nixl_store",
        "backend": "OBJ",
        "pool_size": 8,
        "backend_params": nx.obj_backend_params(endpoint, bucket),
    }
    a = _build(spec, arena, adapters)
    client.delete_bucket(Bucket=bucket)
    res = h.store(a, [h.key(1)], [nx.arena_obj(arena, PAGE, seed=1)])
    assert not res.is_successful()
    assert a.report_status()["healthy"] is False and a.report_status()["slots_used"] == 0

    client.create_bucket(Bucket=bucket)
    src = nx.arena_obj(arena, PAGE, seed=2)
    assert h.store(a, [h.key(2)], [src]).bytes_transferred() == PAGE
    assert a.report_status()["healthy"] is True
    names = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert len(names) == 1 and names[0].startswith("obj_")
    dst = nx.arena_obj(arena, PAGE, seed=3)
    assert h.load(a, [h.key(2)], [dst]).test(0) is True and torch.equal(dst.tensor, src.tensor)


def test_size_mismatch_on_load_is_a_miss(nx, h, tmp_path, arena, adapters):
    a = _build(_posix_spec(tmp_path), arena, adapters)
    assert h.store(a, [h.key(1)], [nx.arena_obj(arena, 3000, seed=1)]).is_successful()
    dst = nx.arena_obj(arena, 2000, seed=2)
    before = dst.tensor.clone()
    assert h.load(a, [h.key(1)], [dst]).test(0) is False
    assert torch.equal(dst.tensor, before)
    assert "holds 3000 bytes" in a.report_status()["last_error"]


def test_direct_io_round_trip(nx, h, tmp_path, arena, adapters):
    a = _build(_posix_spec(tmp_path, direct="true"), arena, adapters)
    src = nx.arena_obj(arena, 2 * PAGE + 10, seed=4)
    assert h.store(a, [h.key(1)], [src]).is_successful()
    dst = nx.arena_obj(arena, 2 * PAGE + 10, seed=5)
    assert h.load(a, [h.key(1)], [dst]).test(0) is True and torch.equal(dst.tensor, src.tensor)


def test_store_zeroes_the_tail_of_the_last_page(nx, h, tmp_path, arena, adapters):
    a = _build(_posix_spec(tmp_path), arena, adapters)
    src = nx.arena_obj(arena, 100, seed=1)
    slot = arena.arena_tensor()[src.metadata.address : src.metadata.address + PAGE]
    slot[100:] = 0xAB  # stale allocator bytes behind the object
    assert h.store(a, [h.key(1)], [src]).is_successful()
    dst = nx.arena_obj(arena, 100, seed=2)
    assert h.load(a, [h.key(1)], [dst]).test(0) is True
    dslot = arena.arena_tensor()[dst.metadata.address : dst.metadata.address + PAGE]
    assert torch.equal(dst.tensor, src.tensor) and int(dslot[100:].count_nonzero()) == 0


def test_small_alignment_is_refused_with_the_fix(tmp_path):
    from lmcache.v1.distributed.l1_memory import L1Allocator

    alloc = L1Allocator(1 << 16, 64, prefault="off")
    try:
        cfg = parse_l2_adapter_dict(1, _posix_spec(tmp_path))
        with pytest.raises(ValueError, match="--l1-align-bytes 4096"):
            create_l2_adapter_from_registry(cfg, alloc.memory_desc())
    finally:
        alloc.close()


def test_file_size_must_be_whole_pages(tmp_path, arena):
    spec = _posix_spec(tmp_path)
    spec["backend_params"]["file_size"] = str(PAGE + 1)
    with pytest.raises(ValueError, match=r"file_size \(4097\) must be a multiple of page_size"):
        create_l2_adapter_from_registry(parse_l2_adapter_dict(1, spec), arena.memory_desc())


def test_close_is_idempotent_removes_slot_files_and_later_submits_fail(nx, h, tmp_path, arena):
    a = create_l2_adapter_from_registry(
        parse_l2_adapter_dict(1, _posix_spec(tmp_path, pool_size=3)), arena.memory_desc()
    )
    assert len(os.listdir(tmp_path / "slots")) == 3
    assert h.store(a, [h.key(1)], [nx.arena_obj(arena, PAGE, seed=1)]).is_successful()
    a.close()
    a.close()
    assert os.listdir(tmp_path / "slots") == []
    tid = a.submit_store_task([h.key(2)], [nx.arena_obj(arena, PAGE, seed=2)])
    assert not a.pop_completed_store_tasks()[tid].is_successful()
    assert a.report_status()["is_healthy"] is False


def test_empty_tasks_complete(h, store_spec, arena, adapters):
    a = _build(store_spec, arena, adapters)
    assert h.store(a, [], []).is_successful()
    assert h.lookup(a, []).size() == 0
    assert h.load(a, [], []).size() == 0


def test_delete_waits_for_a_load_reading_the_slots(nx, h, tmp_path, arena, adapters, monkeypatch):
    a = _build(_posix_spec(tmp_path), arena, adapters)
    src = nx.arena_obj(arena, 2 * PAGE, seed=1)
    assert h.store(a, [h.key(1)], [src]).is_successful()
    release = threading.Event()
    real_state = a._storage.state
    monkeypatch.setattr(
        a._storage, "state", lambda handle: real_state(handle) if release.is_set() else "PROC"
    )
    dst = nx.arena_obj(arena, 2 * PAGE, seed=2)
    tid = a.submit_load_task([h.key(1)], [dst])
    assert h.wait_until(lambda: a._index[h.key(1)].loading == 1)
    a.delete([h.key(1)])  # the read is still running: the slots must not be freed
    assert a.report_status()["slots_used"] == 2
    release.set()
    bm = None
    for _ in range(1000):  # the load result, once the read completes
        bm = a.query_load_result(tid)
        if bm is not None:
            break
        time.sleep(0.02)
    assert bm.test(0) is True and torch.equal(dst.tensor, src.tensor)
    a.delete([h.key(1)])
    assert a.report_status()["slots_used"] == 0


def test_the_io_thread_survives_a_failing_completion(nx, h, tmp_path, arena, adapters, monkeypatch):
    a = _build(_posix_spec(tmp_path), arena, adapters)
    real_finish = a._finish_load
    calls = []

    def broken_once(task, ok):
        calls.append(task.task_id)
        if len(calls) == 1:
            raise TypeError("injected bookkeeping bug")
        real_finish(task, ok)

    monkeypatch.setattr(a, "_finish_load", broken_once)
    a.submit_load_task([h.key(9)], [nx.arena_obj(arena, 10, seed=1)])
    assert h.wait_until(lambda: a.report_status()["healthy"] is False)
    assert "injected bookkeeping bug" in a.report_status()["last_error"]
    src = nx.arena_obj(arena, 10, seed=2)
    assert h.store(a, [h.key(1)], [src]).is_successful()
    dst = nx.arena_obj(arena, 10, seed=3)
    assert h.load(a, [h.key(1)], [dst]).test(0) is True and torch.equal(dst.tensor, src.tensor)
    assert a.report_status()["healthy"] is True


def test_slots_are_handed_out_in_ascending_runs():
    # Consecutive pages meet consecutive slots, so NIXL merges them into one I/O.
    from lmcache.storage.nixl.store_adapter import SlotPool

    pool = SlotPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(6) is None  # all or nothing
    assert pool.allocate(2) == [3, 4]
    pool.free([0, 1, 2])
    assert pool.free_count == 6


def test_eviction_controller_frees_slots_for_new_stores(nx, h, tmp_path, arena, adapters):
    from lmcache.v1.distributed.config import EvictionConfig
    from lmcache.v1.distributed.eviction import L2EvictionController

    a = _build(_posix_spec(tmp_path, pool_size=1, file_pages=8), arena, adapters)
    ctl = L2EvictionController(interval_s=3600)
    assert ctl.add_adapter(0, a, EvictionConfig("LRU", trigger_watermark=0.8, eviction_ratio=0.5))
    old = [h.key(i) for i in range(8)]
    assert h.store(a, old, [nx.arena_obj(arena, PAGE, seed=i) for i in range(8)]).is_successful()
    assert a.get_usage().usage_fraction == 1.0

    ctl.run_once()
    assert h.wait_until(lambda: a.report_status()["slots_used"] == 4)
    new = [h.key(100 + i) for i in range(4)]
    assert h.store(a, new, [nx.arena_obj(arena, PAGE, seed=i) for i in range(4)]).is_successful()
    found = h.lookup(a, old + new).get_indices_list()
    # Half of the old keys made room (LRU drops the later chunks of a prefix first).
    assert len([i for i in found if i < 8]) == 4 and found[-4:] == list(range(8, 12))
