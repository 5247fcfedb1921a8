"""``mock`` L2 type (test-only, docs/design/storage-engine.md#backend-mock): an in-memory store that
emulates bandwidth.

Stores deep copies; duplicate keys and keys that do not fit are skipped while the task still
succeeds with only the newly stored bytes. Lookup takes refcount locks, load copies, delete
removes unlocked keys and notifies.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.utils import init_logger
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L1MemoryDesc, L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import (
    L2AdapterConfigBase,
)
from lmcache.v1.distributed.l2_adapters.health import HealthTracker
from lmcache.v1.distributed.l2_adapters.hookspecs import L2AdapterTypeSpec, hookimpl
from lmcache.v1.distributed.l2_adapters.utils import CompletionChannels, KeyLockTable, TaskIds
from lmcache.v1.memory_management import MemoryObj

logger = init_logger(__name__)

GiB = 1 << 30


def _positive_number(d: dict[str, Any], key: str) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"{key} must be a positive number")
    return float(v)


@dataclass
class MockL2AdapterConfig(L2AdapterConfigBase):
    type_name = "mock"

    max_size_gb: float
    mock_bandwidth_gb: float

    known_fields = frozenset({"max_size_gb", "mock_bandwidth_gb"})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MockL2AdapterConfig:
        return cls(
            max_size_gb=_positive_number(d, "max_size_gb"),
            mock_bandwidth_gb=_positive_number(d, "mock_bandwidth_gb"),
        )

    @classmethod
    def help(cls) -> str:
        return (
            "mock L2 adapter (testing only): in-memory, bandwidth-limited.\n"
            "  max_size_gb (float, required, > 0): capacity in GiB\n"
            "  mock_bandwidth_gb (float, required, > 0): emulated bandwidth in GiB/s\n"
            'Example: {"type":"mock","max_size_gb":1.0,"mock_bandwidth_gb":10.0}'
        )


class MockL2Adapter(CompletionChannels, L2AdapterInterface):
    def __init__(self, config: MockL2AdapterConfig, l1_memory_desc: L1MemoryDesc | None = None):
        super().__init__(max_capacity_bytes=int(config.max_size_gb * GiB))
        self._bandwidth = config.mock_bandwidth_gb * GiB
        self._data: dict[ObjectKey, bytes] = {}
        self._used = 0
        self._mu = threading.Lock()
        self._locks = KeyLockTable()
        self._ids = TaskIds()
        self._open_channels()
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._health = HealthTracker("mock")
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="mock-l2-adapter", daemon=True)
        self._worker.start()

    # worker
    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            op, job = item
            try:
                job()
            except Exception as exc:
                self._health.failure(op, f"{type(exc).__name__}: {exc}")
                logger.exception("mock L2 adapter %s job failed", op)
            else:
                self._health.success(op)

    def _delay(self, nbytes: int) -> None:
        if nbytes > 0:
            time.sleep(nbytes / self._bandwidth)

    def _submit(self, op: str, fn: Any) -> None:
        if self._closed:
            raise RuntimeError("mock L2 adapter is closed")
        self._jobs.put((op, fn))

    # store
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        tid = self._ids.next()
        payload = [bytes(o.byte_array) for o in objects]  # the caller's buffer is read now

        def job() -> None:
            self._delay(sum(len(p) for p in payload))
            new_keys, new_sizes = [], []
            with self._mu:
                for k, data in zip(keys, payload, strict=False):
                    if k in self._data:
                        continue
                    if self._used + len(data) > self._max_capacity_bytes:
                        continue
                    self._data[k] = data
                    self._used += len(data)
                    new_keys.append(k)
                    new_sizes.append(len(data))
            if new_keys:
                self._notify_keys_stored(new_keys, new_sizes)
            self._store_channel.complete(tid, L2StoreResult(True, sum(new_sizes)))

        self._submit("store", job)
        return tid

    # lookup
    def submit_lookup_and_lock_task(
        self,
        keys: list[ObjectKey],
        group_layout_descs: dict[int, MemoryLayoutDesc] | None = None,
    ) -> L2TaskId:
        tid = self._ids.next()

        def job() -> None:
            bm = Bitmap(len(keys))
            found = []
            with self._mu:
                for i, k in enumerate(keys):
                    if k in self._data:
                        bm.set(i)
                        found.append(k)
                self._locks.lock(found)
            self._lookup_channel.complete(tid, bm)

        self._submit("lookup", job)
        return tid

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self._locks.unlock(keys)

    # load
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        tid = self._ids.next()

        def job() -> None:
            bm = Bitmap(len(keys))
            loaded = []
            total = 0
            for i, (k, o) in enumerate(zip(keys, objects, strict=False)):
                with self._mu:
                    data = self._data.get(k)
                if data is None:
                    continue
                dst = o.byte_array
                if len(dst) != len(data):
                    continue  # a length mismatch is a miss
                dst[:] = data
                total += len(data)
                bm.set(i)
                loaded.append(k)
            self._delay(total)
            if loaded:
                self._notify_keys_accessed(loaded)
            self._load_channel.complete(tid, bm)

        self._submit("load", job)
        return tid

    # eviction
    def delete(self, keys: list[ObjectKey]) -> None:
        removed, sizes = [], []
        with self._mu:
            for k in keys:
                if k in self._data and not self._locks.is_locked(k):
                    sizes.append(len(self._data.pop(k)))
                    self._used -= sizes[-1]
                    removed.append(k)
        if removed:
            self._notify_keys_deleted(removed, sizes)

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyListPage:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be positive (got {page_size})")
        try:
            start = int(cursor) if cursor else 0
        except ValueError:
            raise ValueError(f"invalid cursor {cursor!r}: pass the previous page's token") from None
        if start < 0:
            raise ValueError(f"invalid cursor {cursor!r}: pass the previous page's token")
        with self._mu:
            items = [
                (k, len(v))
                for k, v in self._data.items()
                if model_name is None or k.model_name == model_name
            ]
        page = items[start : start + page_size]
        nxt = str(start + page_size) if start + page_size < len(items) else None
        return KeyListPage([KeyEntry(k.to_encoded_object_key(), n) for k, n in page], nxt)

    # debug helpers
    def debug_has_key(self, key: ObjectKey) -> bool:
        with self._mu:
            return key in self._data

    def debug_num_keys(self) -> int:
        with self._mu:
            return len(self._data)

    def debug_used_bytes(self) -> int:
        with self._mu:
            return self._used

    def report_status(self) -> dict[str, Any]:
        healthy = self._health.healthy and self._worker.is_alive() and not self._closed
        return {
            "is_healthy": healthy,
            **self._health.status(),
            "healthy": healthy,
            "type_name": "mock",
            "num_keys": self.debug_num_keys(),
            "used_bytes": self.debug_used_bytes(),
            "capacity_bytes": self._max_capacity_bytes,
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join(timeout=5)
        self._close_channels()


@hookimpl
def lmcache_l2_adapter_types() -> list[L2AdapterTypeSpec]:
    """Core's built-in ``mock`` type (loaded by the registry like a wheel's hooks)."""
    return [L2AdapterTypeSpec("mock", MockL2AdapterConfig, MockL2Adapter)]
