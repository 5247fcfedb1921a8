"""StorageManager with its store and prefetch controllers
(docs/design/storage-engine.md#storage-manager), using real L1 memory."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from testsupport.waiting import eventually

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    LockMode,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import (
    EvictionConfig,
    L1ManagerConfig,
    L1MemoryManagerConfig,
    StorageManagerConfig,
)
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import (
    L2AdapterConfigBase,
    L2AdaptersConfig,
    parse_l2_adapter_dict,
    register_l2_adapter_type,
)
from lmcache.v1.distributed.l2_adapters.factory import register_l2_adapter_factory
from lmcache.v1.distributed.storage_manager import StorageManager
from lmcache.v1.distributed.storage_policies import (
    StorePolicy,
    register_store_policy,
)
from lmcache.v1.platform.event_notifier import create_event_notifier

LAYOUT = MemoryLayoutDesc([torch.Size([1024])], [torch.float32])
KV = ObjectKey.ComputeKVRank(1, 0, 1, 0)


def key(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(ObjectKey.IntHash2Bytes(i), "model", KV, cache_salt=salt)


# --- a scriptable adapter ---------------------------------------------------------------------


class ScriptedAdapter(L2AdapterInterface):
    """Dict-backed adapter whose operations can be held (gates), fail, or return legacy values."""

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[ObjectKey, bytes] = {}
        self.locks: dict[ObjectKey, int] = {}
        self.n = [create_event_notifier() for _ in range(3)]
        self.mu = threading.Lock()
        self.i = 0
        self.store_done: dict[int, Any] = {}
        self.lookup_done: dict[int, Bitmap] = {}
        self.load_done: dict[int, Bitmap] = {}
        self.store_gate = threading.Event()
        self.lookup_gate = threading.Event()
        self.load_gate = threading.Event()
        for g in (self.store_gate, self.lookup_gate, self.load_gate):
            g.set()
        self.store_calls: list[list[ObjectKey]] = []
        self.lookup_calls: list[list[ObjectKey]] = []
        self.load_calls: list[list[ObjectKey]] = []
        self.store_raises = False
        self.store_returns: Any = None  # legacy value instead of L2StoreResult
        self.inflight_stores = 0
        self.max_inflight_stores = 0
        self.closed = False

    def _tid(self) -> int:
        with self.mu:
            self.i += 1
            return self.i

    def _later(self, gate: threading.Event, fn) -> None:
        def run():
            gate.wait()
            fn()

        threading.Thread(target=run, daemon=True).start()

    def get_store_event_fd(self):
        return self.n[0].fileno()

    def get_lookup_and_lock_event_fd(self):
        return self.n[1].fileno()

    def get_load_event_fd(self):
        return self.n[2].fileno()

    def submit_store_task(self, keys, objects):
        if self.store_raises:
            raise RuntimeError("store submit failed")
        tid = self._tid()
        self.store_calls.append(list(keys))
        with self.mu:
            self.inflight_stores += 1
            self.max_inflight_stores = max(self.max_inflight_stores, self.inflight_stores)

        def fn():
            new = []
            with self.mu:
                for k, o in zip(keys, objects, strict=False):
                    if k not in self.data:
                        self.data[k] = bytes(o.byte_array)
                        new.append(k)
                self.inflight_stores -= 1
                self.store_done[tid] = (
                    self.store_returns
                    if self.store_returns is not None
                    else L2StoreResult(True, sum(len(self.data[k]) for k in new))
                )
            self._notify_keys_stored(new, [len(self.data[k]) for k in new])
            self.n[0].notify()

        self._later(self.store_gate, fn)
        return tid

    def pop_completed_store_tasks(self):
        with self.mu:
            d, self.store_done = self.store_done, {}
        return d

    def submit_lookup_and_lock_task(self, keys, group_layout_descs=None):
        tid = self._tid()
        self.lookup_calls.append(list(keys))

        def fn():
            bm = Bitmap(len(keys))
            with self.mu:
                for j, k in enumerate(keys):
                    if k in self.data:
                        bm.set(j)
                        self.locks[k] = self.locks.get(k, 0) + 1
                self.lookup_done[tid] = bm
            self.n[1].notify()

        self._later(self.lookup_gate, fn)
        return tid

    def query_lookup_and_lock_result(self, task_id):
        with self.mu:
            return self.lookup_done.pop(task_id, None)

    def submit_unlock(self, keys):
        with self.mu:
            for k in keys:
                if self.locks.get(k, 0) > 0:
                    self.locks[k] -= 1

    def submit_load_task(self, keys, objects):
        tid = self._tid()
        self.load_calls.append(list(keys))

        def fn():
            bm = Bitmap(len(keys))
            for j, (k, o) in enumerate(zip(keys, objects, strict=False)):
                with self.mu:
                    b = self.data.get(k)
                if b is not None and len(b) == len(o.byte_array):
                    o.byte_array[:] = b
                    bm.set(j)
            with self.mu:
                self.load_done[tid] = bm
            self.n[2].notify()

        self._later(self.load_gate, fn)
        return tid

    def query_load_result(self, task_id):
        with self.mu:
            return self.load_done.pop(task_id, None)

    def locked(self) -> int:
        with self.mu:
            return sum(self.locks.values())

    def close(self):
        self.closed = True


@dataclass
class ScriptedConfig(L2AdapterConfigBase):
    instance: Any = None

    @classmethod
    def from_dict(cls, d):
        return cls(instance=d.get("instance"))

    @classmethod
    def help(cls):
        return "test adapter"


try:
    register_l2_adapter_type("scripted_test", ScriptedConfig)
    register_l2_adapter_factory("scripted_test", lambda cfg, desc: cfg.instance)
except ValueError:
    pass  # re-imported module


def scripted(instance: ScriptedAdapter) -> ScriptedConfig:
    return ScriptedConfig(instance=instance)


def make_sm(adapters=(), slots: int = 64, **kw) -> StorageManager:
    mem = L1MemoryManagerConfig(slots * 4096, use_lazy=False, align_bytes=4096, shm_name="")
    cfg = StorageManagerConfig(
        L1ManagerConfig(mem),
        EvictionConfig(kw.pop("policy", "LRU")),
        L2AdaptersConfig(list(adapters)),
        **kw,
    )
    return StorageManager(cfg, eviction_interval_s=60)


@contextlib.contextmanager
def scripted_sm(**kw) -> Iterator[tuple[StorageManager, ScriptedAdapter]]:
    """A storage manager over one fresh ``ScriptedAdapter``, closed on exit."""
    a = ScriptedAdapter()
    sm = make_sm([scripted(a)], **kw)
    try:
        yield sm, a
    finally:
        sm.close()


def write(sm: StorageManager, keys, value: float | None = None) -> None:
    objs = sm.reserve_write(keys, LAYOUT)  # keys already resident are not writable
    for i, k in enumerate(keys):
        if k in objs:
            objs[k].tensor.fill_(float(i) if value is None else value)
    sm.finish_write(list(objs))


def spec(keys, **kw) -> PrefetchTaskSpec:
    return PrefetchTaskSpec([GroupedObjectKeys(list(keys), 0, LAYOUT)], **kw)


def prefetch(sm: StorageManager, s: PrefetchTaskSpec):
    h = sm.submit_prefetch_task(s)
    assert sm.wait_prefetch_status(h, 30)
    r = sm.query_prefetch_status(h)
    assert r is not None
    assert sm.query_prefetch_status(h) is None  # answers once
    return r


# --- store controller ---------------------------------------------------------------------------


def store_in_l2_only(sm, adapter, keys) -> None:
    """Write ``keys`` through L1, wait until ``adapter`` holds them, then drop them from L1."""
    write(sm, keys)
    eventually(lambda: len(adapter.data) >= len(keys))
    sm.delete_l1_keys(keys)


def test_registry_any_serving_leaves_out_draining_adapters():
    import os

    from lmcache.v1.distributed.adapter_registry import AdapterRegistry

    fds = [os.eventfd(0) for _ in range(3)]

    class Fds:
        def get_store_event_fd(self):
            return fds[0]

        def get_lookup_and_lock_event_fd(self):
            return fds[1]

        def get_load_event_fd(self):
            return fds[2]

    try:
        reg = AdapterRegistry()
        assert not reg.any_serving()
        slot = reg.add(Fds(), "fake")
        assert reg.any_serving() and reg.slots(include_draining=False) == [slot]
        reg.set_draining(slot.index)
        assert not reg.any_serving() and reg.slots(include_draining=False) == []
    finally:
        for fd in fds:
            os.close(fd)


def test_l1_write_is_stored_to_every_adapter_and_pins_released():
    a, b = ScriptedAdapter(), ScriptedAdapter()
    sm = make_sm([scripted(a), scripted(b)])
    try:
        keys = [key(i) for i in range(5)]
        write(sm, keys)
        eventually(lambda: len(a.data) == 5 and len(b.data) == 5)
        l1 = sm.get_l1_manager()
        eventually(lambda: l1.report_status()["pinned_bytes"] == 0)
        eventually(lambda: l1.report_status()["read_locked_count"] == 0)
        assert bytes(a.data[key(3)]) == torch.full((1024,), 3.0).numpy().tobytes()
        assert sm.get_l2_usages()[0].total_bytes_used == 5 * 4096
    finally:
        sm.close()


def test_temporary_and_prefetch_admissions_are_never_stored():
    with scripted_sm() as (sm, a):
        l1 = sm.get_l1_manager()
        l1.reserve_write([key(1)], [True], LAYOUT, "x")
        l1.finish_write([key(1)], "x")
        l1.reserve_write([key(2)], [False], LAYOUT, "prefetch:1")
        l1.finish_write_and_reserve_read([key(2)], 1, "prefetch:1")
        write(sm, [key(3)])
        eventually(lambda: key(3) in a.data)
        time.sleep(0.1)
        assert set(a.data) == {key(3)}


def test_submit_exception_releases_pins():
    a = ScriptedAdapter()
    a.store_raises = True
    sm = make_sm([scripted(a)])
    try:
        write(sm, [key(1), key(2)])
        eventually(lambda: sm.report_status()["store_controller"]["failed_tasks"] >= 1)
        l1 = sm.get_l1_manager()
        eventually(lambda: l1.report_status()["pinned_bytes"] == 0)
        assert l1.report_status()["read_locked_count"] == 0
        assert sm.delete_l1_keys([key(1), key(2)]) == (2, 0)
    finally:
        sm.close()


def test_two_concurrent_batches_release_their_pins():
    a = ScriptedAdapter()
    a.store_gate.clear()
    sm = make_sm([scripted(a)])
    try:
        write(sm, [key(1), key(2)])
        write(sm, [key(3)])
        l1 = sm.get_l1_manager()
        eventually(lambda: l1.report_status()["pinned_bytes"] == 3 * 4096)
        assert sm.delete_l1_keys([key(1)]) == (0, 1)  # read-locked while being stored
        a.store_gate.set()
        eventually(lambda: l1.report_status()["pinned_bytes"] == 0)
        assert len(a.data) == 3
    finally:
        sm.close()


def test_store_cap_of_32_tasks_per_adapter():
    a = ScriptedAdapter()
    a.store_gate.clear()
    sm = make_sm([scripted(a)], slots=128)
    try:
        # distinct kv ranks make distinct tasks
        keys = [ObjectKey(b"\x01", "model", r) for r in range(40)]
        for k in keys:
            write(sm, [k])
        eventually(lambda: len(a.store_calls) == 32)
        time.sleep(0.2)
        assert len(a.store_calls) == 32
        eventually(lambda: sm.report_status()["store_controller"]["pending_keys"] == 8)
        assert len(a.store_calls) == 32
        a.store_gate.set()
        eventually(lambda: len(a.data) == 40)
        assert a.max_inflight_stores <= 32
    finally:
        sm.close()


def test_skip_l1_buffer_only_mode_deletes_after_store():
    a, b = ScriptedAdapter(), ScriptedAdapter()
    sm = make_sm([scripted(a), scripted(b)], l2_store_policy="skip_l1", policy="noop")
    try:
        write(sm, [key(1), key(2)])
        eventually(lambda: len(a.data) == 2 and len(b.data) == 2)
        l1 = sm.get_l1_manager()
        eventually(lambda: l1.keys() == [])
        eventually(lambda: l1.get_memory_usage()[0] == 0)
    finally:
        sm.close()


class HalfLandsAdapter(ScriptedAdapter):
    """Stores only the keys of odd ``i``; a task with an even one fails and says which landed."""

    def submit_store_task(self, keys, objects):
        tid = self._tid()
        landed = Bitmap(len(keys))
        with self.mu:
            for n, (k, o) in enumerate(zip(keys, objects, strict=True)):
                if k.chunk_hash[-1] % 2:
                    self.data[k] = bytes(o.byte_array)
                    landed.set(n)
            ok = landed.popcount() == len(keys)
            self.store_done[tid] = L2StoreResult(ok, 0, error="even keys fail", landed=landed)
        self.n[0].notify()
        return tid


def test_partly_failed_store_counts_its_failed_keys_and_frees_only_landed_ones():
    a = HalfLandsAdapter()
    sm = make_sm([scripted(a)], l2_store_policy="skip_l1", policy="noop")
    try:
        keys = [key(i) for i in range(1, 7)]
        write(sm, keys)
        eventually(lambda: sm.report_status()["store_controller"]["in_flight_tasks"] == 0)
        eventually(lambda: len(a.data) == 3)
        st = sm.report_status()["store_controller"]
        assert st["failed_keys"] == 3 and st["completed_keys"] == 3 and st["failed_tasks"] >= 1
        l1 = sm.get_l1_manager()
        # skip_l1 drops what L2 holds; the keys that did not land stay in L1
        eventually(lambda: sorted(l1.keys(), key=keys.index) == [key(2), key(4), key(6)])
    finally:
        sm.close()


class OnlyFirstAdapter(StorePolicy):
    def select_store_targets(self, keys, adapter_descriptors):
        return {adapter_descriptors[0].index: keys} if adapter_descriptors else {}


class SkipAll(StorePolicy):
    def select_store_targets(self, keys, adapter_descriptors):
        return {}


class DropFromL1(StorePolicy):
    def select_l1_deletions(self, keys):
        return [k for k in keys if k.chunk_hash[-1] % 2 == 0]


register_store_policy("test_only_first", OnlyFirstAdapter)
register_store_policy("test_skip_all", SkipAll)
register_store_policy("test_drop_even", DropFromL1)


def test_custom_store_policies():
    a, b = ScriptedAdapter(), ScriptedAdapter()
    sm = make_sm([scripted(a), scripted(b)], l2_store_policy="test_only_first")
    try:
        write(sm, [key(1)])
        eventually(lambda: key(1) in a.data)
        time.sleep(0.1)
        assert b.data == {}
    finally:
        sm.close()
    c = ScriptedAdapter()
    sm = make_sm([scripted(c)], l2_store_policy="test_skip_all")
    try:
        write(sm, [key(1)])
        time.sleep(0.2)
        assert c.store_calls == []
    finally:
        sm.close()
    d = ScriptedAdapter()
    sm = make_sm([scripted(d)], l2_store_policy="test_drop_even")
    try:
        write(sm, [key(1), key(2)])
        eventually(lambda: len(d.data) == 2)
        l1 = sm.get_l1_manager()
        eventually(lambda: l1.keys() == [key(1)])
    finally:
        sm.close()


def test_legacy_true_store_result_is_normalised(caplog):
    a = ScriptedAdapter()
    a.store_returns = True
    sm = make_sm([scripted(a)])
    try:
        write(sm, [key(1)])
        eventually(lambda: sm.report_status()["store_controller"]["completed_tasks"] == 1)
        st = sm.report_status()["store_controller"]
        assert st["stored_bytes"] == 4096 and st["failed_tasks"] == 0
        assert any("instead of L2StoreResult" in r.getMessage() for r in caplog.records)
    finally:
        sm.close()


# --- prefetch controller --------------------------------------------------------------------------


def test_full_prefix_hit_from_l2_locks_in_l1():
    with scripted_sm() as (sm, a):
        keys = [key(i) for i in range(5)]
        store_in_l2_only(sm, a, keys)
        r = prefetch(sm, spec(keys))
        assert repr(r.hit_cells[0]) == "11111" and repr(r.l2_hit_cells[0]) == "11111"
        assert r.l1_hit_cells[0].popcount() == 0 and r.l1_owners == [[0] * 5]
        l1 = sm.get_l1_manager()
        assert all(l1.is_read_locked(k) for k in keys)
        with sm.read_prefetched_results(keys, r.l1_owners[0]) as objs:
            assert [o.tensor[0].item() for o in objs] == [0.0, 1.0, 2.0, 3.0, 4.0]
        sm.finish_read_prefetched(keys, 1, r.l1_owners[0])
        assert l1.keys() == []  # default policy: loaded keys were temporary
        assert a.locked() == 0
        assert l1.memcheck()


def test_retain_policy_keeps_loaded_keys():
    with scripted_sm(l2_prefetch_policy="retain") as (sm, a):
        keys = [key(i) for i in range(3)]
        store_in_l2_only(sm, a, keys)
        r = prefetch(sm, spec(keys))
        sm.finish_read_prefetched(keys, 1, r.l1_owners[0])
        assert set(sm.get_l1_manager().keys()) == set(keys)


def test_l1_hits_are_not_looked_up_in_l2():
    with scripted_sm() as (sm, a):
        keys = [key(i) for i in range(4)]
        write(sm, keys)
        eventually(lambda: len(a.data) == 4)
        sm.delete_l1_keys(keys[2:])
        r = prefetch(sm, spec(keys))
        assert repr(r.l1_hit_cells[0]) == "1100" and repr(r.l2_hit_cells[0]) == "0011"
        assert a.lookup_calls[-1] == keys[2:]
        sm.finish_read_prefetched(keys, 1, r.l1_owners[0])


def test_gap_gives_prefix_and_loads_nothing_past_it():
    with scripted_sm() as (sm, a):
        keys = [key(i) for i in range(5)]
        store_in_l2_only(sm, a, keys)
        del a.data[key(2)]
        r = prefetch(sm, spec(keys))
        assert r.hit_prefix_length() == 2 and repr(r.hit_cells[0]) == "11000"
        assert a.load_calls[-1] == keys[:2]
        assert a.locked() == 0  # keys past the gap were unlocked
        l1 = sm.get_l1_manager()
        assert not l1.contains(key(3)) and not l1.contains(key(4))
        sm.finish_read_prefetched(keys[:2], 1, r.l1_owners[0][:2])


def test_fault_inject_gap_and_missing_first_key_give_zero_hits():
    fi = parse_l2_adapter_dict(
        1,
        {
            "type": "fault_inject",
            "gap_indices": [0],
            "inner": {"type": "mock", "max_size_gb": 0.01, "mock_bandwidth_gb": 100},
        },
    )
    sm = make_sm([fi])
    try:
        keys = [key(i) for i in range(4)]
        write(sm, keys)
        adapter = sm.get_l2_adapters()[0]
        eventually(lambda: adapter.inner.debug_num_keys() == 4)
        sm.delete_l1_keys(keys)
        r = prefetch(sm, spec(keys))
        assert r.hit_cells[0].popcount() == 0
        l1 = sm.get_l1_manager()
        assert l1.keys() == [] and l1.report_status()["staging_bytes"] == 0
        # missing key 0 everywhere: nothing is loaded at all
        adapter.inner.delete([keys[0]])
        r = prefetch(sm, spec(keys))
        assert r.hit_cells[0].popcount() == 0
    finally:
        sm.close()


def test_disjoint_adapters_compose_a_full_prefix():
    a, b = ScriptedAdapter(), ScriptedAdapter()
    sm = make_sm([scripted(a), scripted(b)])
    try:
        keys = [key(i) for i in range(4)]
        write(sm, keys)
        eventually(lambda: len(a.data) == 4 and len(b.data) == 4)
        sm.delete_l1_keys(keys)
        for k in keys[::2]:
            del a.data[k]
        for k in keys[1::2]:
            del b.data[k]
        r = prefetch(sm, spec(keys))
        assert repr(r.hit_cells[0]) == "1111"
        assert set(a.load_calls[-1] + b.load_calls[-1]) == set(keys)
        assert len(a.load_calls[-1]) == len(b.load_calls[-1]) == 2
        sm.finish_read_prefetched(keys, 1, r.l1_owners[0])
        assert a.locked() == 0 and b.locked() == 0
    finally:
        sm.close()


def test_lowest_index_adapter_serves_shared_cells():
    a, b = ScriptedAdapter(), ScriptedAdapter()
    sm = make_sm([scripted(a), scripted(b)])
    try:
        keys = [key(i) for i in range(3)]
        write(sm, keys)
        eventually(lambda: len(a.data) == 3 and len(b.data) == 3)
        sm.delete_l1_keys(keys)
        r = prefetch(sm, spec(keys))
        assert r.hit_prefix_length() == 3
        assert b.load_calls == [] and a.load_calls[-1] == keys
        assert b.locked() == 0  # b's unplanned locks were released
        sm.finish_read_prefetched(keys, 1, r.l1_owners[0])
    finally:
        sm.close()


def test_no_lock_mode_retains_and_releases():
    with scripted_sm() as (sm, a):
        keys = [key(i) for i in range(3)]
        write(sm, keys)
        eventually(lambda: len(a.data) == 3)
        sm.delete_l1_keys(keys[1:])
        r = prefetch(sm, spec(keys, lock_mode=LockMode.NO_LOCK))
        assert r.hit_prefix_length() == 3
        l1 = sm.get_l1_manager()
        assert not any(l1.is_read_locked(k) for k in keys)
        assert set(l1.keys()) == set(keys)  # loaded keys retained


def test_full_policy_and_sliding_window_rejection():
    with scripted_sm() as (sm, a):
        keys = [key(i) for i in range(4)]
        store_in_l2_only(sm, a, keys)
        del a.data[key(1)]
        r = prefetch(sm, spec(keys, fetching_policy="full"))
        assert repr(r.hit_cells[0]) == "1011" and repr(r.found_cells[0]) == "1011"
        sm.finish_read_prefetched([keys[0], keys[2], keys[3]], 1, [0, 0, 0])
        sw = PrefetchTaskSpec(
            [GroupedObjectKeys(keys, 0, LAYOUT, sliding_window_size=2)], fetching_policy="full"
        )
        with pytest.raises(ValueError, match="sliding windows"):
            sm.submit_prefetch_task(sw)


def test_sliding_window_group_needs_only_last_chunks():
    with scripted_sm() as (sm, a):
        full = [key(i) for i in range(4)]
        swk = [
            ObjectKey(ObjectKey.IntHash2Bytes(i), "model", KV, object_group_id=1) for i in range(4)
        ]
        write(sm, full + swk[2:])
        r = prefetch(
            sm,
            PrefetchTaskSpec(
                [
                    GroupedObjectKeys(full, 0, LAYOUT),
                    GroupedObjectKeys(swk, 1, LAYOUT, sliding_window_size=2),
                ],
                fetching_policy="prefix",
            ),
        )
        assert r.hit_prefix_length() >= 0
        assert repr(r.hit_cells[0]) == "1111" and repr(r.hit_cells[1]) == "0011"


def test_skip_l2_and_empty_requests_are_served_synchronously():
    with scripted_sm() as (sm, a):
        h = sm.submit_prefetch_task(spec([]))
        assert h.prefetch_request_id == -1 and sm.wait_prefetch_status(h, 0)
        write(sm, [key(1)])
        h = sm.submit_prefetch_task(spec([key(1), key(2)]), skip_l2=True)
        r = sm.query_prefetch_status(h)  # already complete
        assert repr(r.hit_cells[0]) == "10" and a.lookup_calls == []


def test_hung_lookup_hits_deadline_and_late_result_is_unlocked():
    with scripted_sm(l2_lookup_timeout_seconds=0.3) as (sm, a):
        keys = [key(i) for i in range(3)]
        store_in_l2_only(sm, a, keys)
        a.lookup_gate.clear()
        r = prefetch(sm, spec(keys))
        assert r.hit_cells[0].popcount() == 0
        a.lookup_gate.set()  # the late result arrives
        eventually(lambda: a.lookup_calls and a.locked() == 0 and not a.lookup_done)
        eventually(lambda: sm.prefetch_controller.inflight_for(0) == 0)


def test_hung_load_keeps_buffers_pinned_until_late_result():
    with scripted_sm(l2_load_timeout_seconds=0.3) as (sm, a):
        keys = [key(i) for i in range(3)]
        store_in_l2_only(sm, a, keys)
        a.load_gate.clear()
        r = prefetch(sm, spec(keys))
        assert r.hit_cells[0].popcount() == 0
        l1 = sm.get_l1_manager()
        assert l1.report_status()["pinned_bytes"] == 3 * 4096  # adapter may still write
        a.load_gate.set()
        eventually(lambda: l1.report_status()["pinned_bytes"] == 0)
        eventually(lambda: l1.get_memory_usage()[0] == 0 and a.locked() == 0)
        assert l1.memcheck()


def test_three_expiries_suspend_the_adapter():
    with scripted_sm(l2_lookup_timeout_seconds=0.1) as (sm, a):
        a.lookup_gate.clear()
        for i in range(3):
            prefetch(sm, spec([key(100 + i)]))
        st = sm.report_status()
        assert st["l2_adapters"][0]["suspended_from_prefetch"] is True
        assert st["l2_adapters"][0]["is_healthy"] is False
        calls = len(a.lookup_calls)
        r = prefetch(sm, spec([key(200)]))  # treated as a miss without asking the adapter
        assert r.hit_cells[0].popcount() == 0 and len(a.lookup_calls) == calls
        a.lookup_gate.set()


def test_one_argument_lookup_plugin_works_under_prefetch():
    class OneArg(ScriptedAdapter):
        def submit_lookup_and_lock_task(self, keys):  # 0.5.x signature
            return super().submit_lookup_and_lock_task(keys)

    a = OneArg()
    sm = make_sm([scripted(a)])
    try:
        write(sm, [key(1)])
        eventually(lambda: key(1) in a.data)
        sm.delete_l1_keys([key(1)])
        r = prefetch(sm, spec([key(1)]))
        assert r.hit_cells[0].test(0) is True
    finally:
        sm.close()


def test_store_and_prefetch_race_on_same_keys():
    a = ScriptedAdapter()
    sm = make_sm([scripted(a)], slots=256)
    errors: list[BaseException] = []
    keys = [key(i) for i in range(16)]

    def writer(seed: int) -> None:
        try:
            for _ in range(15):
                write(sm, keys)  # key(i) holds float(i): a swapped buffer is noticed
                sm.delete_l1_keys(keys[seed::4])
        except BaseException as exc:
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(15):
                r = prefetch(sm, spec(keys))
                n = r.hit_prefix_length()
                owners = r.l1_owners[0][:n]
                with sm.read_prefetched_results(keys[:n], owners) as objs:
                    assert objs is not None and len(objs) == n
                    for i, o in enumerate(objs):
                        assert bool(torch.all(o.tensor == float(i))), (i, o.tensor[0].item())
                sm.finish_read_prefetched(keys[:n], 1, owners)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a worker thread hung"
        assert not errors, errors
        l1 = sm.get_l1_manager()
        eventually(lambda: l1.report_status()["pinned_bytes"] == 0)
        eventually(lambda: l1.report_status()["read_locked_count"] == 0)
        assert l1.memcheck() and a.locked() == 0
    finally:
        sm.close()


def _fill_l2(a: ScriptedAdapter, keys) -> None:
    """Put key i into L2 holding float(i), as the store path would have written it."""
    for i, k in enumerate(keys):
        a.data[k] = torch.full((1024,), float(i), dtype=torch.float32).numpy().tobytes()


def test_l1_without_room_for_all_staging_replans_to_a_shorter_prefix():
    """Step 4 of docs/design/storage-engine.md#prefetch-controller: L1 holds 2 of 5 cells; the plan
    shrinks to a prefix of 2, the L2 locks of the cells that could not be reserved are dropped and
    no staging is left behind."""
    with scripted_sm(slots=2) as (sm, a):
        keys = [key(i) for i in range(5)]
        _fill_l2(a, keys)
        r = prefetch(sm, spec(keys))
        assert r.hit_prefix_length() == 2 and repr(r.hit_cells[0]) == "11000"
        assert [a.locks.get(k, 0) for k in keys[2:]] == [0, 0, 0]  # unlocked in L2
        assert a.load_calls == [keys[:2]]  # nothing past the prefix was loaded
        l1 = sm.get_l1_manager()
        assert l1.get_staging_memory_usage() == 0
        assert l1.report_status()["write_locked_count"] == 0
        with sm.read_prefetched_results(keys[:2], r.l1_owners[0][:2]) as objs:
            assert [o.tensor[0].item() for o in objs] == [0.0, 1.0]
        sm.finish_read_prefetched(keys[:2], 1, r.l1_owners[0][:2])
        assert a.locked() == 0 and l1.keys() == [] and l1.memcheck()


def test_replan_deletes_staging_the_new_plan_drops():
    """Two groups: group 0 reserves all 5 cells, group 1 only 2 (7 slots), so the prefix is 2
    and the staged group-0 cells 2-4 are deleted again (finish_write_and_delete)."""
    with scripted_sm(slots=7) as (sm, a):
        g0 = [key(i) for i in range(5)]
        g1 = [key(100 + i) for i in range(5)]
        _fill_l2(a, g0)
        _fill_l2(a, g1)
        s = PrefetchTaskSpec([GroupedObjectKeys(g0, 0, LAYOUT), GroupedObjectKeys(g1, 1, LAYOUT)])
        r = prefetch(sm, s)
        assert r.hit_prefix_length() == 2
        assert [repr(b) for b in r.hit_cells] == ["11000", "11000"]
        assert all(a.locks.get(k, 0) == 0 for k in g0[2:] + g1[2:])
        assert sorted(k.chunk_hash for c in a.load_calls for k in c) == sorted(
            k.chunk_hash for k in g0[:2] + g1[:2]
        )
        l1 = sm.get_l1_manager()
        assert l1.get_staging_memory_usage() == 0
        assert set(l1.keys()) == set(g0[:2] + g1[:2])  # dropped staging is gone
        sm.finish_read_prefetched(g0[:2], 1, r.l1_owners[0][:2])
        sm.finish_read_prefetched(g1[:2], 1, r.l1_owners[1][:2])
        assert a.locked() == 0 and l1.keys() == [] and l1.memcheck()


def make_two_l1_sm(adapters=(), slots0: int = 2, slots1: int = 8) -> StorageManager:
    def l1cfg(slots: int, tag: str) -> L1ManagerConfig:
        mem = L1MemoryManagerConfig(slots * 4096, use_lazy=False, align_bytes=4096, shm_name="")
        return L1ManagerConfig(mem, tag=tag)

    first = l1cfg(slots0, L1ManagerConfig.__dataclass_fields__["tag"].default)
    cfg = StorageManagerConfig(
        first,
        EvictionConfig("noop"),
        L2AdaptersConfig(list(adapters)),
        extra_l1_manager_configs=[l1cfg(slots1, "second")],
    )
    return StorageManager(cfg, eviction_interval_s=60)


def test_multi_l1_oom_falls_through_and_finish_by_owner():
    """docs/design/storage-engine.md#l1-memory, docs/design/storage-engine.md#storage-manager: keys
    that do not fit the first L1 go to the next; completion is grouped by the L1 that reserved each
    key."""
    sm = make_two_l1_sm()
    try:
        keys = [key(i) for i in range(5)]
        objs = sm.reserve_write(keys, LAYOUT)
        assert set(objs) == set(keys)
        groups = sm.prepare_write_completion(keys)
        assert groups == {0: keys[:2], 1: keys[2:]}
        for i, k in enumerate(keys):
            objs[k].tensor.fill_(float(i))
        res = sm.finish_write_by_owner(groups)
        assert set(res) == set(keys) and all(e.name == "SUCCESS" for e in res.values())
        l1a, l1b = sm.get_l1_manager(0), sm.get_l1_manager(1)
        assert set(l1a.keys()) == set(keys[:2]) and set(l1b.keys()) == set(keys[2:])
        assert key(9) in sm.reserve_write([key(9)], LAYOUT)  # L1 #0 is full, #1 has room
        assert sm.prepare_write_completion([key(9)]) == {1: [key(9)]}
        sm.abort_write([key(9)])
        assert not l1b.contains(key(9)) and l1b.get_staging_memory_usage() == 0
        r = prefetch(sm, spec(keys))
        assert repr(r.hit_cells[0]) == "11111" and r.l1_owners == [[0, 0, 1, 1, 1]]
        with sm.read_prefetched_results(keys, r.l1_owners[0]) as got:
            assert [o.tensor[0].item() for o in got] == [0.0, 1.0, 2.0, 3.0, 4.0]
        sm.finish_read_prefetched(keys, 1, r.l1_owners[0])
        assert not any(l1a.is_read_locked(k) or l1b.is_read_locked(k) for k in keys)
        assert sm.memcheck()
    finally:
        sm.close()


def test_multi_l1_lowest_index_serves_a_cell_held_by_both():
    sm = make_two_l1_sm(slots0=4)
    try:
        k = key(7)
        for li, value in ((1, 1.0), (0, 0.0)):  # the same key resident in both L1s
            l1 = sm.get_l1_manager(li)
            obj = l1.reserve_write([k], [False], LAYOUT)[k][1]
            obj.tensor.fill_(value)
            l1.finish_write([k])
        r = prefetch(sm, spec([k]))
        assert r.l1_owners == [[0]]
        assert sm.get_l1_manager(0).is_read_locked(k)
        assert not sm.get_l1_manager(1).is_read_locked(k)  # the unplanned copy was released
        with sm.read_prefetched_results([k], r.l1_owners[0]) as got:
            assert got[0].tensor[0].item() == 0.0
        sm.finish_read_prefetched([k], 1, r.l1_owners[0])
        assert not sm.get_l1_manager(0).is_read_locked(k)
    finally:
        sm.close()


# --- adapters at runtime, status, errors ---------------------------------------------------------------


def test_add_and_delete_adapter_at_runtime():
    a = ScriptedAdapter()
    sm = make_sm([])
    try:
        idx = sm.add_l2_adapter(scripted(a))
        write(sm, [key(1)])
        eventually(lambda: key(1) in a.data)
        a.store_gate.clear()
        write(sm, [key(2)])
        eventually(lambda: sm.store_controllers[0].inflight_for(idx) == 1)
        done = threading.Event()
        threading.Thread(target=lambda: (sm.delete_l2_adapter(idx, timeout=10), done.set())).start()
        time.sleep(0.1)
        assert not done.is_set()  # drains first
        a.store_gate.set()
        assert done.wait(10) and a.closed
        assert sm.get_l2_adapters() == [] and sm.delete_l2_adapter(idx) is False
        assert sm.get_l1_manager().report_status()["pinned_bytes"] == 0
    finally:
        sm.close()


def test_fd_collision_fails_registration_naming_both():
    a = ScriptedAdapter()
    b = ScriptedAdapter()
    b.n = a.n  # same fds
    with pytest.raises(ValueError, match=r"collides with adapter #0"):
        make_sm([scripted(a), scripted(b)])


def test_failed_construction_unwinds():
    with pytest.raises(ValueError, match="affinity_tag"):
        cfg = scripted(ScriptedAdapter())
        cfg.affinity_tag = "nope"
        make_sm([cfg])


def test_status_and_usage_by_salt():
    with scripted_sm() as (sm, a):
        write(sm, [key(1, "t1"), key(2, "t2")])
        eventually(lambda: len(a.data) == 2)
        assert sm.get_usage_bytes_by_cache_salt() == {"t1": 4096, "t2": 4096}
        st = sm.report_status()
        assert st["is_healthy"] is True
        for k in (
            "l1_managers",
            "l1_eviction_controllers",
            "store_controllers",
            "prefetch_controller",
            "l2_eviction_controller",
            "l2_adapters",
        ):
            assert k in st
        assert st["l2_adapters"][0]["type"] == "scripted_test"
        assert st["prefetch_controller"]["max_in_flight"] == 8
        assert sm.memcheck()


def test_unknown_serde_type_is_refused_at_start_naming_the_registered_ones():
    cfg = parse_l2_adapter_dict(
        1, {"type": "mock", "max_size_gb": 0.01, "mock_bandwidth_gb": 1, "serde": {"type": "zstd"}}
    )
    with pytest.raises(ValueError, match="Unknown serde type 'zstd'. Registered: .*identity"):
        make_sm([cfg])


def test_broken_plugin_at_start_unwinds_everything(tmp_path):
    import os

    from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig

    a = ScriptedAdapter()
    name = f"t_unwind_{os.getpid()}"
    mem = L1MemoryManagerConfig(16 * 4096, use_lazy=False, shm_name=name)
    cfg = StorageManagerConfig(
        L1ManagerConfig(mem),
        EvictionConfig("LRU"),
        L2AdaptersConfig([scripted(a), PluginL2AdapterConfig("no_such_plugin_mod", "X")]),
    )
    with pytest.raises(ImportError, match=r"^Could not import module 'no_such_plugin_mod'"):
        StorageManager(cfg)
    assert a.closed  # the adapter built before the failure was closed
    assert not os.path.exists(f"/dev/shm/lmcache_l1_pool_{name}")  # and the L1 segment removed


_RAISING_PLUGIN = """
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface


