"""Wake-up notifiers: binary, coalescing, drainable, distinct fds."""

from __future__ import annotations

import select
import threading

import pytest

from lmcache.v1.platform.event_notifier import (
    HAS_EVENTFD,
    EventfdNotifier,
    PipeNotifier,
    consume_fd,
    create_event_notifier,
)

NOTIFIER_TYPES = [PipeNotifier] + ([EventfdNotifier] if HAS_EVENTFD else [])


def readable(fd: int, timeout: float = 0.0) -> bool:
    ready, _, _ = select.select([fd], [], [], timeout)
    return bool(ready)


@pytest.mark.parametrize("cls", NOTIFIER_TYPES)
def test_notify_makes_readable_and_consume_drains(cls):
    with cls() as notifier:
        assert not readable(notifier.fileno())
        for _ in range(1000):  # coalesces: many notifies, one readable state
            notifier.notify()
        assert readable(notifier.fileno())
        notifier.consume()
        assert not readable(notifier.fileno())
        notifier.consume()  # nothing to consume is fine


@pytest.mark.parametrize("cls", NOTIFIER_TYPES)
def test_consume_fd_drains_raw_fd(cls):
    with cls() as notifier:
        notifier.notify()
        consume_fd(notifier.fileno())
        assert not readable(notifier.fileno())


@pytest.mark.parametrize("cls", NOTIFIER_TYPES)
def test_notify_wakes_a_blocked_thread(cls):
    with cls() as notifier:
        woke = threading.Event()

        def waiter():
            if readable(notifier.fileno(), timeout=30):
                woke.set()

        thread = threading.Thread(target=waiter)
        thread.start()
        notifier.notify()
        thread.join(timeout=30)
        assert woke.is_set()


def test_factory_prefers_eventfd_and_fds_are_distinct():
    notifiers = [create_event_notifier() for _ in range(6)]
    try:
        if HAS_EVENTFD:
            assert all(isinstance(n, EventfdNotifier) for n in notifiers)
        fds = [n.fileno() for n in notifiers]
        assert len(set(fds)) == len(fds)
    finally:
        for n in notifiers:
            n.close()


@pytest.mark.parametrize("cls", NOTIFIER_TYPES)
def test_close_is_idempotent(cls):
    notifier = cls()
    notifier.close()
    notifier.close()
