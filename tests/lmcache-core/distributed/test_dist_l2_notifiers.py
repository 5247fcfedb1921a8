"""Protected notifiers of L2AdapterInterface (docs/design/storage-engine.md#l2-contract): length
checks and byte accounting."""

from __future__ import annotations

import logging

import pytest

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L2AdapterListener
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface


class _Bare(L2AdapterInterface):
    """Only the base-class accounting matters here; the I/O methods are never called."""


for _name in sorted(L2AdapterInterface.__abstractmethods__):
    setattr(_Bare, _name, lambda self, *a, **k: None)
_Bare.__abstractmethods__ = frozenset()


class _Events(L2AdapterListener):
    def __init__(self) -> None:
        self.stored: list = []
        self.deleted: list = []

    def on_l2_keys_stored(self, keys, sizes):
        self.stored.append((list(keys), list(sizes)))

    def on_l2_keys_accessed(self, keys):
        pass

    def on_l2_keys_deleted(self, keys):
        self.deleted.append(list(keys))


def key(i: int, salt: str = "") -> ObjectKey:
    return ObjectKey(ObjectKey.IntHash2Bytes(i), "m", 0, cache_salt=salt)


@pytest.fixture
def adapter():
    a = _Bare(max_capacity_bytes=1000)
    ev = _Events()
    a.register_listener(ev)
    a.events = ev
    return a


def test_length_mismatch_raises_and_changes_nothing(adapter):
    adapter._notify_keys_stored([key(1)], [100])
    with pytest.raises(ValueError, match=r"differ in length \(2 != 1\)"):
        adapter._notify_keys_stored([key(2), key(3)], [5])
    with pytest.raises(ValueError, match=r"differ in length \(1 != 2\)"):
        adapter._notify_keys_deleted([key(1)], [100, 1])
    assert adapter.get_usage().total_bytes_used == 100
    assert adapter.events.stored == [([key(1)], [100])]
    assert adapter.events.deleted == []


def test_delete_underflow_clamps_at_zero_with_warning(adapter, caplog):
    adapter._notify_keys_stored([key(1, "a"), key(2, "b")], [100, 50])
    with caplog.at_level(logging.WARNING):
        adapter._notify_keys_deleted([key(1, "a")], [300])  # more than was stored
    assert "L2 adapter byte accounting underflow" in caplog.text
    usage = adapter.get_usage()
    assert usage.total_bytes_used == 0  # 150 - 300 clamped, not negative
    assert adapter._bytes_by_cache_salt == {"b": 50}  # "a" clamped and dropped, not negative
    assert adapter.events.deleted == [[key(1, "a")]]


def test_delete_drops_emptied_salt_bucket_without_warning(adapter, caplog):
    adapter._notify_keys_stored([key(1, "a"), key(2, "b")], [100, 50])
    with caplog.at_level(logging.WARNING):
        adapter._notify_keys_deleted([key(1, "a")], [100])
    assert "underflow" not in caplog.text
    assert adapter._bytes_by_cache_salt == {"b": 50}  # "a" reached 0 and is gone
    assert adapter.get_usage().total_bytes_used == 50
    assert adapter.get_usage().usage_fraction == pytest.approx(0.05)
