"""Config classes of the ``fs`` and ``fs_native`` types
(docs/design/storage-engine.md#backend-fs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmcache.v1.distributed.l2_adapters.api import init_logger
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

logger = init_logger(__name__)


def _base_path(d: dict[str, Any]) -> str:
    v = d.get("base_path")
    if not isinstance(v, str) or not v:
        raise ValueError("base_path must be a non-empty string")
    return v


def _opt_positive_int(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{key} must be a positive integer")
    return v


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be a boolean")
    return v


def check_relative_tmp_dir(tmp: str | None) -> None:
    """Creation-time check: a relative path inside base_path."""
    if tmp and (tmp.startswith("/") or ".." in tmp.split("/")):
        raise ValueError(f"Invalid relative_tmp_dir: {tmp} — use a relative path inside base_path")


_COMMON_HELP = """\
  base_path         (str, required)  directory holding one file per key
  relative_tmp_dir  (str)            temp-file directory inside base_path (default: base_path)
  read_ahead_size   (int > 0)        bytes to prefetch from each file's head before a load
  use_odirect       (bool, false)    O_DIRECT when the buffer address and length are aligned
  max_capacity_gb   (float, 0)       capacity for usage and L2 eviction (0 = unlimited)
  fsync             (bool, true)     fsync each file and the directory before publishing
"""


@dataclass
class FSL2AdapterConfig(L2AdapterConfigBase):
    type_name = "fs"

    base_path: str
    relative_tmp_dir: str | None = None
    read_ahead_size: int | None = None
    use_odirect: bool = False
    max_capacity_gb: float = 0.0
    fsync: bool = True
    num_workers: int = 8

    known_fields = frozenset(
        {
            "base_path",
            "relative_tmp_dir",
            "read_ahead_size",
            "use_odirect",
            "max_capacity_gb",
            "fsync",
            "num_workers",
        }
    )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FSL2AdapterConfig:
        base = _base_path(d)
        tmp = d.get("relative_tmp_dir")
        if tmp is not None and not isinstance(tmp, str):
            raise ValueError("relative_tmp_dir must be a string")
        return cls(
            base_path=base,
            relative_tmp_dir=tmp,
            read_ahead_size=_opt_positive_int(d, "read_ahead_size"),
            use_odirect=_bool(d, "use_odirect", False),
            max_capacity_gb=cls._parse_max_capacity_gb(d),
            fsync=_bool(d, "fsync", True),
            num_workers=cls._validate_num_workers(d.get("num_workers", 8)),
        )

    @classmethod
    def help(cls) -> str:
        return (
            "fs: files on a local or shared file system (Python).\n"
            'Example: {"type":"fs","base_path":"/data/lmcache"}\n'
            + _COMMON_HELP
            + "  num_workers       (int, 8)         keys of one task processed concurrently\n"
        )


@dataclass
class FSNativeL2AdapterConfig(L2AdapterConfigBase):
    type_name = "fs_native"

    base_path: str
    num_workers: int = 4
    relative_tmp_dir: str = ""
    use_odirect: bool = False
    read_ahead_size: int | None = None
    max_capacity_gb: float = 0.0
    fsync: bool = True

    known_fields = FSL2AdapterConfig.known_fields

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FSNativeL2AdapterConfig:
        base = _base_path(d)
        tmp = d.get("relative_tmp_dir", "")
        if tmp is None:
            tmp = ""
        if not isinstance(tmp, str):
            raise ValueError("relative_tmp_dir must be a string")
        cfg = cls(
            base_path=base,
            num_workers=cls._validate_num_workers(d.get("num_workers", 4)),
            relative_tmp_dir=tmp,
            use_odirect=_bool(d, "use_odirect", False),
            read_ahead_size=_opt_positive_int(d, "read_ahead_size"),
            max_capacity_gb=cls._parse_max_capacity_gb(d),
            fsync=_bool(d, "fsync", True),
        )
        if cfg.max_capacity_gb > 0 and d.get("eviction") is None:
            logger.warning(
                "fs_native max_capacity_gb=%s without an 'eviction' block only tracks usage; "
                'add "eviction": {"eviction_policy": "LRU"} to evict',
                cfg.max_capacity_gb,
            )
        return cfg

    @classmethod
    def help(cls) -> str:
        return (
            "fs_native: files on a local or shared file system (C++ connector).\n"
            'Example: {"type":"fs_native","base_path":"/data/lmcache","num_workers":4}\n'
            + _COMMON_HELP
            + "  num_workers       (int, 4)         C++ worker threads\n"
        )
