"""``nixl_store``: L2 objects kept in a fixed pool of page-sized NIXL slots
(docs/design/storage-engine.md#backend-nixl).

One NIXL agent has the whole L1 arena registered (one descriptor per ``align_bytes`` page) and
``pool_size`` files of ``file_size`` bytes (file backends) or ``pool_size`` one-page objects
(OBJ) as slots. A store takes free slots for each new key and fills them with one batched
WRITE; a load gathers the key's slots back with one READ. The key -> slots index lives in
memory. Capacity = slots x page, so the L2 eviction controller can delete keys to free slots.

Threads: submits only queue work; one I/O thread owns the agent, posts each task's transfer
and polls the ones in flight, so several tasks overlap. Lookup, unlock and delete touch only
the index and run on the caller's thread.

Robustness (IMPROVE over 0.5.6): every buffer is mapped onto arena pages by its real address
and checked against the registered range and its own slot, so a buffer outside the arena or
misaligned fails that key with a message (0.5.6 reached NIXL's "makeXferReq local index out of
range" or raised into the controller); failed transfers free their slots; loads keep their slots
from being freed by a concurrent delete.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from lmcache.storage.nixl._arena import Arena, BufferRejected
from lmcache.storage.nixl._health import Health
from lmcache.storage.nixl._nixl_api import describe_error as _describe
from lmcache.storage.nixl._nixl_api import nixl_build_name
from lmcache.storage.nixl._slots import SlotStorage
from lmcache.storage.nixl.config import NixlStoreL2AdapterConfig
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.l2_adapters.api import (
    Bitmap,
    CompletionChannels,
    KeyLockTable,
    L1MemoryDesc,
    L2StoreResult,
    TaskIds,
    init_logger,
    object_key_to_string,
)
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId

logger = init_logger(__name__)

IDLE_WAIT_S = 0.5  # nothing in flight: wait for work
MIN_POLL_WAIT_S = 0.00005  # transfers in flight: poll again after this, doubling ...
MAX_POLL_WAIT_S = 0.001  # ... up to this while none completes
CLOSE_DRAIN_S = 10.0


class SlotPool:
    """Free slot indexes; ``allocate`` is all-or-nothing."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._free = list(range(total - 1, -1, -1))
        self._mu = threading.Lock()

    def allocate(self, n: int) -> list[int] | None:
        with self._mu:
            if n > len(self._free):
                return None
            out = self._free[-n:]
            del self._free[-n:]
            out.reverse()  # ascending, so consecutive pages meet consecutive slots (one I/O)
            return out

    def free(self, slots: list[int]) -> None:
        with self._mu:
            self._free.extend(slots)

    @property
    def free_count(self) -> int:
        with self._mu:
            return len(self._free)


@dataclass
class _Entry:
    slots: list[int]
    size: int  # logical bytes
    charged: int  # slots x page: what usage and eviction count
    loading: int = 0  # loads in flight reading these slots


@dataclass
class _Task:
    op: str  # "store" | "load"
    task_id: int
    keys: list[ObjectKey]
    objects: list[Any]
    handle: Any = None
    # store: (key, slots, logical bytes) being written; load: (index, key) being read
    items: list[Any] = field(default_factory=list)
    rejected: bool = False  # some key failed before the transfer


