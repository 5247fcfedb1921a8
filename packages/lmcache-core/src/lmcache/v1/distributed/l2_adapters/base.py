"""``L2AdapterInterface``: the contract every L2 storage adapter implements (spec §5).

Primitives are non-blocking: ``submit_*`` returns an ``L2TaskId`` at once, the adapter
signals the matching event fd when work finishes, and the result is returned exactly once
by ``pop_completed_store_tasks`` / ``query_lookup_and_lock_result`` / ``query_load_result``.
The caller owns the buffers; the adapter touches them only until the task completes.
Adapters must be thread-safe: store, prefetch, eviction and status threads call concurrently.

Base-class state (listeners, identity, byte accounting) is created lazily on first use, so
0.5.6 plugins that never call ``super().__init__()`` still work (IMPROVE §5.5a).
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


@dataclass(frozen=True)
class AdapterUsage:
    """Snapshot of an adapter's byte accounting; capacity 0 means unknown/unlimited."""

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
        if self.total_capacity_bytes <= 0:
            return -1.0
        return self.total_bytes_used / self.total_capacity_bytes


_STATE_LOCK = threading.Lock()  # guards lazy creation of base-class state


class L2AdapterInterface(abc.ABC):
    def __init__(self, max_capacity_bytes: int = 0) -> None:
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
    def get_store_event_fd(self) -> int: ...

    @abc.abstractmethod
    def get_lookup_and_lock_event_fd(self) -> int: ...

    @abc.abstractmethod
    def get_load_event_fd(self) -> int: ...

    @abc.abstractmethod
    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId: ...

    @abc.abstractmethod
    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]: ...

    @abc.abstractmethod
    def submit_lookup_and_lock_task(
        self,
        keys: list[ObjectKey],
        group_layout_descs: dict[int, MemoryLayoutDesc] | None = None,
    ) -> L2TaskId: ...

    @abc.abstractmethod
    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None: ...

    @abc.abstractmethod
    def submit_unlock(self, keys: list[ObjectKey]) -> None: ...

    @abc.abstractmethod
    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId: ...

    @abc.abstractmethod
    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    # --- concrete members ------------------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Remove keys (no-op by default). Evicting adapters override it: skip locked keys
        and call ``_notify_keys_deleted`` for the keys actually removed."""
        return None

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyListPage:
        raise NotImplementedError(f"{type(self).__name__} does not implement list_l2_keys")

    @property
    def max_capacity_bytes(self) -> int:
        self._ensure_base_state()
        return self._max_capacity_bytes

    @property
    def supports_global_eviction(self) -> bool:
        return self.max_capacity_bytes > 0

    def get_usage(self) -> AdapterUsage:
        self._ensure_base_state()
        with self._usage_lock:
            return AdapterUsage(
                total_bytes_used=self._total_bytes_used,
                total_capacity_bytes=self._max_capacity_bytes,
                bytes_by_cache_salt=dict(self._bytes_by_cache_salt),
            )

    def report_status(self) -> dict[str, Any]:
        return {"is_healthy": True, "extra_warning": ""}

    def register_listener(self, listener: L2AdapterListener) -> None:
        self._ensure_base_state()
        with self._usage_lock:
            self._listeners.append(listener)

    def set_backend_identity(self, name: str, shared: bool = False) -> None:
        if not name:
            raise ValueError("backend name must be non-empty")
        self._ensure_base_state()
        self._backend_name = name
        self._shared = bool(shared)

    @property
    def backend_name(self) -> str:
        self._ensure_base_state()
        return self._backend_name

    # --- protected notifiers ----------------------------------------------------------------

    def _listeners_snapshot(self) -> list[L2AdapterListener]:
        self._ensure_base_state()
        with self._usage_lock:
            return list(self._listeners)

    def _notify_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
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
        self._ensure_base_state()
        for listener in self._listeners_snapshot():
            try:
                listener.on_l2_keys_accessed(list(keys))
            except Exception:
                logger.exception("L2 listener failed in on_l2_keys_accessed")

    def _notify_keys_deleted(self, keys: list[ObjectKey], sizes: list[int] | None = None) -> None:
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
