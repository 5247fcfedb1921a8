"""0.5.6's path for adapter factories and plugin loading
(docs/design/storage-engine.md#l2-packaging, docs/design/storage-engine.md#l2-config).

Every function named here is defined in ``lmcache.v1.distributed.compat_056`` and answers from
the default :class:`~lmcache.v1.distributed.l2_adapters.registry.L2AdapterRegistry`, which owns
the types, factories, pending modules and entry-point results; core code calls the registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache.utils.lazy import lazy_attributes, lazy_dir
from lmcache.v1.distributed.compat_056_names import compat_lazy_table
from lmcache.v1.distributed.l2_adapters.hookspecs import L2AdapterFactory
from lmcache.v1.distributed.l2_adapters.registry import BUILTIN_MODULES

if TYPE_CHECKING:
    # Typed views of the names below; at run time __getattr__ imports them.
    from lmcache.v1.distributed.compat_056 import (
        add_pending_module,
        create_l2_adapter_from_registry,
        describe_l2_adapter_types,
        ensure_adapter_loaded,
        failed_l2_adapter_plugins,
        get_all_registered_names,
        load_all_adapters,
        load_all_l2_adapter_types,
        refresh_l2_adapter_plugins,
        register_l2_adapter_factory,
        register_l2_adapter_type_spec,
    )

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

# Defined once, in the compat module (which imports the registry and this package's config);
# a table, not an import, so that no cycle results.
_LAZY = compat_lazy_table(__name__)

# Hidden from type checkers: with a visible module __getattr__, mypy would accept any
# misspelt name imported from this module as Any.
if not TYPE_CHECKING:
    __getattr__ = lazy_attributes(__name__, _LAZY)


__dir__ = lazy_dir(globals(), _LAZY)
