"""Entry point of the ``lmcache.l2_adapters`` group: the ``nixl_store`` and ``nixl_native`` types.

Cheap to import: NIXL loads inside the factories, so a missing ``nixl`` surfaces when an
adapter is created, as an ImportError naming ``pip install nixl==1.5.1``.
"""

from __future__ import annotations

from typing import Any

from lmcache.storage.nixl.config import NixlNativeL2AdapterConfig, NixlStoreL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.api import L2AdapterTypeSpec, hookimpl


def _create_nixl_store(config: NixlStoreL2AdapterConfig, l1_memory_desc: Any = None) -> Any:
    if l1_memory_desc is None:
        raise ValueError("l1_memory_desc is required to create a NixlStoreL2Adapter.")
    from lmcache.storage.nixl.store_adapter import NixlStoreL2Adapter

    return NixlStoreL2Adapter(config, l1_memory_desc)


def _create_nixl_native(config: NixlNativeL2AdapterConfig, l1_memory_desc: Any = None) -> Any:
    from lmcache.storage.nixl.native_adapter import create_nixl_native_adapter

    return create_nixl_native_adapter(config, l1_memory_desc)


@hookimpl
def lmcache_l2_adapter_types() -> list[L2AdapterTypeSpec]:
    return [
        L2AdapterTypeSpec("nixl_store", NixlStoreL2AdapterConfig, _create_nixl_store),
        L2AdapterTypeSpec("nixl_native", NixlNativeL2AdapterConfig, _create_nixl_native),
    ]
