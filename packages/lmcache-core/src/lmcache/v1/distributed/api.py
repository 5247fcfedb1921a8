"""Public data model of the storage layer (docs/design/storage-formats.md#object-key,
docs/design/storage-engine.md#data-model).

Plugins import these names from here: ``ObjectKey``, ``EncodedObjectKey``,
``MemoryLayoutDesc``, ``KeyEntry``, ``KeyListPage``, ``GroupedObjectKeys``,
``PrefetchTaskSpec``, ``PrefetchHandle``, ``PrefetchResult``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcache.lmcache_native import Bitmap

if TYPE_CHECKING:  # torch loads where a layout is built, not with the contract (CLI start-up)
    import torch

__all__ = [
    "Bytes2IntHash",
    "ComputeKVRank",
    "EncodedObjectKey",
    "GroupedObjectKeys",
    "IntHash2Bytes",
    "KeyEntry",
    "KeyListPage",
    "LockMode",
    "MemoryLayoutDesc",
    "ObjectKey",
    "PrefetchHandle",
    "PrefetchLockMode",
    "PrefetchResult",
    "PrefetchTaskSpec",
    "WorldSizeFromKVRank",
]

CACHE_SALT_MAX_LEN = 128
_BAD_SALT_CHARS = frozenset({"@", "/", "\\", "\x00"})


def ComputeKVRank(world_size: int, global_rank: int, local_world_size: int, local_rank: int) -> int:
    """Pack four 8-bit fields: ``(ws<<24)|(rank<<16)|(local_ws<<8)|local_rank``."""
    for name, v in (
        ("world_size", world_size),
        ("global_rank", global_rank),
        ("local_world_size", local_world_size),
        ("local_rank", local_rank),
    ):
        if not 0 <= int(v) <= 255:
            raise ValueError(f"{name} must be in [0, 255] (got {v})")
    return (world_size << 24) | (global_rank << 16) | (local_world_size << 8) | local_rank


def WorldSizeFromKVRank(kv_rank: int) -> int:
    """The world size packed into the top byte of ``kv_rank`` (see :func:`ComputeKVRank`)."""
    return (int(kv_rank) >> 24) & 0xFF


def IntHash2Bytes(n: int) -> bytes:
    """Test helper: an int hash as 4 big-endian bytes."""
    return (int(n) & 0xFFFFFFFF).to_bytes(4, "big")


def Bytes2IntHash(b: bytes) -> int:
    """Test helper, inverse of :func:`IntHash2Bytes`: big-endian bytes as an int, masked
    to 64 bits."""
    return int.from_bytes(bytes(b), "big") & 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True, eq=False)
class ObjectKey:
    """Identity of one stored object: (chunk hash, model, kv rank, object group, salt)."""

    chunk_hash: bytes
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""
    # Keys are looked up in many dicts and sets on every request (each lookup builds fresh
    # key objects, so every hit also runs __eq__): hash and compare one cached tuple.
    _fields: tuple[Any, ...] = field(default=(), init=False, repr=False, compare=False)
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fields = (
            self.chunk_hash,
            self.model_name,
            self.kv_rank,
            self.object_group_id,
            self.cache_salt,
        )
        object.__setattr__(self, "_fields", fields)
        object.__setattr__(self, "_hash", hash(fields))
        if "@" in self.model_name:
            raise ValueError(f"model_name must not contain '@' (got {self.model_name!r})")
        if self.object_group_id < 0:
            raise ValueError(f"object_group_id must be >= 0 (got {self.object_group_id})")
        salt = self.cache_salt
        if salt:
            if any(c in _BAD_SALT_CHARS for c in salt):
                bad = sorted(_BAD_SALT_CHARS)
                raise ValueError(f"cache_salt must not contain {bad!r} (got {salt!r})")
            if len(salt) > CACHE_SALT_MAX_LEN:
                raise ValueError(
                    f"cache_salt exceeds max length {CACHE_SALT_MAX_LEN} (got {len(salt)})"
                )

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if other.__class__ is ObjectKey:
            return self._fields == other._fields  # type: ignore[attr-defined]
        return NotImplemented

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Rebuilt through __init__: str hashes differ between processes.
        return (ObjectKey, self._fields)

    # 0.5.x helpers kept as static methods on the class
    ComputeKVRank = staticmethod(ComputeKVRank)
    WorldSizeFromKVRank = staticmethod(WorldSizeFromKVRank)
    IntHash2Bytes = staticmethod(IntHash2Bytes)
    Bytes2IntHash = staticmethod(Bytes2IntHash)

    def world_size(self) -> int:
        """The world size packed into ``kv_rank``."""
        return WorldSizeFromKVRank(self.kv_rank)

    def to_encoded_object_key(self) -> EncodedObjectKey:
        """The JSON-safe form (hash as lowercase hex) used by the HTTP API and key listings."""
        return EncodedObjectKey(
            chunk_hash_hex=bytes(self.chunk_hash).hex(),
            model_name=self.model_name,
            kv_rank=self.kv_rank,
            object_group_id=self.object_group_id,
            cache_salt=self.cache_salt,
        )


@dataclass(frozen=True)
class EncodedObjectKey:
    """JSON-safe form of an ObjectKey (the HTTP API and key listings use it)."""

    chunk_hash_hex: str
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""

    def to_object_key(self) -> ObjectKey:
        """Back to an :class:`ObjectKey`, validated again; ``ValueError`` on bad hex or a
        field the key rejects."""
        try:
            chunk_hash = bytes.fromhex(self.chunk_hash_hex)
        except ValueError as exc:
            raise ValueError(f"chunk_hash_hex is not hex (got {self.chunk_hash_hex!r})") from exc
        return ObjectKey(
            chunk_hash,
            self.model_name,
            int(self.kv_rank),
            int(self.object_group_id),
            self.cache_salt,
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (JSON bodies)."""
        return {
            "chunk_hash_hex": self.chunk_hash_hex,
            "model_name": self.model_name,
            "kv_rank": self.kv_rank,
            "object_group_id": self.object_group_id,
            "cache_salt": self.cache_salt,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EncodedObjectKey:
        """Inverse of :meth:`to_dict`; ``object_group_id`` and ``cache_salt`` are optional,
        a missing required field raises ``KeyError``."""
        return cls(
            str(d["chunk_hash_hex"]),
            str(d["model_name"]),
            int(d["kv_rank"]),
            int(d.get("object_group_id", 0)),
            str(d.get("cache_salt", "")),
        )


@dataclass
class MemoryLayoutDesc:
    """Shapes and dtypes of the groups one memory object holds (one object, all groups)."""

    shapes: list[torch.Size]
    dtypes: list[torch.dtype]

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.dtypes):
            raise ValueError(
                f"MemoryLayoutDesc needs as many dtypes as shapes (got {len(self.shapes)} shapes, "
                f"{len(self.dtypes)} dtypes)"
            )
        import torch

        self.shapes = [torch.Size(s) for s in self.shapes]

    def nbytes(self) -> int:
        """Logical bytes of one object of this layout: sum of numel x itemsize over groups."""
        total = 0
        for s, d in zip(self.shapes, self.dtypes, strict=False):
            total += s.numel() * d.itemsize
        return total


