"""SerdeL2AdapterWrapper (docs/design/storage-engine.md#l2-wrappers) and the serde factory, with
real threads, a real mock adapter and real L1 memory."""

from __future__ import annotations

import pytest
import torch
from testsupport.waiting import eventually, wait_result

from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
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
from lmcache.v1.distributed.l1_manager import L1Manager
from lmcache.v1.distributed.l2_adapters.config import L2AdaptersConfig, parse_l2_adapter_dict
from lmcache.v1.distributed.l2_adapters.mock_l2_adapter import MockL2Adapter, MockL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper
from lmcache.v1.distributed.serde import (
    AsyncSerdeProcessor,
    SerdeConfig,
    create_serde_processor,
    get_registered_serde_types,
    register_serde_factory,
)
from lmcache.v1.distributed.serde.identity import IdentityDeserializer, IdentitySerializer
from lmcache.v1.distributed.storage_manager import StorageManager

LAYOUT = MemoryLayoutDesc([torch.Size([1024])], [torch.float32])  # 4 KiB objects
KV = ObjectKey.ComputeKVRank(1, 0, 1, 0)


def key(i: int) -> ObjectKey:
    return ObjectKey(ObjectKey.IntHash2Bytes(i), "model", KV)


class ExplodingSerializer(IdentitySerializer):
    """Fails on objects whose first byte is 0xEE."""

    def serialize(self, src, dst, key):
        if src.byte_array[0] == 0xEE:
            raise RuntimeError("boom")
        return super().serialize(src, dst, key)


class ExplodingDeserializer(IdentityDeserializer):
    fail_loads = False

    def deserialize(self, src, dst, key):
        if self.fail_loads:
            raise RuntimeError("boom on load")
        super().deserialize(src, dst, key)


def _exploding(kwargs):
    return AsyncSerdeProcessor(ExplodingSerializer(), ExplodingDeserializer())


if "exploding_test" not in get_registered_serde_types():
    register_serde_factory("exploding_test", _exploding)


@pytest.fixture
def l1():
    mem = L1MemoryManagerConfig(256 * 4096, use_lazy=False, align_bytes=4096, shm_name="")
    m = L1Manager(L1ManagerConfig(mem))
    yield m
    m.close()


def l1_objects(l1: L1Manager, keys, fill):
    """Resident L1 objects (the store controller's situation): reserved, filled, finished."""
    res = l1.reserve_write(keys, [False] * len(keys), LAYOUT, "t")
    objs = [res[k][1] for k in keys]
    for i, o in enumerate(objs):
        fill(i, o)
    l1.finish_write(keys, "t")
    return objs


def staging(l1: L1Manager, keys):
    """Load destinations, as the prefetch controller reserves them (keys not resident)."""
    l1.delete(keys, force=True)
    res = l1.reserve_write(keys, [True] * len(keys), LAYOUT, "load")
    return [res[k][1] for k in keys]


def make_wrapper(l1: L1Manager, serde_name: str = "identity"):
    inner = MockL2Adapter(MockL2AdapterConfig(1.0, 100.0))
    serde = create_serde_processor(SerdeConfig(serde_name))
    return inner, SerdeL2AdapterWrapper(inner, serde, l1, serde_name=serde_name)


def store(w, keys, objs):
    tid = w.submit_store_task(keys, objs)
    return wait_result(lambda: w.pop_completed_store_tasks().get(tid))


def lookup(w, keys):
    tid = w.submit_lookup_and_lock_task(keys)
    return wait_result(lambda: w.query_lookup_and_lock_result(tid))


def load(w, keys, objs):
    tid = w.submit_load_task(keys, objs)
    return wait_result(lambda: w.query_load_result(tid))


def random_fill(i, o):
    o.tensor.copy_(torch.randn(1024, generator=torch.Generator().manual_seed(i)))


def compressible_fill(i, o):
    o.tensor.fill_(float(i))


STORED_BYTES = {"identity": 4096, "checksum": 4096 + 32, "fp8": 1024}


