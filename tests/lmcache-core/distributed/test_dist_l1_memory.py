"""Allocator and arenas (docs/design/storage-engine.md#l1-memory): first fit, coalescing, batches,
lazy growth, SHM pools."""

from __future__ import annotations

import mmap
import os
import random

import pytest
import torch
from testsupport.waiting import eventually

from lmcache.v1.distributed import l1_memory
from lmcache.v1.distributed.l1_memory import AddressManager, L1Allocator, normalize_shm_name

F32 = [torch.float32]


def test_first_fit_and_coalescing():
    am = AddressManager(64, 8)
    a, b, c = am.allocate(10), am.allocate(8), am.allocate(8)
    assert (a, b, c) == (0, 16, 24)  # 10 rounds up to 16
    am.free(b)
    assert am.allocate(4) == 16  # first fit reuses the hole
    am.free(16)
    am.free(a)
    am.free(c)
    assert am.memcheck() and am.used == 0
    assert am.allocate(64) == 0  # everything coalesced into one hole


def test_invalid_size_is_value_error_not_oom():
    am = AddressManager(64, 8)
    with pytest.raises(ValueError):
        am.allocate(0)
    alloc = L1Allocator(1 << 16, 4096)
    try:
        with pytest.raises(ValueError):
            alloc.batched_allocate([torch.Size([0])], F32, 1)
    finally:
        alloc.close()


def test_random_alloc_free_keeps_invariants():
    rng = random.Random(7)
    am = AddressManager(1 << 16, 64)
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            am.free(live.pop(rng.randrange(len(live))))
        else:
            off = am.allocate(rng.randint(1, 2048))
            if off is not None:
                live.append(off)
    assert am.memcheck()
    for off in live:
        am.free(off)
    assert am.memcheck() and am.used == 0 and am.allocate(1 << 16) == 0


def test_batched_allocate_all_or_nothing():
    alloc = L1Allocator(4 * 4096, 4096, shm_name="")
    try:
        objs = alloc.batched_allocate([torch.Size([1024])], F32, 3)
        assert objs is not None and len({o.metadata.address for o in objs}) == 3
        assert all(o.get_physical_size() == 4096 for o in objs)
        assert alloc.batched_allocate([torch.Size([1024])], F32, 2) is None
        assert alloc.used_bytes() == 3 * 4096  # the failed batch freed its partial block
        for o in objs:
            alloc.free(o)
        assert alloc.memcheck()
    finally:
        alloc.close()


def test_objects_are_arena_slices():
    alloc = L1Allocator(1 << 16, 4096, shm_name="")
    try:
        o = alloc.allocate([torch.Size([1000])], F32)
        o.tensor.fill_(3.0)
        base = alloc.arena_tensor()
        assert base[o.metadata.address : o.metadata.address + 4].view(torch.float32).item() == 3.0
        assert o.get_size() == 4000 and o.get_physical_size() == 4096
    finally:
        alloc.close()


def test_lazy_growth_commits_in_steps():
    alloc = L1Allocator(
        8 * 4096,
        4096,
        lazy=True,
        init_size=2 * 4096,
        commit_step=2 * 4096,
        grow_in_background=False,
    )
    try:
        assert alloc.committed_size == 2 * 4096 and alloc.growth_pending
        assert alloc.memory_desc().stable_registration_size == 2 * 4096
        assert alloc.batched_allocate([torch.Size([1024])], F32, 3) is None  # beyond committed
        assert alloc.grow_now()
        assert alloc.batched_allocate([torch.Size([1024])], F32, 3) is not None
        while alloc.grow_now():
            pass
        assert alloc.committed_size == alloc.size and not alloc.growth_pending
    finally:
        alloc.close()


def test_lazy_background_growth_reaches_full_size():
    alloc = L1Allocator(8 * 4096, 4096, lazy=True, init_size=4096, commit_step=4096)
    try:
        for _ in range(500):
            if not alloc.growth_pending:
                break
            import time

            time.sleep(0.01)
        assert alloc.committed_size == 8 * 4096
    finally:
        alloc.close()


