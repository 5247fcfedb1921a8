"""Entry point of the ``lmcache.l2_adapters`` group: the ``fs`` and ``fs_native`` types.

Cheap to import: the adapters (and the compiled client) load inside the factories.
"""

from __future__ import annotations

from typing import Any

from lmcache.storage.fs.config import FSL2AdapterConfig, FSNativeL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.api import L2AdapterTypeSpec, hookimpl


def _create_fs(config: FSL2AdapterConfig, l1_memory_desc: Any = None) -> Any:
    from lmcache.storage.fs.fs_adapter import FSL2Adapter

    return FSL2Adapter(config, l1_memory_desc=l1_memory_desc)


def _create_fs_native(config: FSNativeL2AdapterConfig, l1_memory_desc: Any = None) -> Any:
    from lmcache.storage.fs.native_adapter import create_fs_native_adapter

    return create_fs_native_adapter(config)


@hookimpl
def lmcache_l2_adapter_types() -> list[L2AdapterTypeSpec]:
    return [
        L2AdapterTypeSpec("fs", FSL2AdapterConfig, _create_fs),
        L2AdapterTypeSpec("fs_native", FSNativeL2AdapterConfig, _create_fs_native),
    ]
