"""``SerdeL2AdapterWrapper`` (docs/design/storage-engine.md#l2-wrappers): runs a serde between the
caller and an inner adapter.

An adapter config with a ``"serde": {"type": <name>, **kwargs}`` block is wrapped at
StorageManager start. On store each object is serialised into an L1 temporary buffer and the
inner adapter stores those; on load the inner adapter loads into temporaries which are then
deserialised into the caller's buffers. Lookup, unlock and delete pass straight through.

LMCache's own serialized formats belong to a separate serde specification, so this module
ships only a registry and the ``identity`` serde; real serdes register with
``register_l2_serde``. Because a serialized object may be smaller than its source, the
wrapper remembers each stored key's serialized size (in memory): a key stored by another
process or before a restart is a load miss, never wrong data.
"""

from __future__ import annotations

import itertools
import queue
import select
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from lmcache.lmcache_native import Bitmap
from lmcache.utils import init_logger
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L1Error, L2AdapterListener, L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import SerdeConfig
from lmcache.v1.distributed.l2_adapters.utils import CompletionChannels, TaskIds
from lmcache.v1.distributed.l2_adapters.wrapping import WrappingL2Adapter
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform.event_notifier import consume_fd, create_event_notifier

logger = init_logger(__name__)

__all__ = [
    "IdentitySerde",
    "L2Serde",
    "SerdeL2AdapterWrapper",
    "create_l2_serde",
    "get_registered_l2_serdes",
    "register_l2_serde",
]

TMP_TAG = "serde"
_POLL_MS = 500


class L2Serde(Protocol):
    """A serde turns one object's bytes into a (possibly smaller) serialized form and back."""

    def max_serialized_size(self, nbytes: int) -> int: ...

    def serialize(self, src: memoryview, dst: memoryview) -> int: ...

    def deserialize(self, src: memoryview, dst: memoryview) -> None: ...


class IdentitySerde:
    """Bytes unchanged: exercises the pipeline and is the template for real serdes."""

    def max_serialized_size(self, nbytes: int) -> int:
        return nbytes

    def serialize(self, src: memoryview, dst: memoryview) -> int:
        dst[: len(src)] = src
        return len(src)

    def deserialize(self, src: memoryview, dst: memoryview) -> None:
        if len(src) != len(dst):
            raise ValueError(
                f"identity serde: {len(src)} serialized bytes for a {len(dst)}-byte object"
            )
        dst[:] = src


_SERDES: dict[str, Callable[..., L2Serde]] = {}
_SERDES_LOCK = threading.Lock()


