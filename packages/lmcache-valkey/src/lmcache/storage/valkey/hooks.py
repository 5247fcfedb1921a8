"""Entry point of the ``lmcache.l2_adapters`` group: the ``valkey`` type.

Cheap to import: glide loads inside the factory.
"""

from __future__ import annotations

from typing import Any

from lmcache.storage.valkey.config import ValkeyL2AdapterConfig
from lmcache.v1.distributed.l2_adapters.api import L2AdapterTypeSpec, hookimpl, import_dependency


def create_valkey_adapter(config: ValkeyL2AdapterConfig, l1_memory_desc: Any = None) -> Any:
    glide = import_dependency(
        "glide_sync",
        "the valkey adapter needs valkey-glide's sync client",
        "install it with `pip install valkey-glide-sync` (the plain valkey-glide is async only)",
    )
    from lmcache.storage.valkey.adapter import ValkeyL2Adapter

    # glide's own log repeats every failed command; the adapter reports them (rate-limited).
    glide.Logger.set_logger_config(glide.LogLevel.OFF)

    return ValkeyL2Adapter(config, glide)


@hookimpl
def lmcache_l2_adapter_types() -> list[L2AdapterTypeSpec]:
    return [L2AdapterTypeSpec("valkey", ValkeyL2AdapterConfig, create_valkey_adapter)]
