"""NativeConnectorL2Adapter with a pure-Python connector
(docs/design/storage-engine.md#native-contract, docs/design/storage-engine.md#native-bridge)."""

from __future__ import annotations

import logging
import os
import select
import threading
import time

import pytest
import torch

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L2AdapterListener
from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import NativeConnectorL2Adapter
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform.event_notifier import consume_fd


class FakeConnector:
    """Native contract in Python: completions are produced by a worker thread."""

    def __init__(self, with_delete: bool = True, fail_submit: bool = False) -> None:
        self.data: dict[str, bytes] = {}
        self.calls: list[tuple[str, list[str]]] = []
        self.sent_lengths: list[int] = []
        self.sent_ptrs: list[int] = []
        self._done: list = []
        self._mu = threading.Lock()
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self._fid = 0
        self.closed = 0
        self.fail_submit = fail_submit
        self.hold = threading.Event()
        self.hold.set()
        if not with_delete:
            self.submit_batch_delete = None  # type: ignore[assignment]

    def event_fd(self):
        return self._r

    def _later(self, fn):
        with self._mu:
            self._fid += 1
            fid = self._fid

        def run():
            self.hold.wait()
            ok, bools = fn()
            with self._mu:
                self._done.append((fid, ok, "", bools))
            os.write(self._w, b"x")

        threading.Thread(target=run, daemon=True).start()
        return fid

    def _check(self, op, keys):
        if self.fail_submit:
            raise RuntimeError("backend exploded")
        if not keys:
            raise RuntimeError("keys list is empty")
        self.calls.append((op, list(keys)))

    def submit_batch_set(self, keys, views):
        self._check("set", keys)
        self.sent_lengths += [len(v) for v in views]
        snap = [bytes(v) for v in views]

        def fn():
            for k, b in zip(keys, snap, strict=False):
                self.data[k] = b
            return True, None

        return self._later(fn)

    def submit_batch_get(self, keys, views):
        self._check("get", keys)

        def fn():
            out = []
            for k, v in zip(keys, views, strict=False):
                b = self.data.get(k)
                if b is None or len(b) < len(v):
                    out.append(False)
                    continue
                v[:] = b[: len(v)]
                out.append(True)
            return True, out

        return self._later(fn)

    def submit_batch_exists(self, keys):
        self._check("exists", keys)
        return self._later(lambda: (True, [k in self.data for k in keys]))

    def submit_batch_delete(self, keys):
        self._check("delete", keys)
        return self._later(lambda: (True, [self.data.pop(k, None) is not None for k in keys]))

    def drain_completions(self):
        consume_fd(self._r)
        with self._mu:
            out, self._done = self._done, []
        return out

    def close(self):
        self.closed += 1


