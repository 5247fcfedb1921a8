"""Storage helpers of the 0.5.x ``lmcache.lmcache_native`` surface, in pure Python.

``Bitmap`` is a fixed-size bit vector backed by one Python ``int`` (bit i of the int is
bit i of the map), so set operations, popcount and prefix scans run in C inside the int
implementation. ``TTLLock`` is a counting lock that expires; ``PeriodicEventNotifier``
wakes registered fds on a timer for adapters that cannot signal on their own.
``fold``/``unfold`` turn per-(group, rank) hit rows into prefix-hit lengths and back.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from lmcache.utils import init_logger

logger = init_logger(__name__)

__all__ = [
    "Bitmap",
    "PeriodicEventNotifier",
    "TTLLock",
    "fold",
    "fold_grouped",
    "unfold",
    "unfold_grouped",
]


class Bitmap:
    """Fixed-size bit vector; every per-key result in the storage layer is one."""

    __slots__ = ("_bits", "_size")

    def __init__(self, size: int, prefix_bits: int = 0) -> None:
        size = int(size)
        if size < 0:
            raise ValueError(f"Bitmap size must be >= 0, got {size}")
        self._size = size
        n = max(0, min(int(prefix_bits), size))
        self._bits = (1 << n) - 1

    @classmethod
    def from_int(cls, size: int, bits: int) -> Bitmap:
        """The bitmap whose bit i is bit i of ``bits`` (bits at or beyond ``size`` dropped)."""
        return cls._from_int(int(size), int(bits))

    @classmethod
    def _from_int(cls, size: int, bits: int) -> Bitmap:
        bm = cls.__new__(cls)
        bm._size = size
        bm._bits = bits & ((1 << size) - 1)
        return bm

    def _check(self, i: int) -> int:
        i = int(i)
        if i < 0 or i >= self._size:
            raise IndexError(f"Bitmap index {i} out of range for size {self._size}")
        return i

    # bit operations
    def set(self, i: int) -> None:
        """Set bit ``i``; ``IndexError`` outside ``[0, size)``."""
        self._bits |= 1 << self._check(i)

    def batched_set(self, indices: Iterable[int]) -> None:
        """Set every bit in ``indices`` (each checked like :meth:`set`)."""
        bits = self._bits
        for i in indices:
            bits |= 1 << self._check(i)
        self._bits = bits

    def set_range(self, start: int, end: int) -> None:
        """Set bits ``[start, end)``, clamped to ``[0, size)``."""
        start = max(0, int(start))
        end = min(int(end), self._size)
        if end > start:
            self._bits |= ((1 << (end - start)) - 1) << start

    def clear(self, i: int) -> None:
        """Clear bit ``i``; ``IndexError`` outside ``[0, size)``."""
        self._bits &= ~(1 << self._check(i))

    def test(self, i: int) -> bool:
        """Bit ``i`` as a real ``bool`` (callers write ``bm.test(0) is True``)."""
        return bool((self._bits >> self._check(i)) & 1)

    # queries
    def size(self) -> int:
        """Number of bits (one per key of the task)."""
        return self._size

    def len(self) -> int:
        """Same as :meth:`size` (0.5.x name)."""
        return self._size

    def __len__(self) -> int:
        return self._size

    def copy(self) -> Bitmap:
        """An independent bitmap with the same bits."""
        return Bitmap._from_int(self._size, self._bits)

    def popcount(self) -> int:
        """Number of set bits (hits)."""
        return self._bits.bit_count()

    def count_leading_ones(self) -> int:
        """Length of the run of set bits starting at bit 0 (the prefix hit length)."""
        inv = ~self._bits & ((1 << self._size) - 1)
        if inv == 0:
            return self._size
        return (inv & -inv).bit_length() - 1

    def count_leading_zeros(self) -> int:
        """Length of the run of clear bits starting at bit 0."""
        if self._bits == 0:
            return self._size
        return (self._bits & -self._bits).bit_length() - 1

    def highest_set_bit(self) -> int:
        """Index of the highest set bit, -1 when none is set."""
        return self._bits.bit_length() - 1

    # operators: binary ops truncate to the shorter operand
    def __and__(self, other: Bitmap) -> Bitmap:
        n = min(self._size, other._size)
        return Bitmap._from_int(n, self._bits & other._bits)

    def __or__(self, other: Bitmap) -> Bitmap:
        n = min(self._size, other._size)
        return Bitmap._from_int(n, self._bits | other._bits)

    def __invert__(self) -> Bitmap:
        return Bitmap._from_int(self._size, ~self._bits)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Bitmap):
            return NotImplemented
        return self._size == other._size and self._bits == other._bits

    def __hash__(self) -> int:
        return hash((self._size, self._bits))

    # extraction
    def get_indices_list(self) -> list[int]:
        """Indices of the set bits, ascending."""
        out = []
        bits = self._bits
        while bits:
            low = bits & -bits
            out.append(low.bit_length() - 1)
            bits ^= low
        return out

    def get_indices_set(self) -> set[int]:
        """Indices of the set bits as a set."""
        return set(self.get_indices_list())

    def gather(self, items: Sequence[Any]) -> list[Any]:
        """The items at the set positions (positions beyond ``len(items)`` are ignored)."""
        return [items[i] for i in self.get_indices_list() if i < len(items)]

    def to_int(self) -> int:
        """The bits as one int (bit i of the int is bit i of the map)."""
        return self._bits

    def __repr__(self) -> str:
        return "".join("1" if (self._bits >> i) & 1 else "0" for i in range(self._size))


class TTLLock:
    """Counting lock whose hold expires ``ttl_second`` after the last ``lock()``."""

    __slots__ = ("_count", "_deadline", "_ttl")

    def __init__(self, ttl_second: float = 300) -> None:
        self._ttl = float(ttl_second)
        self._count = 0
        self._deadline = 0.0

    def _expired(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self._deadline

    def lock(self, n: int = 1, now: float | None = None) -> None:
        """``now``: a ``time.monotonic()`` reading the caller already took (batch locking)."""
        if now is None:
            now = time.monotonic()
        if self._count > 0 and now >= self._deadline:
            self._count = 0
        self._count += n
        self._deadline = now + self._ttl

    def unlock(self, n: int = 1) -> None:
        self._count = max(0, self._count - n)

    def is_locked(self) -> bool:
        return self._count > 0 and not self._expired()

    def is_expired(self) -> bool:
        """True when a hold was taken and its TTL ran out."""
        return self._count > 0 and self._expired()

    def count(self) -> int:
        return self._count if not self._expired() else 0

    def reset(self) -> None:
        self._count = 0
        self._deadline = 0.0

    @property
    def ttl_second(self) -> float:
        return self._ttl


def _poke(target: Any, use_eventfd: bool) -> None:
    if hasattr(target, "notify"):
        target.notify()
    elif use_eventfd:
        try:
            os.eventfd_write(target, 1)
        except BlockingIOError:
            pass
    else:
        try:
            os.write(target, b"\x01")
        except BlockingIOError:
            pass


class PeriodicEventNotifier:
    """Process-wide timer that signals every registered fd each interval.

    ``register_fd`` takes an eventfd number (or, with ``use_eventfd=False``, the write end
    of a pipe) or any object with ``notify()`` such as an ``EventNotifier``.
    """

    _instance: PeriodicEventNotifier | None = None
    _cls_lock = threading.Lock()

    def __init__(self, interval_ms: int, use_eventfd: bool) -> None:
        self._interval_ms = max(1, int(interval_ms))
        self._use_eventfd = bool(use_eventfd)
        self._targets: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # Set while something is registered: with nothing to signal the thread sleeps instead
        # of waking every interval (200 wakes a second, each contending for the GIL, cost the
        # server's loop thread a tenth of a core for nothing).
        self._has_targets = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="lmcache-periodic-notifier", daemon=True
        )
        self._thread.start()

    @classmethod
    def create(cls, interval_ms: int = 5, use_eventfd: bool = True) -> PeriodicEventNotifier:
        with cls._cls_lock:
            if cls._instance is None:
                cls._instance = cls(interval_ms, use_eventfd)
            else:
                cls._instance.set_interval_ms(interval_ms)
            return cls._instance

    @classmethod
    def get(cls) -> PeriodicEventNotifier | None:
        return cls._instance

    @classmethod
    def shutdown(cls) -> None:
        with cls._cls_lock:
            inst, cls._instance = cls._instance, None
        if inst is not None:
            inst._stop.set()
            inst._has_targets.set()  # wake a sleeping thread so it sees the stop
            inst._thread.join(timeout=2)

    def register_fd(self, fd: Any) -> None:
        key = fd if isinstance(fd, int) else id(fd)
        with self._lock:
            self._targets[key] = fd
            self._has_targets.set()

    def unregister_fd(self, fd: Any) -> None:
        key = fd if isinstance(fd, int) else id(fd)
        with self._lock:
            self._targets.pop(key, None)
            if not self._targets:
                self._has_targets.clear()

    def set_interval_ms(self, interval_ms: int) -> None:
        self._interval_ms = max(1, int(interval_ms))

    @property
    def interval_ms(self) -> int:
        return self._interval_ms

    def _run(self) -> None:
        while not self._stop.wait(self._interval_ms / 1000.0):
            if not self._has_targets.is_set():
                self._has_targets.wait()
                continue
            with self._lock:
                targets = list(self._targets.values())
            for t in targets:
                try:
                    _poke(t, self._use_eventfd)
                except OSError:
                    pass  # a closed fd: its owner unregisters it on close


# --- prefix folding -------------------------------------------------------------------


def _needed_range(hit: int, window: int) -> tuple[int, int]:
    if window <= 0:
        return 0, hit
    return hit - min(window, hit), hit


def _prefix_ok(rows: Sequence[Bitmap], windows: Sequence[int], hit: int) -> bool:
    for row, w in zip(rows, windows, strict=False):
        lo, hi = _needed_range(hit, w)
        if hi > lo:
            if hi > row.size():
                return False
            mask = ((1 << (hi - lo)) - 1) << lo
            if row.to_int() & mask != mask:
                return False
    return True


def fold_grouped(rows: Sequence[Bitmap], windows: Sequence[int]) -> Bitmap:
    """Bit L set iff every row can serve an L-chunk prefix under its window; bit 0 always."""
    if len(rows) != len(windows):
        raise ValueError(f"fold_grouped: {len(rows)} rows but {len(windows)} windows")
    num_chunks = min((r.size() for r in rows), default=0)
    out = Bitmap(num_chunks + 1)
    out.set(0)
    if all(w <= 0 for w in windows):
        # full attention only: prefixes are monotone, so one scan per row suffices
        best = min((r.count_leading_ones() for r in rows), default=num_chunks)
        out.set_range(0, min(best, num_chunks) + 1)
        return out
    for hit in range(1, num_chunks + 1):
        if _prefix_ok(rows, windows, hit):
            out.set(hit)
    return out


def unfold_grouped(hit_length: int, num_chunks: int, windows: Sequence[int]) -> list[Bitmap]:
    """Per row, the cells needed to serve a ``hit_length`` prefix."""
    out = []
    for w in windows:
        bm = Bitmap(num_chunks)
        lo, hi = _needed_range(min(hit_length, num_chunks), w)
        bm.set_range(lo, hi)
        out.append(bm)
    return out


def _expand_windows(num_ranks: int, group_windows: Sequence[int]) -> list[int]:
    return [w for w in group_windows for _ in range(num_ranks)]


def fold(
    found: Sequence[Bitmap], num_chunks: int, num_ranks: int, group_windows: Sequence[int]
) -> Bitmap:
    """``found`` holds one row per (group, rank), group-major. A chunk counts only when all
    of its rank shards are present."""
    windows = _expand_windows(num_ranks, group_windows)
    if len(found) != len(windows):
        raise ValueError(
            f"fold: expected {len(windows)} rows ({len(group_windows)} groups x {num_ranks} ranks),"
            f" got {len(found)}"
        )
    rows = [Bitmap._from_int(num_chunks, r.to_int()) for r in found]
    return fold_grouped(rows, windows)


def unfold(
    hit_length: int, num_chunks: int, num_ranks: int, group_windows: Sequence[int]
) -> list[Bitmap]:
    return unfold_grouped(hit_length, num_chunks, _expand_windows(num_ranks, group_windows))
