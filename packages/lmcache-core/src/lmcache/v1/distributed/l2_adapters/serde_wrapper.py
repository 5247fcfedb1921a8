"""``SerdeL2AdapterWrapper`` (docs/design/storage-engine.md#l2-wrappers; LMCache 0.5.6's class
and constructor): runs a serde (``lmcache.v1.distributed.serde``) between the caller and an
inner adapter.

An adapter config with a ``"serde": {"type": <name>, **kwargs}`` block is wrapped at
StorageManager start. Store: each object is serialized (on the serde's thread pool) into an L1
temporary buffer, then the inner adapter stores those buffers (exactly the bytes written).
Load: the inner adapter loads into temporaries of ``estimate_serialized_size`` bytes (the
object's layout is the caller's buffer's), then the serde deserializes them into the caller's
buffers. As in 0.5.6, a serde's stored size must be what that estimate says for adapters that
load exactly a buffer's size (``fs``); every built-in serde's is. Lookup, unlock and delete
pass straight through. A failed serialize fails the store; a failed deserialize makes the
whole load task a miss (0.5.6), except that objects the serde only rejected (corrupt, foreign:
``AsyncSerdeProcessor.pop_rejected_positions``) miss alone; never wrong data.
``report_status()`` counts the rejected chunks (``serde_rejected_chunks``).
"""

from __future__ import annotations

import itertools
import queue
import select
import threading
from collections.abc import Callable
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.utils import init_logger
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L1Error, L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.utils import CompletionChannels, TaskIds
from lmcache.v1.distributed.l2_adapters.wrapping import WrappingL2Adapter
from lmcache.v1.distributed.serde import SerdeProcessor, serialized_layout_desc
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform.event_notifier import consume_fd, create_event_notifier

logger = init_logger(__name__)

__all__ = ["SerdeL2AdapterWrapper"]

TMP_TAG = "serde"
_POLL_MS = 500


class _Temporaries:
    """L1 temporary buffers under synthetic keys, pinned while the inner adapter uses them."""

    _ids = itertools.count(1)

    def __init__(self, l1: Any) -> None:
        self._l1 = l1
        self.keys: list[ObjectKey] = []
        self.objs: list[MemoryObj] = []

    def reserve(self, layout: MemoryLayoutDesc) -> MemoryObj | None:
        k = ObjectKey(next(self._ids).to_bytes(8, "big"), "__serde_tmp__", 0)
        err, obj = self._l1.reserve_write([k], [True], layout, TMP_TAG)[k]
        if err is not L1Error.SUCCESS or obj is None:
            return None
        self._l1.pin_objects([obj])
        self.keys.append(k)
        self.objs.append(obj)
        return obj

    def free(self) -> None:
        if self.keys:
            self._l1.finish_write_and_delete(self.keys, TMP_TAG)
            self._l1.unpin_objects(self.objs)
        self.keys, self.objs = [], []


class _Store:
    def __init__(self, tid: int, keys: list[ObjectKey], tmps: _Temporaries) -> None:
        self.tid, self.keys, self.tmps = tid, keys, tmps


class _Load:
    def __init__(
        self, tid: int, keys: list[ObjectKey], objects: list[MemoryObj], tmps: _Temporaries
    ) -> None:
        self.tid, self.keys, self.objects, self.tmps = tid, keys, objects, tmps
        self.hits = Bitmap(len(keys))
        self.decoded: list[int] = []  # positions handed to deserialize, in order


def _layout_of(obj: MemoryObj) -> MemoryLayoutDesc:
    return MemoryLayoutDesc(list(obj.get_shapes()), list(obj.get_dtypes()))


