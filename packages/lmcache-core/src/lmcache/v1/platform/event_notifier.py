"""Thread wake-up notifiers (not device specific): eventfd on Linux, a pipe elsewhere.

A notifier is binary: several ``notify()`` calls coalesce into one readable state and
``consume()`` drains it. ``fileno()`` is what callers register with ``select``/``poll``.
"""

from __future__ import annotations

import abc
import errno
import os

HAS_EVENTFD: bool = hasattr(os, "eventfd")


def consume_fd(fd: int) -> None:
    """Drain a readable, non-blocking eventfd or pipe; nothing to read is fine."""
    while True:
        try:
            if not os.read(fd, 4096):
                return
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return
            raise


class EventNotifier(abc.ABC):
    """Wakes a thread blocked in select/poll on :meth:`fileno`."""

    @abc.abstractmethod
    def fileno(self) -> int:
        """The fd to poll; it stays readable from :meth:`notify` until :meth:`consume`."""

    @abc.abstractmethod
    def notify(self) -> None:
        """Make the fd readable; never blocks, safe from any thread, and repeated notifies
        before a consume collapse into one wake-up."""

    @abc.abstractmethod
    def consume(self) -> None:
        """Reset the fd to not readable (the woken thread calls it before collecting the
        work it was woken for); a no-op when nothing was notified."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the fd(s); idempotent. The fd number may be reused afterwards."""

    def __enter__(self) -> EventNotifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EventfdNotifier(EventNotifier):
    """Linux ``eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)``."""

    def __init__(self) -> None:
        if not HAS_EVENTFD:
            raise OSError("eventfd is not available on this platform")
        self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._closed = False

    def fileno(self) -> int:
        return self._fd

    def notify(self) -> None:
        try:
            os.eventfd_write(self._fd, 1)
        except BlockingIOError:
            pass  # counter saturated: already readable

    def consume(self) -> None:
        try:
            os.eventfd_read(self._fd)
        except BlockingIOError:
            pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._fd)


class PipeNotifier(EventNotifier):
    """Portable fallback: a non-blocking pipe; ``fileno`` is the read end."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._closed = False

    def fileno(self) -> int:
        return self._r

    def notify(self) -> None:
        try:
            os.write(self._w, b"\x01")
        except BlockingIOError:
            pass  # pipe full: already readable

    def consume(self) -> None:
        consume_fd(self._r)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._r)
            os.close(self._w)


def create_event_notifier() -> EventNotifier:
    """An eventfd notifier where the OS has one, else a pipe notifier."""
    if HAS_EVENTFD:
        try:
            return EventfdNotifier()
        except OSError:
            pass
    return PipeNotifier()
