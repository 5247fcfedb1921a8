"""Bridge from a native connector (one fd, mixed completions) to ``L2AdapterInterface``
(docs/design/storage-engine.md#native-bridge).

Constructor::

    NativeConnectorL2Adapter(native_client, max_capacity_gb=0, type_name="",
                             extra_status=None, pad_buffers_to_alignment=False,
                             endpoint="", health_probe_interval_s=0.0)

``native_client`` is any object with the native-connector methods
(docs/design/storage-engine.md#native-contract): ``event_fd() -> int``, ``submit_batch_get(keys:
list[str], memoryviews) -> int``, ``submit_batch_set(keys, memoryviews) -> int``,
``submit_batch_exists(keys) -> int``, optional ``submit_batch_delete(keys) -> int``,
``drain_completions() -> list[(future_id, ok, error, result_bools | None)]`` and ``close()``. The
pybind11 clients of lmcache-fs and lmcache-redis are wrapped with it, e.g.
``NativeConnectorL2Adapter(LMCacheFSClient(...), max_capacity_gb=cfg.max_capacity_gb,
type_name="fs_native", pad_buffers_to_alignment=cfg.use_odirect)``.

The bridge owns three notifiers (store, lookup, load) and a daemon demux thread
(``l2-adapter-demux``) that polls the native fd and routes completions by future id. Keys become
L2 name strings (docs/design/storage-formats.md#l2-names); buffers become ``byte_array`` memoryviews
(for stores the full physical slot, tail zeroed, when padding is on; loads always use the logical
bytes). L2 locks are client-side refcounts with a 300 s TTL; ``delete`` skips locked keys.

Health (``report_status()``, see ``health.py``) comes from the completions: a failed one
records its error (the connector's text, e.g. ``cannot connect to redis at h:6379:
Connection refused``), a successful one clears it. ``endpoint`` names the backend in logs
and status. With ``health_probe_interval_s`` > 0 the bridge also asks the backend whether a
probe key exists when nothing completed for that long (and once at start), so an idle
adapter notices a backend that went away, or one unreachable from the start, and its
recovery.

Subclasses that discover existing keys (a start-up directory scan) use the public
``record_known_keys(keys, sizes)`` and ``known_key_sizes()`` instead of the private size table.
"""

from __future__ import annotations

import collections
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.utils import init_logger
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.health import HealthTracker
from lmcache.v1.distributed.l2_adapters.key_codec import object_key_to_string
from lmcache.v1.distributed.l2_adapters.utils import (
    CompletionChannels,
    KeyLockTable,
    TaskIds,
    record_unknown_keys,
)
from lmcache.v1.memory_management import MemoryObj, TensorMemoryObj

logger = init_logger(__name__)

__all__ = ["NativeConnectorL2Adapter", "_object_key_to_string"]

GiB = 1 << 30
DELETE_TIMEOUT_S = 30.0
POLL_MS = 500
# The key a health probe asks about (it never exists; only the answer's arrival matters).
PROBE_KEY = object_key_to_string(ObjectKey(b"\x00", "lmcache-health-probe", 0))


def _object_key_to_string(key: ObjectKey) -> str:
    """0.5.x helper name; the codec lives in ``key_codec``."""
    return object_key_to_string(key)


@dataclass
class _Pending:
    op: str  # "store" | "lookup" | "load" | "delete" | "probe"
    task_id: int
    n: int
    keys: list[ObjectKey]
    sizes: list[int]
    buffers: list[Any]  # keeps views alive until the completion is drained
    waiter: threading.Event | None = None


