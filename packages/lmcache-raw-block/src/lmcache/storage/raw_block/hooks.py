"""Entry point of the ``lmcache.l2_adapters`` group: the ``raw_block`` type.

Cheap to import: the adapter and ``lmcache-rust-raw-block-io`` load inside the factory, so a
missing dependency surfaces when the adapter is created, as an ImportError naming
``pip install lmcache-rust-raw-block-io``.
"""

from __future__ import annotations

from typing import Any

from lmcache.storage.raw_block.config import RawBlockL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.api import L2AdapterTypeSpec, hookimpl


def _create_raw_block(config: RawBlockL2AdapterConfig, l1_memory_desc: Any = None) -> Any:
    from lmcache.storage.raw_block.adapter import RawBlockL2Adapter

    return RawBlockL2Adapter(config, l1_memory_desc)


@hookimpl
def lmcache_l2_adapter_types() -> list[L2AdapterTypeSpec]:
    return [L2AdapterTypeSpec("raw_block", RawBlockL2AdapterConfig, _create_raw_block)]
