"""``InMemoryL2Adapter``: a dict-backed L2 adapter with FIFO eviction by capacity.

Load it with::

    --l2-adapter '{"type":"plugin","module_path":"lmc_external_l2_adapter",
                   "class_name":"InMemoryL2Adapter",
                   "adapter_params":{"max_size_gb":1.0,"mock_bandwidth_gb":20.0}}'

The constructor accepts the config object (config-class mode) or the raw ``adapter_params``
dict (raw-dict mode), plus ``**kwargs`` (``l1_memory_desc``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey

# Names without a 0.5.6 public path come from the storage plugin API (lmcache>=0.5.6.1).
from lmcache.v1.distributed.l2_adapters.api import (
    Bitmap,
    L2StoreResult,
    MemoryObj,
    create_event_notifier,
)
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

GiB = 1 << 30


@dataclass
class InMemoryL2AdapterConfig(L2AdapterConfigBase):
    max_size_gb: float = 0.5
    mock_bandwidth_gb: float = 10.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InMemoryL2AdapterConfig:
        try:
            size = float(d.get("max_size_gb", 0.5))
            bw = float(d.get("mock_bandwidth_gb", 10.0))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"max_size_gb and mock_bandwidth_gb must be numbers: {exc}") from exc
        if size <= 0:
            raise ValueError(f"max_size_gb must be positive (got {size})")
        if bw <= 0:
            raise ValueError(f"mock_bandwidth_gb must be positive (got {bw})")
        return cls(max_size_gb=size, mock_bandwidth_gb=bw)

    @classmethod
    def help(cls) -> str:
        return (
            "InMemoryL2Adapter (example plugin): objects kept in a Python dict, FIFO eviction.\n"
            "  max_size_gb (float, default 0.5): capacity in GiB\n"
            "  mock_bandwidth_gb (float, default 10.0): emulated bandwidth in GiB/s"
        )


class InMemoryL2Adapter(L2AdapterInterface):
    def __init__(self, config: InMemoryL2AdapterConfig | dict[str, Any], **_kwargs: object):
        if isinstance(config, dict):
            config = InMemoryL2AdapterConfig.from_dict(config)
        capacity = int(config.max_size_gb * GiB)
        super().__init__(max_capacity_bytes=capacity)
        self.config = config
        self._capacity = capacity
        self._bandwidth = config.mock_bandwidth_gb * GiB
        self._data: OrderedDict[ObjectKey, torch.Tensor] = OrderedDict()  # insertion = FIFO
        self._used = 0
        self._locks: dict[ObjectKey, int] = {}
        self._mu = threading.Lock()
        self._next_id = 0
        self._store_fd = create_event_notifier()
        self._lookup_fd = create_event_notifier()
        self._load_fd = create_event_notifier()
        self._store_results: dict[int, L2StoreResult] = {}
        self._lookup_results: dict[int, Bitmap] = {}
        self._load_results: dict[int, Bitmap] = {}
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="inmemory-l2", daemon=True)
        self._worker.start()
        self._closed = False

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def _task_id(self) -> int:
        with self._mu:
            self._next_id += 1
            return self._next_id

    def _delay(self, nbytes: int) -> None:
        time.sleep(nbytes / self._bandwidth)

    # event fds
    def get_store_event_fd(self) -> int:
        return self._store_fd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_fd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_fd.fileno()

    # store
    def _evict_fifo_until(self, need: int) -> None:
        # called with self._mu held; oldest first, locked keys are skipped
        evicted_keys, evicted_sizes = [], []
        for key in list(self._data):
            if self._used + need <= self._capacity:
                break
            if self._locks.get(key, 0) > 0:
                continue
            size = self._data.pop(key).numel()
            self._used -= size
            evicted_keys.append(key)
            evicted_sizes.append(size)
        if evicted_keys:
            self._notify_keys_deleted(evicted_keys, evicted_sizes)

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        tid = self._task_id()
        copies = [torch.frombuffer(bytearray(o.byte_array), dtype=torch.uint8) for o in objects]

        def job() -> None:
            new_keys, new_sizes = [], []
            with self._mu:
                for key, data in zip(keys, copies, strict=False):
                    size = data.numel()
                    if key in self._data or size > self._capacity:
                        continue
                    self._evict_fifo_until(size)
                    if self._used + size > self._capacity:
                        continue  # everything left is locked
                    self._data[key] = data
                    self._used += size
                    new_keys.append(key)
                    new_sizes.append(size)
            self._delay(sum(new_sizes))
            if new_keys:
                self._notify_keys_stored(new_keys, new_sizes)
            with self._mu:
                self._store_results[tid] = L2StoreResult(True, sum(new_sizes))
            self._store_fd.notify()

        self._jobs.put(job)
        return tid

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._mu:
            done, self._store_results = self._store_results, {}
        return done

    # lookup
    def submit_lookup_and_lock_task(
        self,
        keys: list[ObjectKey],
        group_layout_descs: dict[int, MemoryLayoutDesc] | None = None,
    ) -> L2TaskId:
        tid = self._task_id()

        def job() -> None:
            bm = Bitmap(len(keys))
            with self._mu:
                for i, key in enumerate(keys):
                    if key in self._data:
                        bm.set(i)
                        self._locks[key] = self._locks.get(key, 0) + 1
                self._lookup_results[tid] = bm
            self._lookup_fd.notify()

        self._jobs.put(job)
        return tid

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._mu:
            return self._lookup_results.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        with self._mu:
            for key in keys:
                n = self._locks.get(key, 0) - 1
                if n > 0:
                    self._locks[key] = n
                else:
                    self._locks.pop(key, None)

    # load
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        tid = self._task_id()

        def job() -> None:
            bm = Bitmap(len(keys))
            loaded, total = [], 0
            for i, (key, obj) in enumerate(zip(keys, objects, strict=False)):
                with self._mu:
                    data = self._data.get(key)
                dst = obj.byte_array
                if data is None or data.numel() != len(dst):
                    continue
                dst[:] = data.numpy().tobytes()
                total += data.numel()
                loaded.append(key)
                bm.set(i)
            self._delay(total)
            if loaded:
                self._notify_keys_accessed(loaded)
            with self._mu:
                self._load_results[tid] = bm
            self._load_fd.notify()

        self._jobs.put(job)
        return tid

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._mu:
            return self._load_results.pop(task_id, None)

    # eviction support
    def delete(self, keys: list[ObjectKey]) -> None:
        removed, sizes = [], []
        with self._mu:
            for key in keys:
                if key in self._data and self._locks.get(key, 0) == 0:
                    size = self._data.pop(key).numel()
                    self._used -= size
                    removed.append(key)
                    sizes.append(size)
        if removed:
            self._notify_keys_deleted(removed, sizes)

    def report_status(self) -> dict[str, Any]:
        with self._mu:
            return {
                "is_healthy": not self._closed,
                "num_keys": len(self._data),
                "used_bytes": self._used,
                "capacity_bytes": self._capacity,
            }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._worker.join(timeout=5)
        for n in (self._store_fd, self._lookup_fd, self._load_fd):
            n.close()
