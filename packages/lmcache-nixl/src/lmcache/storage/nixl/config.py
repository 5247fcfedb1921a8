"""Configs of the ``nixl_store`` and ``nixl_native`` types
(docs/design/storage-engine.md#backend-nixl).

Field names, defaults and error texts are those of LMCache 0.5.6, so its JSON configs parse
unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

VALID_NIXL_BACKENDS = ("GDS", "GDS_MT", "POSIX", "HF3FS", "OBJ", "AZURE_BLOB", "IBM_SCALE")
FILE_BACKENDS = ("GDS", "GDS_MT", "POSIX", "HF3FS", "IBM_SCALE")
OBJECT_BACKENDS = ("OBJ", "AZURE_BLOB")
#: keys of ``backend_params`` that configure the adapter and are not NIXL backend options
ADAPTER_PARAM_KEYS = ("file_path", "use_direct_io", "file_size")

_BACKEND_PATTERN = re.compile(r"[A-Z][A-Z0-9_]*")
_BACKEND_PARAMS_ERROR = "backend_params must be a dict of string key-value pairs"


def _string_params(raw: Any, *, strict: bool) -> dict[str, str]:
    """``backend_params`` as str -> str. 0.5.6's nixl_store took any JSON scalar (it compared
    ``str(v).lower()``), so scalars are converted there; ``strict`` (nixl_native) wants strings."""
    if not isinstance(raw, dict):
        raise ValueError(_BACKEND_PARAMS_ERROR)
    out: dict[str, str] = {}
    for k, v in raw.items():
        if not isinstance(k, str):
            raise ValueError(f"{_BACKEND_PARAMS_ERROR} (key {k!r} is not a string)")
        if isinstance(v, str):
            out[k] = v
        elif not strict and isinstance(v, bool):
            out[k] = "true" if v else "false"
        elif not strict and isinstance(v, (int, float)):
            out[k] = str(v)
        else:
            raise ValueError(f"{_BACKEND_PARAMS_ERROR} (value of {k!r} is {v!r}; quote it)")
    return out


def is_true(value: str | None) -> bool:
    return str(value).strip().lower() == "true"


@dataclass
class NixlStoreL2AdapterConfig(L2AdapterConfigBase):
    """``nixl_store``: a fixed pool of page-sized slots (file offsets or objects) behind one
    NIXL agent that has the whole L1 arena registered."""

    type_name = "nixl_store"

    backend: str
    backend_params: dict[str, str] = field(default_factory=dict)
    pool_size: int = 1

    known_fields = frozenset({"backend", "backend_params", "pool_size"})

    def __post_init__(self) -> None:
        if self.backend in FILE_BACKENDS:
            for required in ("file_path", "use_direct_io"):
                if required not in self.backend_params:
                    raise ValueError(
                        f"backend_params must include {required!r} for file-based backend "
                        f"{self.backend!r}"
                    )
        size = self.backend_params.get("file_size")
        if size is not None and (not size.strip().isdigit() or int(size) <= 0):
            raise ValueError(
                f"backend_params['file_size'] must be a positive integer (got {size!r})"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NixlStoreL2AdapterConfig:
        backend = d.get("backend")
        if backend not in VALID_NIXL_BACKENDS:
            raise ValueError(f"backend must be one of {VALID_NIXL_BACKENDS}, got {backend!r}")
        params = _string_params(d.get("backend_params", {}), strict=False)
        pool_size = d.get("pool_size")
        if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size <= 0:
            raise ValueError("pool_size must be a positive integer")
        return cls(backend=backend, backend_params=params, pool_size=pool_size)

    @classmethod
    def help(cls) -> str:
        return (
            "nixl_store: a pool of page-sized slots behind a NIXL storage backend; the L1 arena "
            "is registered with NIXL once and objects move by DMA, one batched transfer per task.\n"
            'Example: {"type":"nixl_store","backend":"POSIX","pool_size":64,'
            '"backend_params":{"file_path":"/data/nixl","use_direct_io":"false"}}\n'
            f"  backend        (str, required)  one of {', '.join(VALID_NIXL_BACKENDS)}\n"
            "  backend_params (dict str->str)  NIXL backend options; file backends "
            f"({', '.join(FILE_BACKENDS)}) need file_path and use_direct_io ('true'/'false') and "
            "take file_size (bytes per file, a multiple of the L1 page; default one page)\n"
            "  pool_size      (int, required)  files (file backends) or one-page objects (OBJ)\n"
            "Capacity = slots x --l1-align-bytes, so an 'eviction' block works. The key index "
            "lives in memory: stored data does not survive a restart.\n"
        )

    @property
    def is_file_backend(self) -> bool:
        return self.backend in FILE_BACKENDS

    @property
    def use_direct_io(self) -> bool:
        return is_true(self.backend_params.get("use_direct_io"))

    def nixl_backend_params(self) -> dict[str, str]:
        """The options handed to NIXL's ``create_backend`` (without the adapter's own keys)."""
        return {k: v for k, v in self.backend_params.items() if k not in ADAPTER_PARAM_KEYS}


@dataclass
class NixlNativeL2AdapterConfig(L2AdapterConfigBase):
    """``nixl_native``: one file (FILE_SEG plugins) or object (OBJ_SEG plugins) per key, under
    the L2 names (docs/design/storage-formats.md#l2-names), moved by NIXL from the registered L1
    arena."""

    type_name = "nixl_native"

    backend: str
    backend_params: dict[str, str] = field(default_factory=dict)
    num_workers: int = 4
    max_capacity_gb: float = 0.0

    known_fields = frozenset({"backend", "backend_params", "num_workers", "max_capacity_gb"})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NixlNativeL2AdapterConfig:
        backend = d.get("backend")
        if not isinstance(backend, str) or not _BACKEND_PATTERN.fullmatch(backend):
            raise ValueError(
                "backend must be an uppercase NIXL plugin identifier (for example 'POSIX' or "
                f"'OBJ'), got {backend!r}"
            )
        if "storage_type" in d:
            raise ValueError(
                "storage_type is not configurable; the NIXL backend's FILE_SEG or OBJ_SEG "
                "capability selects the storage strategy — remove 'storage_type'"
            )
        params = _string_params(d.get("backend_params", {}), strict=True)
        if "shard_dirs" in params or "shard_dirs" in d:
            raise ValueError(
                "shard_dirs is not supported by nixl_native: files are written flat under "
                "file_path with the fs file names — remove 'shard_dirs'"
            )
        num_workers = cls._validate_num_workers(d.get("num_workers", 4))
        return cls(
            backend=backend,
            backend_params=params,
            num_workers=num_workers,
            max_capacity_gb=cls._parse_max_capacity_gb(d),
        )

    @classmethod
    def help(cls) -> str:
        return (
            "nixl_native: one file or object per key through a NIXL plugin (FILE_SEG plugins "
            "such as POSIX write the fs file names under file_path; OBJ_SEG plugins such as OBJ "
            "write one object per key named by the native key string).\n"
            'Example: {"type":"nixl_native","backend":"POSIX",'
            '"backend_params":{"file_path":"/data/nixl-native","use_direct_io":"false"}}\n'
            "  backend         (str, required)  uppercase NIXL plugin name\n"
            "  backend_params  (dict str->str)  NIXL options; FILE_SEG backends need file_path "
            "and accept use_direct_io\n"
            "  num_workers     (int, 4)         worker threads, one NIXL agent each\n"
            "  max_capacity_gb (float, 0)       capacity for usage and L2 eviction (0 = unlimited)\n"
        )