class SerdeL2AdapterWrapper(CompletionChannels, WrappingL2Adapter):
    def __init__(
        self,
        inner: L2AdapterInterface,
        serde: SerdeProcessor,
        l1_manager: Any,
        serde_name: str = "",
    ) -> None:
        super().__init__()
        self._inner = inner
        self._serde = serde
        self._serde_name = serde_name or type(serde).__name__
        self._l1 = l1_manager
        self._ids = TaskIds()
        self._mu = threading.Lock()
        # by serde task id, then by inner task id (touched by the poll thread only)
        self._serializing: dict[int, _Store] = {}
        self._storing: dict[int, _Store] = {}
        self._loading: dict[int, _Load] = {}
        self._deserializing: dict[int, _Load] = {}
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        self._open_channels()  # lookup results stay the inner adapter's: only its fd is woken
        self._ctl_n = create_event_notifier()
        self._closed = False
        self._errors = 0
        self._thread = threading.Thread(target=self._run, name="l2-serde-wrapper", daemon=True)
        self._thread.start()

    @property
    def inner_adapter(self) -> L2AdapterInterface:
        return self._inner

    # --- poll thread -----------------------------------------------------------------------

    def _run(self) -> None:
        fds = {
            self._ctl_n.fileno(): self._drain_jobs,
            self._serde.get_serialize_event_fd(): self._collect_serialized,
            self._inner.get_store_event_fd(): self._collect_stores,
            self._inner.get_load_event_fd(): self._collect_loads,
            self._serde.get_deserialize_event_fd(): self._collect_deserialized,
        }
        inner_lookup = self._inner.get_lookup_and_lock_event_fd()
        poller = select.poll()
        for fd in (*fds, inner_lookup):
            poller.register(fd, select.POLLIN)
        while not self._closed:
            ready = {fd for fd, _ in poller.poll(_POLL_MS)}
            for fd in ready:
                consume_fd(fd)
            if self._closed:
                return
            if inner_lookup in ready:
                self._lookup_channel.wake()
            for step in fds.values():  # every step each wake-up: a lost wake-up cannot stall
                try:
                    step()
                except Exception:
                    logger.exception("serde wrapper poll loop error (continuing)")

    def _drain_jobs(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            job()

    def _submit(self, job: Callable[[], None]) -> None:
        if self._closed:
            raise RuntimeError("serde L2 adapter wrapper is closed")
        self._jobs.put(job)
        self._ctl_n.notify()

    def _fail(self, what: str, exc: BaseException | None = None) -> None:
        with self._mu:
            self._errors += 1
        logger.warning(
            "serde %r: %s task failed%s", self._serde_name, what, f": {exc}" if exc else ""
        )

    def _submit_task(
        self,
        start: Callable[[int, list[ObjectKey], list[MemoryObj]], None],
        keys: list[ObjectKey],
        objects: list[MemoryObj],
    ) -> L2TaskId:
        """A new task id now; ``start(tid, keys, objects)`` runs on the poll thread."""
        if len(keys) != len(objects):
            raise ValueError(f"keys and objects differ in length ({len(keys)} != {len(objects)})")
        tid = self._ids.next()
        keys, objects = list(keys), list(objects)
        self._submit(lambda: start(tid, keys, objects))
        return tid

    def _reserve_serialized(self, objects: list[MemoryObj]) -> _Temporaries:
        """One temporary per object, ``estimate_serialized_size`` bytes; MemoryError when L1
        has no room (the temporaries reserved so far are freed)."""
        tmps = _Temporaries(self._l1)
        for obj in objects:
            if tmps.reserve(serialized_layout_desc(_layout_of(obj), self._serde)) is None:
                tmps.free()
                raise MemoryError("no L1 memory for a serde temporary buffer")
        return tmps

    # --- store: serialize, then the inner adapter stores the temporaries ---------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit_task(self._start_store, keys, objects)

    def _start_store(self, tid: int, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        try:
            tmps = self._reserve_serialized(objects)
        except Exception as e:
            self._fail("store", e)
            self._store_channel.complete(tid, L2StoreResult(False, 0))
            return
        try:
            sid = self._serde.submit_serialize(objects, tmps.objs, keys)
        except Exception as e:
            tmps.free()
            self._fail("store", e)
            self._store_channel.complete(tid, L2StoreResult(False, 0))
            return
        self._serializing[sid] = _Store(tid, keys, tmps)

    def _collect_serialized(self) -> None:
        for sid in list(self._serializing):
            ok = self._serde.query_serialize_result(sid)
            if ok is None:
                continue
            st = self._serializing.pop(sid)
            try:
                if not ok:
                    raise ValueError("serialize failed")
                inner_tid = self._inner.submit_store_task(st.keys, st.tmps.objs)
            except Exception as e:
                st.tmps.free()
                self._fail("store", e)
                self._store_channel.complete(st.tid, L2StoreResult(False, 0))
                continue
            self._storing[inner_tid] = st

    def _collect_stores(self) -> None:
        if not self._storing:
            return
        for inner_tid, result in self._inner.pop_completed_store_tasks().items():
            st = self._storing.pop(inner_tid, None)
            if st is None:
                continue
            st.tmps.free()
            self._store_channel.complete(st.tid, result)

    # --- lookup: the inner adapter's (the poll thread only forwards its wake-ups) -------------

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._inner.query_lookup_and_lock_result(task_id)

    # --- load: the inner adapter loads the temporaries, then deserialize ------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit_task(self._start_load, keys, objects)

    def _start_load(self, tid: int, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        try:
            tmps = self._reserve_serialized(objects)
        except Exception as e:
            self._fail("load", e)
            self._load_channel.complete(tid, Bitmap(len(keys)))
            return
        try:
            inner_tid = self._inner.submit_load_task(keys, tmps.objs)
        except Exception as e:
            tmps.free()
            self._fail("load", e)
            self._load_channel.complete(tid, Bitmap(len(keys)))
            return
        self._loading[inner_tid] = _Load(tid, keys, objects, tmps)

    def _collect_loads(self) -> None:
        for inner_tid in list(self._loading):
            bm = self._inner.query_load_result(inner_tid)
            if bm is None:
                continue
            ld = self._loading.pop(inner_tid)
            hit = [i for i in range(len(ld.keys)) if bm.test(i)]
            if not hit:
                self._finish_load(ld, Bitmap(len(ld.keys)))
                continue
            try:
                sid = self._serde.submit_deserialize(
                    [ld.tmps.objs[i] for i in hit],
                    [ld.objects[i] for i in hit],
                    [ld.keys[i] for i in hit],
                )
            except Exception as e:
                self._fail("load", e)
                self._finish_load(ld, Bitmap(len(ld.keys)))
                continue
            for i in hit:
                ld.hits.set(i)
            ld.decoded = hit
            self._deserializing[sid] = ld

    def _collect_deserialized(self) -> None:
        for sid in list(self._deserializing):
            ok = self._serde.query_deserialize_result(sid)
            if ok is None:
                continue
            ld = self._deserializing.pop(sid)
            bm = ld.hits
            if not ok:
                self._fail("load")
                pop = getattr(self._serde, "pop_rejected_positions", None)
                rejected = pop(sid) if pop is not None else None
                if rejected:  # only those objects miss; the others were decoded
                    for j in rejected:
                        bm.clear(ld.decoded[j])
                else:
                    bm = Bitmap(len(ld.keys))
            self._finish_load(ld, bm)

    def _finish_load(self, ld: _Load, bm: Bitmap) -> None:
        ld.tmps.free()
        self._load_channel.complete(ld.tid, bm)

    # --- accounting and status: the inner adapter's ----------------------------------------------

    def report_status(self) -> dict[str, Any]:
        status = dict(self._inner.report_status())
        with self._mu:
            errors = self._errors
        status["serde"] = self._serde_name
        status["serde_wrapped"] = True  # 0.5.6's key
        status["serde_failed_tasks"] = errors
        status["serde_rejected_chunks"] = int(getattr(self._serde, "rejected_chunks", 0))
        status["is_healthy"] = bool(status.get("is_healthy", True)) and self._thread.is_alive()
        return status

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ctl_n.notify()
        self._thread.join(timeout=5)
        # after these two no one touches a temporary any more
        self._inner.close()
        self._serde.close()
        for st in [*self._serializing.values(), *self._storing.values()]:
            st.tmps.free()
        for ld in [*self._loading.values(), *self._deserializing.values()]:
            ld.tmps.free()
        self._serializing, self._storing, self._loading, self._deserializing = {}, {}, {}, {}
        self._close_channels()
        self._ctl_n.close()