@pytest.mark.parametrize("serde_name", ["identity", "checksum", "fp8"])
def test_round_trip_through_wrapper(l1, serde_name):
    inner, w = make_wrapper(l1, serde_name)
    try:
        keys = [key(i) for i in range(4)]
        src = l1_objects(l1, keys, random_fill)
        r = store(w, keys, src)
        assert r.is_successful()
        assert all(inner.debug_has_key(k) for k in keys)
        stored = inner.debug_used_bytes()
        assert stored == 4 * STORED_BYTES[serde_name]  # the inner adapter holds what was written
        assert w.get_usage().total_bytes_used == stored  # usage is the inner adapter's
        assert repr(lookup(w, keys + [key(99)])) == "11110"
        if serde_name == "fp8":
            expected = [
                o.tensor.to(torch.float8_e4m3fn).to(torch.float32).numpy().tobytes() for o in src
            ]
        else:
            expected = [bytes(o.byte_array) for o in src]
        dst = staging(l1, keys)
        bm = load(w, keys, dst)
        assert repr(bm) == "1111"
        assert [bytes(d.byte_array) for d in dst] == expected
        w.submit_unlock(keys)
        l1.finish_write_and_delete(keys, "load")
        assert l1.get_staging_memory_usage() == 0  # every temporary was freed
        assert l1.memcheck()
    finally:
        w.close()


def test_serialisation_error_fails_only_that_task(l1):
    inner, w = make_wrapper(l1, "exploding_test")
    try:
        good = [key(i) for i in range(2)]
        bad = [key(10 + i) for i in range(2)]
        gobjs = l1_objects(l1, good, compressible_fill)
        bobjs = l1_objects(l1, bad, lambda i, o: o.byte_array.__setitem__(0, 0xEE if i else 1))
        r_bad = store(w, bad, bobjs)
        assert not r_bad.is_successful()
        assert not inner.debug_has_key(bad[0])  # the task failed as a whole
        r_good = store(w, good, gobjs)
        assert r_good.is_successful() and all(inner.debug_has_key(k) for k in good)
        # a deserialisation error fails that load task as a whole; the wrapper keeps going
        w._serde.deserializer.fail_loads = True
        assert repr(load(w, good, staging(l1, good))) == "00"
        l1.finish_write_and_delete(good, "load")
        w._serde.deserializer.fail_loads = False
        assert repr(load(w, good, staging(l1, good))) == "11"
        l1.finish_write_and_delete(good, "load")
        st = w.report_status()
        assert st["serde"] == "exploding_test" and st["serde_failed_tasks"] == 2
        assert st["is_healthy"] and st["type_name"] == "mock"
        assert l1.get_staging_memory_usage() == 0
    finally:
        w.close()


def test_lookup_unlock_delete_pass_through(l1):
    inner, w = make_wrapper(l1)
    try:
        keys = [key(i) for i in range(3)]
        store(w, keys, l1_objects(l1, keys, random_fill))
        assert repr(lookup(w, keys)) == "111"
        assert inner._locks.is_locked(keys[0])  # the lock is taken in the inner adapter
        w.delete(keys)  # locked keys are skipped
        assert inner.debug_num_keys() == 3
        w.submit_unlock(keys)
        assert not inner._locks.is_locked(keys[0])
        w.delete(keys[:2])
        assert inner.debug_num_keys() == 1 and w.get_usage().total_bytes_used == 4096
        assert repr(lookup(w, keys)) == "001"
        # a deleted key is a clean miss on load
        assert repr(load(w, keys, staging(l1, keys))) == "001"
        l1.finish_write_and_delete(keys, "load")
    finally:
        w.close()


def test_three_distinct_fds_differ_from_inner(l1):
    inner, w = make_wrapper(l1)
    try:
        mine = {w.get_store_event_fd(), w.get_lookup_and_lock_event_fd(), w.get_load_event_fd()}
        theirs = {
            inner.get_store_event_fd(),
            inner.get_lookup_and_lock_event_fd(),
            inner.get_load_event_fd(),
        }
        assert len(mine) == 3 and not mine & theirs
    finally:
        w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.submit_store_task([], [])


def make_sm(adapter_dict) -> StorageManager:
    mem = L1MemoryManagerConfig(64 * 4096, use_lazy=False, align_bytes=4096, shm_name="")
    cfg = StorageManagerConfig(
        L1ManagerConfig(mem),
        EvictionConfig("LRU"),
        L2AdaptersConfig([parse_l2_adapter_dict(1, adapter_dict)]),
    )
    return StorageManager(cfg, eviction_interval_s=60)


