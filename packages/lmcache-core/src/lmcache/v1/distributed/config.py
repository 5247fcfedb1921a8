"""Storage configuration: dataclasses and the ``lmcache server`` storage flags
(docs/design/storage-engine.md#l1-memory, docs/design/storage-engine.md#prefetch-controller).

Dataclasses: ``EvictionConfig``, ``L1MemoryManagerConfig``, ``L1ManagerConfig``,
``StorageManagerConfig``.

Argparse helpers (what ``lmcache server`` and ``lmcache bench`` call):

- ``add_storage_manager_args(parser, *, l1_size_gb_default=None, eviction_policy_default=None,
  include_shm_name=True, include_l2_adapters=True)`` adds every L1, eviction, L2-policy and
  ``--l2-adapter`` flag (it calls the three helpers below plus ``add_l2_adapters_args``).
- ``add_l1_args(parser, ...)``, ``add_eviction_args(parser, ...)``, ``add_l2_policy_args(parser)``
  add one flag family each.
- ``parse_args_to_storage_manager_config(args) -> StorageManagerConfig`` validates and builds the
  config (``ValueError`` naming the flag and the fix on bad input). The legacy L1 path needs
  ``--l1-size-gb`` and ``--eviction-policy``; the server passes its IMPROVE defaults (4 GiB, LRU)
  through the ``*_default`` keywords so that a no-flag start works.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcache.v1.distributed.eviction_config import EVICTION_POLICIES, EvictionConfig
from lmcache.v1.distributed.l1_mapping import PREFAULT_MODES, mapping_error

if TYPE_CHECKING:
    from lmcache.v1.distributed.l2_adapters.config import L2AdaptersConfig

__all__ = [
    "EVICTION_POLICIES",
    "EvictionConfig",
    "L1ManagerConfig",
    "L1MemoryManagerConfig",
    "StorageManagerConfig",
    "add_eviction_args",
    "add_l1_args",
    "add_l2_policy_args",
    "add_storage_manager_args",
    "parse_args_to_storage_manager_config",
    "parse_l1_manager_json",
]

GiB = 1 << 30
DEFAULT_TAG = "_default"


def _default_shm_name() -> str:
    return f"lmcache_l1_pool_{os.getpid()}"


GDS_L1_BACKENDS = ("auto", "cufile", "hipfile", "mufile", "phx", "ugds")


@dataclass
class L1MemoryManagerConfig:
    size_in_bytes: int
    use_lazy: bool
    init_size_in_bytes: int = 20 * GiB
    align_bytes: int = 4096
    shm_name: str = field(default_factory=_default_shm_name)
    use_hugepages: bool = False
    devdax_path: str | None = None
    devdax_size_in_bytes: int = 0
    #: when L1 pages are backed: "all" (from the start), "ahead" (256 MiB ahead of use), "off"
    prefault: str = "all"

    def __post_init__(self) -> None:
        if self.prefault not in PREFAULT_MODES:
            raise ValueError(
                f"l1 prefault must be one of {', '.join(PREFAULT_MODES)} (got {self.prefault!r})"
            )
        if int(self.size_in_bytes) <= 0:
            raise ValueError(f"L1 size must be positive (got {self.size_in_bytes} bytes)")
        a = int(self.align_bytes)
        if a <= 0 or a & (a - 1):
            raise ValueError(f"l1 align_bytes must be a power of two (got {a})")
        self.init_size_in_bytes = min(int(self.init_size_in_bytes), int(self.size_in_bytes))


@dataclass
class L1ManagerConfig:
    memory_config: L1MemoryManagerConfig
    gds_l1_config: Any = None
    write_ttl_seconds: float = 600
    read_ttl_seconds: float = 300
    # multi-L1 (``--l1-manager``): the tag adapters bind to, the medium and its own eviction
    tag: str = DEFAULT_TAG
    l1_type: str = "DRAM"
    eviction_config: EvictionConfig | None = None


@dataclass
class StorageManagerConfig:
    l1_manager_config: L1ManagerConfig
    eviction_config: EvictionConfig
    l2_adapter_config: L2AdaptersConfig | None = None
    l2_store_policy: str = "default"
    l2_prefetch_policy: str = "default"
    l2_prefetch_max_in_flight: int = 8
    periodic_notifier_interval_ms: int = 5
    l2_lookup_timeout_seconds: float = 30.0
    l2_load_timeout_seconds: float = 60.0
    #: further L1 managers from repeated ``--l1-manager`` (each with its own eviction)
    extra_l1_manager_configs: list[L1ManagerConfig] = field(default_factory=list)

    def all_l1_manager_configs(self) -> list[L1ManagerConfig]:
        return [self.l1_manager_config, *self.extra_l1_manager_configs]

    def eviction_config_for(self, l1: L1ManagerConfig) -> EvictionConfig:
        return l1.eviction_config or self.eviction_config

    def to_dict(self) -> dict[str, Any]:
        def l1(c: L1ManagerConfig) -> dict[str, Any]:
            m = c.memory_config
            return {
                "tag": c.tag,
                "type": c.l1_type,
                "size_in_bytes": m.size_in_bytes,
                "use_lazy": m.use_lazy,
                "init_size_in_bytes": m.init_size_in_bytes,
                "align_bytes": m.align_bytes,
                "shm_name": m.shm_name,
                "use_hugepages": m.use_hugepages,
                "prefault": m.prefault,
                "write_ttl_seconds": c.write_ttl_seconds,
                "read_ttl_seconds": c.read_ttl_seconds,
                "eviction": vars(self.eviction_config_for(c)).copy(),
            }

        adapters = []
        if self.l2_adapter_config is not None:
            for a in self.l2_adapter_config.adapters:
                adapters.append({"class": type(a).__name__, "affinity_tag": a.affinity_tag})
        return {
            "l1_managers": [l1(c) for c in self.all_l1_manager_configs()],
            "l2_adapters": adapters,
            "l2_store_policy": self.l2_store_policy,
            "l2_prefetch_policy": self.l2_prefetch_policy,
            "l2_prefetch_max_in_flight": self.l2_prefetch_max_in_flight,
            "periodic_notifier_interval_ms": self.periodic_notifier_interval_ms,
            "l2_lookup_timeout_seconds": self.l2_lookup_timeout_seconds,
            "l2_load_timeout_seconds": self.l2_load_timeout_seconds,
        }


# --- argparse ------------------------------------------------------------------------------


def add_l1_args(
    parser: argparse.ArgumentParser | Any,
    *,
    l1_size_gb_default: float | None = None,
    include_shm_name: bool = True,
) -> None:
    g = parser.add_argument_group("L1 memory")
    # The flag itself defaults to None so an explicit value is distinguishable from the
    # caller's default (needed for "Use either --l1-manager or legacy L1 flags").
    parser.set_defaults(l1_size_gb_default=l1_size_gb_default)
    g.add_argument(
        "--l1-size-gb",
        type=float,
        default=None,
        help="L1 (CPU memory) cache size in GiB"
        + (f" (default {l1_size_gb_default})" if l1_size_gb_default else ""),
    )
    g.add_argument(
        "--l1-use-lazy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="grow (commit) L1 memory in the background instead of all at start",
    )
    g.add_argument(
        "--l1-init-size-gb",
        type=int,
        default=20,
        help="initially committed L1 size in GiB for lazy L1 (clamped to --l1-size-gb)",
    )
    g.add_argument(
        "--l1-prefault",
        choices=PREFAULT_MODES,
        default="all",
        help="when the pages of L1 are backed, by a background thread: all = the whole pool "
        "from the start (memory use reaches --l1-size-gb within seconds; stores never wait for "
        "page allocation), ahead = 256 MiB ahead of use (memory grows as L1 fills), off = on "
        "first write",
    )
    g.add_argument(
        "--l1-align-bytes",
        type=int,
        default=4096,
        help="allocation alignment in bytes (a power of two)",
    )
    g.add_argument(
        "--l1-use-hugepages",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="back L1 with 2 MiB hugepages (forces --no-l1-use-lazy)",
    )
    g.add_argument(
        "--l1-write-ttl-seconds",
        type=float,
        default=600,
        help="a write reservation not finished within this time can be reclaimed",
    )
    g.add_argument(
        "--l1-read-ttl-seconds", type=float, default=300, help="a read lock expires after this time"
    )
    g.add_argument(
        "--l1-manager",
        action="append",
        default=[],
        metavar="JSON",
        help='tagged L1, repeatable: {"type":"DRAM","tag":"_default","size_gb":8,'
        '"eviction":{"eviction_policy":"LRU"}}',
    )
    g.add_argument("--l1-devdax-path", type=str, default=None, help="devdax device for a DEVDAX L1")
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
        g.add_argument(
            "--shm-name",
            type=str,
            default="",
            help='POSIX shared-memory name for the L1 pool ("" disables SHM)',
        )


def add_eviction_args(
    parser: argparse.ArgumentParser | Any, *, eviction_policy_default: str | None = None
) -> None:
    g = parser.add_argument_group("Eviction")
    parser.set_defaults(eviction_policy_default=eviction_policy_default)
    g.add_argument(
        "--eviction-policy",
        choices=EVICTION_POLICIES,
        default=None,
        help="L1 eviction policy"
        + (f" (default {eviction_policy_default})" if eviction_policy_default else ""),
    )
    g.add_argument(
        "--eviction-trigger-watermark",
        type=float,
        default=0.8,
        help="evict when L1 usage reaches this fraction",
    )
    g.add_argument(
        "--eviction-ratio",
        type=float,
        default=0.2,
        help="fraction of used bytes freed per eviction cycle",
    )


def add_l2_policy_args(parser: argparse.ArgumentParser | Any) -> None:
    g = parser.add_argument_group("L2 policies")
    g.add_argument(
        "--l2-store-policy",
        type=str,
        default="default",
        help="default (store to every adapter, keep L1) | skip_l1 (delete from L1 after)",
    )
    g.add_argument(
        "--l2-prefetch-policy",
        type=str,
        default="default",
        help="default (loaded keys are temporary) | retain (loaded keys stay in L1)",
    )
    g.add_argument(
        "--l2-prefetch-max-in-flight", type=int, default=8, help="prefetch requests running at once"
    )
    g.add_argument(
        "--periodic-notifier-interval-ms",
        type=int,
        default=5,
        help="interval of the timer that wakes adapters without their own signal",
    )
    g.add_argument(
        "--l2-lookup-timeout-seconds",
        type=float,
        default=30.0,
        help="an L2 lookup past this deadline counts as a miss (0 disables)",
    )
    g.add_argument(
        "--l2-load-timeout-seconds",
        type=float,
        default=60.0,
        help="an L2 load past this deadline counts as a miss (0 disables)",
    )


def add_storage_manager_args(
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
        from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args

        add_l2_adapters_args(parser)


_L1_COMMON = {
    "type",
    "tag",
    "size_gb",
    "align_bytes",
    "read_ttl_seconds",
    "write_ttl_seconds",
    "eviction",
}
_L1_DRAM = {"use_lazy", "init_size_gb", "shm_name", "use_hugepages", "prefault"}
_L1_EXTRA = {
    "DRAM": _L1_DRAM,
    "DEVDAX": {"devdax_path"},
    "GDS": {"path", "use_direct_io", "backend"},
}


def check_l1_size_gb(size_gb: Any, flag: str) -> None:
    """An L1 size must be a positive, finite number of GiB this machine can map. A size
    above the memory available now only warns (at start-up): a lazy L1 commits memory as it
    fills."""
    if not (
        isinstance(size_gb, int | float)
        and not isinstance(size_gb, bool)
        and math.isfinite(size_gb)
        and size_gb > 0
    ):
        raise ValueError(f"{flag} must be a positive, finite number of GiB (got {size_gb!r})")
    error = mapping_error(int(size_gb * GiB))
    if error is not None:
        raise ValueError(
            f"{flag} {size_gb:g} is too large for this machine: it cannot map that much memory "
            f"({error}); pass a smaller {flag}"
        )


def _num(d: dict[str, Any], k: str, default: float, lo: float | None = None) -> float:
    v = d.get(k, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (lo is not None and v < lo):
        raise ValueError(f"--l1-manager field {k!r} must be a number >= {lo} (got {v!r})")
    return v


def parse_l1_manager_json(text: str) -> L1ManagerConfig:
    """Parse one ``--l1-manager`` JSON object."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"Invalid JSON for --l1-manager: {exc}") from exc
    if not isinstance(d, dict):
        raise ValueError(f"--l1-manager: expected a JSON object, got {type(d).__name__}")
    t = d.get("type")
    if t not in _L1_EXTRA:
        raise ValueError("--l1-manager requires type DRAM, DEVDAX or GDS")
    unknown = set(d) - _L1_COMMON - _L1_EXTRA[t]
    if unknown:
        raise ValueError(f"Unknown L1 fields: {sorted(unknown)}")
    tag = d.get("tag", DEFAULT_TAG if t == "DRAM" else "")
    if not isinstance(tag, str) or not tag:
        raise ValueError("--l1-manager 'tag' must be a non-empty string")
    if tag == DEFAULT_TAG and t != "DRAM":
        raise ValueError(f"only a DRAM L1 may use the tag {DEFAULT_TAG!r}")
    ev = d.get("eviction")
    if not isinstance(ev, dict) or not ev.get("eviction_policy"):
        raise ValueError("An eviction policy is required for each L1")
    eviction = EvictionConfig(
        eviction_policy=ev["eviction_policy"],
        trigger_watermark=ev.get("trigger_watermark", 0.8),
        eviction_ratio=ev.get("eviction_ratio", 0.2),
    )
    size_gb = _num(d, "size_gb", 0, 0)
    if size_gb <= 0:
        raise ValueError("--l1-manager 'size_gb' must be a positive number")
    align = int(_num(d, "align_bytes", 4096, 1))
    use_lazy = bool(d.get("use_lazy", True))
    shm_name = d.get("shm_name", "")
    if not isinstance(shm_name, str):
        raise ValueError("--l1-manager 'shm_name' must be a string")
    if shm_name and "use_lazy" in d and use_lazy:
        raise ValueError("shm_name cannot coexist with use_lazy")
    if shm_name:
        use_lazy = False
    mem = L1MemoryManagerConfig(
        size_in_bytes=int(size_gb * GiB),
        use_lazy=use_lazy,
        init_size_in_bytes=int(_num(d, "init_size_gb", 20, 0) * GiB),
        align_bytes=align,
        shm_name=shm_name,
        use_hugepages=bool(d.get("use_hugepages", False)),
        devdax_path=d.get("devdax_path"),
        prefault=d.get("prefault", "all"),
    )
    return L1ManagerConfig(
        memory_config=mem,
        write_ttl_seconds=_num(d, "write_ttl_seconds", 600, 0),
        read_ttl_seconds=_num(d, "read_ttl_seconds", 300, 0),
        tag=tag,
        l1_type=t,
        eviction_config=eviction,
    )


