"""The storage flags of ``lmcache server`` and ``lmcache bench``, and the one step from parsed
flags to the typed ``StorageManagerConfig`` the storage engine is built from
(docs/design/storage-engine.md#l1-memory, docs/design/storage-engine.md#l2-config).

- ``add_storage_flags(parser, *, l1_size_gb_default=None, eviction_policy_default=None,
  include_shm_name=True, include_l2_adapters=True)`` adds every L1, eviction, L2-policy and
  ``--l2-adapter`` flag; ``add_l1_args``, ``add_eviction_args``, ``add_l2_policy_args`` and
  ``add_l2_adapter_flag`` add one family each.
- ``storage_manager_config(options) -> StorageManagerConfig`` validates and builds the config
  from the parsed flags as a mapping (``vars(args)``: the CLI turns its Namespace into typed
  configs here, once; the storage engine never sees it). ``ValueError`` names the flag and
  the fix. The legacy L1 path needs ``--l1-size-gb`` and ``--eviction-policy``; the server
  passes its defaults (4 GiB, LRU) through the ``*_default`` keywords so that a no-flag start
  works.
- ``l2_adapters_config(texts)`` parses the ``--l2-adapter`` JSON strings with the L2 type
  registry (``L2AdapterRegistry.parse``).

A flag is declared once, on the config field it sets (``config_flags.flag``): the L1 memory
and manager fields in ``config``, eviction in ``eviction_config``, the L2 policies and limits
on ``StorageManagerConfig``. Declared here are only the flags whose value is JSON parsed by
its own code (``--l1-manager``, ``--l2-adapter``) and the GDS flags, which have no config
class of their own.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Mapping
from typing import Any

from lmcache.v1.distributed.config import (
    GDS_L1_BACKENDS,
    GiB,
    L1ManagerConfig,
    L1MemoryManagerConfig,
    StorageManagerConfig,
    check_l1_size_gb,
    parse_l1_manager_json,
)
from lmcache.v1.distributed.config_flags import add_flags, flag_of, flag_value
from lmcache.v1.distributed.eviction_config import EvictionConfig
from lmcache.v1.distributed.l2_adapters.config import L2AdaptersConfig
from lmcache.v1.distributed.l2_adapters.registry import default_l2_adapter_registry

__all__ = [
    "add_eviction_args",
    "add_l1_args",
    "add_l2_adapter_flag",
    "add_l2_policy_args",
    "add_storage_flags",
    "l2_adapters_config",
    "storage_manager_config",
]


def add_l1_args(
    parser: argparse.ArgumentParser | Any,
    *,
    l1_size_gb_default: float | None = None,
    include_shm_name: bool = True,
) -> None:
    g = parser.add_argument_group("L1 memory")
    # --l1-size-gb itself defaults to None so an explicit value is distinguishable from the
    # caller's default (needed for "Use either --l1-manager or legacy L1 flags").
    parser.set_defaults(l1_size_gb_default=l1_size_gb_default)
    suffix = f" (default {l1_size_gb_default})" if l1_size_gb_default else ""
    add_flags(
        g,
        L1MemoryManagerConfig,
        ("size_in_bytes", "use_lazy", "init_size_in_bytes", "prefault", "align_bytes"),
        help_suffix={"size_in_bytes": suffix},
    )
    add_flags(g, L1MemoryManagerConfig, ("use_hugepages",))
    add_flags(g, L1ManagerConfig, ("write_ttl_seconds", "read_ttl_seconds"))
    g.add_argument(
        "--l1-manager",
        action="append",
        default=[],
        metavar="JSON",
        help='tagged L1, repeatable: {"type":"DRAM","tag":"_default","size_gb":8,'
        '"eviction":{"eviction_policy":"LRU"}}',
    )
    add_flags(g, L1MemoryManagerConfig, ("devdax_path",))
    g.add_argument("--gds-l1-path", type=str, default=None, help="GDS L1 directory")
    g.add_argument(
        "--gds-l1-use-direct-io",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="open the GDS L1 slab with O_DIRECT (only with --gds-l1-path)",
    )
    g.add_argument(
        "--gds-l1-backend",
        choices=GDS_L1_BACKENDS,
        default="auto",
        help="GDS backend (only with --gds-l1-path)",
    )
    if include_shm_name:
        add_flags(g, L1MemoryManagerConfig, ("shm_name",))


def add_eviction_args(
    parser: argparse.ArgumentParser | Any, *, eviction_policy_default: str | None = None
) -> None:
    g = parser.add_argument_group("Eviction")
    parser.set_defaults(eviction_policy_default=eviction_policy_default)
    suffix = f" (default {eviction_policy_default})" if eviction_policy_default else ""
    add_flags(
        g,
        EvictionConfig,
        ("eviction_policy", "trigger_watermark", "eviction_ratio"),
        help_suffix={"eviction_policy": suffix},
    )


#: The L2 policy and limit fields of StorageManagerConfig that are flags, in --help order.
L2_POLICY_FIELDS = (
    "l2_store_policy",
    "l2_prefetch_policy",
    "l2_prefetch_max_in_flight",
    "periodic_notifier_interval_ms",
    "l2_lookup_timeout_seconds",
    "l2_load_timeout_seconds",
)


def add_l2_policy_args(parser: argparse.ArgumentParser | Any) -> None:
    add_flags(parser.add_argument_group("L2 policies"), StorageManagerConfig, L2_POLICY_FIELDS)


def add_storage_flags(
    parser: argparse.ArgumentParser | Any,
    *,
    l1_size_gb_default: float | None = None,
    eviction_policy_default: str | None = None,
    include_shm_name: bool = True,
    include_l2_adapters: bool = True,
) -> None:
    """Add every storage flag of ``lmcache server`` (L1, eviction, L2 policies, --l2-adapter)."""
    add_l1_args(parser, l1_size_gb_default=l1_size_gb_default, include_shm_name=include_shm_name)
    add_eviction_args(parser, eviction_policy_default=eviction_policy_default)
    add_l2_policy_args(parser)
    if include_l2_adapters:
        add_l2_adapter_flag(parser)


def _help_example(types: list[str]) -> str:
    if "fs" in types:
        return '{"type":"fs","base_path":"/data/lmcache"}'
    return '{"type":"mock","max_size_gb":1.0,"mock_bandwidth_gb":10.0}'


def add_l2_adapter_flag(parser: argparse.ArgumentParser | Any) -> None:
    """Add the repeatable ``--l2-adapter JSON`` flag (group "L2 Adapters"). Its help names
    the built-in types and the installed ``lmcache.l2_adapters`` entry points without
    importing any plugin (``lmcache server --help`` stays fast and cannot fail on a broken
    plugin); ``lmcache plugins`` lists every type each entry point provides."""
    types, entry_points = default_l2_adapter_registry().names_without_plugins()
    plugins = (
        f"; installed plugins (entry points, each providing one or more types): "
        f"{', '.join(entry_points)}"
        if entry_points
        else ""
    )
    group = parser.add_argument_group("L2 Adapters")
    group.add_argument(
        "--l2-adapter",
        action="append",
        default=[],
        metavar="JSON",
        dest="l2_adapter",
        help=(
            "L2 adapter as a JSON object, repeatable (cascade in argument order). "
            f"Types: {', '.join(types) or '(none)'}{plugins}. `lmcache plugins` lists every "
            f"type. Example: '{_help_example([*types, *entry_points])}'"
        ),
    )


def l2_adapters_config(texts: Iterable[str]) -> L2AdaptersConfig:
    """Every ``--l2-adapter`` JSON string as its typed config, in order (the cascade order);
    ``ValueError`` naming the adapter's position on bad JSON, an unknown type or a rejected
    field."""
    registry = default_l2_adapter_registry()
    return L2AdaptersConfig(
        adapters=[
            registry.parse(text, where=f"--l2-adapter #{i}") for i, text in enumerate(texts, 1)
        ]
    )


def storage_manager_config(options: Mapping[str, Any]) -> StorageManagerConfig:
    """The ``StorageManagerConfig`` of parsed storage flags: ``options`` maps each flag's
    argparse dest to its value (``vars(args)``); a flag the parser lacks takes its default.

    One builder per section, each validating its own flags, in this order: TTLs and eviction
    fractions, L1 (``--l1-manager`` JSON or the legacy flags), L2 limits, L2 adapters, L2
    policies."""
    watermark, ratio, write_ttl, read_ttl = _l1_ttls_and_eviction_fractions(options)
    l1_jsons = list(options.get("l1_manager", None) or [])
    if l1_jsons:
        primary, extra = _l1_managers_from_json(options, l1_jsons)
        eviction = primary.eviction_config
        assert eviction is not None
    else:
        primary, eviction = _legacy_l1_manager(options, watermark, ratio, write_ttl, read_ttl)
        extra = []
    max_in_flight, interval, lookup_to, load_to = _l2_limits(options)
    l2 = l2_adapters_config(options.get("l2_adapter") or [])
    store_policy, prefetch_policy = _l2_policies(options)
    return StorageManagerConfig(
        l1_manager_config=primary,
        eviction_config=eviction,
        l2_adapter_config=l2,
        l2_store_policy=store_policy,
        l2_prefetch_policy=prefetch_policy,
        l2_prefetch_max_in_flight=max_in_flight,
        periodic_notifier_interval_ms=interval,
        l2_lookup_timeout_seconds=lookup_to,
        l2_load_timeout_seconds=load_to,
        extra_l1_manager_configs=extra,
    )


def _l1_ttls_and_eviction_fractions(options: Mapping[str, Any]) -> tuple[float, float, Any, Any]:
    """``(watermark, ratio, write_ttl, read_ttl)`` of the legacy flags, checked."""
    watermark = flag_value(EvictionConfig, "trigger_watermark", options)
    ratio = flag_value(EvictionConfig, "eviction_ratio", options)
    write_ttl = flag_value(L1ManagerConfig, "write_ttl_seconds", options)
    read_ttl = flag_value(L1ManagerConfig, "read_ttl_seconds", options)
    for field_name, v in (("write_ttl_seconds", write_ttl), ("read_ttl_seconds", read_ttl)):
        if v <= 0:
            raise ValueError(
                f"{flag_of(L1ManagerConfig, field_name).name} must be positive (got {v})"
            )
    for field_name, v in (("trigger_watermark", watermark), ("eviction_ratio", ratio)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(
                f"{flag_of(EvictionConfig, field_name).name} must be a fraction in [0, 1] (got {v})"
            )
    return watermark, ratio, write_ttl, read_ttl


def _l1_managers_from_json(
    options: Mapping[str, Any], l1_jsons: list[str]
) -> tuple[L1ManagerConfig, list[L1ManagerConfig]]:
    """The primary (a DRAM) L1 and the others, from ``--l1-manager`` JSON objects."""
    legacy = [
        flag_of(cls, name).name
        for cls, name in (
            (L1MemoryManagerConfig, "size_in_bytes"),
            (EvictionConfig, "eviction_policy"),
            (L1MemoryManagerConfig, "devdax_path"),
        )
        if flag_value(cls, name, options) is not None
    ]
    if options.get("gds_l1_path") is not None:
        legacy.append("--gds-l1-path")
    if legacy:
        raise ValueError(f"Use either --l1-manager or legacy L1 flags (got {', '.join(legacy)})")
    managers = [parse_l1_manager_json(t) for t in l1_jsons]
    tags = [m.tag for m in managers]
    if len(set(tags)) != len(tags):
        raise ValueError(f"--l1-manager tags must be distinct (got {tags})")
    if not any(m.l1_type == "DRAM" for m in managers):
        raise ValueError("--l1-manager: at least one DRAM L1 is required")
    shm = [m.memory_config.shm_name for m in managers if m.memory_config.shm_name]
    if len(set(shm)) != len(shm):
        raise ValueError(f"DRAM L1 managers need distinct shm names (got {shm})")
    managers.sort(key=lambda m: m.l1_type != "DRAM")
    return managers[0], managers[1:]


def _memory(name: str, options: Mapping[str, Any]) -> Any:
    """The value of ``L1MemoryManagerConfig`` field ``name``'s flag, as given."""
    return flag_value(L1MemoryManagerConfig, name, options)