def test_shm_name_normalisation():
    assert normalize_shm_name("/foo") == "lmcache_l1_pool_foo"
    assert normalize_shm_name("lmcache_l1_pool_bar") == "lmcache_l1_pool_bar"


def _shm_path(name: str) -> str:
    return os.path.join("/dev/shm", normalize_shm_name(name))


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="/dev/shm not available")
def test_shm_pool_is_shared_and_stale_segment_replaced():
    name = f"/t_store_{os.getpid()}"
    path = _shm_path(name)
    with open(path, "wb") as f:  # a stale segment from a crashed server
        f.write(b"stale")
    alloc = L1Allocator(1 << 20, 4096, shm_name=name)
    try:
        assert alloc.shm_name == normalize_shm_name(name)
        assert alloc.pool_size == 1 << 20 and os.path.getsize(path) == 1 << 20
        assert alloc.memory_desc().stable_registration_size is None
        o = alloc.allocate([torch.Size([16])], [torch.uint8])
        o.tensor.copy_(torch.arange(16, dtype=torch.uint8))
        # another mapping of the segment sees the bytes at the object's offset
        fd = os.open(path, os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, 1 << 20, prot=mmap.PROT_READ)
            off = o.metadata.address
            assert mm[off : off + 16] == bytes(range(16))
            mm.close()
        finally:
            os.close(fd)
        with pytest.raises(ValueError, match="already used"):
            L1Allocator(1 << 20, 4096, shm_name=name)
        del o
    finally:
        alloc.close()
    assert not os.path.exists(path)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="/dev/shm not available")
def test_shm_works_with_lazy_growth_as_a_sparse_segment():
    name = f"t_lazy_{os.getpid()}"
    size = 64 << 20
    alloc = L1Allocator(
        size, 4096, lazy=True, init_size=4096, shm_name=name, grow_in_background=False
    )
    try:
        assert alloc.shm_name and alloc.pool_size == size
        st = os.stat(_shm_path(name))
        assert st.st_size == size
        assert st.st_blocks * 512 < size  # sparse: pages committed on use
    finally:
        alloc.close()


def test_too_little_shm_falls_back_loudly(monkeypatch, caplog):
    class FakeStat:
        f_bavail = 16
        f_frsize = 4096

    monkeypatch.setattr(l1_memory.os, "statvfs", lambda _p: FakeStat())
    alloc = L1Allocator(1 << 20, 4096, shm_name=f"t_small_{os.getpid()}")
    try:
        assert alloc.shm_name == "" and alloc.pool_size == 0
        assert "needs" in alloc.shm_disabled_reason
        assert any("--shm-size" in r.getMessage() for r in caplog.records)
        assert alloc.allocate([torch.Size([8])], F32) is not None  # still a working L1
    finally:
        alloc.close()


def test_hugepages_with_shm_is_rejected():
    with pytest.raises(ValueError, match=r"^l1-use-hugepages is incompatible with shared memory"):
        L1Allocator(1 << 20, 4096, shm_name="x", use_hugepages=True)


def test_hugepages_force_lazy_off_and_fall_back():
    alloc = L1Allocator(1 << 21, 4096, lazy=True, init_size=4096, use_hugepages=True)
    try:
        assert alloc.lazy is False and alloc.committed_size == alloc.size
        assert alloc.allocate([torch.Size([8])], F32) is not None
    finally:
        alloc.close()


def test_pool_larger_than_available_memory_starts_with_a_warning(caplog):
    """A lazy L1 bigger than the memory available reserves address space only and warns
    (docs/design/protocol.md#defaults-shm)."""
    import logging

    from lmcache.v1.distributed.l1_memory import L1Allocator, _available_memory_bytes

    # The same measure the allocator uses (MemAvailable counts reclaimable page cache, so
    # it can be far above the free pages on a host with a warm cache).
    available = _available_memory_bytes()
    assert available is not None
    size = available + (4 << 30)
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        alloc = L1Allocator(size, lazy=True, init_size=1 << 20, grow_in_background=False)
    try:
        assert alloc.size >= size
        assert "larger than the memory available" in caplog.text
    finally:
        alloc.close()


