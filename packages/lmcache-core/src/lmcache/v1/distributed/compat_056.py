"""LMCache 0.5.6's storage-configuration functions, kept for code written against 0.5.6
(docs/design/storage-engine.md#l2-config).

This module is the one place they are defined. Each is a thin call into what the project
itself uses: the L2 type registry (``L2AdapterRegistry``: ``parse`` / ``create`` / ``build``
and the registration methods) and the storage flags (``storage_flags``). Their 0.5.6 import
paths keep working because the 0.5.6 modules re-export them by name
(``lmcache.v1.distributed.config``, ``...l2_adapters.config``, ``...l2_adapters.factory``,
``...l2_adapters``), through lazy tables so that no import cycle results. Core code never
calls them.

Besides 0.5.6's names, this module keeps a few earlier names of this project that tests and
plugins import (``build_config_from_dict``, ``parse_l2_adapter_dict``,
``register_l2_adapter_type_spec``, ``load_all_l2_adapter_types``, ``describe_l2_adapter_types``,
``failed_l2_adapter_plugins``, ``refresh_l2_adapter_plugins``).
"""

from __future__ import annotations

import argparse
from typing import Any

from lmcache.v1.distributed.compat_056_names import ALL_COMPAT_NAMES
from lmcache.v1.distributed.config import StorageManagerConfig
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase, L2AdaptersConfig
from lmcache.v1.distributed.l2_adapters.hookspecs import L2AdapterFactory, L2AdapterTypeSpec
from lmcache.v1.distributed.l2_adapters.registry import default_l2_adapter_registry
from lmcache.v1.distributed.storage_flags import (
    add_l2_adapter_flag,
    add_storage_flags,
    l2_adapters_config,
    storage_manager_config,
)

# The names, grouped by the 0.5.6 module that re-exports them, are listed once, in
# ``compat_056_names``.
__all__ = list(ALL_COMPAT_NAMES)


# --- lmcache.v1.distributed.config ----------------------------------------------------------


def add_storage_manager_args(
    parser: argparse.ArgumentParser | Any,
    *,
    l1_size_gb_default: float | None = None,
    eviction_policy_default: str | None = None,
    include_shm_name: bool = True,
    include_l2_adapters: bool = True,
) -> None:
    """Add every storage flag of ``lmcache server`` (L1, eviction, L2 policies, --l2-adapter)."""
    add_storage_flags(
        parser,
        l1_size_gb_default=l1_size_gb_default,
        eviction_policy_default=eviction_policy_default,
        include_shm_name=include_shm_name,
        include_l2_adapters=include_l2_adapters,
    )


def parse_args_to_storage_manager_config(args: argparse.Namespace) -> StorageManagerConfig:
    """The ``StorageManagerConfig`` of parsed storage flags (``ValueError`` naming the flag)."""
    return storage_manager_config(vars(args))


# --- lmcache.v1.distributed.l2_adapters.config ----------------------------------------------


def register_l2_adapter_type(name: str, cls: type[L2AdapterConfigBase]) -> None:
    """Make JSON ``type`` ``name`` parse with ``cls`` (entry-point wheels use
    ``L2AdapterTypeSpec`` instead). A name already taken raises ``DuplicateRegistrationError``."""
    default_l2_adapter_registry().register_type(name, cls)


def get_l2_adapter_config_class(t: str) -> type[L2AdapterConfigBase]:
    """The config class of type (or alias) ``t``; ``UnknownL2AdapterTypeError`` otherwise."""
    return default_l2_adapter_registry().config_class(t)


def get_registered_l2_adapter_types() -> list[str]:
    """Every type name and alias, sorted (loads built-ins and plugins)."""
    return default_l2_adapter_registry().names()


def get_type_name_for_config(cfg: L2AdapterConfigBase) -> str:
    """The registered type name whose config class is exactly ``type(cfg)``."""
    return default_l2_adapter_registry().type_name_for_config(cfg)


def create_l2_adapter_from_registry(
    cfg: L2AdapterConfigBase, l1_memory_desc: L1MemoryDesc | None = None
) -> L2AdapterInterface:
    """The adapter ``cfg`` configures (also exported by ``l2_adapters.config``: IMPROVE,
    docs/design/storage-engine.md#l2-packaging)."""
    return default_l2_adapter_registry().create(cfg, l1_memory_desc)


def add_l2_adapters_args(parser: argparse.ArgumentParser | Any) -> None:
    """Add the repeatable ``--l2-adapter JSON`` flag (group "L2 Adapters")."""
    add_l2_adapter_flag(parser)


def parse_args_to_l2_adapters_config(args: argparse.Namespace) -> L2AdaptersConfig:
    """Parse every ``--l2-adapter`` JSON string of ``args``."""
    return l2_adapters_config(getattr(args, "l2_adapter", None) or [])


def build_config_from_dict(
    cls: type[L2AdapterConfigBase], d: dict[str, Any]
) -> L2AdapterConfigBase:
    """``cls.from_options(d)``: ``from_dict`` plus the generic fields."""
    return cls.from_options(d)


def parse_l2_adapter_dict(i: int, d: Any) -> L2AdapterConfigBase:
    """Parse one decoded ``--l2-adapter`` object (``i`` is its 1-based index)."""
    return default_l2_adapter_registry().parse(d, where=f"--l2-adapter #{i}")


# --- lmcache.v1.distributed.l2_adapters.factory ---------------------------------------------


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


def describe_l2_adapter_types() -> list[dict[str, Any]]:
    """One dict per canonical type: name, aliases, source, distribution, version."""
    return default_l2_adapter_registry().describe()


def failed_l2_adapter_plugins() -> list[tuple[str, str, str]]:
    """(entry-point name, value, reason) for each plugin that was skipped."""
    return default_l2_adapter_registry().failed_plugins()


def refresh_l2_adapter_plugins() -> None:
    """Forget entry-point results and rescan (after installing a wheel at run time)."""
    default_l2_adapter_registry().refresh()


# --- lmcache.v1.distributed.l2_adapters -----------------------------------------------------


def create_l2_adapter(
    config: L2AdapterConfigBase, l1_memory_desc: L1MemoryDesc | None = None
) -> L2AdapterInterface:
    return default_l2_adapter_registry().create(config, l1_memory_desc)