def _legacy_l1_manager(
    options: Mapping[str, Any], watermark: float, ratio: float, write_ttl: Any, read_ttl: Any
) -> tuple[L1ManagerConfig, EvictionConfig]:
    """The one L1 of the legacy flags (``--l1-size-gb``, ``--eviction-policy``, ...)."""
    size_gb = _memory("size_in_bytes", options)
    if size_gb is None:
        size_gb = options.get("l1_size_gb_default")
    policy = flag_value(EvictionConfig, "eviction_policy", options)
    if policy is None:
        policy = options.get("eviction_policy_default")
    if size_gb is None or policy is None:
        raise ValueError("Legacy L1 configuration requires --l1-size-gb and --eviction-policy")
    check_l1_size_gb(size_gb, "--l1-size-gb")
    init_gb = _memory("init_size_in_bytes", options)
    if not (isinstance(init_gb, int | float) and math.isfinite(init_gb) and init_gb >= 0):
        raise ValueError(f"--l1-init-size-gb must be a finite number of GiB >= 0 (got {init_gb!r})")
    align = int(_memory("align_bytes", options))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"--l1-align-bytes must be a power of two (got {align})")
    shm_name = _memory("shm_name", options) or ""
    use_hugepages = bool(_memory("use_hugepages", options))
    if use_hugepages and shm_name:
        raise ValueError(
            'l1-use-hugepages is incompatible with shared memory. Please set --shm-name "" '
            "to disable SHM when enabling hugepages."
        )
    mem = L1MemoryManagerConfig(
        size_in_bytes=int(size_gb * GiB),
        use_lazy=bool(_memory("use_lazy", options)),
        init_size_in_bytes=int(init_gb * GiB),
        align_bytes=align,
        shm_name=shm_name,
        use_hugepages=use_hugepages,
        devdax_path=_memory("devdax_path", options),
        prefault=_memory("prefault", options),
    )
    eviction = EvictionConfig(policy, watermark, ratio)
    gds_path = options.get("gds_l1_path")
    gds = (
        {
            "path": gds_path,
            "use_direct_io": bool(options.get("gds_l1_use_direct_io", True)),
            "backend": options.get("gds_l1_backend", "auto"),
        }
        if gds_path
        else None
    )
    primary = L1ManagerConfig(
        mem, gds_l1_config=gds, write_ttl_seconds=write_ttl, read_ttl_seconds=read_ttl
    )
    return primary, eviction