def parse_args_to_storage_manager_config(args: argparse.Namespace) -> StorageManagerConfig:
    """Build a ``StorageManagerConfig`` from parsed flags (see the module docstring).

    One builder per section, each validating its own flags, in this order: TTLs and eviction
    fractions, L1 (``--l1-manager`` JSON or the legacy flags), L2 limits, L2 adapters, L2
    policies."""
    watermark, ratio, write_ttl, read_ttl = _l1_ttls_and_eviction_fractions(args)
    l1_jsons = list(getattr(args, "l1_manager", None) or [])
    if l1_jsons:
        primary, extra = _l1_managers_from_json(args, l1_jsons)
        eviction = primary.eviction_config
        assert eviction is not None
    else:
        primary, eviction = _legacy_l1_manager(args, watermark, ratio, write_ttl, read_ttl)
        extra = []
    max_in_flight, interval, lookup_to, load_to = _l2_limits(args)
    l2 = _l2_adapters(args)
    store_policy, prefetch_policy = _l2_policies(args)
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


def _l1_ttls_and_eviction_fractions(args: argparse.Namespace) -> tuple[float, float, Any, Any]:
    """``(watermark, ratio, write_ttl, read_ttl)`` of the legacy flags, checked."""
    watermark = getattr(args, "eviction_trigger_watermark", 0.8)
    ratio = getattr(args, "eviction_ratio", 0.2)
    write_ttl = getattr(args, "l1_write_ttl_seconds", 600)
    read_ttl = getattr(args, "l1_read_ttl_seconds", 300)
    for name, v in (("--l1-write-ttl-seconds", write_ttl), ("--l1-read-ttl-seconds", read_ttl)):
        if v <= 0:
            raise ValueError(f"{name} must be positive (got {v})")
    for name, v in (("--eviction-trigger-watermark", watermark), ("--eviction-ratio", ratio)):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{name} must be a fraction in [0, 1] (got {v})")
    return watermark, ratio, write_ttl, read_ttl