@pytest.mark.parametrize("serde_name", ["identity", "checksum"])
def test_storage_manager_stores_and_prefetches_through_serde(serde_name):
    sm = make_sm(
        {
            "type": "mock",
            "max_size_gb": 0.01,
            "mock_bandwidth_gb": 100,
            "serde": {"type": serde_name},
        }
    )
    try:
        w = sm.get_l2_adapters()[0]
        assert isinstance(w, SerdeL2AdapterWrapper)
        keys = [key(i) for i in range(4)]
        objs = sm.reserve_write(keys, LAYOUT)
        for i, k in enumerate(keys):
            objs[k].tensor.fill_(float(i) + 0.5)
        sm.finish_write(keys)
        eventually(lambda: w.inner.debug_num_keys() == 4)
        sm.delete_l1_keys(keys)
        h = sm.submit_prefetch_task(PrefetchTaskSpec([GroupedObjectKeys(keys, 0, LAYOUT)]))
        assert sm.wait_prefetch_status(h, 30)
        r = sm.query_prefetch_status(h)
        assert repr(r.l2_hit_cells[0]) == "1111"
        with sm.read_prefetched_results(keys, r.l1_owners[0]) as got:
            assert [o.tensor[0].item() for o in got] == [0.5, 1.5, 2.5, 3.5]
            assert all(bool((o.tensor == o.tensor[0]).all()) for o in got)
        sm.finish_read_prefetched(keys, 1, r.l1_owners[0])
        assert sm.report_status()["l2_adapters"][0]["type"] == "mock"
        assert sm.get_l1_manager().get_staging_memory_usage() == 0
        assert sm.memcheck()
    finally:
        sm.close()


def test_unknown_serde_type_names_type_and_registered_ones():
    with pytest.raises(ValueError) as ei:
        make_sm(
            {"type": "mock", "max_size_gb": 0.01, "mock_bandwidth_gb": 1, "serde": {"type": "zstd"}}
        )
    msg = str(ei.value)
    assert "Unknown serde type 'zstd'. Registered: " in msg
    assert all(t in msg for t in ("aesgcm", "checksum", "fp8", "identity", "exploding_test"))


def test_registry_rejects_duplicates_and_bad_options():
    assert {"identity", "fp8", "aesgcm", "checksum"} <= set(get_registered_serde_types())
    with pytest.raises(ValueError, match="Serde type already registered: 'fp8'"):
        register_serde_factory("fp8", _exploding)
    with pytest.raises(ValueError, match="serde option 'max_workers' must be an integer"):
        create_serde_processor(SerdeConfig("identity", {"max_workers": "many"}))
    with pytest.raises(ValueError, match="max_workers must be >= 1"):
        create_serde_processor(SerdeConfig("identity", {"max_workers": 0}))


def test_many_tasks_in_flight_from_several_threads(l1):
    import threading

    inner, w = make_wrapper(l1, "checksum")
    try:
        groups = [[key(100 * g + i) for i in range(3)] for g in range(6)]
        objs = [
            l1_objects(l1, ks, lambda i, o, g=g: o.tensor.fill_(g * 10.0 + i))
            for g, ks in enumerate(groups)
        ]
        expected = {
            k: bytes(o.byte_array)
            for ks, os_ in zip(groups, objs, strict=True)
            for k, o in zip(ks, os_, strict=True)
        }
        tids: dict[int, int] = {}

        def submit(g):  # concurrent submitters; results are collected below
            tids[g] = w.submit_store_task(groups[g], objs[g])

        threads = [threading.Thread(target=submit, args=(g,)) for g in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(set(tids.values())) == 6
        results: dict[int, object] = {}

        def collect():
            results.update(w.pop_completed_store_tasks())
            return True if len(results) == 6 else None

        wait_result(collect)
        assert set(results) == set(tids.values())
        assert all(r.is_successful() for r in results.values())
        assert inner.debug_num_keys() == 18
        all_keys = [k for ks in groups for k in ks]
        dst = staging(l1, all_keys)
        tids = [w.submit_load_task(all_keys[i : i + 6], dst[i : i + 6]) for i in range(0, 18, 6)]
        for tid in tids:
            assert repr(wait_result(lambda tid=tid: w.query_load_result(tid))) == "111111"
        assert [bytes(d.byte_array) for d in dst] == [expected[k] for k in all_keys]
        l1.finish_write_and_delete(all_keys, "load")
        assert l1.get_staging_memory_usage() == 0
    finally:
        w.close()
