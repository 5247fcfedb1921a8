"""Helpers shared by Python L2 adapters (core's and the storage wheels'): client-side L2 locks,
task ids, the completion channels behind the event-fd half of ``L2AdapterInterface``, and the
completion half of a native connector written in Python."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Container
from typing import TYPE_CHECKING, Any

from lmcache.lmcache_native import Bitmap, TTLLock
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.platform.event_notifier import create_event_notifier

L2_LOCK_TTL_SECONDS = 300.0


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable (a file just published in it). A
    directory that cannot be opened (some file systems) is skipped; a failed fsync raises."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def record_unknown_keys(
    known: dict[ObjectKey, int], storing: Container[ObjectKey], keys: list[ObjectKey], sizes: Any
) -> tuple[list[ObjectKey], list[int]]:
    """Add to ``known`` the keys (found on the backend, with their sizes) it lacks, leaving
    the keys a store is writing to that store; returns the added keys and sizes (for
    ``_notify_keys_stored``). The caller holds the lock guarding both containers."""
    fresh = [
        (k, int(s)) for k, s in zip(keys, sizes, strict=True) if k not in known and k not in storing
    ]
    known.update(fresh)
    return [k for k, _ in fresh], [s for _, s in fresh]


class KeyLockTable:
    """Refcount locks per key that expire after a TTL, so a lost unlock cannot pin a key forever."""

    def __init__(self, ttl_seconds: float | None = None) -> None:
        # None reads the module constant at construction time (tests shorten it).
        self._ttl = L2_LOCK_TTL_SECONDS if ttl_seconds is None else float(ttl_seconds)
        self._locks: dict[ObjectKey, TTLLock] = {}
        self._mu = threading.Lock()

    def lock(self, keys: list[ObjectKey]) -> None:
        """Take one reference on each key (a repeated key takes several) and restart its TTL.
        Adapters call it when a lookup-and-lock finds the key."""
        with self._mu:
            for k in keys:
                lk = self._locks.get(k)
                if lk is None:
                    lk = self._locks[k] = TTLLock(self._ttl)
                lk.lock()

    def unlock(self, keys: list[ObjectKey]) -> None:
        """Drop one reference on each key; unknown or expired keys are ignored (``submit_unlock``
        must always succeed)."""
        with self._mu:
            for k in keys:
                lk = self._locks.get(k)
                if lk is None:
                    continue
                lk.unlock()
                if not lk.is_locked():
                    del self._locks[k]

    def is_locked(self, key: ObjectKey) -> bool:
        """Whether ``key`` holds a reference that has not expired; eviction and ``delete`` skip
        locked keys."""
        with self._mu:
            lk = self._locks.get(key)
            if lk is None:
                return False
            if not lk.is_locked():
                del self._locks[key]
                return False
            return True

    def count(self, key: ObjectKey) -> int:
        """References ``key`` holds (status and tests)."""
        with self._mu:
            lk = self._locks.get(key)
            return lk.count() if lk is not None else 0

    def num_locked(self) -> int:
        """How many keys hold a lock that has not expired."""
        with self._mu:
            return sum(1 for lk in self._locks.values() if lk.is_locked())

    def clear(self) -> None:
        """Drop every lock (adapter ``close``)."""
        with self._mu:
            self._locks.clear()


class TaskIds:
    """Monotonic task ids (unique within one adapter)."""

    def __init__(self) -> None:
        self._it = itertools.count(1)
        self._mu = threading.Lock()

    def next(self) -> int:
        """The next id, starting at 1; thread-safe."""
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


class CompletionChannel:
    """Completions of one task kind (store, lookup-and-lock or load): each result is handed out
    exactly once, and the event fd the caller polls becomes readable when one is ready. After
    ``close()`` results are still kept but nobody is woken (the fd may be reused already)."""

    def __init__(self) -> None:
        self._results = OnceResults()
        self._notifier = create_event_notifier()
        self._mu = threading.Lock()
        self._closed = False

    def fileno(self) -> int:
        return self._notifier.fileno()

    def complete(self, task_id: int, result: Any) -> None:
        """Publish ``result`` for ``task_id``, then wake the caller (in that order, so a woken
        caller always finds it)."""
        self._results.put(task_id, result)
        self.wake()

    def wake(self) -> None:
        """Wake the caller without a result (a wrapper whose results live elsewhere)."""
        with self._mu:
            if not self._closed:
                self._notifier.notify()

    def take(self, task_id: int) -> Any:
        return self._results.take(task_id)

    def take_all(self) -> dict[int, Any]:
        return self._results.take_all()

    def close(self) -> None:
        with self._mu:
            if not self._closed:
                self._closed = True
                self._notifier.close()


class CompletionChannels:
    """Mixin implementing the completion half of ``L2AdapterInterface`` (the three event-fd
    getters, ``pop_completed_store_tasks``, ``query_lookup_and_lock_result`` and
    ``query_load_result``) over three channels. Call ``_open_channels()`` in ``__init__``,
    ``channel.complete(task_id, result)`` when a task finishes, ``_close_channels()`` in
    ``close()``. List it before ``L2AdapterInterface`` among the bases."""

    _store_channel: CompletionChannel
    _lookup_channel: CompletionChannel
    _load_channel: CompletionChannel

    def _open_channels(self) -> None:
        self._store_channel = CompletionChannel()
        self._lookup_channel = CompletionChannel()
        self._load_channel = CompletionChannel()

    def _close_channels(self) -> None:
        for channel in (self._store_channel, self._lookup_channel, self._load_channel):
            channel.close()

    def get_store_event_fd(self) -> int:
        """The store channel's fd, readable after a store completes (the interface's method)."""
        return self._store_channel.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        """The lookup channel's fd, readable after a lookup-and-lock completes."""
        return self._lookup_channel.fileno()

    def get_load_event_fd(self) -> int:
        """The load channel's fd, readable after a load completes."""
        return self._load_channel.fileno()

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        """Every store result published since the last call, by task id; each exactly once."""
        return self._store_channel.take_all()

    def query_lookup_and_lock_result(self, task_id: int) -> Bitmap | None:
        """The lookup bitmap of ``task_id`` once it completed (exactly once), else ``None``."""
        return self._lookup_channel.take(task_id)

    def query_load_result(self, task_id: int) -> Bitmap | None:
        """The load bitmap of ``task_id`` once it completed (exactly once), else ``None``."""
        return self._load_channel.take(task_id)

    def _complete_load(self, task_id: int, keys: list[ObjectKey], loaded: list[bool]) -> None:
        """Finish a load whose key ``i`` was loaded where ``loaded[i]``: listeners hear of the
        loaded keys, then the task's bitmap is published."""
        bm = Bitmap(len(keys))
        for i, ok in enumerate(loaded):
            if ok:
                bm.set(i)
        hits = bm.gather(keys)
        if hits:
            self._notify_keys_accessed(hits)
        self._load_channel.complete(task_id, bm)

    if TYPE_CHECKING:  # L2AdapterInterface's (listed after this mixin among the bases)

        def _notify_keys_accessed(self, keys: list[ObjectKey]) -> None: ...


