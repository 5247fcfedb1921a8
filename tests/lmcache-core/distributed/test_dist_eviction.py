"""Eviction policies and controllers (docs/design/storage-engine.md#eviction)."""

from __future__ import annotations

import pytest
import torch
from testsupport.waiting import eventually

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import EvictionConfig, L1ManagerConfig, L1MemoryManagerConfig
from lmcache.v1.distributed.eviction import (
    ARCEvictionPolicy,
    EvictionDestination,
    IsolatedLRUEvictionPolicy,
    L1EvictionController,
    L2EvictionController,
    LRUEvictionPolicy,
    NoopEvictionPolicy,
    QuotaManager,
    create_eviction_policy,
)
from lmcache.v1.distributed.l1_manager import L1Manager
from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2Adapter, MockL2AdapterConfig
from lmcache.v1.memory_management import BytesBufferMemoryObj

LAYOUT = MemoryLayoutDesc([torch.Size([1024])], [torch.float32])


def key(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(ObjectKey.IntHash2Bytes(i), "m", 0, cache_salt=salt)


def test_lru_batch_inserted_in_reverse():
    p = LRUEvictionPolicy()
    p.on_keys_created([key(0), key(1), key(2)])
    assert p.candidates() == [key(2), key(1), key(0)]
    p.on_keys_touched([key(2)])
    assert p.candidates()[-1] == key(2)
    p.on_keys_removed([key(1)])
    assert p.candidates() == [key(0), key(2)]
    acts = p.get_eviction_actions(0.5)
    assert acts[0].destination is EvictionDestination.DISCARD and acts[0].keys == [key(0)]


def test_arc_cases():
    p = ARCEvictionPolicy()
    p.on_keys_created([key(1)])
    p.on_keys_created([key(2)])
    assert set(p.t1) == {key(1), key(2)}
    p.on_keys_touched([key(1)])  # second access -> T2
    assert key(1) in p.t2 and key(1) not in p.t1
    assert p.candidates()[0] == key(2)  # T1 goes first (len(T1) >= p == 0: tie to T1)
    p.on_keys_removed([key(2)])  # T1 removal becomes a B1 ghost
    assert key(2) in p.b1
    p.on_keys_created([key(2)])  # ghost hit in B1 raises the target and lands in T2
    assert p.p >= 1.0 and key(2) in p.t2 and key(2) not in p.b1
    p.on_keys_removed([key(1)])
    assert key(1) in p.b2
    before = p.p
    p.on_keys_created([key(1)])  # ghost hit in B2 lowers the target
    assert p.p < before and key(1) in p.t2
    assert p.capacity >= 2


def test_isolated_lru_without_salt_evicts_globally():
    p = IsolatedLRUEvictionPolicy()
    assert p.support_isolation
    p.on_keys_created([key(1, "a")])
    p.on_keys_created([key(2, "b")])
    p.on_keys_created([key(3, "a")])
    assert p.candidates(None, None) == [key(1, "a"), key(2, "b"), key(3, "a")]
    assert p.candidates(None, "a") == [key(1, "a"), key(3, "a")]
    assert p.get_eviction_actions(0.3)  # does not raise without a salt (0.5.6 #4817)


def test_noop_tracks_nothing():
    p = NoopEvictionPolicy()
    p.on_keys_created([key(1)])
    assert p.candidates() == [] and p.get_eviction_actions(1.0) == []


def test_unknown_policy_error_text():
    with pytest.raises(ValueError, match=r"^eviction.eviction_policy must be 'LRU', 'ARC'"):
        create_eviction_policy("FIFO")


def make_l1(slots: int) -> L1Manager:
    mem = L1MemoryManagerConfig(slots * 4096, use_lazy=False, shm_name="")
    return L1Manager(L1ManagerConfig(mem))


def fill(l1: L1Manager, keys) -> None:
    for k in keys:
        l1.reserve_write([k], [False], LAYOUT)
        l1.finish_write([k])


def test_l1_loop_skips_below_watermark_and_evicts_bytes():
    l1 = make_l1(10)
    ctl = L1EvictionController(l1, EvictionConfig("LRU", 0.8, 0.2), interval_s=60)
    try:
        fill(l1, [key(i) for i in range(7)])
        ctl.run_once()
        assert len(l1.keys()) == 7  # 70% < 80%
        fill(l1, [key(7), key(8)])
        ctl.run_once()  # 90%: free 20% of used bytes = 1.8 objects -> 2 keys
        assert len(l1.keys()) == 7
        assert not l1.contains(key(0)) and not l1.contains(key(1))  # oldest first
    finally:
        l1.close()


def test_l1_loop_ratio_frees_at_least_one_key():
    l1 = make_l1(4)
    ctl = L1EvictionController(l1, EvictionConfig("LRU", 0.5, 0.01), interval_s=60)
    try:
        fill(l1, [key(i) for i in range(4)])
        ctl.run_once()
        assert len(l1.keys()) == 3
    finally:
        l1.close()


def test_eviction_thread_survives_policy_exception():
    l1 = make_l1(4)
    ctl = L1EvictionController(l1, EvictionConfig("LRU", 0.1, 0.5), interval_s=0.01)
    calls = {"n": 0}
    real = ctl.policy.candidates

    def broken(*a, **kw):
        calls["n"] += 1
        if calls["n"] <= 3:
            raise RuntimeError("policy bug")
        return real(*a, **kw)

    ctl.policy.candidates = broken
    try:
        fill(l1, [key(i) for i in range(4)])
        ctl.cycle()
        ctl.cycle()
        ctl.cycle()
        assert not ctl.is_healthy and ctl.errors == 3
        ctl.start()
        # the cycle resets its error streak only after its eviction returned: wait for both
        eventually(lambda: len(l1.keys()) < 4 and ctl.is_healthy, "the restarted loop evicted", 5)
        assert ctl.report_status()["eviction"]["errors"] >= 3
    finally:
        ctl.stop()
        l1.close()


def test_dead_thread_is_restarted():
    l1 = make_l1(2)
    ctl = L1EvictionController(l1, EvictionConfig("LRU"), interval_s=0.01)
    try:
        ctl.start()
        ctl._stop.set()
        ctl._thread.join()
        ctl._stop.clear()  # the thread died without being asked to stop
        ctl.ensure_running()
        assert ctl.restarts == 1 and ctl._thread.is_alive()
    finally:
        ctl.stop()
        l1.close()


# --- L2 eviction ------------------------------------------------------------------------------


def mock(capacity_bytes: int) -> MockL2Adapter:
    return MockL2Adapter(MockL2AdapterConfig(capacity_bytes / (1 << 30), 100.0))


def store(adapter: MockL2Adapter, keys, size: int = 100) -> None:
    tid = adapter.submit_store_task(keys, [BytesBufferMemoryObj(bytes(size)) for _ in keys])
    eventually(lambda: tid in adapter.pop_completed_store_tasks(), "the L2 store to complete")


def test_per_salt_quota_eviction():
    qm = QuotaManager()
    qm.set_quota("a", 300)
    qm.set_quota("b", 10_000)
    ctl = L2EvictionController(qm, interval_s=60)
    a = mock(1 << 20)
    try:
        assert ctl.add_adapter(0, a, EvictionConfig("IsolatedLRU", 0.8, 0.5))
        store(a, [key(i, "a") for i in range(4)])  # 400 B > 0.8 * 300
        store(a, [key(10 + i, "b") for i in range(4)])  # 400 B, under budget
        store(a, [key(20 + i, "c") for i in range(2)])  # unregistered salt: limit 0
        ctl.run_once()
        usage = a.get_usage().bytes_by_cache_salt
        assert usage.get("a") == 200  # evicted by ratio 0.5 of its bytes
        assert usage.get("b") == 400  # untouched
        assert "c" not in usage  # unregistered salt wiped
        ctl.run_once()
        assert a.get_usage().bytes_by_cache_salt.get("b") == 400  # under budget: no-op
    finally:
        a.close()


def test_default_limit_none_exempts_unregistered_salts():
    qm = QuotaManager()
    qm.set_default_limit_bytes(None)
    ctl = L2EvictionController(qm, interval_s=60)
    a = mock(1 << 20)
    try:
        ctl.add_adapter(0, a, EvictionConfig("IsolatedLRU"))
        store(a, [key(1, "z")])
        ctl.run_once()
        assert a.debug_num_keys() == 1
        assert qm.effective_limit_bytes("z") is None and qm.get_limit_bytes("z") == 0
    finally:
        a.close()


def test_lru_ignores_quotas_and_evicts_globally_by_bytes():
    qm = QuotaManager()  # would wipe every salt if consulted
    ctl = L2EvictionController(qm, interval_s=60)
    a = mock(1000)
    try:
        ctl.add_adapter(0, a, EvictionConfig("LRU", 0.8, 0.25))
        store(a, [key(i, "s") for i in range(9)])  # 900/1000
        ctl.run_once()
        assert a.get_usage().total_bytes_used == 600  # 25% of 900 -> 3 keys
    finally:
        a.close()


def test_isolated_lru_without_quota_manager_falls_back_to_global():
    ctl = L2EvictionController(None, interval_s=60)
    a = mock(1000)
    try:
        ctl.add_adapter(0, a, EvictionConfig("IsolatedLRU", 0.5, 0.5))
        store(a, [key(i, "s") for i in range(6)])
        ctl.run_once()
        assert a.get_usage().total_bytes_used == 300
    finally:
        a.close()


def test_global_policy_without_capacity_is_gated(caplog):
    class NoCap(MockL2Adapter):
        @property
        def supports_global_eviction(self) -> bool:
            return False

    ctl = L2EvictionController(QuotaManager(), interval_s=60)
    a = NoCap(MockL2AdapterConfig(1.0, 10.0))
    try:
        assert ctl.add_adapter(0, a, EvictionConfig("LRU")) is False
        assert any("eviction disabled" in r.getMessage() for r in caplog.records)
    finally:
        a.close()


def test_arc_reservation_then_creation_is_one_reference():
    p = ARCEvictionPolicy()
    p.on_keys_reserved([key(1)])
    p.on_keys_created([key(1)])
    assert key(1) in p.t1 and key(1) not in p.t2
    p.on_keys_reserved([key(2)])
    p.on_keys_removed([key(2)])  # abandoned reservation
    assert key(2) not in p.b1 and key(2) not in p.t1


def test_aborted_and_expired_reservations_leave_the_policy():
    l1 = make_l1(8)
    ctl = L1EvictionController(l1, EvictionConfig("LRU"), interval_s=60)
    try:
        l1.reserve_write([key(1), key(2)], [True, True], LAYOUT, "prefetch:1")
        assert ctl.policy.num_tracked() == 2
        l1.finish_write_and_delete([key(1), key(2)], "prefetch:1")
        assert ctl.policy.num_tracked() == 0
        l1.reserve_write([key(3)], [False], LAYOUT)
        l1.delete([key(3)], force=True)
        assert ctl.policy.num_tracked() == 0
    finally:
        l1.close()
