"""Base class of adapters that wrap another adapter (``fault_inject``, the serde wrapper).

A wrapper changes how some tasks run; everything it leaves alone — unlock, delete, key
listing, capacity, usage, listeners and backend identity — belongs to the inner adapter,
so accounting and eviction see the inner adapter's real state.
"""

from __future__ import annotations

from lmcache.v1.distributed.api import KeyListPage, ObjectKey
from lmcache.v1.distributed.internal_api import L2AdapterListener
from lmcache.v1.distributed.l2_adapters.base import AdapterUsage, L2AdapterInterface


class WrappingL2Adapter(L2AdapterInterface):
    """Subclasses set ``self._inner`` in ``__init__`` and implement the task primitives."""

    _inner: L2AdapterInterface

    @property
    def inner(self) -> L2AdapterInterface:
        return self._inner

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