def _l1_managers_from_json(
    args: argparse.Namespace, l1_jsons: list[str]
) -> tuple[L1ManagerConfig, list[L1ManagerConfig]]:
    """The primary (a DRAM) L1 and the others, from ``--l1-manager`` JSON objects."""
    legacy = [
        f
        for f, n in (
            ("--l1-size-gb", "l1_size_gb"),
            ("--eviction-policy", "eviction_policy"),
            ("--l1-devdax-path", "l1_devdax_path"),
            ("--gds-l1-path", "gds_l1_path"),
        )
        if getattr(args, n, None) is not None
    ]
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


def _legacy_l1_manager(
    args: argparse.Namespace, watermark: float, ratio: float, write_ttl: Any, read_ttl: Any
) -> tuple[L1ManagerConfig, EvictionConfig]:
    """The one L1 of the legacy flags (``--l1-size-gb``, ``--eviction-policy``, ...)."""
    size_gb = getattr(args, "l1_size_gb", None)
    if size_gb is None:
        size_gb = getattr(args, "l1_size_gb_default", None)
    policy = getattr(args, "eviction_policy", None)
    if policy is None:
        policy = getattr(args, "eviction_policy_default", None)
    if size_gb is None or policy is None:
        raise ValueError("Legacy L1 configuration requires --l1-size-gb and --eviction-policy")
    check_l1_size_gb(size_gb, "--l1-size-gb")
    init_gb = getattr(args, "l1_init_size_gb", 20)
    if not (isinstance(init_gb, int | float) and math.isfinite(init_gb) and init_gb >= 0):
        raise ValueError(f"--l1-init-size-gb must be a finite number of GiB >= 0 (got {init_gb!r})")
    align = int(getattr(args, "l1_align_bytes", 4096))
    if align <= 0 or align & (align - 1):
        raise ValueError(f"--l1-align-bytes must be a power of two (got {align})")
    shm_name = getattr(args, "shm_name", "") or ""
    use_hugepages = bool(getattr(args, "l1_use_hugepages", False))
    if use_hugepages and shm_name:
        raise ValueError(
            'l1-use-hugepages is incompatible with shared memory. Please set --shm-name "" '
            "to disable SHM when enabling hugepages."
        )
    mem = L1MemoryManagerConfig(
        size_in_bytes=int(size_gb * GiB),
        use_lazy=bool(getattr(args, "l1_use_lazy", True)),
        init_size_in_bytes=int(init_gb * GiB),
        align_bytes=align,
        shm_name=shm_name,
        use_hugepages=use_hugepages,
        devdax_path=getattr(args, "l1_devdax_path", None),
        prefault=getattr(args, "l1_prefault", "all"),
    )
    eviction = EvictionConfig(policy, watermark, ratio)
    gds_path = getattr(args, "gds_l1_path", None)
    gds = (
        {
            "path": gds_path,
            "use_direct_io": bool(getattr(args, "gds_l1_use_direct_io", True)),
            "backend": getattr(args, "gds_l1_backend", "auto"),
        }
        if gds_path
        else None
    )
    primary = L1ManagerConfig(
        mem, gds_l1_config=gds, write_ttl_seconds=write_ttl, read_ttl_seconds=read_ttl
    )
    return primary, eviction


