"""Helpers shared by the Python adapters of core: client-side L2 locks and task bookkeeping."""

from __future__ import annotations

import itertools
import threading
from typing import Any

from lmcache.lmcache_native import TTLLock
from lmcache.v1.distributed.api import ObjectKey

L2_LOCK_TTL_SECONDS = 300.0


class KeyLockTable:
    """Refcount locks per key that expire after a TTL, so a lost unlock cannot pin a key forever."""

    def __init__(self, ttl_seconds: float | None = None) -> None:
        # None reads the module constant at construction time (tests shorten it).
        self._ttl = L2_LOCK_TTL_SECONDS if ttl_seconds is None else float(ttl_seconds)
        self._locks: dict[ObjectKey, TTLLock] = {}
        self._mu = threading.Lock()

    def lock(self, keys: list[ObjectKey]) -> None:
        with self._mu:
            for k in keys:
                lk = self._locks.get(k)
                if lk is None:
                    lk = self._locks[k] = TTLLock(self._ttl)
                lk.lock()

    def unlock(self, keys: list[ObjectKey]) -> None:
        with self._mu:
            for k in keys:
                lk = self._locks.get(k)
                if lk is None:
                    continue
                lk.unlock()
                if not lk.is_locked():
                    del self._locks[k]

    def is_locked(self, key: ObjectKey) -> bool:
        with self._mu:
            lk = self._locks.get(key)
            if lk is None:
                return False
            if not lk.is_locked():
                del self._locks[key]
                return False
            return True

    def count(self, key: ObjectKey) -> int:
        with self._mu:
            lk = self._locks.get(key)
            return lk.count() if lk is not None else 0

    def clear(self) -> None:
        with self._mu:
            self._locks.clear()


class TaskIds:
    """Monotonic task ids (unique within one adapter)."""

    def __init__(self) -> None:
        self._it = itertools.count(1)
        self._mu = threading.Lock()

    def next(self) -> int:
        with self._mu:
            return next(self._it)


class OnceResults:
    """Results handed out exactly once: ``put`` then ``take`` returns it once, then None."""

    def __init__(self) -> None:
        self._d: dict[int, Any] = {}
        self._mu = threading.Lock()

    def put(self, task_id: int, value: Any) -> None:
        with self._mu:
            self._d[task_id] = value

    def take(self, task_id: int) -> Any:
        with self._mu:
            return self._d.pop(task_id, None)

    def take_all(self) -> dict[int, Any]:
        with self._mu:
            out, self._d = self._d, {}
            return out

    def __len__(self) -> int:
        with self._mu:
            return len(self._d)
