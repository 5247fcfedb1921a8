"""The poll loop of the store and prefetch controllers.

Each controller thread waits on its own notifiers plus one or more event fds of every live
adapter (store: the store fd; prefetch: the lookup and load fds). The poll set follows the
registry: it is rebuilt when ``registry.version`` changes or an adapter closes an fd.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Iterable

from lmcache.utils import init_logger
from lmcache.v1.distributed.adapter_registry import AdapterRegistry
from lmcache.v1.platform.event_notifier import EventNotifier, consume_fd

logger = init_logger(__name__)

POLL_MS = 500

# (adapter index, kind) of an adapter fd that became readable; kind names the fd slot.
FdTarget = tuple[int, str]


class AdapterFdPoller:
    """``poll()`` over ``own`` notifiers and the adapter fds named in ``fd_kinds``
    (position in ``AdapterSlot.fds`` -> kind, e.g. ``{0: "store"}``)."""

    def __init__(
        self, registry: AdapterRegistry, own: Iterable[EventNotifier], fd_kinds: dict[int, str]
    ) -> None:
        self._registry = registry
        self._own = {n.fileno(): n for n in own}
        self._fd_kinds = dict(fd_kinds)
        self._poller = select.poll()
        for fd in self._own:
            self._poller.register(fd, select.POLLIN)
        self._registered: dict[int, FdTarget] = {}
        self._version = -1

    def _refresh(self) -> None:
        if self._version == self._registry.version:
            return
        self._version = self._registry.version
        for fd in self._registered:
            self._poller.unregister(fd)
        self._registered.clear()
        for slot in self._registry.slots():
            for position, kind in self._fd_kinds.items():
                fd = slot.fds[position]
                self._registered[fd] = (slot.index, kind)
                self._poller.register(fd, select.POLLIN)

    def poll(self, timeout_ms: int = POLL_MS) -> set[FdTarget] | None:
        """Wait up to ``timeout_ms``; drain what became readable. Returns the adapter fds that
        signalled (empty when only an own notifier did), or None on a timeout."""
        self._refresh()
        events = self._poller.poll(timeout_ms)
        if not events:
            return None
        targets: set[FdTarget] = set()
        for fd, ev in events:
            if ev & select.POLLNVAL:
                self._version = -1  # an adapter closed its fd: rebuild the poll set
                continue
            own = self._own.get(fd)
            if own is not None:
                own.consume()
            elif fd in self._registered:
                consume_fd(fd)
                targets.add(self._registered[fd])
        return targets


def run_poll_loop(
    stop: threading.Event,
    poller: AdapterFdPoller,
    step: Callable[[set[FdTarget] | None], None],
    what: str,
) -> None:
    """Until ``stop`` is set: poll, then ``step(targets)`` (None after a timeout: check
    everything in flight). An error is logged and the loop goes on, so one bad adapter cannot
    stop a controller."""
    while not stop.is_set():
        try:
            step(poller.poll())
        except Exception:
            logger.exception("%s error (continuing)", what)
            time.sleep(0.05)