class NativeConnectorL2Adapter(CompletionChannels, L2AdapterInterface):
    #: Replay the keys already known (recovered at start, or stored) to a listener that
    #: registers later, so it (an L2 eviction policy, say) sees them too.
    replay_known_keys = False

    def __init__(
        self,
        native_client: Any,
        max_capacity_gb: float = 0,
        type_name: str = "",
        extra_status: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
        pad_buffers_to_alignment: bool = False,
        endpoint: str = "",
        health_probe_interval_s: float = 0.0,
    ) -> None:
        super().__init__(max_capacity_bytes=int(float(max_capacity_gb) * GiB))
        self._client = native_client
        self._type_name = type_name or type(native_client).__name__
        self._endpoint = str(endpoint)
        self._health = HealthTracker(
            f"{self._type_name} at {endpoint}" if endpoint else self._type_name
        )
        self._probe_interval = max(0.0, float(health_probe_interval_s))
        self._probe_pending = False
        self._last_activity = 0.0  # monotonic time of the latest completion
        self._last_probe = 0.0  # monotonic; 0 = probe at once
        self._extra_status = extra_status
        self._pad = bool(pad_buffers_to_alignment)
        self._has_delete = callable(getattr(native_client, "submit_batch_delete", None))
        self._lock = threading.Lock()
        self._ids = TaskIds()
        self._pending: dict[int, _Pending] = {}
        self._local_future = -1  # negative ids for work completed without the connector
        self._known: dict[ObjectKey, int] = {}  # stored key -> size charged
        # Keys of stores not routed yet: a start-up scan that finds their files meanwhile
        # leaves them to the store, which charges and reports them itself.
        self._storing: collections.Counter[ObjectKey] = collections.Counter()
        self._locks = KeyLockTable()
        self._open_channels()
        self._closed = False
        self._healthy = True
        self._demux_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._demux_loop, name="l2-adapter-demux", daemon=True
        )
        self._thread.start()

    # --- submit path ------------------------------------------------------------------------

    def _view(self, obj: MemoryObj, pad: bool) -> tuple[memoryview, int]:
        # Padding is for writes only (docs/design/storage-formats.md#value-bytes): a load gets the
        # logical bytes, so a file written without padding (``fs``, 0.5.6, fs_native without
        # O_DIRECT) that is shorter than the slot is still a hit; a longer, padded file is read for
        # its first len(buffer) bytes.
        if pad and isinstance(obj, TensorMemoryObj) and obj.get_physical_size() > obj.get_size():
            full = obj.physical_byte_array()
            logical = obj.get_size()
            full[logical:] = bytes(len(full) - logical)  # never ship stale allocator bytes
            return full, len(full)
        view = obj.byte_array
        return view, len(view)

    def _submit(
        self,
        op: str,
        keys: list[ObjectKey],
        objects: list[MemoryObj] | None,
        waiter: threading.Event | None = None,
    ) -> int:
        task_id = self._ids.next()
        if not keys:
            self._complete_locally(op, task_id, waiter)
            return task_id
        names = [object_key_to_string(k) for k in keys]
        views: list[Any] = []
        sizes: list[int] = []
        if objects is not None:
            for o in objects:
                v, n = self._view(o, pad=self._pad and op == "store")
                views.append(v)
                sizes.append(n)
        submit_error = ""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._type_name} L2 adapter is closed")
            if op == "store":
                self._storing.update(keys)
            try:
                if op == "store":
                    fid = self._client.submit_batch_set(names, views)
                elif op == "load":
                    fid = self._client.submit_batch_get(names, views)
                elif op == "lookup":
                    fid = self._client.submit_batch_exists(names)
                else:
                    fid = self._client.submit_batch_delete(names)
            except Exception as exc:  # IMPROVE: a raising submit is a failed completion
                fid = None
                submit_error = f"submit raised {type(exc).__name__}: {exc}"
            if fid is not None:
                self._pending[int(fid)] = _Pending(
                    op, task_id, len(keys), list(keys), sizes, views, waiter
                )
        if fid is None:
            self._route(
                _Pending(op, task_id, len(keys), list(keys), sizes, views, waiter),
                False,
                None,
                submit_error,
            )
        return task_id

    def _complete_locally(self, op: str, task_id: int, waiter: threading.Event | None) -> None:
        self._route(_Pending(op, task_id, 0, [], [], [], waiter), True, [])

    # --- routing -------------------------------------------------------------------------------

    def _route(self, p: _Pending, ok: bool, bools: list[bool] | None, error: str = "") -> None:
        if p.n:  # empty tasks complete locally and say nothing about the backend
            op = "lookup" if p.op == "probe" else p.op  # a probe is a one-key lookup
            if ok:
                self._health.success(op)
            else:
                self._health.failure(op, error)
        if p.op == "probe":
            self._probe_pending = False
            return
        if p.op == "store":
            new_keys, new_sizes, old_keys = [], [], []
            landed_bits = self._bitmap(p.n, ok, bools, default_all=True)
            landed = landed_bits.gather(list(zip(p.keys, p.sizes, strict=False)))
            with self._lock:
                self._storing -= collections.Counter(p.keys)  # drops keys that reach 0
                for k, s in landed:
                    if k in self._known:
                        old_keys.append(k)
                    else:
                        self._known[k] = s
                        new_keys.append(k)
                        new_sizes.append(s)
            if new_keys:  # listeners are called outside the lock
                self._notify_keys_stored(new_keys, new_sizes)
            if old_keys:
                self._notify_keys_stored(old_keys, [0] * len(old_keys))
            result = (
                L2StoreResult(True, sum(new_sizes))
                if ok
                else L2StoreResult(
                    False, 0, error=error or "the connector gave no reason", landed=landed_bits
                )
            )
            self._store_channel.complete(p.task_id, result)
        elif p.op == "lookup":
            bm = self._bitmap(p.n, ok, bools, default_all=False)
            found = bm.gather(p.keys)
            self._locks.lock(found)
            self._lookup_channel.complete(p.task_id, bm)
        elif p.op == "load":
            bm = self._bitmap(p.n, ok, bools, default_all=True)
            loaded = bm.gather(p.keys)
            if loaded:
                self._notify_keys_accessed(loaded)
            self._load_channel.complete(p.task_id, bm)
        else:  # delete
            bm = self._bitmap(p.n, ok, bools, default_all=True)
            removed, sizes = [], []
            with self._lock:
                for k in bm.gather(p.keys):
                    if k in self._known:
                        sizes.append(self._known.pop(k))
                        removed.append(k)
            if removed:
                self._notify_keys_deleted(removed, sizes)
            if p.waiter is not None:
                p.waiter.set()

    @staticmethod
    def _bitmap(n: int, ok: bool, bools: list[bool] | None, default_all: bool) -> Bitmap:
        bm = Bitmap(n)
        if bools is not None and len(bools) == n:
            if ok or bools:
                bm.batched_set(i for i, b in enumerate(bools) if b)
        elif ok and default_all:
            bm.set_range(0, n)
        return bm

    def _demux_loop(self) -> None:
        poller = select.poll()
        try:
            fd = int(self._client.event_fd())
            poller.register(fd, select.POLLIN)
        except Exception:
            logger.exception("%s: cannot poll the native event fd", self._type_name)
            self._healthy = False
            return
        while not self._stop.is_set():
            try:
                self._maybe_probe()
                if not poller.poll(POLL_MS):
                    continue
                if self._stop.is_set():
                    return
                completions = self._client.drain_completions()
                if completions:
                    self._last_activity = time.monotonic()
                for fid, ok, error, bools in completions:
                    with self._lock:
                        p = self._pending.pop(int(fid), None)
                    if p is None:
                        logger.warning(
                            "%s: completion for unknown future id %s", self._type_name, fid
                        )
                        continue
                    if not ok and error:
                        logger.debug(
                            "%s %s future %s failed: %s", self._type_name, p.op, fid, error
                        )
                    self._route(
                        p, bool(ok), list(bools) if bools is not None else None, str(error or "")
                    )
                self._demux_errors = 0
            except Exception:
                if self._stop.is_set():
                    return
                self._demux_errors += 1
                self._healthy = False
                logger.exception("%s: demux loop error (continuing)", self._type_name)
                time.sleep(0.05)

    def _maybe_probe(self) -> None:
        """Ask the backend about PROBE_KEY once per probe interval while nothing else
        completes, or while it is unhealthy (other traffic, e.g. stores, may never retry
        the lookups whose failure keeps it so)."""
        now = time.monotonic()
        if (
            self._probe_interval <= 0
            or self._probe_pending
            or now - self._last_probe < self._probe_interval
            or (now - self._last_activity < self._probe_interval and self._health.healthy)
        ):
            return
        self._probe_pending = True
        self._last_probe = now
        error = ""
        with self._lock:
            if self._closed:
                return
            try:
                fid = self._client.submit_batch_exists([PROBE_KEY])
                self._pending[int(fid)] = _Pending("probe", -1, 1, [], [], [])
                return
            except Exception as exc:
                error = f"submit raised {type(exc).__name__}: {exc}"
        self._route(_Pending("probe", -1, 1, [], [], []), False, None, error)

    # --- L2AdapterInterface -----------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit("store", list(keys), list(objects))

    def submit_lookup_and_lock_task(
        self,
        keys: list[ObjectKey],
        group_layout_descs: dict[int, MemoryLayoutDesc] | None = None,
    ) -> L2TaskId:
        return self._submit("lookup", list(keys), None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self._locks.unlock(list(keys))

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit("load", list(keys), list(objects))

    def delete(self, keys: list[ObjectKey]) -> None:
        if not self._has_delete or self._closed:
            return
        targets = [k for k in keys if not self._locks.is_locked(k)]
        if not targets:
            return
        waiter = threading.Event()
        task_id = self._submit("delete", targets, None, waiter)
        if not waiter.wait(DELETE_TIMEOUT_S):
            with self._lock:
                for fid, p in list(self._pending.items()):
                    if p.task_id == task_id and p.op == "delete":
                        del self._pending[fid]
            logger.warning("delete() timed out after 30s for %d keys", len(targets))

    # --- public helpers for subclasses (e.g. fs_native's start-up scan) --------------------------

    def record_known_keys(self, keys: list[ObjectKey], sizes: list[int]) -> list[ObjectKey]:
        """Record keys that already exist in the backend (found by a start-up scan, say) with
        the sizes they occupy, and fire ``on_l2_keys_stored`` for the ones not yet known.

        Keys the bridge already knows keep their first size, and keys a store is writing are
        left to that store. Returns the newly recorded keys.
        Later deletes report these sizes, so usage stays balanced.
        """
        if len(keys) != len(sizes):
            raise ValueError(
                f"record_known_keys: {len(keys)} keys but {len(sizes)} sizes; pass one size per key"
            )
        with self._lock:
            fresh, fresh_sizes = record_unknown_keys(self._known, self._storing, keys, sizes)
        if fresh:
            self._notify_keys_stored(fresh, fresh_sizes)
        return fresh

    def register_listener(self, listener: Any) -> None:
        """With ``replay_known_keys``, also tells the new listener the keys already known."""
        super().register_listener(listener)
        known = self.known_key_sizes() if self.replay_known_keys else []
        if known:
            listener.on_l2_keys_stored([k for k, _ in known], [s for _, s in known])

    def known_key_sizes(self) -> list[tuple[ObjectKey, int]]:
        """A snapshot of every key the bridge knows is stored, with its charged size (to replay
        them to a listener registered late, for instance)."""
        with self._lock:
            return list(self._known.items())

    def lock_count(self, key: ObjectKey) -> int:
        """Client-side lock references ``key`` holds (status, tests); 0 when unlocked."""
        return self._locks.count(key)

    def report_status(self) -> dict[str, Any]:
        extra = self._extra_status() if callable(self._extra_status) else (self._extra_status or {})
        with self._lock:
            inflight = len(self._pending)
        health = self._health.status()
        healthy = (
            health["healthy"] and self._thread.is_alive() and self._healthy and not self._closed
        )
        return {
            "is_healthy": healthy,
            **health,
            "healthy": healthy,
            "type_name": self._type_name,
            "endpoint": self._endpoint,
            "in_flight": inflight,
            "demux_errors": self._demux_errors,
            "has_delete": self._has_delete,
            "padding": self._pad,
            "extra_status": extra,
        }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            waiters = [p.waiter for p in self._pending.values() if p.waiter is not None]
        self._stop.set()
        self._thread.join(timeout=POLL_MS / 1000.0 + 2)
        try:
            self._client.close()
        except Exception:
            logger.exception("%s: close() of the native client failed", self._type_name)
        for w in waiters:
            w.set()
        with self._lock:
            self._pending.clear()
        self._close_channels()
