"""The server's narrow view of the storage layer (``lmcache.v1.distributed``).

The MP handlers need a handful of calls with per-key outcomes; this module maps them
onto ``StorageManager`` (prefetch/lookups with L2) and its L1 manager (reservations,
locked reads, deletes) so the handlers never depend on storage internals.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Protocol

from lmcache.utils import init_logger
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchHandle,
    PrefetchResult,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.internal_api import L1Error, L1ManagerListener, L1OperationResult
from lmcache.v1.memory_management import MemoryObj

logger = init_logger(__name__)

_WRITER_TAG = "storage_manager"


class L1Store(Protocol):
    """The operations of one L1 manager (``distributed.l1_manager.L1Manager``) the server
    uses: batch calls with an outcome per key."""

    def reserve_write(
        self,
        keys: list[ObjectKey],
        is_temporary: list[bool],
        layout_desc: MemoryLayoutDesc,
        tag: str = "",
    ) -> dict[ObjectKey, L1OperationResult]: ...

    def finish_write(self, keys: list[ObjectKey], tag: str = "") -> dict[ObjectKey, L1Error]: ...

    def finish_write_and_delete(
        self, keys: list[ObjectKey], tag: str = ""
    ) -> dict[ObjectKey, L1Error]: ...

    def unsafe_read(self, keys: list[ObjectKey]) -> dict[ObjectKey, L1OperationResult]: ...

    def finish_read(
        self, keys: list[ObjectKey], read_locks: int = 1
    ) -> dict[ObjectKey, L1Error]: ...

    def touch_keys(self, keys: list[ObjectKey]) -> None: ...

    def clear(self, force: bool = False) -> int: ...

    def get_memory_usage(self) -> tuple[int, int]: ...

    def get_staging_memory_usage(self) -> int: ...

    def register_listener(self, listener: L1ManagerListener) -> None: ...


class StorageEngine(Protocol):
    """The operations of the storage engine (``distributed.storage_manager.StorageManager``)
    the server uses: lookups over L1 and L2 (prefetch tasks), its L1, status and health."""

    def submit_prefetch_task(
        self, spec: PrefetchTaskSpec, external_request_id: str = "", skip_l2: bool = False
    ) -> PrefetchHandle: ...

    def lookup_prefix_in_l1(self, rows: list[list[ObjectKey]], readers: int) -> int | None: ...

    def query_prefetch_status(self, handle: PrefetchHandle) -> PrefetchResult | None: ...

    def wait_prefetch_status(
        self, handle: PrefetchHandle, timeout: float | None = None
    ) -> bool: ...

    def get_l1_manager(self, index: int = 0) -> L1Store: ...

    def report_status(self) -> dict[str, Any]: ...

    def health_reasons(self) -> list[str]: ...

    def close(self) -> None: ...


@dataclass
class ReserveOutcome:
    objs: dict[ObjectKey, MemoryObj]  # new reservations of this writer
    already: list[ObjectKey]  # resident, or being written by another writer: counts as done
    failed: list[ObjectKey]  # could not be allocated (L1 full)


@dataclass
class LookupOutcome:
    hit_chunks: int  # contiguous prefix every row holds
    l1_keys: int
    l2_keys: int


class StorageBridge:
    def __init__(self, storage_manager: StorageEngine) -> None:
        self.sm = storage_manager
        self.l1: L1Store = storage_manager.get_l1_manager(0)  # the server has one L1
        self._clear_lock = threading.Lock()

    def register_key_listener(self, listener: Any) -> bool:
        """Subscribe ``listener`` (a ``StorageKeyListener``) to the keys every tier stores
        and removes; False when this storage engine cannot report them."""
        register = getattr(self.sm, "register_key_listener", None)
        if register is None:
            return False
        register(listener)
        return True

    # -- writes -------------------------------------------------------------
    def reserve_write(self, keys: list[ObjectKey], layout: MemoryLayoutDesc) -> ReserveOutcome:
        if not keys:
            return ReserveOutcome({}, [], [])
        res = self.l1.reserve_write(keys, [False] * len(keys), layout, _WRITER_TAG)
        objs: dict[ObjectKey, MemoryObj] = {}
        already: list[ObjectKey] = []
        failed: list[ObjectKey] = []
        for k in keys:
            err, obj = res.get(k, (L1Error.OUT_OF_MEMORY, None))
            if err == L1Error.SUCCESS and obj is not None:
                objs[k] = obj
            elif err == L1Error.OUT_OF_MEMORY:
                failed.append(k)
            else:
                already.append(k)
        return ReserveOutcome(objs, already, failed)

    def finish_write(self, keys: list[ObjectKey]) -> list[ObjectKey]:
        """Admit reservations; returns the keys that could not be admitted (expired)."""
        if not keys:
            return []
        res = self.l1.finish_write(keys, _WRITER_TAG)
        return [k for k in keys if res.get(k) != L1Error.SUCCESS]

    def abort_write(self, keys: list[ObjectKey]) -> None:
        """Discard reservations: the staging objects are freed and never become visible."""
        if keys:
            self.l1.finish_write_and_delete(keys, _WRITER_TAG)

    # -- lookups and reads ---------------------------------------------------------
    def submit_lookup(
        self,
        rows: list[list[ObjectKey]],
        layout: MemoryLayoutDesc,
        num_kv_readers: int,
        request_id: str,
    ) -> PrefetchHandle:
        groups = [
            GroupedObjectKeys(keys=row, object_group_id=row[0].object_group_id, layout_desc=layout)
            for row in rows
        ]
        spec = PrefetchTaskSpec(key_groups=groups, num_kv_readers=num_kv_readers)
        # Callers try lookup_l1_now first, which serves every lookup the single L1 alone can
        # answer; what reaches here needs the L2 path (or spans several L1 managers).
        return self.sm.submit_prefetch_task(spec, external_request_id=request_id)

    def lookup_l1_now(
        self, rows: list[list[ObjectKey]], num_kv_readers: int
    ) -> LookupOutcome | None:
        """The lookup answered synchronously from L1 when nothing else could add to it (one
        L1; no L2 adapter, or every key resident), its hit prefix read-locked; else None."""
        hit = self.sm.lookup_prefix_in_l1(rows, num_kv_readers)
        if hit is None:
            return None
        return LookupOutcome(hit, hit * len(rows), 0)

    def wait_lookup(self, handle: PrefetchHandle, timeout: float) -> bool:
        return bool(self.sm.wait_prefetch_status(handle, timeout))

    def lookup_result(self, handle: PrefetchHandle, n_chunks: int) -> LookupOutcome:
        result = self.sm.query_prefetch_status(handle)
        if result is None:
            return LookupOutcome(0, 0, 0)
        rows = list(result.hit_cells)
        hit = min((min(r.count_leading_ones(), n_chunks) for r in rows), default=0)
        l1 = sum(_prefix_pop(r, hit) for r in (result.l1_hit_cells or []))
        l2 = sum(_prefix_pop(r, hit) for r in (result.l2_hit_cells or []))
        return LookupOutcome(hit, l1, l2)

    def read_locked(self, keys: list[ObjectKey]) -> list[MemoryObj] | None:
        """The MemoryObjs of read-locked keys, or None when any key is missing/unlocked."""
        if not keys:
            return []
        res = self.l1.unsafe_read(keys)
        out: list[MemoryObj] = []
        for k in keys:
            err, obj = res.get(k, (None, None))
            if err != L1Error.SUCCESS or obj is None:
                return None
            out.append(obj)
        return out

    def release_read(self, keys: list[ObjectKey], shares: int = 1) -> None:
        if keys and shares > 0:
            self.l1.finish_read(keys, shares)

    def touch(self, keys: list[ObjectKey]) -> None:
        if keys:
            self.l1.touch_keys(keys)

    # -- maintenance -------------------------------------------------------------
    def clear(self, force: bool) -> None:
        with self._clear_lock:  # concurrent clears run one at a time
            self.l1.clear(force=force)

    def memory_usage(self) -> tuple[int, int]:
        return self.l1.get_memory_usage()

    def staging_bytes(self) -> int:
        try:
            return int(self.l1.get_staging_memory_usage())
        except Exception:
            return 0

    def drain_l2_throughput(self) -> list[tuple[str, str, float]]:
        """(``store``/``load``, adapter type, GB/s) of the L2 tasks finished since the last call."""
        out: list[tuple[str, str, float]] = []
        queues = [("store", sc.throughput) for sc in getattr(self.sm, "store_controllers", [])]
        prefetch = getattr(self.sm, "prefetch_controller", None)
        if prefetch is not None:
            queues.append(("load", prefetch.load_throughput))
        for kind, queue in queues:
            while queue:
                name, gbps = queue.popleft()
                out.append((kind, name, gbps))
        return out

    def status(self) -> dict[str, Any]:
        try:
            return self.sm.report_status()
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def health_reasons(self) -> list[str]:
        """Why the storage engine is unhealthy (empty when it is not); cheaper than status()."""
        try:
            return list(self.sm.health_reasons())
        except Exception as exc:
            return [f"the storage engine cannot report its health: {type(exc).__name__}: {exc}"]

    def close(self) -> None:
        self.sm.close()


def _prefix_pop(bitmap: Any, n: int) -> int:
    """Set bits among the first ``n``."""
    n = min(n, bitmap.size())
    return (bitmap.to_int() & ((1 << n) - 1)).bit_count() if n > 0 else 0
