"""The test-only L2 types: mock (docs/design/storage-engine.md#backend-mock) and fault_inject
(docs/design/storage-engine.md#backend-fault-inject)."""

from __future__ import annotations

import hashlib
import logging
import time

import pytest
from testsupport.waiting import wait_result

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L2AdapterListener
from lmcache.v1.distributed.l2_adapters.config import build_config_from_dict
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
from lmcache.v1.distributed.l2_adapters.fault_inject_l2_adapter import (
    FaultInjectL2Adapter,
    FaultInjectL2AdapterConfig,
    dropped_positions,
    key_bucket,
)
from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2Adapter, MockL2AdapterConfig
from lmcache.v1.memory_management import BytesBufferMemoryObj


def key(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(ObjectKey.IntHash2Bytes(i), "m", 5, 1, salt)


def store(a, keys, size=100):
    tid = a.submit_store_task(
        keys, [BytesBufferMemoryObj(bytes([i % 251]) * size) for i in range(len(keys))]
    )
    return wait_result(lambda: a.pop_completed_store_tasks().get(tid))


def test_mock_config_errors():
    for d, msg in [
        ({"mock_bandwidth_gb": 1}, "max_size_gb must be a positive number"),
        ({"max_size_gb": 1, "mock_bandwidth_gb": 0}, "mock_bandwidth_gb must be a positive number"),
        ({"max_size_gb": True, "mock_bandwidth_gb": 1}, "max_size_gb must be a positive number"),
    ]:
        with pytest.raises(ValueError, match=rf"^{msg}"):
            MockL2AdapterConfig.from_dict(d)


def test_mock_skips_duplicates_and_over_capacity_but_succeeds():
    a = MockL2Adapter(MockL2AdapterConfig(250 / (1 << 30), 100.0))
    sizes = []

    class L(L2AdapterListener):
        def on_l2_keys_stored(self, keys, s):
            sizes.extend(s)

    a.register_listener(L())
    try:
        r1 = store(a, [key(1), key(2)])
        assert r1.is_successful() and r1.bytes_transferred() == 200
        r2 = store(a, [key(1), key(3)])  # duplicate + over capacity
        assert r2.is_successful() and r2.bytes_transferred() == 0
        assert a.debug_has_key(key(1)) and not a.debug_has_key(key(3))
        assert sizes == [100, 100]
        a.delete([key(1)])
        assert a.get_usage().total_bytes_used == 100
    finally:
        a.close()


def test_mock_lookup_locks_block_delete_and_load_copies():
    a = MockL2Adapter(MockL2AdapterConfig(1.0, 100.0))
    try:
        store(a, [key(1)])
        tid = a.submit_lookup_and_lock_task([key(1), key(2)])
        bm = wait_result(lambda: a.query_lookup_and_lock_result(tid))
        assert (bm.test(0), bm.test(1)) == (True, False)
        a.delete([key(1)])
        assert a.debug_has_key(key(1))  # locked
        dst = BytesBufferMemoryObj(bytes(100))
        tid = a.submit_load_task([key(1)], [dst])
        assert wait_result(lambda: a.query_load_result(tid)).test(0)
        assert bytes(dst.byte_array) == bytes([0]) * 100
        a.submit_unlock([key(1)])
        a.delete([key(1)])
        assert not a.debug_has_key(key(1))
    finally:
        a.close()


def test_mock_lock_ttl_expiry_lets_delete_proceed(monkeypatch):
    """A lost unlock cannot pin a key: after the TTL (300 s by default) delete() succeeds."""
    from lmcache.v1.distributed.l2_adapters import utils

    monkeypatch.setattr(utils, "L2_LOCK_TTL_SECONDS", 0.2)
    a = MockL2Adapter(MockL2AdapterConfig(1.0, 100.0))
    try:
        store(a, [key(1)])
        tid = a.submit_lookup_and_lock_task([key(1)])
        assert wait_result(lambda: a.query_lookup_and_lock_result(tid)).test(0)
        a.delete([key(1)])
        assert a.debug_has_key(key(1))  # still locked
        time.sleep(0.3)  # never unlocked; the lock expires
        a.delete([key(1)])
        assert not a.debug_has_key(key(1))
        assert a.get_usage().total_bytes_used == 0
    finally:
        a.close()


def fi_config(**kw) -> FaultInjectL2AdapterConfig:
    d = {
        "type": "fault_inject",
        "inner": {"type": "mock", "max_size_gb": 1, "mock_bandwidth_gb": 100},
    }
    d.update(kw)
    return build_config_from_dict(FaultInjectL2AdapterConfig, d)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"inner": []}, "'inner' must be an adapter spec dict with a 'type' field"),
        ({"inner": {"type": 3}}, "'inner' adapter spec must include a string 'type'"),
        ({"rate": 1.5}, "rate must be a number in [0, 1]"),
        ({"seed": "x"}, "seed must be an integer"),
        ({"gap_indices": [-1]}, "gap_indices must be a list of non-negative integers"),
        ({"gap_tail_ratios": [2.0]}, "gap_tail_ratios must be a list of floats in [0, 1]"),
    ],
)
def test_fault_inject_config_errors(kw, msg):
    with pytest.raises(ValueError) as exc:
        fi_config(**kw)
    assert str(exc.value).startswith(msg)


