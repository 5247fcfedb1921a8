"""Which 0.5.6 module re-exports which name of ``compat_056``: the one list.

``compat_056`` defines the functions and imports the modules below, so those modules cannot
import it back; each takes its lazy table from here instead (``compat_lazy_table``). This
module imports nothing, so any module may import it.
"""

from __future__ import annotations

COMPAT_056_MODULE = "lmcache.v1.distributed.compat_056"

REEXPORTED_BY: dict[str, tuple[str, ...]] = {
    "lmcache.v1.distributed.config": (
        "add_storage_manager_args",
        "parse_args_to_storage_manager_config",
    ),
    "lmcache.v1.distributed.l2_adapters.config": (
        "add_l2_adapters_args",
        "build_config_from_dict",
        "create_l2_adapter_from_registry",
        "get_l2_adapter_config_class",
        "get_registered_l2_adapter_types",
        "get_type_name_for_config",
        "parse_args_to_l2_adapters_config",
        "parse_l2_adapter_dict",
        "register_l2_adapter_type",
    ),
    "lmcache.v1.distributed.l2_adapters.factory": (
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
    ),
    "lmcache.v1.distributed.l2_adapters": ("create_l2_adapter",),
}

ALL_COMPAT_NAMES: tuple[str, ...] = tuple(
    sorted({name for names in REEXPORTED_BY.values() for name in names})
)


def compat_lazy_table(module_name: str) -> dict[str, tuple[str, str | None]]:
    """The ``lazy_attributes`` table of ``module_name``'s 0.5.6 names."""
    return {name: (COMPAT_056_MODULE, name) for name in REEXPORTED_BY[module_name]}