def _resident_bytes(ptr: int, length: int) -> int:
    """Bytes of [ptr, ptr + length) backed by memory now (mincore(2))."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pages = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(ptr), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


@pytest.mark.skipif(l1_memory._MADV_POPULATE_WRITE is None, reason="Linux only")
def test_prefault_keeps_headroom_backed_past_the_high_water_mark():
    """Pages ahead of the allocations are backed in the background (a store then copies into
    backed memory), memory grows only with the allocations, and data is never touched."""
    mib = 1 << 20
    a = L1Allocator(256 * mib, 4096, prefault="ahead", prefault_headroom=32 * mib)
    try:
        eventually(lambda: a.prefaulted_bytes == 32 * mib)
        assert _resident_bytes(a.base_ptr, 256 * mib) == 32 * mib  # not the whole pool
        first = a.allocate([torch.Size([8 * mib])], [torch.uint8])
        first.tensor.copy_(torch.arange(8 * mib, dtype=torch.int64).to(torch.uint8))
        more = a.batched_allocate([torch.Size([8 * mib])], [torch.uint8], 8)  # up to 72 MiB
        assert more is not None
        eventually(lambda: a.prefaulted_bytes == 72 * mib + 32 * mib)
        assert _resident_bytes(a.base_ptr, 256 * mib) == 104 * mib
        assert torch.equal(first.tensor, torch.arange(8 * mib, dtype=torch.int64).to(torch.uint8))
    finally:
        a.close()
    off = L1Allocator(64 * mib, 4096, prefault="off")
    try:
        assert off.prefault == "off"
        assert off.prefaulted_bytes == 0 and _resident_bytes(off.base_ptr, 64 * mib) < mib
    finally:
        off.close()


@pytest.mark.skipif(l1_memory._MADV_POPULATE_WRITE is None, reason="Linux only")
def test_prefault_all_backs_the_whole_pool_without_touching_data():
    """The default backs every page of the pool in the background before any allocation,
    so no store copies into unbacked memory; data written meanwhile survives."""
    mib = 1 << 20
    a = L1Allocator(96 * mib, 4096, shm_name=f"t_prefault_all_{os.getpid()}")
    try:
        assert a.prefault == "all"
        obj = a.allocate([torch.Size([4 * mib])], [torch.uint8])
        obj.tensor.copy_(torch.arange(4 * mib, dtype=torch.int64).to(torch.uint8))
        eventually(lambda: a.prefaulted_bytes == 96 * mib)
        assert _resident_bytes(a.base_ptr, 96 * mib) == 96 * mib
        assert torch.equal(obj.tensor, torch.arange(4 * mib, dtype=torch.int64).to(torch.uint8))
    finally:
        a.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_prefault_thread_runs_at_the_lowest_cpu_priority():
    """Backing the pool takes CPU time that transfers leave idle (nice 19), so the first
    stores on a host with few cores are not slowed down by it."""
    import threading

    a = L1Allocator(8 << 20, 4096, shm_name=f"t_prefault_nice_{os.getpid()}")
    try:
        t = next(t for t in threading.enumerate() if t.name == "l1-prefault")
        stat = f"/proc/self/task/{t.native_id}/stat"

        def nice() -> int:
            return int(open(stat).read().rsplit(")", 1)[1].split()[16])

        eventually(lambda: nice() == 19)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != 19  # only it
    finally:
        a.close()


def test_prefault_all_falls_back_to_ahead_when_the_pool_does_not_fit(monkeypatch, caplog):
    mib = 1 << 20
    monkeypatch.setattr(l1_memory, "_available_memory_bytes", lambda: 32 * mib)
    a = L1Allocator(64 * mib, 4096, prefault_headroom=8 * mib)
    try:
        assert a.prefault == "ahead"
        assert "prefault 'all' skipped" in caplog.text
        eventually(lambda: a.prefaulted_bytes == 8 * mib)
    finally:
        a.close()
    with pytest.raises(ValueError, match="prefault must be one of all, ahead, off"):
        L1Allocator(64 * mib, 4096, prefault="eager")