def key(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(ObjectKey.IntHash2Bytes(i), "model", 0, cache_salt=salt)


def obj(nbytes: int = 400, phy: int | None = None, fill: int = 0) -> TensorMemoryObj:
    phy = phy or nbytes
    raw = torch.full((phy,), 0xAB, dtype=torch.uint8)
    raw[:nbytes] = fill
    meta = MemoryObjMetadata(torch.Size([nbytes]), torch.uint8, 0, phy, 1)
    return TensorMemoryObj(raw, meta)


def wait_result(fd: int, poll, timeout: float = 5.0):
    deadline = time.monotonic() + timeout  # a bound on waiting, not a speed check
    while time.monotonic() < deadline:
        res = poll()
        if res is not None:
            return res
        select.select([fd], [], [], 0.05)
        consume_fd(fd)
    raise AssertionError("no result")


_RESULTS: dict = {}
_RESULTS_LOCK = threading.Lock()


def store(a, keys, objs):
    """Submit and wait; results are shared because ``pop`` returns every finished task."""
    tid = a.submit_store_task(keys, objs)

    def poll():
        with _RESULTS_LOCK:
            for t, r in a.pop_completed_store_tasks().items():
                _RESULTS[(id(a), t)] = r
            return _RESULTS.pop((id(a), tid), None)

    return tid, wait_result(a.get_store_event_fd(), poll)


def lookup(a, keys):
    tid = a.submit_lookup_and_lock_task(keys, None)
    return tid, wait_result(
        a.get_lookup_and_lock_event_fd(), lambda: a.query_lookup_and_lock_result(tid)
    )


def load(a, keys, objs):
    tid = a.submit_load_task(keys, objs)
    return wait_result(a.get_load_event_fd(), lambda: a.query_load_result(tid))


@pytest.fixture
def conn():
    return FakeConnector()


@pytest.fixture
def bridge(conn):
    a = NativeConnectorL2Adapter(conn, max_capacity_gb=2000 / (1 << 30))
    yield a
    a.close()


def test_fds_distinct_and_demux_thread(bridge):
    fds = {
        bridge.get_store_event_fd(),
        bridge.get_lookup_and_lock_event_fd(),
        bridge.get_load_event_fd(),
    }
    assert len(fds) == 3
    assert any(t.name == "l2-adapter-demux" for t in threading.enumerate())
    st = bridge.report_status()
    assert st["is_healthy"] is True and st["type_name"] == "FakeConnector"


def test_store_lookup_load_unlock(bridge, conn):
    t1, res = store(bridge, [key(1)], [obj(fill=7)])
    assert res.is_successful() and res.bytes_transferred() == 400
    assert bridge.pop_completed_store_tasks() == {}  # popped once
    assert t1 not in bridge.pop_completed_store_tasks()
    assert conn.calls[0] == ("set", ["model@00000000@0@00000001"])
    t2, bm = lookup(bridge, [key(1), key(2)])
    assert (bm.test(0), bm.test(1)) == (True, False)
    assert bridge.query_lookup_and_lock_result(t2) is None  # once
    assert bridge.query_lookup_and_lock_result(99999) is None
    assert len({t1, t2}) == 2
    dst = obj(fill=0)
    bm = load(bridge, [key(1)], [dst])
    assert bm.test(0) is True and torch.all(dst.tensor == 7)
    miss = load(bridge, [key(2)], [obj()])
    assert miss.test(0) is False
    bridge.submit_unlock([key(1), key(42)])  # unknown keys are harmless
    assert bridge.lock_count(key(1)) == 0


def test_usage_and_no_double_counting(bridge):
    assert NativeConnectorL2Adapter(FakeConnector()).get_usage().usage_fraction == -1.0
    store(bridge, [key(1)], [obj()])
    assert bridge.get_usage().usage_fraction == pytest.approx(0.2)
    store(bridge, [key(1)], [obj()])  # re-store
    assert bridge.get_usage().total_bytes_used == 400
    bridge.delete([key(1)])
    assert bridge.get_usage().total_bytes_used == 0


def test_delete_variants(bridge, conn):
    store(bridge, [key(1), key(2), key(3)], [obj(), obj(), obj()])
    bridge.delete([])  # empty: no connector call
    bridge.delete([key(9)])  # nonexistent
    _, bm = lookup(bridge, [key(1)])  # lock key 1
    bridge.delete([key(1), key(2), key(3)])
    assert set(conn.data) == {"model@00000000@0@00000001"}  # the locked key was skipped
    bridge.submit_unlock([key(1)])
    bridge.delete([key(1)])
    assert conn.data == {}


def test_listener_sees_stored_and_deleted_sizes(bridge):
    events = []

    class L(L2AdapterListener):
        def on_l2_keys_stored(self, keys, sizes):
            events.append(("stored", sizes))

        def on_l2_keys_deleted(self, keys):
            events.append(("deleted", len(keys)))

        def on_l2_keys_accessed(self, keys):
            events.append(("accessed", len(keys)))

    bridge.register_listener(L())
    store(bridge, [key(1)], [obj()])
    store(bridge, [key(1)], [obj()])
    load(bridge, [key(1)], [obj()])
    bridge.delete([key(1)])
    assert events == [("stored", [400]), ("stored", [0]), ("accessed", 1), ("deleted", 1)]


def test_without_delete_is_noop():
    c = FakeConnector(with_delete=False)
    a = NativeConnectorL2Adapter(c)
    try:
        store(a, [key(1)], [obj()])
        a.delete([key(1)])
        assert len(c.data) == 1
    finally:
        a.close()


def test_empty_key_lists_complete_locally(bridge, conn):
    _, res = store(bridge, [], [])
    assert res.is_successful() and res.bytes_transferred() == 0
    _, bm = lookup(bridge, [])
    assert bm.size() == 0
    assert conn.calls == []


def test_raising_submit_is_a_failed_completion():
    a = NativeConnectorL2Adapter(FakeConnector(fail_submit=True))
    try:
        _, res = store(a, [key(1)], [obj()])
        assert not res.is_successful()
        _, bm = lookup(a, [key(1)])
        assert bm.popcount() == 0
    finally:
        a.close()


def test_padding_sends_full_zeroed_slot_zero_copy():
    c = FakeConnector()
    a = NativeConnectorL2Adapter(c, max_capacity_gb=1.0, pad_buffers_to_alignment=True)
    try:
        o = obj(4000, phy=4096, fill=1)
        assert bool(torch.all(o.raw_tensor[4000:] == 0xAB))  # stale allocator bytes
        store(a, [key(1)], [o])
        assert c.sent_lengths == [4096]
        assert bool(torch.all(o.raw_tensor[4000:] == 0))  # zeroed in place: zero-copy view
        assert c.data["model@00000000@0@00000001"][4000:] == bytes(96)
        assert a.get_usage().total_bytes_used == 4096
        # a file longer than the destination loads its first len(buffer) bytes
        dst = obj(4000, phy=4096)
        assert load(a, [key(1)], [dst]).test(0)
    finally:
        a.close()
    c2 = FakeConnector()
    b = NativeConnectorL2Adapter(c2)
    try:
        store(b, [key(1)], [obj(4000, phy=4096)])
        assert c2.sent_lengths == [4000]
    finally:
        b.close()


def test_close_is_idempotent_and_wakes_delete():
    c = FakeConnector()
    a = NativeConnectorL2Adapter(c)
    store(a, [key(1)], [obj()])
    c.hold.clear()  # the next completion never arrives
    t = threading.Thread(target=a.delete, args=([key(1)],))
    t.start()
    time.sleep(0.1)
    a.close()
    t.join(timeout=5)
    assert not t.is_alive()
    a.close()
    assert c.closed == 1
    assert a.report_status()["is_healthy"] is False


def test_demux_errors_mark_unhealthy_and_loop_continues(caplog):
    c = FakeConnector()
    real = c.drain_completions
    n = {"calls": 0}

    def flaky():
        n["calls"] += 1
        if n["calls"] == 1:
            consume_fd(c._r)
            os.write(c._w, b"x")  # stay readable so the loop runs again
            raise RuntimeError("drain failed")
        return real()

    c.drain_completions = flaky
    a = NativeConnectorL2Adapter(c)
    try:
        with caplog.at_level(logging.ERROR):
            _, res = store(a, [key(1)], [obj()])
        assert res.is_successful()
        assert a.report_status()["demux_errors"] == 0 or n["calls"] > 1
    finally:
        a.close()


def test_concurrent_submitters(bridge):
    errors = []

    def worker(base):
        try:
            for i in range(20):
                k = key(base * 100 + i)
                _, r = store(bridge, [k], [obj(fill=base)])
                assert r.is_successful()
                _, bm = lookup(bridge, [k])
                assert bm.test(0)
                bridge.submit_unlock([k])
        except Exception as exc:
            errors.append(exc)

    ts = [threading.Thread(target=worker, args=(b,)) for b in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


def test_padding_applies_to_stores_only_short_value_loads():
    """docs/design/storage-formats.md#value-bytes: a value written without padding (shorter than the
    slot) is a hit for a padding bridge, which reads with the logical size; stores still send the
    full slot."""
    c = FakeConnector()
    a = NativeConnectorL2Adapter(c, max_capacity_gb=1.0, pad_buffers_to_alignment=True)
    try:
        c.data["model@00000000@0@00000001"] = bytes([5]) * 4000  # unpadded writer
        dst = obj(4000, phy=4096)
        assert load(a, [key(1)], [dst]).test(0) is True
        assert bool(torch.all(dst.tensor == 5))
        assert bool(torch.all(dst.raw_tensor[4000:] == 0xAB))  # slot tail untouched
        store(a, [key(2)], [obj(4000, phy=4096, fill=3)])
        assert c.sent_lengths == [4096]
    finally:
        a.close()


def test_record_known_keys_and_known_key_sizes(bridge, conn):
    stored = []

    class L(L2AdapterListener):
        def on_l2_keys_stored(self, keys, sizes):
            stored.append((list(keys), list(sizes)))

        def on_l2_keys_deleted(self, keys):
            pass

        def on_l2_keys_accessed(self, keys):
            pass

    bridge.register_listener(L())
    store(bridge, [key(1)], [obj(400)])
    assert bridge.record_known_keys([key(1), key(2)], [999, 300]) == [key(2)]
    assert stored[-1] == ([key(2)], [300])  # key 1 keeps its first size, no event
    assert dict(bridge.known_key_sizes()) == {key(1): 400, key(2): 300}
    assert bridge.get_usage().total_bytes_used == 700
    assert bridge.record_known_keys([key(2)], [300]) == []
    with pytest.raises(ValueError, match="2 keys but 1 sizes"):
        bridge.record_known_keys([key(3), key(4)], [1])
    conn.data["model@00000000@0@00000002"] = b"x"  # the scanned file exists
    bridge.delete([key(2)])
    assert bridge.get_usage().total_bytes_used == 400


def test_lock_ttl_expiry_lets_delete_proceed(monkeypatch):
    from lmcache.v1.distributed.l2_adapters import utils

    monkeypatch.setattr(utils, "L2_LOCK_TTL_SECONDS", 0.2)
    c = FakeConnector()
    a = NativeConnectorL2Adapter(c)
    try:
        store(a, [key(1)], [obj()])
        _, bm = lookup(a, [key(1)])
        assert bm.test(0) and a.lock_count(key(1)) == 1
        a.delete([key(1)])
        assert len(c.data) == 1  # locked: skipped
        time.sleep(0.3)  # the unlock is lost; the TTL frees the key
        assert a.lock_count(key(1)) == 0
        a.delete([key(1)])
        assert c.data == {}
    finally:
        a.close()


class PerKeySetConnector(FakeConnector):
    """A connector whose sets fail key by key and say which keys landed (mooncake_store's way):
    keys ending in an even digit land, the others fail."""

    def submit_batch_set(self, keys, views):
        self._check("set", keys)
        snap = [bytes(v) for v in views]

        def fn():
            landed = [k[-1] in "02468" for k in keys]
            for k, b, ok in zip(keys, snap, landed, strict=True):
                if ok:
                    self.data[k] = b
            return all(landed), landed

        return self._later(fn)


def test_a_failed_set_with_per_key_results_charges_only_the_landed_keys():
    conn = PerKeySetConnector()
    a = NativeConnectorL2Adapter(conn)
    try:
        _, res = store(a, [key(1), key(2), key(4)], [obj(), obj(), obj()])
        assert not res.is_successful()
        assert a.known_key_sizes() == [(key(2), 400), (key(4), 400)]
        assert a.get_usage().total_bytes_used == 800
        _, res = store(a, [key(2), key(6)], [obj(), obj()])  # every key lands: success
        assert res.is_successful() and res.bytes_transferred() == 400  # key 2 was there
    finally:
        a.close()
