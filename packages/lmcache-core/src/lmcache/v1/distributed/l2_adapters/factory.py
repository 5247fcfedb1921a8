"""Adapter factories and plugin discovery: 0.5.6's functions
(docs/design/storage-engine.md#l2-packaging, docs/design/storage-engine.md#l2-config).

Each answers from the default :class:`~lmcache.v1.distributed.l2_adapters.registry.L2AdapterRegistry`,
which owns the types, factories, pending modules and entry-point results.
For ``lmcache plugins``: ``describe_l2_adapter_types()`` and ``failed_l2_adapter_plugins()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcache.v1.distributed.l2_adapters.hookspecs import L2AdapterFactory, L2AdapterTypeSpec
from lmcache.v1.distributed.l2_adapters.registry import (
    BUILTIN_MODULES,
    default_l2_adapter_registry,
)

if TYPE_CHECKING:
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
    from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

__all__ = [
    "BUILTIN_MODULES",
    "L2AdapterFactory",
    "add_pending_module",
    "create_l2_adapter_from_registry",
    "describe_l2_adapter_types",
    "ensure_adapter_loaded",
    "failed_l2_adapter_plugins",
    "get_all_registered_names",
    "load_all_adapters",
    "load_all_l2_adapter_types",
    "refresh_l2_adapter_plugins",
    "register_l2_adapter_factory",
    "register_l2_adapter_type_spec",
]


def register_l2_adapter_factory(name: str, fn: L2AdapterFactory) -> None:
    default_l2_adapter_registry().register_factory(name, fn)


def register_l2_adapter_type_spec(spec: L2AdapterTypeSpec) -> None:
    """Register a type with its config class, factory and aliases (``PluginError`` if malformed)."""
    default_l2_adapter_registry().register_spec(spec)


def add_pending_module(path: str) -> None:
    """Queue a module whose import registers adapter types (the 0.5.6 lazy mechanism)."""
    default_l2_adapter_registry().add_pending_module(path)


def ensure_adapter_loaded(name: str, raise_import_error: bool = True) -> None:
    default_l2_adapter_registry().ensure_loaded(name, raise_import_error)


def load_all_l2_adapter_types() -> None:
    default_l2_adapter_registry().load_all()


load_all_adapters = load_all_l2_adapter_types  # 0.5.6's name


def get_all_registered_names() -> list[str]:
    return default_l2_adapter_registry().factory_names()


def create_l2_adapter_from_registry(
    cfg: L2AdapterConfigBase, l1_memory_desc: L1MemoryDesc | None = None
) -> L2AdapterInterface:
    return default_l2_adapter_registry().create(cfg, l1_memory_desc)


def describe_l2_adapter_types() -> list[dict[str, Any]]:
    """One dict per canonical type: name, aliases, source, distribution, version."""
    return default_l2_adapter_registry().describe()


def failed_l2_adapter_plugins() -> list[tuple[str, str, str]]:
    """(entry-point name, value, reason) for each plugin that was skipped."""
    return default_l2_adapter_registry().failed_plugins()


def refresh_l2_adapter_plugins() -> None:
    """Forget entry-point results and rescan (after installing a wheel at run time)."""
    default_l2_adapter_registry().refresh()