def _l2_limits(args: argparse.Namespace) -> tuple[int, int, float, float]:
    """``(prefetch max in flight, notifier interval ms, lookup timeout, load timeout)``."""
    max_in_flight = int(getattr(args, "l2_prefetch_max_in_flight", 8))
    if max_in_flight < 1:
        raise ValueError(f"--l2-prefetch-max-in-flight must be >= 1 (got {max_in_flight})")
    interval = int(getattr(args, "periodic_notifier_interval_ms", 5))
    if interval < 1:
        raise ValueError(f"--periodic-notifier-interval-ms must be >= 1 (got {interval})")
    lookup_to = float(getattr(args, "l2_lookup_timeout_seconds", 30.0))
    load_to = float(getattr(args, "l2_load_timeout_seconds", 60.0))
    if lookup_to < 0 or load_to < 0:
        raise ValueError("--l2-lookup-timeout-seconds/--l2-load-timeout-seconds must be >= 0")
    return max_in_flight, interval, lookup_to, load_to


def _l2_adapters(args: argparse.Namespace) -> L2AdaptersConfig:
    """The ``--l2-adapter`` list (none when the parser has no such flag)."""
    from lmcache.v1.distributed.l2_adapters.config import (
        L2AdaptersConfig,
        parse_args_to_l2_adapters_config,
    )

    return (
        parse_args_to_l2_adapters_config(args)
        if hasattr(args, "l2_adapter")
        else L2AdaptersConfig(adapters=[])
    )


def _l2_policies(args: argparse.Namespace) -> tuple[str, str]:
    """``(store policy, prefetch policy)``, each one a registered name."""
    from lmcache.v1.distributed.storage_policies import (
        get_registered_prefetch_policies,
        get_registered_store_policies,
    )

    chosen = []
    for flag, registered in (
        ("--l2-store-policy", get_registered_store_policies()),
        ("--l2-prefetch-policy", get_registered_prefetch_policies()),
    ):
        name = getattr(args, flag[2:].replace("-", "_"), "default")
        if name not in registered:
            raise ValueError(
                f"{flag}: unknown policy {name!r}. Known: {', '.join(sorted(registered))}"
            )
        chosen.append(name)
    return chosen[0], chosen[1]