class RaisingInitAdapter(L2AdapterInterface):
    def __init__(self, config):
        raise RuntimeError("plugin backend unreachable")


for _name in sorted(L2AdapterInterface.__abstractmethods__):
    setattr(RaisingInitAdapter, _name, lambda self, *a, **k: None)
RaisingInitAdapter.__abstractmethods__ = frozenset()
"""


def test_broken_plugin_added_at_runtime_leaves_others_working(tmp_path, monkeypatch):
    import os

    from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig

    mod = f"t_raising_plugin_{os.getpid()}"
    (tmp_path / f"{mod}.py").write_text(_RAISING_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    with scripted_sm() as (sm, a):
        fds_before = len(os.listdir("/proc/self/fd"))
        for bad, exc in [
            (PluginL2AdapterConfig("no_such_plugin_mod", "X"), ImportError),
            (PluginL2AdapterConfig("json", "loads"), TypeError),
            (PluginL2AdapterConfig("json", "Missing"), AttributeError),
            (PluginL2AdapterConfig(mod, "RaisingInitAdapter"), RuntimeError),
        ]:
            with pytest.raises(exc):
                sm.add_l2_adapter(bad)
        assert len(sm.get_l2_adapters()) == 1
        assert len(os.listdir("/proc/self/fd")) <= fds_before  # nothing half-registered
        write(sm, [key(1)])
        eventually(lambda: key(1) in a.data)
        sm.delete_l1_keys([key(1)])
        assert prefetch(sm, spec([key(1)])).hit_cells[0].test(0) is True


def test_storage_manager_advertises_shm_pool_under_lazy_l1():
    import os

    name = f"t_adv_{os.getpid()}"
    mem = L1MemoryManagerConfig(1 << 22, use_lazy=True, init_size_in_bytes=1 << 20, shm_name=name)
    sm = StorageManager(
        StorageManagerConfig(L1ManagerConfig(mem), EvictionConfig("LRU")), eviction_interval_s=60
    )
    try:
        assert sm.shm_name == f"lmcache_l1_pool_{name}" and sm.pool_size == 1 << 22
        assert sm.shm_disabled_reason == ""
        obj = sm.reserve_write([key(1)], LAYOUT)[key(1)]
        obj.tensor.fill_(2.5)
        with open(f"/dev/shm/{sm.shm_name}", "rb") as f:  # what an engine maps
            f.seek(obj.metadata.address)
            assert torch.frombuffer(bytearray(f.read(4)), dtype=torch.float32).item() == 2.5
        assert sm.get_l1_manager().get_l1_memory_desc().stable_registration_size is None
    finally:
        sm.close()
    assert not os.path.exists(f"/dev/shm/lmcache_l1_pool_{name}")


def test_abort_prefetch_releases_locks_now_or_when_finished():
    with scripted_sm() as (sm, a):
        keys = [key(i) for i in range(3)]
        write(sm, keys)
        eventually(lambda: len(a.data) == 3)
        l1 = sm.get_l1_manager()
        # finished but never collected
        h = sm.submit_prefetch_task(spec(keys))
        assert sm.wait_prefetch_status(h, 10)
        assert all(l1.is_read_locked(k) for k in keys)
        assert sm.abort_prefetch_task(h) is True
        assert not any(l1.is_read_locked(k) for k in keys)
        assert sm.query_prefetch_status(h) is None and sm.abort_prefetch_task(h) is False
        # aborted while its L2 load is still running
        sm.delete_l1_keys(keys)
        a.load_gate.clear()
        h = sm.submit_prefetch_task(spec(keys))
        eventually(lambda: a.load_calls)
        assert sm.abort_prefetch_task(h) is True
        a.load_gate.set()
        eventually(lambda: l1.report_status()["read_locked_count"] == 0)
        eventually(lambda: l1.get_memory_usage()[0] == 0)  # temporary copies freed
        assert a.locked() == 0 and l1.memcheck()


@pytest.mark.parametrize("lock_mode", [LockMode.LOCK, LockMode.NO_LOCK])
def test_l1_only_fast_path_matches_the_general_path(lock_mode, monkeypatch):
    """Requests served from L1 alone take a short path; it must report the same hits,
    owners and read locks as the general cell-by-cell path, including a gap in one row."""
    from lmcache.v1.distributed import prefetch_controller as pc

    def run(fast: bool):
        if not fast:
            monkeypatch.setattr(pc._RequestRun, "_l1_only", lambda self: False)
        sm = make_sm()
        try:
            rows = [[key(10 * r + c) for c in range(5)] for r in range(2)]
            write(sm, [k for row in rows for k in row if k != rows[1][3]])  # row 1 misses col 3
            s = PrefetchTaskSpec(
                [GroupedObjectKeys(row, 0, LAYOUT) for row in rows],
                num_kv_readers=2,
                lock_mode=lock_mode,
            )
            r = prefetch(sm, s)
            l1 = sm.get_l1_manager()
            locks = [[l1.is_read_locked(k) for k in row] for row in rows]
            return (
                [bm.to_int() for bm in r.hit_cells],
                [bm.to_int() for bm in r.l1_hit_cells],
                [bm.to_int() for bm in r.l2_hit_cells],
                r.l1_owners,
                locks,
            )
        finally:
            sm.close()

    fast = run(True)
    assert fast[0] == [0b111, 0b111]  # the common prefix of both rows
    assert fast[4][0][:3] == [lock_mode is LockMode.LOCK] * 3 and not any(fast[4][0][3:])
    assert fast == run(False)


def test_writes_reach_an_adapter_attached_after_start():
    # The store controller skips writes while no adapter is attached; that skip must follow
    # the registry as it is now, not as it was when the controller started.
    sm = make_sm([], slots=16)
    try:
        write(sm, [ObjectKey(b"\x01", "model", 0)])
        a = ScriptedAdapter()
        sm.add_l2_adapter(scripted(a))
        write(sm, [ObjectKey(b"\x02", "model", 0)])
        eventually(lambda: len(a.data) == 1)
        assert sm.store_controllers[0].idle()
    finally:
        sm.close()
