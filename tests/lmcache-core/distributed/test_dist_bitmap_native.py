"""Bitmap, TTLLock, PeriodicEventNotifier and fold/unfold
(docs/design/storage-engine.md#data-model)."""

from __future__ import annotations

import select
import time

import pytest

import lmcache.native_storage_ops as nso
from lmcache.lmcache_native import (
    Bitmap,
    PeriodicEventNotifier,
    TTLLock,
    fold,
    fold_grouped,
    unfold,
    unfold_grouped,
)
from lmcache.v1.platform.event_notifier import create_event_notifier


def bm_from(bits: str) -> Bitmap:
    b = Bitmap(len(bits))
    b.batched_set(i for i, c in enumerate(bits) if c == "1")
    return b


def test_constructors_and_bit_ops():
    b = Bitmap(10, 3)
    assert repr(b) == "1110000000"
    b.set(5)
    b.clear(0)
    assert b.test(0) is False and b.test(5) is True and b.test(1) is True
    b.set_range(8, 100)  # end clamped
    assert repr(b) == "0110010011"
    assert b.size() == b.len() == len(b) == 10


def test_queries():
    b = bm_from("1110100")
    assert b.popcount() == 4
    assert b.count_leading_ones() == 3
    assert b.count_leading_zeros() == 0
    assert bm_from("0001").count_leading_zeros() == 3
    assert b.highest_set_bit() == 4
    assert Bitmap(8).highest_set_bit() == -1
    assert Bitmap(4, 4).count_leading_ones() == 4
    c = b.copy()
    c.clear(0)
    assert b.test(0) is True


def test_operators_truncate_to_shorter():
    a = bm_from("1100")
    b = bm_from("101")
    assert repr(a & b) == "100"
    assert repr(a | b) == "111"
    assert repr(~a) == "0011"


def test_extraction():
    b = bm_from("0101")
    assert b.get_indices_list() == [1, 3]
    assert b.get_indices_set() == {1, 3}
    assert b.gather(["a", "b", "c", "d"]) == ["b", "d"]


@pytest.mark.parametrize("op", ["set", "clear", "test"])
def test_out_of_range_raises_index_error(op):
    b = Bitmap(4)
    with pytest.raises(IndexError):
        getattr(b, op)(4)
    with pytest.raises(IndexError):
        getattr(b, op)(-1)


def test_native_storage_ops_reexports_same_objects():
    assert nso.Bitmap is Bitmap and nso.fold is fold and nso.TTLLock is TTLLock


def test_ttl_lock_counts_and_expiry():
    lk = TTLLock(ttl_second=1.0)  # long enough that a loaded machine cannot expire it early
    lk.lock()
    lk.lock()
    assert lk.is_locked()
    lk.unlock()
    assert lk.is_locked()
    lk.unlock()
    lk.unlock()  # never below 0
    assert not lk.is_locked()
    short = TTLLock(ttl_second=0.05)
    short.lock()
    time.sleep(0.08)
    assert not short.is_locked()  # expired
    assert short.is_expired()
    short.lock()  # restarts at 1 after expiry
    short.unlock()
    assert not short.is_locked()
    lk.lock()
    lk.reset()
    assert not lk.is_locked()


def test_periodic_event_notifier_signals_registered_notifiers():
    PeriodicEventNotifier.shutdown()
    n = create_event_notifier()
    try:
        p = PeriodicEventNotifier.create(5, True)
        assert PeriodicEventNotifier.get() is p
        p.register_fd(n)
        r, _, _ = select.select([n.fileno()], [], [], 2.0)
        assert r
        p.set_interval_ms(0)
        assert p.interval_ms == 1
        p.unregister_fd(n)
    finally:
        PeriodicEventNotifier.shutdown()
        n.close()
    assert PeriodicEventNotifier.get() is None


def test_periodic_event_notifier_sleeps_while_idle_and_wakes_on_register():
    """With nothing registered the timer thread waits for a registration (no idle ticks);
    a later registration is still signalled, and shutdown ends an idle thread."""
    PeriodicEventNotifier.shutdown()
    n = create_event_notifier()
    p = PeriodicEventNotifier.create(5, True)
    try:
        assert not select.select([n.fileno()], [], [], 0.05)[0]  # not registered: no signal
        p.register_fd(n)
        assert select.select([n.fileno()], [], [], 2.0)[0]
        p.unregister_fd(n)
        n.consume()
    finally:
        PeriodicEventNotifier.shutdown()
        n.close()
    p._thread.join(timeout=2)
    assert not p._thread.is_alive()


def test_fold_full_prefix_and_gap():
    rows = [bm_from("1111"), bm_from("1111")]
    assert repr(fold(rows, 4, 2, [-1])) == "11111"
    gap = [bm_from("1101"), bm_from("1111")]
    out = fold(gap, 4, 2, [-1])
    assert repr(out) == "11100"  # prefix 0..2 only
    assert out.test(0) is True


def test_fold_missing_rank_shard_breaks_the_chunk():
    rows = [bm_from("1111"), bm_from("1011")]  # rank 1 lacks chunk 1
    assert fold(rows, 4, 2, [-1]).highest_set_bit() == 1


def test_fold_sliding_window():
    # group 0 full attention, group 1 window 2: needs only the last two chunks
    rows = [bm_from("1111"), bm_from("0011")]
    out = fold(rows, 4, 1, [-1, 2])
    assert out.test(4) is True and out.test(3) is False and out.test(0) is True
    assert [repr(b) for b in unfold(4, 4, 1, [-1, 2])] == ["1111", "0011"]


def test_grouped_variants():
    rows = [bm_from("1110"), bm_from("0110")]
    out = fold_grouped(rows, [0, 2])
    assert out.test(3) is True and out.test(2) is False
    assert [repr(b) for b in unfold_grouped(3, 4, [0, 2])] == ["1110", "0110"]


def test_fold_fast_path_matches_brute_force():
    import random

    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(0, 12)
        rows = [bm_from("".join(rng.choice("1111110") for _ in range(n))) for _ in range(3)]
        out = fold_grouped(rows, [-1, 0, -1])
        for hit in range(n + 1):
            expected = all(all(r.test(c) for c in range(hit)) for r in rows)
            assert out.test(hit) is expected
