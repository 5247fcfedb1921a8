"""``L2AdapterInterface``: the contract every L2 storage adapter implements.

An L2 adapter moves whole memory objects (one KV chunk each) between the server's L1
memory and a store (files, Redis, S3, NIXL, a vendor's service). The server drives it
from several threads at once; this is the picture a plugin author needs:

* **Non-blocking primitives.** ``submit_store_task``, ``submit_lookup_and_lock_task``
  and ``submit_load_task`` return an ``L2TaskId`` at once and do the I/O elsewhere
  (the adapter's own threads, an event loop, a native worker pool). ``submit_unlock``
  is fire-and-forget. None of them may wait for I/O.
* **Completion through event fds.** The adapter owns three file descriptors, one per
  kind (store, lookup, load). When a task finishes, the adapter first records its
  result, then makes that kind's fd readable (``create_event_notifier()`` gives a
  ready-made eventfd/pipe). The server polls the fds and then collects results.
* **Exactly once.** Every task id an adapter handed out yields exactly one result:
  ``pop_completed_store_tasks`` returns a finished store once and forgets it;
  ``query_lookup_and_lock_result`` / ``query_load_result`` return ``None`` while the
  task runs, the result once, and ``None`` ever after. A failed task is a result too
  (``L2StoreResult(False, 0)`` or a bitmap with the failed keys' bits cleared), never
  silence: a task that never completes holds L1 memory until its deadline.
* **Buffer ownership.** The ``MemoryObj`` buffers passed to a store or load belong to
  the server's L1. The adapter may read them (store) or write them (load) from the
  submit call until it publishes that task's result, and never afterwards. The server
  keeps them pinned for exactly that window, so they cannot be evicted or reused under
  the adapter. Never free, resize or keep a reference to them past completion.
* **Threads.** The store controller thread submits stores and pops their results; the
  prefetch workers submit lookups, loads and unlocks while the prefetch poller thread
  queries results; the L2 eviction thread calls ``delete`` and ``get_usage``; HTTP
  handler threads call ``list_l2_keys``, ``delete``, ``get_usage`` and
  ``report_status``; shutdown calls ``close``. All of these can overlap: every method
  must be thread-safe.
* **Failure.** An exception raised by a submit call fails that one task (stores:
  pins released, task counted failed, never retried; lookups and loads: counted as
  all-miss); an exception from a query or pop is logged and read as all-miss or
  "nothing finished". None of it stops the server, and a wrong answer is worse than a
  miss, so report failure whenever the bytes are in doubt.

The byte layout of a stored value and the object names every adapter must use are in
``docs/design/storage-formats.md``; the controllers that call this interface are in
``docs/design/storage-engine.md``.

Base-class state (listeners, identity, byte accounting) is created lazily on first use, so
0.5.6 plugins that never call ``super().__init__()`` still work.
"""

from __future__ import annotations

import abc
import threading
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcache.lmcache_native import Bitmap
from lmcache.utils import init_logger
from lmcache.v1.distributed.api import KeyListPage, MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2AdapterListener, L2StoreResult

if TYPE_CHECKING:
    from lmcache.v1.memory_management import MemoryObj

logger = init_logger(__name__)

__all__ = ["AdapterUsage", "L2AdapterInterface", "L2TaskId"]

L2TaskId = int
"""Id of one submitted task, unique within one adapter only (controllers key work by
``(adapter_index, task_id)``)."""


@dataclass(frozen=True)
class AdapterUsage:
    """Snapshot of an adapter's byte accounting; capacity 0 means unknown/unlimited.

    ``bytes_by_cache_salt`` is a read-only mapping that keeps only positive buckets. Each
    ``get_usage()`` call builds a fresh snapshot; it never changes afterwards.
    """

    total_bytes_used: int
    total_capacity_bytes: int = 0
    bytes_by_cache_salt: Mapping[str, int] = field(
        default_factory=lambda: types.MappingProxyType({})
    )

    def __post_init__(self) -> None:
        positive = {k: int(v) for k, v in dict(self.bytes_by_cache_salt).items() if v > 0}
        object.__setattr__(self, "bytes_by_cache_salt", types.MappingProxyType(positive))

    @property
    def usage_fraction(self) -> float:
        """``used / capacity``, or -1.0 when the capacity is unknown (no eviction signal)."""
        if self.total_capacity_bytes <= 0:
            return -1.0
        return self.total_bytes_used / self.total_capacity_bytes


