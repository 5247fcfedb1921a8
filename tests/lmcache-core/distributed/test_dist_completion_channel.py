"""CompletionChannel(s): the completion half every Python L2 adapter shares."""

from __future__ import annotations

import select

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.utils import CompletionChannel, CompletionChannels
from lmcache.v1.platform.event_notifier import consume_fd


def _readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_a_result_wakes_the_fd_and_is_handed_out_once():
    ch = CompletionChannel()
    try:
        assert not _readable(ch.fileno())
        ch.complete(7, "done")
        assert _readable(ch.fileno())
        consume_fd(ch.fileno())
        assert ch.take(7) == "done"
        assert ch.take(7) is None
        ch.complete(1, "a")
        ch.complete(2, "b")
        assert ch.take_all() == {1: "a", 2: "b"}
        assert ch.take_all() == {}
    finally:
        ch.close()


def test_completing_after_close_keeps_the_result_and_wakes_nobody():
    ch = CompletionChannel()
    ch.close()
    ch.complete(3, "late")  # a worker finishing after close() must not raise
    ch.wake()
    ch.close()
    assert ch.take(3) == "late"


class _Adapter(CompletionChannels):
    def __init__(self) -> None:
        self._open_channels()


def test_the_mixin_serves_the_interface_from_three_distinct_channels():
    a = _Adapter()
    try:
        fds = {a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()}
        assert len(fds) == 3
        a._store_channel.complete(1, L2StoreResult(True, 10))
        a._lookup_channel.complete(2, Bitmap(3))
        a._load_channel.complete(3, Bitmap(1))
        assert _readable(a.get_store_event_fd()) and _readable(a.get_load_event_fd())
        assert a.pop_completed_store_tasks()[1].bytes_transferred() == 10
        assert a.query_lookup_and_lock_result(2).size() == 3
        assert a.query_lookup_and_lock_result(2) is None
        assert a.query_load_result(3).size() == 1
    finally:
        a._close_channels()