def register_l2_serde(name: str, factory: Callable[..., L2Serde]) -> None:
    """Register ``factory(**kwargs) -> serde`` under ``name`` (the ``serde.type`` value)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"L2 serde name must be a non-empty string, got {name!r}")
    with _SERDES_LOCK:
        if name in _SERDES:
            raise ValueError(f"L2 serde already registered: {name!r}")
        _SERDES[name] = factory


def get_registered_l2_serdes() -> list[str]:
    with _SERDES_LOCK:
        return sorted(_SERDES)


def create_l2_serde(cfg: SerdeConfig) -> L2Serde:
    """Build the serde a ``serde`` block names; an unknown type or bad kwargs raise ValueError."""
    with _SERDES_LOCK:
        factory = _SERDES.get(cfg.type)
    if factory is None:
        known = ", ".join(get_registered_l2_serdes()) or "(none)"
        raise ValueError(
            f"unknown L2 serde type {cfg.type!r}. Registered serdes: {known} "
            "(register more with lmcache.v1.distributed.l2_adapters.serde_wrapper."
            "register_l2_serde)"
        )
    try:
        return factory(**cfg.kwargs)
    except TypeError as e:
        raise ValueError(f"serde {cfg.type!r}: bad options {cfg.kwargs!r}: {e}") from e


register_l2_serde("identity", IdentitySerde)


def _byte_layout(n: int) -> MemoryLayoutDesc:
    return MemoryLayoutDesc([torch.Size([max(1, n)])], [torch.uint8])


class _Temporaries:
    """L1 temporary buffers under synthetic keys, pinned while the inner adapter uses them."""

    _ids = itertools.count(1)

    def __init__(self, l1: Any) -> None:
        self._l1 = l1
        self.keys: list[ObjectKey] = []
        self.objs: list[MemoryObj] = []

    def reserve(self, n: int) -> MemoryObj | None:
        k = ObjectKey(next(self._ids).to_bytes(8, "big"), "__serde_tmp__", 0)
        err, obj = self._l1.reserve_write([k], [True], _byte_layout(n), TMP_TAG)[k]
        if err is not L1Error.SUCCESS or obj is None:
            return None
        self._l1.pin_objects([obj])
        obj.set_used_size(n)
        self.keys.append(k)
        self.objs.append(obj)
        return obj

    def free(self) -> None:
        if self.keys:
            self._l1.finish_write_and_delete(self.keys, TMP_TAG)
            self._l1.unpin_objects(self.objs)
        self.keys, self.objs = [], []


class _SizeForgetter(L2AdapterListener):
    def __init__(self, sizes: dict[ObjectKey, int], mu: threading.Lock) -> None:
        self._sizes, self._mu = sizes, mu

    def on_l2_keys_deleted(self, keys: list[ObjectKey]) -> None:
        with self._mu:
            for k in keys:
                self._sizes.pop(k, None)


class SerdeL2AdapterWrapper(CompletionChannels, WrappingL2Adapter):
    def __init__(
        self, inner: L2AdapterInterface, serde: L2Serde, serde_name: str, l1_manager: Any
    ) -> None:
        super().__init__()
        self._inner = inner
        self._serde = serde
        self._serde_name = serde_name
        self._l1 = l1_manager
        self._ids = TaskIds()
        self._mu = threading.Lock()
        self._sizes: dict[ObjectKey, int] = {}  # serialized size of each stored key
        self._stores: dict[int, tuple[int, list[ObjectKey], list[int], _Temporaries]] = {}
        self._loads: dict[int, tuple[int, list[int], list[MemoryObj], _Temporaries, int]] = {}
        self._jobs: queue.Queue[Callable[[], None]] = queue.Queue()
        self._open_channels()  # lookup results stay the inner adapter's: only its fd is woken
        self._ctl_n = create_event_notifier()
        self._closed = False
        self._errors = 0
        inner.register_listener(_SizeForgetter(self._sizes, self._mu))
        self._thread = threading.Thread(target=self._run, name="l2-serde-wrapper", daemon=True)
        self._thread.start()

    # --- poll thread -----------------------------------------------------------------------

    def _run(self) -> None:
        inner_store = self._inner.get_store_event_fd()
        inner_lookup = self._inner.get_lookup_and_lock_event_fd()
        inner_load = self._inner.get_load_event_fd()
        ctl = self._ctl_n.fileno()
        poller = select.poll()
        for fd in (ctl, inner_store, inner_lookup, inner_load):
            poller.register(fd, select.POLLIN)
        while not self._closed:
            ready = {fd for fd, _ in poller.poll(_POLL_MS)}
            for fd in ready:
                consume_fd(fd)
            if self._closed:
                return
            if inner_lookup in ready:
                self._lookup_channel.wake()
            try:
                self._drain_jobs()
                self._collect_stores()
                self._collect_loads()
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

    def _fail(self, what: str, exc: BaseException) -> None:
        with self._mu:
            self._errors += 1
        logger.warning("serde %r: %s task failed: %s", self._serde_name, what, exc)

    # --- store -----------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit_task(self._start_store, keys, objects)

    def _submit_task(
        self,
        start: Callable[[int, list[ObjectKey], list[MemoryObj]], None],
        keys: list[ObjectKey],
        objects: list[MemoryObj],
    ) -> L2TaskId:
        """A new task id now; ``start(tid, keys, objects)`` runs on the worker thread."""
        if len(keys) != len(objects):
            raise ValueError(f"keys and objects differ in length ({len(keys)} != {len(objects)})")
        tid = self._ids.next()
        keys, objects = list(keys), list(objects)
        self._submit(lambda: start(tid, keys, objects))
        return tid

    def _start_store(self, tid: int, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        tmps = _Temporaries(self._l1)
        try:
            sizes = []
            for obj in objects:
                src = obj.byte_array
                tmp = tmps.reserve(self._serde.max_serialized_size(len(src)))
                if tmp is None:
                    raise MemoryError("no L1 memory for a serde temporary buffer")
                n = int(self._serde.serialize(src, tmp.byte_array))
                if not 0 <= n <= tmp.get_size():
                    raise ValueError(f"serialize() returned {n} for a {tmp.get_size()}-byte buffer")
                tmp.set_used_size(n)
                sizes.append(n)
            inner_tid = self._inner.submit_store_task(keys, tmps.objs)
        except Exception as e:
            tmps.free()
            self._fail("store", e)
            self._store_channel.complete(tid, L2StoreResult(False, 0))
            return
        with self._mu:
            self._stores[inner_tid] = (tid, keys, sizes, tmps)

    def _collect_stores(self) -> None:
        with self._mu:
            if not self._stores:
                return
        done = self._inner.pop_completed_store_tasks()
        for inner_tid, result in done.items():
            with self._mu:
                entry = self._stores.pop(inner_tid, None)
            if entry is None:
                continue
            tid, keys, sizes, tmps = entry
            tmps.free()
            if _succeeded(result):
                with self._mu:
                    self._sizes.update(zip(keys, sizes, strict=False))
            self._store_channel.complete(tid, result)

    # --- lookup: the inner adapter's (the poll thread only forwards its wake-ups) -------------

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._inner.query_lookup_and_lock_result(task_id)

    # --- load ----------------------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit_task(self._start_load, keys, objects)

    def _start_load(self, tid: int, keys: list[ObjectKey], objects: list[MemoryObj]) -> None:
        tmps = _Temporaries(self._l1)
        positions: list[int] = []
        sub_keys: list[ObjectKey] = []
        try:
            with self._mu:
                known = [self._sizes.get(k) for k in keys]
            for i, (k, size) in enumerate(zip(keys, known, strict=False)):
                if size is None:
                    continue  # not stored through this wrapper: a miss
                if tmps.reserve(size) is None:
                    break  # out of L1 memory: the rest are misses
                positions.append(i)
                sub_keys.append(k)
            if not sub_keys:
                tmps.free()
                self._finish_load(tid, Bitmap(len(keys)))
                return
            inner_tid = self._inner.submit_load_task(sub_keys, tmps.objs)
        except Exception as e:
            tmps.free()
            self._fail("load", e)
            self._finish_load(tid, Bitmap(len(keys)))
            return
        with self._mu:
            self._loads[inner_tid] = (tid, positions, objects, tmps, len(keys))

    def _collect_loads(self) -> None:
        with self._mu:
            pending = list(self._loads)
        for inner_tid in pending:
            bm = self._inner.query_load_result(inner_tid)
            if bm is None:
                continue
            with self._mu:
                tid, positions, objects, tmps, n = self._loads.pop(inner_tid)
            out = Bitmap(n)
            try:
                for j, i in enumerate(positions):
                    if bm.test(j):
                        self._serde.deserialize(tmps.objs[j].byte_array, objects[i].byte_array)
                        out.set(i)
            except Exception as e:
                self._fail("load", e)
                out = Bitmap(n)  # the task fails as a whole
            finally:
                tmps.free()
            self._finish_load(tid, out)

    def _finish_load(self, tid: int, bm: Bitmap) -> None:
        self._load_channel.complete(tid, bm)

    # --- accounting and status: the inner adapter's ----------------------------------------------

    def report_status(self) -> dict[str, Any]:
        status = dict(self._inner.report_status())
        with self._mu:
            errors = self._errors
        status["serde"] = self._serde_name
        status["serde_failed_tasks"] = errors
        status["is_healthy"] = bool(status.get("is_healthy", True)) and self._thread.is_alive()
        return status

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._ctl_n.notify()
        self._thread.join(timeout=5)
        self._inner.close()  # after this the inner adapter touches no temporary
        with self._mu:
            stores, self._stores = self._stores, {}
            loads, self._loads = self._loads, {}
        for _tid, _keys, _sizes, tmps in stores.values():
            tmps.free()
        for _tid, _pos, _objs, tmps, _n in loads.values():
            tmps.free()
        self._close_channels()
        self._ctl_n.close()


def _succeeded(result: Any) -> bool:
    """Success of a raw inner store result (legacy values as in
    docs/design/storage-engine.md#store-controller)."""
    if isinstance(result, L2StoreResult):
        return bool(result.is_successful())
    if isinstance(result, bool):
        return result
    if isinstance(result, int):
        return result >= 0
    return False
