"""``plugin`` L2 type (docs/design/storage-engine.md#plugin-type): load a Python
``L2AdapterInterface`` class from any module.

``{"type":"plugin","module_path":"my_plugin.l2","class_name":"MyL2Adapter",
"adapter_params":{...},"config_class_name":"MyL2AdapterConfig"}``

At StorageManager start the module is imported, the class checked, its config class resolved
(explicit name, then ``<class_name>Config``, then the class's ``config_class_name``
attribute, else raw-dict mode) and the adapter built with ``cfg_cls.from_dict(adapter_params)``
or the raw dict, plus ``l1_memory_desc=`` when the constructor accepts it.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any

from lmcache.utils import init_logger
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import (
    L2AdapterConfigBase,
)
from lmcache.v1.distributed.l2_adapters.hookspecs import L2AdapterTypeSpec, hookimpl

logger = init_logger(__name__)

__all__ = [
    "PluginL2AdapterConfig",
    "create_plugin_l2_adapter",
    "import_plugin_class",
    "parse_plugin_location",
]


def parse_plugin_location(d: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """``(module_path, class_name, adapter_params)`` of a ``plugin`` or ``native_plugin``
    config dict; ``ValueError`` naming the field when one is missing or of the wrong type."""
    module_path = d.get("module_path")
    if not isinstance(module_path, str) or not module_path:
        raise ValueError("module_path must be a non-empty string")
    class_name = d.get("class_name")
    if not isinstance(class_name, str) or not class_name:
        raise ValueError("class_name must be a non-empty string")
    params = d.get("adapter_params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ValueError("adapter_params must be a dict")
    return module_path, class_name, dict(params)


@dataclass
class PluginL2AdapterConfig(L2AdapterConfigBase):
    type_name = "plugin"

    module_path: str
    class_name: str
    adapter_params: dict[str, Any] = field(default_factory=dict)
    config_class_name: str | None = None

    known_fields = frozenset({"module_path", "class_name", "adapter_params", "config_class_name"})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PluginL2AdapterConfig:
        module_path, class_name, params = parse_plugin_location(d)
        ccn = d.get("config_class_name")
        if ccn is not None and not isinstance(ccn, str):
            raise ValueError("config_class_name must be a string")
        return cls(module_path, class_name, params, ccn or None)

    @classmethod
    def help(cls) -> str:
        return (
            "plugin L2 adapter: loads an L2AdapterInterface subclass from a Python module.\n"
            "  module_path (str, required): dotted import path of the module\n"
            "  class_name (str, required): the adapter class in that module\n"
            "  adapter_params (dict, default {}): passed to the config class's from_dict, or to\n"
            "    the constructor as a raw dict when no config class is found\n"
            "  config_class_name (str, optional): L2AdapterConfigBase subclass in the module\n"
            'Example: {"type":"plugin","module_path":"lmc_external_l2_adapter",'
            '"class_name":"InMemoryL2Adapter","adapter_params":{"max_size_gb":1.0}}'
        )


def import_plugin_class(module_path: str, class_name: str) -> tuple[Any, Any]:
    """Import ``module_path`` and fetch ``class_name`` with the error texts of
    docs/design/storage-engine.md#plugin-type."""
    try:
        module = importlib.import_module(module_path)
    except Exception as exc:
        raise ImportError(f"Could not import module '{module_path}': {exc}") from exc
    try:
        obj = getattr(module, class_name)
    except AttributeError as exc:
        raise AttributeError(f"Module '{module_path}' has no class '{class_name}': {exc}") from exc
    return module, obj


def _is_config_class(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, L2AdapterConfigBase)


def _resolve_config_class(
    module: Any, adapter_cls: type, cfg: PluginL2AdapterConfig
) -> type[L2AdapterConfigBase] | None:
    candidates: list[tuple[str, str]] = []
    if cfg.config_class_name:
        candidates.append(("config_class_name", cfg.config_class_name))
    candidates.append(("convention", cfg.class_name + "Config"))
    attr = getattr(adapter_cls, "config_class_name", None)
    if isinstance(attr, str) and attr:
        candidates.append(("class attribute", attr))
    for origin, name in candidates:
        obj = getattr(module, name, None)
        if _is_config_class(obj):
            return obj
        if origin == "config_class_name":
            logger.warning(
                "plugin %s: config_class_name %r is %s in module %r; trying %s",
                cfg.class_name,
                name,
                "missing" if obj is None else "not an L2AdapterConfigBase subclass",
                cfg.module_path,
                [n for o, n in candidates if o != "config_class_name"] or "raw-dict mode",
            )
    return None


def _accepts_l1_memory_desc(cls: type) -> bool:
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return True  # cannot inspect: pass it, as 0.5.6 always did
    params = sig.parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params) or (
        "l1_memory_desc" in sig.parameters
    )


def _lookup_takes_layouts(adapter: Any) -> bool:
    try:
        sig = inspect.signature(adapter.submit_lookup_and_lock_task)
    except (TypeError, ValueError):
        return True
    ps = list(sig.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in ps):
        return True
    return len(ps) >= 2


def adapt_legacy_adapter(adapter: L2AdapterInterface, qualname: str) -> L2AdapterInterface:
    """Fill base state a plugin skipped (IMPROVE, docs/design/storage-engine.md#legacy-plugins) and
    mark one-argument lookups (docs/design/storage-engine.md#legacy-plugins)."""
    if adapter._ensure_base_state():
        logger.warning(
            "%s did not call L2AdapterInterface.__init__(); usage accounting assumes capacity 0",
            qualname,
        )
    if not _lookup_takes_layouts(adapter):
        adapter._lmcache_lookup_one_arg = True  # type: ignore[attr-defined]
    return adapter


def create_plugin_l2_adapter(
    cfg: PluginL2AdapterConfig, l1_memory_desc: L1MemoryDesc | None = None
) -> L2AdapterInterface:
    module, cls = import_plugin_class(cfg.module_path, cfg.class_name)
    if not (isinstance(cls, type) and issubclass(cls, L2AdapterInterface)):
        raise TypeError(
            f"{cfg.module_path}.{cfg.class_name} is not a subclass of L2AdapterInterface"
        )
    cfg_cls = _resolve_config_class(module, cls, cfg)
    arg: Any = cfg_cls.from_dict(dict(cfg.adapter_params)) if cfg_cls else dict(cfg.adapter_params)
    kw: dict[str, Any] = {}
    if l1_memory_desc is not None and _accepts_l1_memory_desc(cls):
        kw["l1_memory_desc"] = l1_memory_desc
    adapter = cls(arg, **kw)
    return adapt_legacy_adapter(adapter, f"{cfg.module_path}.{cfg.class_name}")


@hookimpl
def lmcache_l2_adapter_types() -> list[L2AdapterTypeSpec]:
    """Core's built-in ``plugin`` type (loaded by the registry like a wheel's hooks)."""
    return [L2AdapterTypeSpec("plugin", PluginL2AdapterConfig, create_plugin_l2_adapter)]
