"""Pluggy hook specification for L2 adapter types shipped by other wheels
(docs/design/storage-engine.md#l2-packaging).

A storage wheel declares::

    [project.entry-points."lmcache.l2_adapters"]
    fs = "lmcache.storage.fs.hooks"

and its ``hooks`` module implements::

    from lmcache.v1.distributed.l2_adapters.hookspecs import L2AdapterTypeSpec, hookimpl

    @hookimpl
    def lmcache_l2_adapter_types():
        return [L2AdapterTypeSpec("fs", FSL2AdapterConfig, _create_fs)]

Keep hook modules cheap to import: import heavy dependencies inside the factory so a
missing one surfaces as an ``ImportError`` naming the pip package when the adapter is
created, not when the registry is listed (``import_dependency`` words that error).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
    from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

PROJECT_NAME = "lmcache.l2_adapters"
ENTRY_POINT_GROUP = "lmcache.l2_adapters"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
"""Decorator marking a storage wheel's ``lmcache_l2_adapter_types()`` hook implementation
(pluggy project ``"lmcache.l2_adapters"``)."""

#: ``factory(config, l1_memory_desc_or_None) -> L2AdapterInterface``
L2AdapterFactory = Callable[["L2AdapterConfigBase", "L1MemoryDesc | None"], "L2AdapterInterface"]

__all__ = [
    "ENTRY_POINT_GROUP",
    "L2AdapterFactory",
    "L2AdapterHookSpecs",
    "L2AdapterTypeSpec",
    "hookimpl",
    "hookspec",
    "import_dependency",
]


@dataclass(frozen=True)
class L2AdapterTypeSpec:
    """One L2 type a wheel provides: its JSON ``type`` name, config class and factory.

    The config class carries the same name in ``type_name`` (a class that declares none gets
    it when the spec registers); creating an adapter reads it to find ``factory``."""

    name: str
    config_class: type[L2AdapterConfigBase]
    factory: Callable[..., Any]
    aliases: tuple[str, ...] = ()


class L2AdapterHookSpecs:
    @hookspec
    def lmcache_l2_adapter_types(self) -> list[L2AdapterTypeSpec]:  # type: ignore[empty-body]
        """Return the L2 adapter types this plugin provides."""


def import_dependency(module: str, needed_by: str, fix: str) -> ModuleType:
    """Import ``module`` inside an adapter factory. A missing one raises an ``ImportError``
    that says what needs it and how to install it (``fix``)."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{needed_by} ({exc}); {fix}") from exc