NativeCompletion = tuple[int, bool, str, list[bool] | None]
"""One entry of ``drain_completions()``: ``(future id, ok, error text, per-key results)``."""


class PythonNativeConnector:
    """Base of native connectors written in Python (docs/design/storage-engine.md#native-contract),
    driven by ``NativeConnectorL2Adapter`` like the compiled ones: the event fd, future ids,
    ``drain_completions`` and the ``submit_batch_get/set/exists`` entry points. A subclass
    implements ``_submit(op, keys, memoryviews or None)`` (returning ``_next_future_id()``), calls
    ``_complete(...)`` from its workers once per batch, adds ``submit_batch_delete`` where its
    storage can delete, and calls ``_close_completions()`` last in ``close()``."""

    def _open_completions(self) -> None:
        self._completion_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._completed: list[NativeCompletion] = []
        self._completed_mu = threading.Lock()
        self._future_ids = TaskIds()

    def _close_completions(self) -> None:
        os.close(self._completion_fd)

    def _next_future_id(self) -> int:
        return self._future_ids.next()

    def _complete(self, future_id: int, ok: bool, error: str, results: list[bool] | None) -> None:
        """Publish one batch's completion, then wake the bridge (in that order)."""
        with self._completed_mu:
            self._completed.append((future_id, ok, error, results))
        try:
            os.eventfd_write(self._completion_fd, 1)
        except OSError:  # closed under us: nobody is waiting any more
            pass

    def _submit(self, op: str, keys: list[str], views: list[Any] | None) -> int:
        raise NotImplementedError

    # --- the native-connector contract ---------------------------------------------------

    def event_fd(self) -> int:
        """The fd that becomes readable when a batch completed."""
        return self._completion_fd

    def submit_batch_get(self, keys: list[str], memoryviews: list[Any]) -> int:
        """Read each key's value into its buffer; returns the batch's future id."""
        return self._submit("get", keys, memoryviews)

    def submit_batch_set(self, keys: list[str], memoryviews: list[Any]) -> int:
        """Write each buffer under its key; returns the batch's future id."""
        return self._submit("set", keys, memoryviews)

    def submit_batch_exists(self, keys: list[str]) -> int:
        """Ask which keys exist; returns the batch's future id."""
        return self._submit("exists", keys, None)

    def drain_completions(self) -> list[NativeCompletion]:
        """Every completion published since the last call, each exactly once."""
        try:
            os.eventfd_read(self._completion_fd)
        except (BlockingIOError, OSError):
            pass
        with self._completed_mu:
            out, self._completed = self._completed, []
        return out
