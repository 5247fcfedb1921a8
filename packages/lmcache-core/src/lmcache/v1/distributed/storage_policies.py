"""Store and prefetch policies (docs/design/storage-engine.md#store-controller,
docs/design/storage-engine.md#prefetch-controller) and their registries.

Store: ``select_store_targets(keys, adapter_descriptors) -> {adapter_index: keys}`` and
``select_l1_deletions(keys) -> keys`` (run after a successful store). Prefetch:
``choose_owner`` picks, for one cell, the L1 or adapter that serves it, and
``plan_l1_retention()`` says whether loaded keys stay resident.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from lmcache.v1.distributed.api import ObjectKey

__all__ = [
    "AdapterDescriptor",
    "DefaultPrefetchPolicy",
    "DefaultStorePolicy",
    "PrefetchPolicy",
    "RetainPrefetchPolicy",
    "SkipL1StorePolicy",
    "StorePolicy",
    "get_registered_prefetch_policies",
    "get_registered_store_policies",
    "register_prefetch_policy",
    "register_store_policy",
]


@dataclass(frozen=True)
class AdapterDescriptor:
    index: int
    type_name: str
    affinity_tag: str = "_default"
    draining: bool = False


class StorePolicy:
    def select_store_targets(
        self, keys: list[ObjectKey], adapter_descriptors: list[AdapterDescriptor]
    ) -> dict[int, list[ObjectKey]]:
        return {d.index: list(keys) for d in adapter_descriptors if not d.draining}

    def select_l1_deletions(self, keys: list[ObjectKey]) -> list[ObjectKey]:
        return []


class DefaultStorePolicy(StorePolicy):
    """Every key to every non-draining adapter; L1 keeps its copy."""


class SkipL1StorePolicy(StorePolicy):
    """Same targets; the L1 copy is deleted once stored (buffer-only L1)."""

    def select_l1_deletions(self, keys: list[ObjectKey]) -> list[ObjectKey]:
        return list(keys)


class PrefetchPolicy:
    def choose_owner(self, l1_holders: list[int], l2_holders: list[int]) -> tuple[str, int] | None:
        """Lowest-index L1 that holds the cell, else the lowest-index adapter."""
        if l1_holders:
            return ("l1", min(l1_holders))
        if l2_holders:
            return ("l2", min(l2_holders))
        return None

    def plan_l1_retention(self) -> bool:
        return False


class DefaultPrefetchPolicy(PrefetchPolicy):
    """Loaded keys are temporary: freed at their last read."""


class RetainPrefetchPolicy(PrefetchPolicy):
    """Loaded keys stay resident in L1."""

    def plan_l1_retention(self) -> bool:
        return True


P = TypeVar("P")


class _PolicyTable(Generic[P]):
    """Policy classes by name, for one kind of policy (``store`` or ``prefetch``)."""

    def __init__(self, kind: str, classes: dict[str, type[P]]) -> None:
        self.kind = kind
        self._classes = dict(classes)

    def register(self, name: str, cls: type[P]) -> None:
        if name in self._classes:
            raise ValueError(f"{self.kind} policy already registered: {name!r}")
        self._classes[name] = cls

    def names(self) -> list[str]:
        return sorted(self._classes)

    def create(self, name: str) -> P:
        try:
            return self._classes[name]()
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} policy {name!r}. Known: {', '.join(self.names())}"
            ) from None


_STORE: _PolicyTable[StorePolicy] = _PolicyTable(
    "store", {"default": DefaultStorePolicy, "skip_l1": SkipL1StorePolicy}
)
_PREFETCH: _PolicyTable[PrefetchPolicy] = _PolicyTable(
    "prefetch", {"default": DefaultPrefetchPolicy, "retain": RetainPrefetchPolicy}
)


# The module's functions are the tables' methods.
register_store_policy = _STORE.register
get_registered_store_policies = _STORE.names
create_store_policy = _STORE.create
register_prefetch_policy = _PREFETCH.register
get_registered_prefetch_policies = _PREFETCH.names
create_prefetch_policy = _PREFETCH.create
