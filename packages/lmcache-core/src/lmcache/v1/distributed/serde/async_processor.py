"""``AsyncSerdeProcessor`` (LMCache 0.5.6's name and constructor): a ``SerdeProcessor``
built from a synchronous Serializer/Deserializer pair.

Each submitted batch runs on a thread pool of ``max_workers`` threads (default 1), never on
the submitter's thread (the L2 wrapper's poll thread, the server's event loop). When a batch
ends, its result is kept until queried and the serialize or deserialize event fd is woken.
A batch fails as a whole when one object fails (0.5.6's result). Objects a deserializer
rejects (``SerdeRejectedError``) are counted in ``rejected_chunks``, and when rejections are
a batch's only failures, ``pop_rejected_positions`` (ours) names them, so that the L2 wrapper
misses only those objects and serves the rest of the batch.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from lmcache.utils import init_logger
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde.base import (
    Deserializer,
    SerdeProcessor,
    SerdeRejectedError,
    SerdeTaskId,
    Serializer,
)
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform.event_notifier import EventNotifier, create_event_notifier

logger = init_logger(__name__)

__all__ = ["AsyncSerdeProcessor"]


class _Side:
    """One direction (serialize or deserialize): its notifier and finished results."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.notifier: EventNotifier = create_event_notifier()
        self.results: dict[SerdeTaskId, bool] = {}
        self.rejected: dict[SerdeTaskId, list[int]] = {}


class AsyncSerdeProcessor(SerdeProcessor):
    """A ``SerdeProcessor`` running ``serializer`` / ``deserializer`` on a pool of
    ``max_workers`` threads (see the module docstring)."""

    def __init__(
        self, serializer: Serializer, deserializer: Deserializer, max_workers: int = 1
    ) -> None:
        max_workers = int(max_workers)
        if max_workers < 1:
            raise ValueError(f"serde max_workers must be >= 1, got {max_workers}")
        self._serializer = serializer
        self._deserializer = deserializer
        self._lock = threading.Lock()
        self._next_id: SerdeTaskId = 0
        self._ser = _Side("serialize")
        self._de = _Side("deserialize")
        self._rejected = 0
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="l2-serde")

    @property
    def serializer(self) -> Serializer:
        """The synchronous serializer the pool runs."""
        return self._serializer

    @property
    def deserializer(self) -> Deserializer:
        """The synchronous deserializer the pool runs."""
        return self._deserializer

    @property
    def rejected_chunks(self) -> int:
        """Objects the deserializer rejected as corrupt or not its own, since start."""
        with self._lock:
            return self._rejected

    def pop_rejected_positions(self, task_id: SerdeTaskId) -> list[int] | None:
        """After a deserialize task reported False: the positions of the objects rejected
        as corrupt or foreign when those were its only failures (the others were decoded),
        else None. Asked once per task."""
        with self._lock:
            return self._de.rejected.pop(task_id, None)

    def get_serialize_event_fd(self) -> int:
        return self._ser.notifier.fileno()

    def get_deserialize_event_fd(self) -> int:
        return self._de.notifier.fileno()

    def submit_serialize(
        self, src_objs: list[MemoryObj], dst_objs: list[MemoryObj], keys: list[ObjectKey]
    ) -> SerdeTaskId:
        return self._submit(self._ser, src_objs, dst_objs, keys)

    def query_serialize_result(self, task_id: SerdeTaskId) -> bool | None:
        with self._lock:
            return self._ser.results.pop(task_id, None)

    def submit_deserialize(
        self, src_objs: list[MemoryObj], dst_objs: list[MemoryObj], keys: list[ObjectKey]
    ) -> SerdeTaskId:
        return self._submit(self._de, src_objs, dst_objs, keys)

    def query_deserialize_result(self, task_id: SerdeTaskId) -> bool | None:
        with self._lock:
            return self._de.results.pop(task_id, None)

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        return int(self._serializer.estimate_serialized_size(layout_desc))

    def close(self) -> None:
        """Waits for running batches, then closes the event fds."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._ser.notifier.close()
        self._de.notifier.close()

    # --- internals ---------------------------------------------------------------------------

    def _submit(
        self,
        side: _Side,
        src_objs: list[MemoryObj],
        dst_objs: list[MemoryObj],
        keys: list[ObjectKey],
    ) -> SerdeTaskId:
        if not len(src_objs) == len(dst_objs) == len(keys):
            raise ValueError(
                f"serde {side.name}: {len(src_objs)} sources, {len(dst_objs)} destinations "
                f"and {len(keys)} keys (they must pair up)"
            )
        if self._closed:
            raise RuntimeError("serde processor is closed")
        with self._lock:
            task_id = self._next_id
            self._next_id += 1
        self._pool.submit(self._run, side, task_id, list(src_objs), list(dst_objs), list(keys))
        return task_id

    def _run(
        self,
        side: _Side,
        task_id: SerdeTaskId,
        src_objs: list[MemoryObj],
        dst_objs: list[MemoryObj],
        keys: list[ObjectKey],
    ) -> None:
        ok = True
        rejected: list[int] = []
        for i, (src, dst, key) in enumerate(zip(src_objs, dst_objs, keys, strict=True)):
            try:
                if side is self._ser:
                    n = self._serializer.serialize(src, dst, key)
                    # the adapter stores exactly the bytes written (0.5.6 does the same)
                    if isinstance(n, int) and hasattr(dst, "set_used_size"):
                        dst.set_used_size(n)
                else:
                    self._deserializer.deserialize(src, dst, key)
            except SerdeRejectedError as e:
                ok = False
                rejected.append(i)
                logger.warning("serde %s task %d: object rejected: %s", side.name, task_id, e)
            except Exception:
                ok = False
                rejected = []  # not only rejections: the batch fails as a whole
                logger.exception("serde %s task %d failed", side.name, task_id)
                break
        with self._lock:
            self._rejected += len(rejected)
            if rejected:
                side.rejected[task_id] = rejected
            side.results[task_id] = ok
        try:
            side.notifier.notify()
        except OSError:
            logger.exception("serde %s task %d: cannot signal completion", side.name, task_id)
