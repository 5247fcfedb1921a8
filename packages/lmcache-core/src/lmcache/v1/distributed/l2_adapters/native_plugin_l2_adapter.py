"""``native_plugin`` L2 type (docs/design/storage-engine.md#native-plugin-type): wrap any
native-style connector in the bridge.

``{"type":"native_plugin","module_path":"my_ext.connector","class_name":"MyConnectorClient",
"adapter_params":{...},"max_capacity_gb":0}`` imports the module, calls
``class_name(**adapter_params)`` (a factory class whose ``__new__`` returns the native object is
fine), checks the native-connector methods (docs/design/storage-engine.md#native-contract) and
returns ``NativeConnectorL2Adapter(client, max_capacity_gb)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lmcache.utils import init_logger
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l2_adapters.config import (
    L2AdapterConfigBase,
)
from lmcache.v1.distributed.l2_adapters.hookspecs import L2AdapterTypeSpec, hookimpl
from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
    NativeConnectorL2Adapter,
)
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import (
    import_plugin_class,
    parse_plugin_location,
)

logger = init_logger(__name__)

__all__ = ["REQUIRED_METHODS", "NativePluginL2AdapterConfig", "create_native_plugin_l2_adapter"]

REQUIRED_METHODS = (
    "event_fd",
    "submit_batch_get",
    "submit_batch_set",
    "submit_batch_exists",
    "drain_completions",
    "close",
)


@dataclass
class NativePluginL2AdapterConfig(L2AdapterConfigBase):
    type_name = "native_plugin"

    module_path: str
    class_name: str
    adapter_params: dict[str, Any] = field(default_factory=dict)
    max_capacity_gb: float = 0

    known_fields = frozenset({"module_path", "class_name", "adapter_params", "max_capacity_gb"})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NativePluginL2AdapterConfig:
        module_path, class_name, params = parse_plugin_location(d)
        return cls(module_path, class_name, params, cls._parse_max_capacity_gb(d))

    @classmethod
    def help(cls) -> str:
        return (
            "native_plugin L2 adapter: wraps a native (e.g. pybind11) connector object.\n"
            "  module_path (str, required): dotted import path of the module\n"
            "  class_name (str, required): connector class or factory; called as\n"
            "    class_name(**adapter_params)\n"
            "  adapter_params (dict, default {}): constructor keyword arguments\n"
            "  max_capacity_gb (number >= 0, default 0): capacity for usage/eviction (0 = off)\n"
            "The instance must expose event_fd, submit_batch_get, submit_batch_set,\n"
            "submit_batch_exists, drain_completions and close (submit_batch_delete optional)."
        )


def create_native_plugin_l2_adapter(
    cfg: NativePluginL2AdapterConfig, l1_memory_desc: L1MemoryDesc | None = None
) -> NativeConnectorL2Adapter:
    _module, cls = import_plugin_class(cfg.module_path, cfg.class_name)
    client = cls(**cfg.adapter_params)
    qual = f"{cfg.module_path}.{cfg.class_name}"
    for name in REQUIRED_METHODS:
        if not callable(getattr(client, name, None)):
            close = getattr(client, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    logger.exception("%s.close() failed after a failed check", qual)
            raise TypeError(f"{qual} instance missing required method '{name}'")
    if not callable(getattr(client, "submit_batch_delete", None)):
        logger.warning(
            "%s does not expose submit_batch_delete; L2 eviction delete will be a no-op.", qual
        )
    return NativeConnectorL2Adapter(
        client, max_capacity_gb=cfg.max_capacity_gb, type_name=cfg.class_name
    )


@hookimpl
def lmcache_l2_adapter_types() -> list[L2AdapterTypeSpec]:
    """Core's built-in ``native_plugin`` type (loaded by the registry like a wheel's hooks)."""
    return [
        L2AdapterTypeSpec(
            "native_plugin", NativePluginL2AdapterConfig, create_native_plugin_l2_adapter
        )
    ]