@dataclass(frozen=True)
class KeyEntry:
    """One stored object in an L2 key listing: its key and stored size in bytes."""

    key: EncodedObjectKey
    size_bytes: int


@dataclass
class KeyListPage:
    """One page of ``L2AdapterInterface.list_l2_keys``; ``next_page_token`` is passed back to
    get the next page and is ``None`` on the last one."""

    entries: list[KeyEntry]
    next_page_token: str | None = None


class LockMode(enum.Enum):
    LOCK = "lock"
    NO_LOCK = "no_lock"


PrefetchLockMode = LockMode


@dataclass
class GroupedObjectKeys:
    """One row per (object group, kv rank); column j is chunk j."""

    keys: list[ObjectKey]
    object_group_id: int
    layout_desc: MemoryLayoutDesc
    sliding_window_size: int = -1


@dataclass
class PrefetchTaskSpec:
    """What a lookup asks the storage manager to find and lock: rows of keys (one per object
    group and kv rank, equal lengths), how many readers will retrieve them, whether a prefix
    or every chunk counts (``fetching_policy``) and whether hits are locked."""

    key_groups: list[GroupedObjectKeys]
    num_kv_readers: int = 1
    fetching_policy: str = "prefix"
    lock_mode: LockMode = LockMode.LOCK

    def __post_init__(self) -> None:
        if self.fetching_policy not in ("prefix", "full"):
            raise ValueError(
                f"fetching_policy must be 'prefix' or 'full' (got {self.fetching_policy!r})"
            )
        lengths = {len(g.keys) for g in self.key_groups}
        if len(lengths) > 1:
            raise ValueError(f"all key rows must have the same length (got {sorted(lengths)})")
        if self.num_kv_readers < 1:
            raise ValueError(f"num_kv_readers must be >= 1 (got {self.num_kv_readers})")

    @property
    def num_chunks(self) -> int:
        """Chunks per row (columns of the key matrix)."""
        return len(self.key_groups[0].keys) if self.key_groups else 0

    def all_keys(self) -> list[ObjectKey]:
        """Every key of every row, row by row."""
        return [k for g in self.key_groups for k in g.keys]


@dataclass
class PrefetchHandle:
    """The receipt of a submitted prefetch, used to poll its result; ``submit_time`` is
    ``time.time()`` seconds."""

    prefetch_request_id: int
    external_request_id: str
    total_requested_keys: int
    submit_time: float
    sliding_windows: list[int] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """True for the placeholder handle of a request with nothing to prefetch (id -1)."""
        return self.prefetch_request_id == -1


@dataclass
class PrefetchResult:
    """One Bitmap per row. l1 and l2 hits are disjoint; their union is ``hit_cells``.

    ``l1_owners[row][col]`` is the index of the L1 manager that holds the locked cell
    (-1 outside the hit).
    """

    hit_cells: list[Bitmap]
    l1_hit_cells: list[Bitmap]
    l2_hit_cells: list[Bitmap]
    found_cells: list[Bitmap] | None = None
    l1_owners: list[list[int]] = field(default_factory=list)

    def hit_prefix_length(self) -> int:
        """Leading chunks every row hit: the prefix the engine may skip."""
        if not self.hit_cells:
            return 0
        return min(bm.count_leading_ones() for bm in self.hit_cells)

    def num_hit_keys(self) -> int:
        """Hit cells over all rows."""
        return sum(bm.popcount() for bm in self.hit_cells)
