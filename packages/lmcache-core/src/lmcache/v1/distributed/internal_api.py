"""Internal contracts between L1, controllers and adapters
(docs/design/storage-engine.md#data-model, docs/design/storage-engine.md#l1-manager).

Import surface: ``L2StoreResult``, ``L1MemoryDesc``, ``L2AdapterListener``,
``L1ManagerListener``, ``L1ManagerInterface`` (plus ``L1Error``).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache.lmcache_native import Bitmap
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.memory_management import MemoryObj

__all__ = [
    "L1Error",
    "L1ManagerInterface",
    "L1ManagerListener",
    "L1MemoryDesc",
    "L1OperationResult",
    "L2AdapterListener",
    "L2StoreResult",
    "StorageKeyListener",
]


class L2StoreResult(int):
    """Store outcome as an int: bytes written on success, -1 on failure.

    A successful zero-byte store is the int 0, which is falsy: use ``is_successful()``.
    A failure may say why in ``error`` (logged by the store controller).

    A failed task whose keys fail one by one says which keys did land in ``landed``: a
    ``Bitmap`` over the task's keys, bit ``i`` set when ``keys[i]`` is stored (written now
    or found there). Without it a failure means no key landed and a success that all did
    (``landed_keys``).
    """

    error: str | None
    landed: Bitmap | None

    def __new__(
        cls,
        success: bool = True,
        bytes_transferred: int = 0,
        error: str | None = None,
        landed: Bitmap | None = None,
    ) -> L2StoreResult:
        bytes_transferred = int(bytes_transferred)
        if bytes_transferred < 0:
            raise ValueError(f"bytes_transferred must be >= 0, got {bytes_transferred}")
        self = super().__new__(cls, bytes_transferred if success else -1)
        self.error = None if success else error
        self.landed = landed
        return self

    @classmethod
    def per_key(
        cls, stored: Sequence[bool], bytes_transferred: int = 0, error: str | None = None
    ) -> L2StoreResult:
        """The result of a task whose keys are written one by one: ``stored[i]`` says whether
        ``keys[i]`` is stored. Success when all are; otherwise a failure whose ``landed``
        names the keys that are."""
        if all(stored):
            return cls(True, bytes_transferred)
        from lmcache.lmcache_native import Bitmap

        landed = Bitmap(len(stored))
        landed.batched_set(i for i, ok in enumerate(stored) if ok)
        return cls(False, 0, error=error, landed=landed)

    def landed_keys(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """The keys of the task (in order) that are stored after it: those ``landed`` marks,
        else all of them on success and none on failure."""
        if self.landed is None:
            return list(keys) if self.is_successful() else []
        if self.landed.size() != len(keys):
            raise ValueError(
                f"landed bitmap has {self.landed.size()} bits for {len(keys)} keys; "
                "give one bit per key of the task"
            )
        return self.landed.gather(list(keys))

    def is_successful(self) -> bool:
        """Whether the store succeeded (value >= 0). Use this, never truthiness."""
        return int(self) >= 0

    def bytes_transferred(self) -> int:
        """Bytes actually written (0 for a duplicate or skipped key, and on failure)."""
        return max(0, int(self))

    def __repr__(self) -> str:
        if self.is_successful():
            return f"L2StoreResult(success=True, bytes={int(self)})"
        return f"L2StoreResult(success=False, error={self.error!r})"

    @classmethod
    def normalise(cls, value: Any, objects: Sequence[Any] = ()) -> tuple[L2StoreResult, bool]:
        """Accept legacy store results (docs/design/storage-engine.md#store-controller). Returns
        (result, was_legacy)."""
        if isinstance(value, L2StoreResult):
            return value, False
        if value is True:
            return cls(True, sum(int(o.get_size()) for o in objects)), True
        if value is False or value is None:
            return cls(False, 0), True
        if isinstance(value, int):
            return (cls(True, value) if value >= 0 else cls(False, 0)), True
        return cls(False, 0), True


@dataclass(frozen=True)
class L1MemoryDesc:
    """The contiguous L1 arena, for adapters that register memory (RDMA, NIXL)."""

    ptr: int
    size: int
    align_bytes: int
    stable_registration_size: int | None = None


class L1Error(enum.Enum):
    SUCCESS = 0
    KEY_NOT_EXIST = 1
    KEY_NOT_READABLE = 2
    KEY_NOT_WRITABLE = 3
    KEY_IN_WRONG_STATE = 4
    KEY_IS_LOCKED = 5
    OUT_OF_MEMORY = 6


L1OperationResult = tuple[L1Error, "MemoryObj | None"]


class L1ManagerListener:
    """Receives L1 state changes; called inside the L1 lock, so it must only record."""

    def on_l1_keys_reserved_read(self, keys: list[ObjectKey]) -> None:
        pass

    def on_l1_keys_read_finished(self, keys: list[ObjectKey]) -> None:
        pass

    def on_l1_keys_reserved_write(self, keys: list[ObjectKey]) -> None:
        pass

    def on_l1_keys_write_finished(self, keys: list[ObjectKey]) -> None:
        pass

    def on_l1_keys_finish_write_and_reserve_read(self, keys: list[ObjectKey]) -> None:
        pass

    def on_l1_keys_deleted_by_manager(self, keys: list[ObjectKey]) -> None:
        pass

    def on_l1_keys_accessed(self, keys: list[ObjectKey]) -> None:
        pass


class L2AdapterListener:
    def on_l2_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        pass

    def on_l2_keys_accessed(self, keys: list[ObjectKey]) -> None:
        pass

    def on_l2_keys_deleted(self, keys: list[ObjectKey]) -> None:
        pass


class StorageKeyListener:
    """Keys that became readable in a storage tier, or left it, across L1 and every L2
    adapter (``StorageManager.register_key_listener``). ``medium`` names the tier:
    ``"CPU"`` for L1, the L2 adapter's type name in upper case (``"FS"``, ``"RESP"``, ...).
    Called on the storage engine's own threads, sometimes inside the L1 lock: only record."""

    def on_keys_stored(self, medium: str, keys: list[ObjectKey]) -> None:
        pass

    def on_keys_removed(self, medium: str, keys: list[ObjectKey]) -> None:
        pass


class L1ManagerInterface(abc.ABC):
    """Batch API of one L1 manager; every call is atomic and reports per-key errors."""

    @abc.abstractmethod
    def reserve_write(
        self,
        keys: list[ObjectKey],
        is_temporary: list[bool],
        layout_desc: MemoryLayoutDesc,
        tag: str = "",
    ) -> dict[ObjectKey, L1OperationResult]: ...

    @abc.abstractmethod
    def finish_write(self, keys: list[ObjectKey], tag: str = "") -> dict[ObjectKey, L1Error]: ...

    @abc.abstractmethod
    def finish_write_and_reserve_read(
        self, keys: list[ObjectKey], read_locks: int = 1, tag: str = ""
    ) -> dict[ObjectKey, L1OperationResult]: ...

    @abc.abstractmethod
    def finish_write_and_delete(
        self, keys: list[ObjectKey], tag: str = ""
    ) -> dict[ObjectKey, L1Error]: ...

    @abc.abstractmethod
    def reserve_read(
        self, keys: list[ObjectKey], read_locks: int = 1
    ) -> dict[ObjectKey, L1OperationResult]: ...

    @abc.abstractmethod
    def unsafe_read(self, keys: list[ObjectKey]) -> dict[ObjectKey, L1OperationResult]: ...

    @abc.abstractmethod
    def finish_read(
        self, keys: list[ObjectKey], read_locks: int = 1
    ) -> dict[ObjectKey, L1Error]: ...

    @abc.abstractmethod
    def delete(self, keys: list[ObjectKey], force: bool = False) -> dict[ObjectKey, L1Error]: ...

    @abc.abstractmethod
    def touch_keys(self, keys: list[ObjectKey]) -> None: ...

    def reserve_read_prefix(
        self, rows: list[list[ObjectKey]], read_locks: int = 1, keep_locks: bool = True
    ) -> int:
        """The longest chunk prefix that every row of keys has readable (the prefix policy).

        Its keys stay read-locked ``read_locks`` times when ``keep_locks`` and are touched
        for eviction; every other key the check locked is released at once. Managers may
        do this in one pass; this version composes the batch calls.
        """
        cols = len(rows[0]) if rows else 0
        flat = [k for row in rows for k in row]
        res = self.reserve_read(flat, read_locks)
        ok = [k in res and res[k][0] is L1Error.SUCCESS for k in flat]
        hit = cols
        for r in range(len(rows)):
            row_ok = ok[r * cols : (r + 1) * cols]
            hit = min(hit, row_ok.index(False) if False in row_ok else cols)
        keep = hit if keep_locks else 0
        release = [k for i, k in enumerate(flat) if ok[i] and i % cols >= keep]
        if release:
            self.finish_read(release, read_locks)
        if hit:
            self.touch_keys([k for i, k in enumerate(flat) if i % cols < hit])
        return hit

    @abc.abstractmethod
    def get_memory_usage(self) -> tuple[int, int]: ...

    @abc.abstractmethod
    def get_l1_memory_desc(self) -> L1MemoryDesc | None: ...

    @abc.abstractmethod
    def register_listener(self, listener: L1ManagerListener) -> None: ...

    @abc.abstractmethod
    def report_status(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def close(self) -> None: ...