_STATE_LOCK = threading.Lock()  # guards lazy creation of base-class state


class L2AdapterInterface(abc.ABC):
    """Base class of every L2 adapter; see the module docstring for threads and ownership.

    Subclass it, implement the eleven abstract methods, and override ``delete`` when the
    adapter can evict. Report every newly stored key with ``_notify_keys_stored`` and every
    removed key with ``_notify_keys_deleted`` (same size): the base class turns that into
    ``get_usage()`` and the L2 eviction policy sees only keys reported this way.
    """

    def __init__(self, max_capacity_bytes: int = 0) -> None:
        """Set up listeners, identity and byte accounting.

        ``max_capacity_bytes`` > 0 declares a capacity: ``usage_fraction`` becomes
        meaningful and the L2 eviction controller may evict this adapter's keys (only when
        its config has an ``eviction`` block). 0 means unknown or unlimited.
        The attribute names (``_listeners``, ``_backend_name``, ``_shared``,
        ``_max_capacity_bytes``, ``_total_bytes_used``, ``_bytes_by_cache_salt``,
        ``_usage_lock``) are the ones 0.5.6 subclasses read; keep them.
        """
        self._listeners: list[L2AdapterListener] = []
        self._backend_name: str = type(self).__name__
        self._shared: bool = False
        self._max_capacity_bytes: int = max(0, int(max_capacity_bytes))
        self._total_bytes_used: int = 0
        self._bytes_by_cache_salt: dict[str, int] = {}
        self._usage_lock = threading.Lock()

    # --- lazy base state for plugins that skipped super().__init__() -----------------

    def _ensure_base_state(self) -> bool:
        """Create missing base-class state. Returns True when something was missing."""
        if "_usage_lock" in self.__dict__:
            return False
        with _STATE_LOCK:
            if "_usage_lock" in self.__dict__:
                return False
            defaults: dict[str, Any] = {
                "_listeners": [],
                "_backend_name": type(self).__name__,
                "_shared": False,
                "_max_capacity_bytes": 0,
                "_total_bytes_used": 0,
                "_bytes_by_cache_salt": {},
            }
            for name, value in defaults.items():
                if name not in self.__dict__:
                    setattr(self, name, value)
            self._usage_lock = threading.Lock()
            return True

    # --- abstract primitives -----------------------------------------------------------

    @abc.abstractmethod
    def get_store_event_fd(self) -> int:
        """The fd that becomes readable once at least one store task has finished.

        Called once, when the adapter is added to the server; the store controller thread
        then polls it for the adapter's lifetime. Return the same fd every time. It must be
        distinct from the lookup and load fds and from every other adapter's fds. The
        poller drains it (reads the eventfd counter) before it calls
        ``pop_completed_store_tasks``, so signal *after* the result is recorded. The fd
        stays owned by the adapter and is closed by ``close()``.
        """

    @abc.abstractmethod
    def get_lookup_and_lock_event_fd(self) -> int:
        """The fd that becomes readable once at least one lookup task has finished.

        Same rules as ``get_store_event_fd``; the prefetch poller thread polls it and then
        calls ``query_lookup_and_lock_result`` for each lookup it waits on.
        """

    @abc.abstractmethod
    def get_load_event_fd(self) -> int:
        """The fd that becomes readable once at least one load task has finished.

        Same rules as ``get_store_event_fd``; the prefetch poller thread polls it and then
        calls ``query_load_result`` for each load it waits on.
        """

    @abc.abstractmethod
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        """Start writing ``objects[i]`` under ``keys[i]``; return a new task id at once.

        Called by the store controller thread, one task per (adapter, model, kv_rank)
        group; the lists have equal length and no duplicate keys. Store each object's
        logical bytes (``obj.byte_array``, ``get_size()`` bytes) under the name from
        ``key_codec``. The objects are read-locked and pinned in L1 until this task's
        result is popped: read them only until then.

        A key that already exists is skipped and contributes 0 bytes (the first write
        wins; stored objects are immutable). Call ``_notify_keys_stored`` for the keys
        actually written. Signal the store fd when the task is done; the result is
        ``L2StoreResult(True, bytes_written)`` or ``L2StoreResult(False, 0, error=...)``; when
        only some keys failed, add ``landed=`` a ``Bitmap`` of the keys that are stored, so the
        server counts only the others as failed.
        Raising here fails the task at once: the server releases the pins, counts the
        task as failed and never retries it (the keys stay in L1 only).
        Task ids need only be unique within this adapter.
        """

    @abc.abstractmethod
    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        """Return every store task finished since the last call, and forget them.

        Called by the store controller thread after the store fd fired (and, as a safety
        net, periodically while tasks are in flight), so it must be cheap and must not
        block on I/O. Each task id appears in exactly one returned dict; an empty dict
        means nothing finished. On return the server releases the task's L1 pins and may
        delete the objects from L1 (``skip_l1`` policy), so the adapter must be completely
        done with the buffers of every task it returns. 0.5.6-era ``True``/``False``/int
        values are accepted and normalised with a one-time warning; return
        ``L2StoreResult``. An exception is logged and the tasks stay in flight.
        """

    @abc.abstractmethod
    def submit_lookup_and_lock_task(
        self,
        keys: list[ObjectKey],
        group_layout_descs: dict[int, MemoryLayoutDesc] | None = None,
    ) -> L2TaskId:
        """Start checking which ``keys`` exist and lock each hit; return a task id at once.

        Called by a prefetch worker thread while it holds the prefetch controller's lock
        (so a result cannot slip past the poller): return quickly and never call back
        into the server. The result (``query_lookup_and_lock_result``) has bit ``i`` set
        when ``keys[i]`` exists *and* is now locked: a locked key is not deleted or
        evicted until ``submit_unlock`` releases it (or a lock TTL, 300 s in our adapters,
        expires, so a lost unlock cannot pin a key forever). Locks are counted: two
        lookups of one key need two unlocks.

        ``group_layout_descs`` maps ``object_group_id`` to the object layout; it is
        advisory and most adapters ignore it. Adapters written for the one-argument 0.5.x
        signature still work: the server detects them and calls ``(keys)`` only. Raising
        makes this lookup an all-miss for this adapter.
        """

    @abc.abstractmethod
    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        """The lookup's per-key bitmap exactly once: ``None`` while running, then the
        ``Bitmap(len(keys))``, then ``None`` again; an unknown id gives ``None``.

        Called by the prefetch poller thread under the prefetch controller's lock, after
        the lookup fd fired: non-blocking, no callbacks into the server. If the server
        gave up waiting (deadline, default 30 s) it still collects the late result and
        unlocks every key it reports found, so a late result must be as accurate as a
        timely one. Raising counts as all-miss for this lookup.
        """

    @abc.abstractmethod
    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        """Release one lock per key taken by an earlier lookup; fire-and-forget.

        Called by prefetch worker threads (for hits not planned for loading, after loads,
        and when a request is aborted) and by the poller for late lookups. The server never
        retries an unlock, so the adapter must make it succeed eventually. Unknown or
        already unlocked keys are harmless. Must not raise; must not block on I/O.
        """

    @abc.abstractmethod
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        """Start reading ``keys[i]`` into ``objects[i]``; return a task id at once.

        Called by a prefetch worker thread under the prefetch controller's lock, for keys
        this adapter reported found and locked. The objects are fresh L1 staging buffers
        owned by the server; write exactly ``get_size()`` logical bytes into each
        ``obj.byte_array`` and touch nothing else. A stored value of the wrong length is a
        miss for that key, never a partial copy. Keys fail individually: the result bit
        says which buffers hold valid data. Call ``_notify_keys_accessed`` for the keys
        loaded (it feeds the eviction policy's recency).

        The buffers stay pinned until this task's result is queried, even when the server
        stopped waiting at its deadline (default 60 s): the late result is collected and
        the buffers are freed then. Raising makes every key of this load a miss.
        """

    @abc.abstractmethod
    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        """The load's per-key success bitmap exactly once: ``None`` while running, then
        ``Bitmap(len(keys))`` (bit ``i`` = ``objects[i]`` holds ``keys[i]``'s bytes), then
        ``None`` again; an unknown id gives ``None``.

        Called by the prefetch poller thread under the prefetch controller's lock after the
        load fd fired. Return it only once every write into the task's buffers is over:
        the server admits the set bits to L1 and frees the others right away. Raising
        counts as all-miss for this load.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop all work and release everything the adapter owns, including its three fds.

        Called once when the server shuts down or the adapter is removed, after the server
        stopped submitting to it, from the shutting-down thread. Tasks still running may be
        abandoned without results, but after ``close`` returns no caller buffer may be
        touched again (join or cancel the workers first). Should be idempotent; should not
        raise (an exception is logged and shutdown continues).
        """

    # --- concrete members ------------------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Remove ``keys`` from the store; a no-op by default.

        Called by the L2 eviction thread (victims chosen by the adapter's eviction policy)
        and by HTTP handler threads (``DELETE /cache/objects``). It may block until the
        deletes are done (our adapters wait up to 30 s). Skip keys that are locked by a
        lookup, ignore keys that do not exist, and call ``_notify_keys_deleted`` with the
        stored sizes for the keys actually removed, or the accounting and eviction policy
        drift. Errors should be logged and the key left in place, not raised.
        """
        return None

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyListPage:
        """One page of stored keys, for ``GET /cache/objects?tier=l2`` (an HTTP thread).

        ``model_name`` filters by model; ``cursor`` is the ``next_page_token`` of the
        previous page (``None`` starts over); the returned page has at most ``page_size``
        entries and ``next_page_token=None`` on the last page. Raise ``ValueError`` for a
        bad page size or cursor. The default raises ``NotImplementedError`` and the HTTP
        API reports that the adapter cannot list its keys.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement list_l2_keys")

    @property
    def max_capacity_bytes(self) -> int:
        """The capacity given to ``__init__``; 0 means unknown or unlimited."""
        self._ensure_base_state()
        return self._max_capacity_bytes

    @property
    def supports_global_eviction(self) -> bool:
        """True when a capacity is declared: only then can global L2 eviction measure fill."""
        return self.max_capacity_bytes > 0

    def get_usage(self) -> AdapterUsage:
        """A fresh snapshot of the bytes reported through the ``_notify_keys_*`` calls.

        Called by the L2 eviction thread every cycle and by status/metrics threads; cheap,
        never blocks on I/O. Override only to report usage the adapter measures itself.
        """
        self._ensure_base_state()
        with self._usage_lock:
            return AdapterUsage(
                total_bytes_used=self._total_bytes_used,
                total_capacity_bytes=self._max_capacity_bytes,
                bytes_by_cache_salt=dict(self._bytes_by_cache_salt),
            )

    def report_status(self) -> dict[str, Any]:
        """Health for ``/status`` (an HTTP thread): must contain ``is_healthy: bool``.

        Override to add adapter details (connection state, breaker state, ...); keep it
        cheap and never block on the backend. An exception is reported as unhealthy.
        """
        return {"is_healthy": True, "extra_warning": ""}

    def register_listener(self, listener: L2AdapterListener) -> None:
        """Add a listener for stored/accessed/deleted keys (called by the server at setup;
        the L2 eviction policy is one). Not meant to be overridden."""
        self._ensure_base_state()
        with self._usage_lock:
            self._listeners.append(listener)

    def set_backend_identity(self, name: str, shared: bool = False) -> None:
        """Record the type name the server knows this adapter by, and whether the store is
        shared with other servers (the config's ``shared``). Called once at setup; raises
        ``ValueError`` for an empty name."""
        if not name:
            raise ValueError("backend name must be non-empty")
        self._ensure_base_state()
        self._backend_name = name
        self._shared = bool(shared)

    @property
    def backend_name(self) -> str:
        """The name set by ``set_backend_identity`` (the class name before that)."""
        self._ensure_base_state()
        return self._backend_name

    # --- protected notifiers ----------------------------------------------------------------

    def _listeners_snapshot(self) -> list[L2AdapterListener]:
        self._ensure_base_state()
        with self._usage_lock:
            return list(self._listeners)

    def _notify_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        """Account newly stored keys, then tell the listeners (outside the lock).

        Call it from any adapter thread, once per newly stored key, with its stored size. A
        re-store of an existing key notifies with size 0 or not at all, or usage
        double-counts. Raises ``ValueError`` when the lists differ in length; a listener
        that raises is logged and skipped.
        """
        if len(keys) != len(sizes):
            raise ValueError(f"keys and sizes differ in length ({len(keys)} != {len(sizes)})")
        self._ensure_base_state()
        with self._usage_lock:
            for k, s in zip(keys, sizes, strict=False):
                s = int(s)
                self._total_bytes_used += s
                if s:
                    self._bytes_by_cache_salt[k.cache_salt] = (
                        self._bytes_by_cache_salt.get(k.cache_salt, 0) + s
                    )
        for listener in self._listeners_snapshot():
            try:
                listener.on_l2_keys_stored(list(keys), [int(s) for s in sizes])
            except Exception:
                logger.exception("L2 listener failed in on_l2_keys_stored")

    def _notify_keys_accessed(self, keys: list[ObjectKey]) -> None:
        """Tell the listeners that ``keys`` were read (recency for the eviction policy)."""
        self._ensure_base_state()
        for listener in self._listeners_snapshot():
            try:
                listener.on_l2_keys_accessed(list(keys))
            except Exception:
                logger.exception("L2 listener failed in on_l2_keys_accessed")

    def _notify_keys_deleted(self, keys: list[ObjectKey], sizes: list[int] | None = None) -> None:
        """Subtract removed keys (with the sizes they were stored with), then tell listeners.

        Usage is clamped at 0 with a warning when an adapter deletes more than it stored.
        Raises ``ValueError`` when the lists differ in length.
        """
        if sizes is None:
            sizes = [0] * len(keys)
        if len(keys) != len(sizes):
            raise ValueError(f"keys and sizes differ in length ({len(keys)} != {len(sizes)})")
        self._ensure_base_state()
        underflow = False
        with self._usage_lock:
            for k, s in zip(keys, sizes, strict=False):
                s = int(s)
                if s > self._total_bytes_used:
                    underflow = True
                self._total_bytes_used = max(0, self._total_bytes_used - s)
                cur = self._bytes_by_cache_salt.get(k.cache_salt, 0)
                if s > cur:
                    underflow = True
                left = cur - s
                if left > 0:
                    self._bytes_by_cache_salt[k.cache_salt] = left
                else:
                    self._bytes_by_cache_salt.pop(k.cache_salt, None)
        if underflow:
            logger.warning(
                "L2 adapter byte accounting underflow: %s deleted more bytes than it stored "
                "(clamped at 0)",
                type(self).__name__,
            )
        for listener in self._listeners_snapshot():
            try:
                listener.on_l2_keys_deleted(list(keys))
            except Exception:
                logger.exception("L2 listener failed in on_l2_keys_deleted")
