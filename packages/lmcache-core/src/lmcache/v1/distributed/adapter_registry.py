"""The live L2 adapters of one StorageManager, shared by its controllers.

Indexes are assigned in creation order and never reused. A draining adapter gets no new
work; it is detached once no controller has work in flight for it.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field
from typing import Any

from lmcache.utils import init_logger
from lmcache.v1.distributed.storage_policies import AdapterDescriptor

logger = init_logger(__name__)


@dataclass
class AdapterSlot:
    index: int
    adapter: Any
    type_name: str
    affinity_tag: str = "_default"
    l1_index: int = 0
    draining: bool = False
    config: Any = None
    fds: tuple[int, int, int] = field(default=(-1, -1, -1))

    def descriptor(self) -> AdapterDescriptor:
        return AdapterDescriptor(self.index, self.type_name, self.affinity_tag, self.draining)


def _lookup_one_arg(adapter: Any) -> bool:
    flag = getattr(adapter, "_lmcache_lookup_one_arg", None)
    if flag is not None:
        return bool(flag)
    try:
        ps = list(inspect.signature(adapter.submit_lookup_and_lock_task).parameters.values())
        one = len(ps) < 2 and not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in ps)
    except (TypeError, ValueError):
        one = False
    try:
        adapter._lmcache_lookup_one_arg = one
    except AttributeError:
        pass
    return one


def submit_lookup(adapter: Any, keys: list[Any], layouts: dict[int, Any] | None) -> int:
    """Call a lookup, one-argument for legacy plugins (IMPROVE,
    docs/design/storage-engine.md#legacy-plugins)."""
    if _lookup_one_arg(adapter):
        return adapter.submit_lookup_and_lock_task(keys)
    return adapter.submit_lookup_and_lock_task(keys, layouts)


class AdapterRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[int, AdapterSlot] = {}
        self._next = 0
        self.version = 0
        self._fd_owner: dict[int, int] = {}

    def add(
        self,
        adapter: Any,
        type_name: str,
        affinity_tag: str = "_default",
        l1_index: int = 0,
        config: Any = None,
    ) -> AdapterSlot:
        fds = (
            int(adapter.get_store_event_fd()),
            int(adapter.get_lookup_and_lock_event_fd()),
            int(adapter.get_load_event_fd()),
        )
        with self._lock:
            index = self._next
            name = f"#{index} ({type_name})"
            if len(set(fds)) != 3:
                raise ValueError(
                    f"L2 adapter {name} returned duplicate event fds {fds}: store, lookup and load "
                    "fds must be distinct"
                )
            for fd in fds:
                other = self._fd_owner.get(fd)
                if other is not None:
                    o = self._slots[other]
                    raise ValueError(
                        f"L2 adapter {name} event fd {fd} collides with adapter #{o.index} "
                        f"({o.type_name}); every adapter needs its own fds"
                    )
            self._next += 1
            slot = AdapterSlot(
                index, adapter, type_name, affinity_tag, l1_index, False, config, fds
            )
            self._slots[index] = slot
            for fd in fds:
                self._fd_owner[fd] = index
            self.version += 1
            return slot

    def remove(self, index: int) -> AdapterSlot | None:
        with self._lock:
            slot = self._slots.pop(index, None)
            if slot is not None:
                for fd in slot.fds:
                    self._fd_owner.pop(fd, None)
                self.version += 1
            return slot

    def set_draining(self, index: int) -> AdapterSlot | None:
        with self._lock:
            slot = self._slots.get(index)
            if slot is not None:
                slot.draining = True
                self.version += 1
            return slot

    def get(self, index: int) -> AdapterSlot | None:
        with self._lock:
            return self._slots.get(index)

    def slots(self, include_draining: bool = True) -> list[AdapterSlot]:
        with self._lock:
            return [s for _, s in sorted(self._slots.items()) if include_draining or not s.draining]

    def counts(self) -> dict[str, int]:
        """Adapter counts under the names 0.5.6's controller reports use."""
        with self._lock:
            draining = sum(1 for s in self._slots.values() if s.draining)
            return {
                "num_l2_adapters": len(self._slots),
                "num_active_adapters": len(self._slots) - draining,
                "num_draining_adapters": draining,
            }

    def any_serving(self) -> bool:
        """Whether an adapter that is not draining is registered (``slots(False)`` != [])."""
        with self._lock:
            return any(not s.draining for s in self._slots.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)
