"""Base class of adapters that wrap another adapter (``fault_inject``, the serde wrapper).

A wrapper changes how some tasks run; everything it leaves alone — the tasks and event fds
it does not override, unlock, delete, key listing, capacity, usage, listeners and backend
identity — belongs to the inner adapter, so accounting and eviction see the inner adapter's
real state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyListPage, MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2AdapterListener, L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface, L2TaskId

if TYPE_CHECKING:
    from lmcache.v1.memory_management import MemoryObj


class WrappingL2Adapter(L2AdapterInterface):
    """Subclasses set ``self._inner`` in ``__init__`` and override the primitives they change;
    the rest pass through (``close`` included)."""

    _inner: L2AdapterInterface

    @property
    def inner(self) -> L2AdapterInterface:
        return self._inner

    def get_store_event_fd(self) -> int:
        return self._inner.get_store_event_fd()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._inner.get_lookup_and_lock_event_fd()

    def get_load_event_fd(self) -> int:
        return self._inner.get_load_event_fd()

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._inner.submit_store_task(keys, objects)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        return self._inner.pop_completed_store_tasks()

    def submit_lookup_and_lock_task(
        self,
        keys: list[ObjectKey],
        group_layout_descs: dict[int, MemoryLayoutDesc] | None = None,
    ) -> L2TaskId:
        return self._inner.submit_lookup_and_lock_task(keys, group_layout_descs)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._inner.query_lookup_and_lock_result(task_id)

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._inner.submit_load_task(keys, objects)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._inner.query_load_result(task_id)

    def close(self) -> None:
        self._inner.close()

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self._inner.submit_unlock(keys)

    def delete(self, keys: list[ObjectKey]) -> None:
        self._inner.delete(keys)

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyListPage:
        return self._inner.list_l2_keys(model_name, page_size, cursor)

    @property
    def max_capacity_bytes(self) -> int:
        return self._inner.max_capacity_bytes

    def get_usage(self) -> AdapterUsage:
        return self._inner.get_usage()

    def register_listener(self, listener: L2AdapterListener) -> None:
        self._inner.register_listener(listener)

    def set_backend_identity(self, name: str, shared: bool = False) -> None:
        super().set_backend_identity(name, shared)
        self._inner.set_backend_identity(name, shared)
