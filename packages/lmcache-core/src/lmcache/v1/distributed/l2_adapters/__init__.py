"""L2 adapters: the interface, config registry, factories and the built-in types.

``create_l2_adapter(config, l1_memory_desc=None)`` builds an adapter from a parsed config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

if TYPE_CHECKING:
    from lmcache.v1.distributed.internal_api import L1MemoryDesc

__all__ = ["L2AdapterConfigBase", "L2AdapterInterface", "create_l2_adapter"]


def create_l2_adapter(
    config: L2AdapterConfigBase, l1_memory_desc: L1MemoryDesc | None = None
) -> L2AdapterInterface:
    return create_l2_adapter_from_registry(config, l1_memory_desc)
