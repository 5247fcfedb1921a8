"""Config of the ``raw_block`` type: LMCache 0.5.6's keys, defaults and checks
(docs/design/storage-engine.md#backend-raw-block)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

IO_ENGINES = ("io_uring", "posix")
DEFAULT_IOURING_QUEUE_DEPTH = 256
MAX_PLACEMENT_ID = 0xFFFF
FDP_DATA_POLICIES = ("cache_salt_prefix", "cache_salt_rank", "none")
FDP_REUSE_POLICIES = ("none", "pid_affinity")

_HELP = f"""\
raw_block L2 adapter config fields (LMCache 0.5.6's):
  device_path       (str, required)  block device or pre-sized file (truncate -s 8G PATH)
  slot_bytes        (int, required)  bytes per slot (header included), a multiple of block_align;
                                     an object takes one slot: slot_bytes >= header_bytes + object
  capacity_bytes    (int, 0)         use at most this many bytes of the device (0 = all of it)
  use_odirect       (bool, true)     O_DIRECT I/O
  block_align       (int, 4096)      power-of-two alignment of offsets and lengths
  header_bytes      (int, 4096)      per-slot header
  meta_total_bytes  (int, 256 MiB)   metadata (two checkpoint copies) at the start of the device
  meta_magic        (str, LMCIDX01)  8-byte checkpoint magic
  meta_version      (int, 1)         checkpoint version
  meta_checkpoint_interval_sec (int, 60)  periodic checkpoint interval
  meta_idle_quiet_ms (int, 100)      a periodic checkpoint waits for this much I/O quiet
  meta_enable_periodic (bool, true)  run the periodic checkpoint thread (one is always written at close)
  load_checkpoint_on_init (bool, true)  find the keys of the last checkpoint at start-up
  meta_verify_on_load (bool, true)   check each recovered key's slot header
  enable_zero_copy  (bool, true)     I/O straight from/to aligned buffers
  io_engine         (str, posix)     posix or io_uring (legacy: use_iouring / use_uring true)
  iouring_queue_depth (int, {DEFAULT_IOURING_QUEUE_DEPTH})
  use_uring_cmd, max_data_transfer_size, fdp_enabled, fdp_placement_ids,
  fdp_data_placement_policy, fdp_slot_reuse_policy, meta_checkpoint_placement_id
                                     NVMe passthrough / FDP (accepted and checked as 0.5.6 does;
                                     not provided by this wheel yet: creating the adapter says so)
  num_store_workers (int, 2), num_lookup_workers (int, 1), num_load_workers (int, 4)
Example: {{"type":"raw_block","device_path":"/dev/nvme1n1","slot_bytes":1052672}}"""


def _int(d: dict[str, Any], key: str, default: int) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key} must be an integer, got {v!r}")
    return v


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be true or false, got {v!r}")
    return v


def _io_engine(d: dict[str, Any]) -> str:
    engine = d.get("io_engine")
    if engine is None or engine == "":
        return "io_uring" if d.get("use_iouring") or d.get("use_uring") else "posix"
    engine = str(engine).lower()
    if engine not in IO_ENGINES:
        raise ValueError(f"io_engine must be one of: {', '.join(IO_ENGINES)}; got {engine!r}")
    return engine


def _placement_id(v: Any, field: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_PLACEMENT_ID:
        raise ValueError(f"{field} must be placement identifiers in 1..={MAX_PLACEMENT_ID}")
    return v


def _policy(d: dict[str, Any], key: str, allowed: tuple[str, ...], fdp: bool, on: str) -> str:
    v = d.get(key)
    if v is None or v == "":
        return on if fdp else "none"
    v = str(v).lower()
    if v not in allowed:
        raise ValueError(f"{key} must be one of: {', '.join(allowed)}")
    if v != "none" and not fdp:
        raise ValueError(f"{key} requires fdp_enabled=true")
    return v


@dataclass
class RawBlockL2AdapterConfig(L2AdapterConfigBase):
    type_name: ClassVar[str] = "raw_block"

    device_path: str
    slot_bytes: int
    capacity_bytes: int = 0
    use_odirect: bool = True
    block_align: int = 4096
    header_bytes: int = 4096
    meta_total_bytes: int = 256 * 1024 * 1024
    meta_magic: str = "LMCIDX01"
    meta_version: int = 1
    meta_checkpoint_interval_sec: int = 60
    meta_idle_quiet_ms: int = 100
    meta_enable_periodic: bool = True
    load_checkpoint_on_init: bool = True
    meta_verify_on_load: bool = True
    enable_zero_copy: bool = True
    io_engine: str = "posix"
    iouring_queue_depth: int = DEFAULT_IOURING_QUEUE_DEPTH
    use_uring_cmd: bool = False
    max_data_transfer_size: int = 0
    fdp_enabled: bool = False
    fdp_placement_ids: list[int] | None = None
    fdp_data_placement_policy: str = "none"
    fdp_slot_reuse_policy: str = "none"
    meta_checkpoint_placement_id: int | None = None
    num_store_workers: int = 2
    num_lookup_workers: int = 1
    num_load_workers: int = 4

    known_fields: ClassVar[frozenset[str]] = frozenset(
        {
            "device_path",
            "slot_bytes",
            "capacity_bytes",
            "use_odirect",
            "block_align",
            "header_bytes",
            "meta_total_bytes",
            "meta_magic",
            "meta_version",
            "meta_checkpoint_interval_sec",
            "meta_idle_quiet_ms",
            "meta_enable_periodic",
            "load_checkpoint_on_init",
            "meta_verify_on_load",
            "enable_zero_copy",
            "io_engine",
            "use_iouring",
            "use_uring",
            "iouring_queue_depth",
            "use_uring_cmd",
            "max_data_transfer_size",
            "fdp_enabled",
            "fdp_placement_ids",
            "fdp_data_placement_policy",
            "fdp_slot_reuse_policy",
            "meta_checkpoint_placement_id",
            "num_store_workers",
            "num_lookup_workers",
            "num_load_workers",
        }
    )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RawBlockL2AdapterConfig:
        device_path = d.get("device_path")
        if not isinstance(device_path, str) or not device_path:
            raise ValueError("device_path must be a non-empty string")
        if "per_tp_device_paths" in d:
            raise ValueError("per_tp_device_paths is not supported in MP raw_block mode")
        if not d.get("persist_enabled", True):
            raise ValueError("raw_block requires persist_enabled=true")
        slot_bytes = d.get("slot_bytes")
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be a positive integer, got {slot_bytes!r}")
        block_align = _int(d, "block_align", 4096)
        header_bytes = _int(d, "header_bytes", 4096)
        meta_total = _int(d, "meta_total_bytes", 256 * 1024 * 1024)
        capacity = _int(d, "capacity_bytes", 0)
        if block_align <= 0 or block_align & (block_align - 1):
            raise ValueError(f"block_align must be a power of 2, got {block_align}")
        for name, value in (
            ("slot_bytes", slot_bytes),
            ("header_bytes", header_bytes),
            ("meta_total_bytes", meta_total),
        ):
            if value % block_align:
                raise ValueError(f"{name} must be a multiple of block_align ({block_align})")
        if header_bytes < 24:
            raise ValueError("header_bytes must be >= 24")
        if slot_bytes < header_bytes + 1:
            raise ValueError("slot_bytes must be >= header_bytes + 1")
        if meta_total < 4 * block_align:
            # each of the two checkpoint copies needs a header block and payload room
            raise ValueError(f"meta_total_bytes must be at least 4 x block_align ({block_align})")
        if 0 < capacity <= meta_total:
            raise ValueError("capacity_bytes must leave space for at least one slot")
        magic = d.get("meta_magic", "LMCIDX01")
        if not isinstance(magic, str) or not magic.isascii() or len(magic) != 8:
            raise ValueError(f"meta_magic must be 8 ASCII characters, got {magic!r}")
        meta_version = _int(d, "meta_version", 1)
        if meta_version <= 0:
            raise ValueError("meta_version must be > 0")
        io_engine = _io_engine(d)
        depth = _int(d, "iouring_queue_depth", DEFAULT_IOURING_QUEUE_DEPTH)
        if depth <= 0:
            raise ValueError("iouring_queue_depth must be > 0")
        use_uring_cmd = _bool(d, "use_uring_cmd", False)
        fdp = _bool(d, "fdp_enabled", False)
        if use_uring_cmd and io_engine != "io_uring":
            raise ValueError("use_uring_cmd requires io_uring io_engine")
        if fdp and not use_uring_cmd:
            raise ValueError("fdp_enabled requires io_engine='io_uring' and use_uring_cmd=true")
        meta_pid = d.get("meta_checkpoint_placement_id")
        if meta_pid is not None:
            if not use_uring_cmd:
                raise ValueError(
                    "meta_checkpoint_placement_id requires io_engine='io_uring' and "
                    "use_uring_cmd=true"
                )
            meta_pid = _placement_id(meta_pid, "meta_checkpoint_placement_id")
        pids = d.get("fdp_placement_ids")
        if pids is not None and not isinstance(pids, list):
            raise ValueError("fdp_placement_ids must be a list")
        if fdp and pids is not None:
            pids = [_placement_id(p, "fdp_placement_ids") for p in pids]
            if not pids or len(set(pids)) != len(pids):
                raise ValueError("fdp_placement_ids must be non-empty and without duplicates")
            if meta_pid in pids:
                raise ValueError(
                    "meta_checkpoint_placement_id must not overlap with fdp_placement_ids"
                )
        workers = {}
        for name, default in (
            ("num_store_workers", 2),
            ("num_lookup_workers", 1),
            ("num_load_workers", 4),
        ):
            workers[name] = _int(d, name, default)
            if workers[name] <= 0:
                raise ValueError(f"{name} must be > 0")
        return cls(
            device_path=device_path,
            slot_bytes=slot_bytes,
            capacity_bytes=capacity,
            use_odirect=_bool(d, "use_odirect", True),
            block_align=block_align,
            header_bytes=header_bytes,
            meta_total_bytes=meta_total,
            meta_magic=magic,
            meta_version=meta_version,
            meta_checkpoint_interval_sec=_int(d, "meta_checkpoint_interval_sec", 60),
            meta_idle_quiet_ms=_int(d, "meta_idle_quiet_ms", 100),
            meta_enable_periodic=_bool(d, "meta_enable_periodic", True),
            load_checkpoint_on_init=_bool(d, "load_checkpoint_on_init", True),
            meta_verify_on_load=_bool(d, "meta_verify_on_load", True),
            enable_zero_copy=_bool(d, "enable_zero_copy", True),
            io_engine=io_engine,
            iouring_queue_depth=depth,
            use_uring_cmd=use_uring_cmd,
            max_data_transfer_size=_int(d, "max_data_transfer_size", 0),
            fdp_enabled=fdp,
            fdp_placement_ids=pids if fdp else None,
            fdp_data_placement_policy=_policy(
                d, "fdp_data_placement_policy", FDP_DATA_POLICIES, fdp, "cache_salt_prefix"
            ),
            fdp_slot_reuse_policy=_policy(
                d, "fdp_slot_reuse_policy", FDP_REUSE_POLICIES, fdp, "pid_affinity"
            ),
            meta_checkpoint_placement_id=meta_pid,
            **workers,
        )

    @classmethod
    def help(cls) -> str:
        return _HELP