def _l2_limits(options: Mapping[str, Any]) -> tuple[int, int, float, float]:
    """``(prefetch max in flight, notifier interval ms, lookup timeout, load timeout)``."""

    def value(name: str) -> Any:
        return flag_value(StorageManagerConfig, name, options)

    max_in_flight = int(value("l2_prefetch_max_in_flight"))
    if max_in_flight < 1:
        raise ValueError(f"--l2-prefetch-max-in-flight must be >= 1 (got {max_in_flight})")
    interval = int(value("periodic_notifier_interval_ms"))
    if interval < 1:
        raise ValueError(f"--periodic-notifier-interval-ms must be >= 1 (got {interval})")
    lookup_to = float(value("l2_lookup_timeout_seconds"))
    load_to = float(value("l2_load_timeout_seconds"))
    if lookup_to < 0 or load_to < 0:
        raise ValueError("--l2-lookup-timeout-seconds/--l2-load-timeout-seconds must be >= 0")
    return max_in_flight, interval, lookup_to, load_to


def _l2_policies(options: Mapping[str, Any]) -> tuple[str, str]:
    """``(store policy, prefetch policy)``, each one a registered name."""
    from lmcache.v1.distributed.storage_policies import (
        get_registered_prefetch_policies,
        get_registered_store_policies,
    )

    chosen = []
    for field_name, registered in (
        ("l2_store_policy", get_registered_store_policies()),
        ("l2_prefetch_policy", get_registered_prefetch_policies()),
    ):
        name = flag_value(StorageManagerConfig, field_name, options)
        if name not in registered:
            raise ValueError(
                f"{flag_of(StorageManagerConfig, field_name).name}: unknown policy {name!r}. "
                f"Known: {', '.join(sorted(registered))}"
            )
        chosen.append(name)
    return chosen[0], chosen[1]
