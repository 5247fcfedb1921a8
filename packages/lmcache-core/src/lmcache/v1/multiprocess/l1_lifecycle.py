"""L1 chunk lifecycle for the ``/metrics`` histograms LMCache 0.5.6 exports: how long a
chunk lives in L1, how long it sat unused before it went, the gap between two uses of it,
and how soon a chunk that went is written again.

A sample of the chunks (``--metrics-sample-rate``, chosen by key hash, so one chunk is
always in or out) is followed. The L1 manager calls this listener inside its lock, so it
only records; ``drain()`` hands the observations to the metrics at scrape time.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from lmcache.v1.distributed.internal_api import L1ManagerListener

EVICT_REUSE_WAIT_S = 300.0  # a chunk not written again within this counts as this long
_SCALE = 1_000_000


class L1Lifecycle(L1ManagerListener):
    def __init__(self, sample_rate: float, clock: Any = time.monotonic) -> None:
        self._threshold = int(sample_rate * _SCALE)
        self._clock = clock
        self._alive: dict[Any, list[float]] = {}  # key -> [written at, last used at]
        self._gone: dict[Any, float] = {}  # key -> left L1 at
        self._lock = threading.Lock()
        self._out: collections.deque[tuple[str, float]] = collections.deque(maxlen=65536)

    def _sampled(self, key: Any) -> bool:
        return hash(key) % _SCALE < self._threshold

    def on_l1_keys_write_finished(self, keys: list[Any]) -> None:
        now = self._clock()
        with self._lock:
            for key in keys:
                left = self._gone.pop(key, None)
                if left is not None:
                    self._out.append(("evict_reuse_gap", min(now - left, EVICT_REUSE_WAIT_S)))
                state = self._alive.get(key)
                if state is not None:
                    self._out.append(("reuse_gap", now - state[1]))
                if state is not None or self._sampled(key):
                    self._alive[key] = [now, now]
            self._expire(now)

    on_l1_keys_finish_write_and_reserve_read = on_l1_keys_write_finished

    def on_l1_keys_read_finished(self, keys: list[Any]) -> None:
        now = self._clock()
        with self._lock:
            for key in keys:
                state = self._alive.get(key)
                if state is not None:
                    self._out.append(("reuse_gap", now - state[1]))
                    state[1] = now

    def on_l1_keys_deleted_by_manager(self, keys: list[Any]) -> None:
        now = self._clock()
        with self._lock:
            for key in keys:
                state = self._alive.pop(key, None)
                if state is not None:
                    self._out.append(("lifetime", now - state[0]))
                    self._out.append(("idle_before_evict", now - state[1]))
                    self._gone[key] = now
            self._expire(now)

    def _expire(self, now: float) -> None:
        # _gone is in the order chunks left (a re-written one is popped, so it re-enters
        # at the end): the stale ones are at its front.
        while self._gone:
            key, left = next(iter(self._gone.items()))
            if now - left < EVICT_REUSE_WAIT_S:
                break
            del self._gone[key]
            self._out.append(("evict_reuse_gap", EVICT_REUSE_WAIT_S))

    def drain(self) -> list[tuple[str, float]]:
        """(``lifetime``/``idle_before_evict``/``reuse_gap``/``evict_reuse_gap``, seconds)."""
        with self._lock:
            self._expire(self._clock())
            out = list(self._out)
            self._out.clear()
        return out