def test_inner_keeps_its_own_eviction_block():
    cfg = fi_config(
        inner={
            "type": "mock",
            "max_size_gb": 1,
            "mock_bandwidth_gb": 1,
            "eviction": {"eviction_policy": "LRU"},
        }
    )
    assert cfg.inner.eviction_config.eviction_policy == "LRU"


def test_rate_zero_passes_through_and_gaps_clear_only_load_bits(caplog):
    with caplog.at_level(logging.WARNING):
        a = create_l2_adapter_from_registry(fi_config(gap_indices=[1]))
    assert isinstance(a, FaultInjectL2Adapter)
    assert any("fault_inject" in r.getMessage() for r in caplog.records)
    try:
        keys = [key(i) for i in range(3)]
        store(a, keys)
        tid = a.submit_lookup_and_lock_task(keys)
        assert (
            wait_result(lambda: a.query_lookup_and_lock_result(tid)).popcount() == 3
        )  # lookups intact
        objs = [BytesBufferMemoryObj(bytes(100)) for _ in keys]
        tid = a.submit_load_task(keys, objs)
        bm = wait_result(lambda: a.query_load_result(tid))
        assert repr(bm) == "101"
        assert a.get_usage().total_bytes_used == 300  # delegated accounting
    finally:
        a.close()


def test_tail_ratio_positions_scale_with_batch():
    cfg = fi_config(gap_tail_ratios=[0.0, 1.0, 0.5])
    assert dropped_positions(cfg, [key(i) for i in range(5)]) == {4, 0, 2}
    assert dropped_positions(cfg, [key(i) for i in range(9)]) == {8, 0, 4}
    assert dropped_positions(cfg, [key(0)]) == {0}
    assert dropped_positions(cfg, []) == set()


def test_rate_bucket_is_deterministic_and_matches_the_formula():
    k = key(7, "salt")
    text = f"3:{k.chunk_hash.hex()}:m:5:1:salt"
    expected = (
        int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") % 1_000_000
    )
    assert key_bucket(3, k) == expected
    keys = [key(i) for i in range(4000)]
    a = dropped_positions(fi_config(rate=0.25, seed=11), keys)
    b = dropped_positions(fi_config(rate=0.25, seed=11), keys)
    assert a == b
    assert 0.2 < len(a) / len(keys) < 0.3
    assert dropped_positions(fi_config(rate=0.0), keys) == set()
    assert len(dropped_positions(fi_config(rate=1.0), keys)) == len(keys)


def test_mock_lists_keys_in_pages():
    a = MockL2Adapter(MockL2AdapterConfig(1.0, 100.0))
    try:
        store(a, [key(i) for i in range(5)])
        first = a.list_l2_keys(page_size=2)
        assert len(first.entries) == 2 and first.next_page_token is not None
        seen = list(first.entries)
        page = first
        while page.next_page_token:
            page = a.list_l2_keys(page_size=2, cursor=page.next_page_token)
            seen += page.entries
        assert sorted(e.key.to_object_key().chunk_hash for e in seen) == [
            key(i).chunk_hash for i in range(5)
        ]
        assert all(e.size_bytes == 100 for e in seen)
        assert a.list_l2_keys(model_name="other").entries == []
        with pytest.raises(ValueError, match=r"^page_size must be positive \(got 0\)"):
            a.list_l2_keys(page_size=0)
        with pytest.raises(ValueError, match="cursor"):
            a.list_l2_keys(cursor="zz")
    finally:
        a.close()
