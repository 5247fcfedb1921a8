"""Storage configuration: the typed configs the storage engine is built from
(docs/design/storage-engine.md#l1-memory, docs/design/storage-engine.md#prefetch-controller).

Dataclasses: ``EvictionConfig``, ``L1MemoryManagerConfig``, ``L1ManagerConfig``,
``StorageManagerConfig``; ``parse_l1_manager_json`` reads one ``--l1-manager`` object.

The storage flags of ``lmcache server`` and ``lmcache bench`` (and the step from parsed flags
to a ``StorageManagerConfig``) are in ``storage_flags``; 0.5.6's argparse functions of this
module (``add_storage_manager_args``, ``parse_args_to_storage_manager_config``) are in
``compat_056``. Both stay importable from here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcache.utils.lazy import lazy_attributes, lazy_dir
from lmcache.v1.distributed.compat_056_names import compat_lazy_table
from lmcache.v1.distributed.config_flags import flag
from lmcache.v1.distributed.eviction_config import EVICTION_POLICIES, EvictionConfig
from lmcache.v1.distributed.l1_mapping import PREFAULT_MODES, mapping_error

if TYPE_CHECKING:
    # Typed views of the flag functions below; at run time __getattr__ imports them.
    from lmcache.v1.distributed.compat_056 import (
        add_storage_manager_args,
        parse_args_to_storage_manager_config,
    )
    from lmcache.v1.distributed.l2_adapters.config import L2AdaptersConfig
    from lmcache.v1.distributed.storage_flags import (
        add_eviction_args,
        add_l1_args,
        add_l2_policy_args,
    )

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
    """One L1's memory. The fields that are ``lmcache server`` flags declare them
    (``config_flags``); sizes are GiB on the command line, bytes here."""

    size_in_bytes: int = flag(
        "--l1-size-gb", "L1 (CPU memory) cache size in GiB", type=float, flag_default=None
    )
    use_lazy: bool = flag(
        "--l1-use-lazy",
        "grow (commit) L1 memory in the background instead of all at start",
        action=argparse.BooleanOptionalAction,
        flag_default=True,
    )
    init_size_in_bytes: int = flag(
        "--l1-init-size-gb",
        "initially committed L1 size in GiB for lazy L1 (clamped to --l1-size-gb)",
        default=20 * GiB,
        type=int,
        flag_default=20,
    )
    align_bytes: int = flag(
        "--l1-align-bytes", "allocation alignment in bytes (a power of two)", default=4096, type=int
    )
    shm_name: str = flag(
        "--shm-name",
        'POSIX shared-memory name for the L1 pool ("" disables SHM)',
        default_factory=_default_shm_name,
        type=str,
        flag_default="",
    )
    use_hugepages: bool = flag(
        "--l1-use-hugepages",
        "back L1 with 2 MiB hugepages (forces --no-l1-use-lazy)",
        default=False,
        action=argparse.BooleanOptionalAction,
    )
    devdax_path: str | None = flag(
        "--l1-devdax-path", "devdax device for a DEVDAX L1", default=None, type=str
    )
    devdax_size_in_bytes: int = 0
    #: when L1 pages are backed: "all" (from the start), "ahead" (256 MiB ahead of use), "off"
    prefault: str = flag(
        "--l1-prefault",
        "when the pages of L1 are backed, by a background thread: all = the whole pool "
        "from the start (memory use reaches --l1-size-gb within seconds; stores never wait for "
        "page allocation), ahead = 256 MiB ahead of use (memory grows as L1 fills), off = on "
        "first write",
        default="all",
        choices=PREFAULT_MODES,
    )

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
    write_ttl_seconds: float = flag(
        "--l1-write-ttl-seconds",
        "a write reservation not finished within this time can be reclaimed",
        default=600,
        type=float,
    )
    read_ttl_seconds: float = flag(
        "--l1-read-ttl-seconds", "a read lock expires after this time", default=300, type=float
    )
    # multi-L1 (``--l1-manager``): the tag adapters bind to, the medium and its own eviction
    tag: str = DEFAULT_TAG
    l1_type: str = "DRAM"
    eviction_config: EvictionConfig | None = None


@dataclass
class StorageManagerConfig:
    l1_manager_config: L1ManagerConfig
    eviction_config: EvictionConfig
    l2_adapter_config: L2AdaptersConfig | None = None
    l2_store_policy: str = flag(
        "--l2-store-policy",
        "default (store to every adapter, keep L1) | skip_l1 (delete from L1 after)",
        default="default",
        type=str,
    )
    l2_prefetch_policy: str = flag(
        "--l2-prefetch-policy",
        "default (loaded keys are temporary) | retain (loaded keys stay in L1)",
        default="default",
        type=str,
    )
    l2_prefetch_max_in_flight: int = flag(
        "--l2-prefetch-max-in-flight", "prefetch requests running at once", default=8, type=int
    )
    periodic_notifier_interval_ms: int = flag(
        "--periodic-notifier-interval-ms",
        "interval of the timer that wakes adapters without their own signal",
        default=5,
        type=int,
    )
    l2_lookup_timeout_seconds: float = flag(
        "--l2-lookup-timeout-seconds",
        "an L2 lookup past this deadline counts as a miss (0 disables)",
        default=30.0,
        type=float,
    )
    l2_load_timeout_seconds: float = flag(
        "--l2-load-timeout-seconds",
        "an L2 load past this deadline counts as a miss (0 disables)",
        default=60.0,
        type=float,
    )
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


# The flag functions live in ``storage_flags`` (ours) and ``compat_056`` (0.5.6's), which
# import this module; a table, not an import, so that no cycle results.
_LAZY: dict[str, tuple[str, str | None]] = {
    "add_eviction_args": ("lmcache.v1.distributed.storage_flags", "add_eviction_args"),
    "add_l1_args": ("lmcache.v1.distributed.storage_flags", "add_l1_args"),
    "add_l2_policy_args": ("lmcache.v1.distributed.storage_flags", "add_l2_policy_args"),
    **compat_lazy_table(__name__),
}

# Hidden from type checkers: with a visible module __getattr__, mypy would accept any
# misspelt name imported from this module as Any.
if not TYPE_CHECKING:
    __getattr__ = lazy_attributes(__name__, _LAZY)


__dir__ = lazy_dir(globals(), _LAZY)