class NixlStoreL2Adapter(CompletionChannels, L2AdapterInterface):
    def __init__(
        self, config: NixlStoreL2AdapterConfig | dict[str, Any], l1_memory_desc: L1MemoryDesc
    ) -> None:
        if isinstance(config, dict):
            config = NixlStoreL2AdapterConfig.from_dict(config)
        self._cfg = config
        self._arena = Arena(l1_memory_desc, "nixl_store")
        self._storage = SlotStorage(config, self._arena)
        super().__init__(max_capacity_bytes=self._storage.num_slots * self._arena.page)
        self._pool = SlotPool(self._storage.num_slots)
        self._health = Health(logger, f"nixl_store ({config.backend})")

        self._lock = threading.Lock()
        self._index: dict[ObjectKey, _Entry] = {}
        self._storing: set[ObjectKey] = set()
        self._pins = KeyLockTable()
        self._ids = TaskIds()
        self._open_channels()

        self._queue: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._io_loop, name="lmc-nixl-store", daemon=True)
        self._thread.start()
        logger.info(
            "nixl_store ready: backend %s (%s), %d slots of %d bytes (%.2f GiB), %s",
            config.backend,
            nixl_build_name(),
            self._storage.num_slots,
            self._arena.page,
            self.max_capacity_bytes / 2**30,
            f"files under {config.backend_params['file_path']}"
            if config.is_file_backend
            else "one object per slot",
        )

    # --- submit ------------------------------------------------------------------------------

    def _enqueue(self, op: str, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        task = _Task(op, self._ids.next(), list(keys), list(objects))
        if len(task.keys) != len(task.objects):
            self._health.failure(
                f"{op} task got {len(task.keys)} keys but {len(task.objects)} buffers",
                backend=False,
            )
            task.rejected = True
            self._finish(task, ok=False)
        elif self._closed:
            self._finish(task, ok=False)
        else:
            self._queue.put(task)
        return task.task_id

    def submit_store_task(self, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        return self._enqueue("store", keys, objects)

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc] | None = None
    ) -> L2TaskId:
        task_id = self._ids.next()
        bm = Bitmap(len(keys))
        with self._lock:  # pin under the index lock: a delete cannot slip in between
            found = [i for i, k in enumerate(keys) if k in self._index]
            self._pins.lock([keys[i] for i in found])
        if found:
            bm.batched_set(found)
        self._lookup_channel.complete(task_id, bm)
        return task_id

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self._pins.unlock(list(keys))

    def submit_load_task(self, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        return self._enqueue("load", keys, objects)

    # --- I/O thread ----------------------------------------------------------------------------

    def _io_loop(self) -> None:
        inflight: list[_Task] = []
        wait = IDLE_WAIT_S
        stopping = False
        while not stopping or inflight:
            try:
                task = self._queue.get(timeout=wait if not stopping else MAX_POLL_WAIT_S)
            except queue.Empty:
                task = None
            else:
                while True:
                    if task is None:
                        stopping = True
                    elif stopping:
                        self._guarded(self._finish, task, False)
                    else:
                        self._guarded(self._start, task, inflight)
                    try:
                        task = self._queue.get_nowait()
                    except queue.Empty:
                        break
            progressed = self._guarded(self._poll, inflight)
            if not inflight:
                wait = IDLE_WAIT_S
            elif progressed or wait >= IDLE_WAIT_S:
                wait = MIN_POLL_WAIT_S
            else:
                wait = min(MAX_POLL_WAIT_S, wait * 2)

    def _guarded(self, fn: Any, *args: Any) -> Any:
        """The I/O thread outlives any bug in one task's bookkeeping (it serves all the others)."""
        try:
            return fn(*args)
        except Exception as exc:
            logger.exception("nixl_store: I/O thread error (continuing)")
            self._health.failure(f"I/O thread error: {_describe(exc)}", backend=True)
            return False

    def _start(self, task: _Task, inflight: list[_Task]) -> None:
        try:
            pages, slots = (
                self._prepare_store(task) if task.op == "store" else self._prepare_load(task)
            )
            if not pages:
                self._finish(task, ok=True)
                return
            task.handle = self._storage.post(
                "WRITE" if task.op == "store" else "READ", pages, slots
            )
        except Exception as exc:  # never into a controller: the task fails as a whole
            self._health.failure(
                f"{task.op} transfer of {len(task.keys)} keys failed to start: {_describe(exc)}",
                backend=True,
            )
            self._finish(task, ok=False)
            return
        inflight.append(task)

    def _poll(self, inflight: list[_Task]) -> bool:
        progressed = False
        for task in list(inflight):
            try:
                state = self._storage.state(task.handle)
            except Exception as exc:  # NIXL raises on a backend error status
                state = "ERR"
                error = _describe(exc)
            else:
                error = "NIXL reported ERR"
            if state == "PROC":
                continue
            progressed = True
            inflight.remove(task)
            try:
                self._storage.release(task.handle)
            except Exception as exc:
                logger.debug("nixl_store: releasing a transfer handle failed: %s", exc)
            if state != "DONE":
                self._health.failure(
                    f"{task.op} transfer of {len(task.items)} keys failed: {error}", backend=True
                )
            self._finish(task, ok=state == "DONE")
        return progressed

    # --- store -------------------------------------------------------------------------------

    def _prepare_store(self, task: _Task) -> tuple[list[int], list[int]]:
        pages: list[int] = []
        slots: list[int] = []
        for key, obj in zip(task.keys, task.objects, strict=True):
            with self._lock:
                if key in self._index or key in self._storing:
                    continue  # duplicate: 0 new bytes
            try:
                first, n, nbytes = self._arena.pages_of(obj)
            except BufferRejected as exc:
                self._reject(task, key, str(exc))
                continue
            got = self._pool.allocate(n)
            if got is None:
                self._reject(
                    task,
                    key,
                    f"no free slots for {n} pages ({self._pool.free_count} of "
                    f"{self._pool.total} free); raise pool_size or configure an 'eviction' block",
                )
                continue
            with self._lock:
                if key in self._index or key in self._storing:  # raced with another task
                    self._pool.free(got)
                    continue
                self._storing.add(key)
            tail = n * self._arena.page - nbytes
            if tail:  # the last page's tail is this object's own slot: never ship stale bytes
                ctypes.memset(self._arena.base + first * self._arena.page + nbytes, 0, tail)
            task.items.append((key, got, nbytes))
            pages.extend(range(first, first + n))
            slots.extend(got)
        return pages, slots

    def _reject(self, task: _Task, key: ObjectKey, why: str) -> None:
        task.rejected = True
        self._health.failure(
            f"{task.op} of {object_key_to_string(key)} skipped: {why}", backend=False
        )

    # --- load --------------------------------------------------------------------------------

    def _prepare_load(self, task: _Task) -> tuple[list[int], list[int]]:
        pages: list[int] = []
        slots: list[int] = []
        for i, (key, obj) in enumerate(zip(task.keys, task.objects, strict=True)):
            try:
                first, n, nbytes = self._arena.pages_of(obj)
            except BufferRejected as exc:
                self._reject(task, key, str(exc))
                continue
            with self._lock:
                entry = self._index.get(key)
                if entry is None:
                    continue  # a miss
                if entry.size != nbytes:
                    why = f"it holds {entry.size} bytes but the destination takes {nbytes}"
                else:
                    entry.loading += 1  # its slots stay ours until the read is done
                    why = ""
            if why:
                self._reject(task, key, why)
                continue
            task.items.append((i, key))
            pages.extend(range(first, first + n))
            slots.extend(entry.slots)
        return pages, slots

    # --- completion ------------------------------------------------------------------------------

    def _finish(self, task: _Task, ok: bool) -> None:
        if task.op == "store":
            self._finish_store(task, ok)
        else:
            self._finish_load(task, ok)

    def _finish_store(self, task: _Task, ok: bool) -> None:
        new_keys: list[ObjectKey] = []
        sizes: list[int] = []
        with self._lock:
            for key, slots, nbytes in task.items:
                self._storing.discard(key)
                if ok:
                    charged = len(slots) * self._arena.page
                    self._index[key] = _Entry(slots, nbytes, charged)
                    new_keys.append(key)
                    sizes.append(charged)
                else:
                    self._pool.free(slots)
            stored = [key in self._index for key in task.keys]  # written now or found there
        if task.items and ok:
            self._health.success()
        if new_keys:
            self._notify_keys_stored(new_keys, sizes)
        self._store_channel.complete(task.task_id, L2StoreResult.per_key(stored, sum(sizes)))

    def _finish_load(self, task: _Task, ok: bool) -> None:
        bm = Bitmap(len(task.keys))
        loaded: list[ObjectKey] = []
        with self._lock:
            for i, key in task.items:
                entry = self._index.get(key)
                if entry is not None:
                    entry.loading -= 1
                if ok:
                    bm.set(i)
                    loaded.append(key)
        if task.items and ok:
            self._health.success()
        if loaded:
            self._notify_keys_accessed(loaded)
        self._load_channel.complete(task.task_id, bm)

    # --- eviction ----------------------------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Free the slots of unpinned keys. Pinned keys (a lookup not yet unlocked) and keys a
        load is reading are skipped; the eviction controller retries them later."""
        removed: list[ObjectKey] = []
        sizes: list[int] = []
        with self._lock:
            for key in dict.fromkeys(keys):
                entry = self._index.get(key)
                if entry is None or entry.loading or self._pins.is_locked(key):
                    continue
                del self._index[key]
                self._pool.free(entry.slots)
                removed.append(key)
                sizes.append(entry.charged)
        if removed:
            self._notify_keys_deleted(removed, sizes)

    # --- status and lifecycle --------------------------------------------------------------------

    def is_pinned(self, key: ObjectKey) -> bool:
        return self._pins.is_locked(key)

    def report_status(self) -> dict[str, Any]:
        with self._lock:
            stored = len(self._index)
            pinned = sum(1 for k in self._index if self._pins.is_locked(k))
        free = self._pool.free_count
        status = self._health.snapshot(alive=self._thread.is_alive() and not self._closed)
        status.update(
            {
                "type_name": "nixl_store",
                "type": "NixlStoreL2Adapter",
                "backend": self._cfg.backend,
                "nixl_build": nixl_build_name(),
                "stored_object_count": stored,
                "pinned_object_count": pinned,
                "pool_size": self._cfg.pool_size,
                "slot_bytes": self._arena.page,
                "slots_total": self._pool.total,
                "slots_used": self._pool.total - free,
                "pool_free_slots": free,
                "event_loop_alive": self._thread.is_alive(),
            }
        )
        return status

    def close(self) -> None:
        """Finish the transfers in flight (no buffer is touched once this returns), fail the
        queued tasks, then release NIXL and the slot files."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._thread.join(CLOSE_DRAIN_S)
        if self._thread.is_alive():
            logger.warning(
                "nixl_store: transfers still running %.0f s after close(); NIXL resources are "
                "left allocated",
                CLOSE_DRAIN_S,
            )
        else:
            self._storage.close()
        self._pins.clear()
        self._close_channels()  # a completion after this wakes nobody (the fd may be reused)
