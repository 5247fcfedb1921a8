"""Memory objects: the unit of KV data that moves between L1 and L2
(docs/design/storage-formats.md#memory-object).

A ``MemoryObj`` is a view over bytes that some allocator owns (usually a slice of the L1
arena). Adapters read it through ``byte_array`` (a writable, zero-copy memoryview of the
logical bytes), ``tensor`` or ``get_tensor(i)``; they never free, keep or resize it.
"""

from __future__ import annotations

import ctypes
import enum
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

__all__ = [
    "BytesBufferMemoryObj",
    "MemoryFormat",
    "MemoryObj",
    "MemoryObjMetadata",
    "TensorMemoryObj",
]


class MemoryFormat(enum.Enum):
    UNDEFINED = 0
    KV_2LTD = 1
    KV_T2D = 2
    KV_2TD = 3
    KV_MLA_FMT = 4
    BINARY = 5
    BINARY_BUFFER = 6

    def token_dim(self) -> int:
        return {MemoryFormat.KV_2LTD: 2, MemoryFormat.KV_T2D: 0, MemoryFormat.KV_2TD: 1}.get(
            self, 0
        )


@dataclass
class MemoryObjMetadata:
    shape: torch.Size
    dtype: torch.dtype | None
    address: int
    phy_size: int
    ref_count: int
    pin_count: int = 0
    fmt: MemoryFormat = MemoryFormat.UNDEFINED
    cached_positions: Any = None
    shapes: list[torch.Size] | None = None
    dtypes: list[torch.dtype] | None = None

    def get_shapes(self) -> list[torch.Size]:
        return list(self.shapes) if self.shapes is not None else [torch.Size(self.shape)]

    def get_dtypes(self) -> list[torch.dtype]:
        if self.dtypes is not None:
            return list(self.dtypes)
        return [self.dtype if self.dtype is not None else torch.uint8]

    def logical_size(self) -> int:
        total = 0
        for shape, dtype in zip(self.get_shapes(), self.get_dtypes(), strict=False):
            numel = 1
            for d in shape:
                numel *= int(d)
            total += numel * dtype.itemsize
        return total


@lru_cache(maxsize=4096)
def _ubyte_array_type(length: int) -> type:
    """One ctypes array type per length: creating a new type per call leaks (LMCache #3767)."""
    return ctypes.c_ubyte * length


def _memoryview_at(ptr: int, length: int, keepalive: Any) -> memoryview:
    if length == 0:
        return memoryview(bytearray())
    arr = _ubyte_array_type(length).from_address(ptr)
    arr._lmcache_keepalive = keepalive  # the memory outlives the view's users
    return memoryview(arr).cast("B")


class MemoryObj:
    """Interface shared by every memory object."""

    def __init__(self, metadata: MemoryObjMetadata) -> None:
        self._metadata = metadata
        self._used_size: int | None = None
        self._l1_manager: Any = None
        self._lock = threading.Lock()

    # ownership and layout
    @property
    def metadata(self) -> MemoryObjMetadata:
        """Shape, dtype(s), arena offset, physical size and counts of the object."""
        return self._metadata

    @property
    def meta(self) -> MemoryObjMetadata:
        """Same as :attr:`metadata` (0.5.x name)."""
        return self._metadata

    def get_shapes(self) -> list[torch.Size]:
        """Shape of each group the object holds, in layout order."""
        return self._metadata.get_shapes()

    def get_dtypes(self) -> list[torch.dtype]:
        """Dtype of each group, in layout order (``uint8`` when untyped)."""
        return self._metadata.get_dtypes()

    def get_shape(self) -> torch.Size:
        """The primary shape (``metadata.shape``; single-group objects)."""
        return torch.Size(self._metadata.shape)

    def get_dtype(self) -> torch.dtype | None:
        """The primary dtype (``metadata.dtype``), ``None`` when untyped."""
        return self._metadata.dtype

    def get_memory_format(self) -> MemoryFormat:
        """The layout tag of the bytes (``MemoryFormat``)."""
        return self._metadata.fmt

    def set_l1_manager(self, tag: Any) -> None:
        """Record which L1 manager owns the object (set by L1, read by the controllers)."""
        self._l1_manager = tag

    def get_l1_manager(self) -> Any:
        """The tag given to :meth:`set_l1_manager`, ``None`` outside L1."""
        return self._l1_manager

    # sizes
    def get_size(self) -> int:
        """Logical bytes: sum over groups of numel x itemsize, or the value of
        :meth:`set_used_size`. Adapters store and load exactly this many bytes."""
        if self._used_size is not None:
            return self._used_size
        return self._metadata.logical_size()

    def set_used_size(self, n: int) -> None:
        """Declare that only the first ``n`` bytes are used; ``ValueError`` outside ``[0,
        physical size]``."""
        n = int(n)
        if n < 0 or n > self.get_physical_size():
            raise ValueError(f"used size {n} outside [0, {self.get_physical_size()}]")
        self._used_size = n

    def get_physical_size(self) -> int:
        """Bytes of the allocated slot (aligned; at least :meth:`get_size`)."""
        return int(self._metadata.phy_size)

    # 0.5.x reference counting (the L1 manager tracks its own locks; these stay for plugins)
    def ref_count_up(self) -> None:
        """0.5.x reference count +1 (kept for plugins; L1 tracks its own locks)."""
        with self._lock:
            self._metadata.ref_count += 1

    def ref_count_down(self) -> None:
        """0.5.x reference count -1, never below 0."""
        with self._lock:
            self._metadata.ref_count = max(0, self._metadata.ref_count - 1)

    def get_ref_count(self) -> int:
        """The 0.5.x reference count."""
        return self._metadata.ref_count

    def pin(self) -> bool:
        """0.5.x pin count +1; always True."""
        with self._lock:
            self._metadata.pin_count += 1
        return True

    def unpin(self) -> bool:
        """0.5.x pin count -1 (never below 0); always True."""
        with self._lock:
            self._metadata.pin_count = max(0, self._metadata.pin_count - 1)
        return True

    def is_pinned(self) -> bool:
        """Whether the 0.5.x pin count is above 0."""
        return self._metadata.pin_count > 0

    @property
    def byte_array(self) -> memoryview:
        """A writable, zero-copy ``memoryview`` (itemsize 1) over exactly :meth:`get_size`
        bytes: what adapters write to or fill from their backend."""
        raise NotImplementedError

    @property
    def data_ptr(self) -> int:
        """Address of the first byte (for native I/O and memory registration)."""
        raise NotImplementedError

    @property
    def tensor(self) -> torch.Tensor | None:
        """The object as a tensor of the primary shape and dtype, ``None`` when it has none."""
        raise NotImplementedError

    @property
    def raw_tensor(self) -> torch.Tensor | None:
        """The flat uint8 tensor over the whole slot, ``None`` when not tensor-backed."""
        raise NotImplementedError

    def get_tensor(self, index: int) -> torch.Tensor | None:
        """Group ``index`` as a tensor of its shape and dtype (a view at its offset)."""
        raise NotImplementedError

    def physical_byte_array(self) -> memoryview:
        """Zero-copy view over the whole allocated slot (``get_physical_size()`` bytes)."""
        raise NotImplementedError


class TensorMemoryObj(MemoryObj):
    """A memory object backed by a tensor (a slice of the L1 arena, or any CPU tensor)."""

    def __init__(
        self,
        raw_data: torch.Tensor,
        metadata: MemoryObjMetadata,
        parent_allocator: Any = None,
    ) -> None:
        super().__init__(metadata)
        self.raw_data = raw_data
        self.parent_allocator = parent_allocator
        flat = raw_data.reshape(-1) if raw_data.is_contiguous() else raw_data.contiguous()
        self._raw_u8 = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat

    @property
    def raw_tensor(self) -> torch.Tensor:
        return self._raw_u8

    @property
    def data_ptr(self) -> int:
        return self._raw_u8.data_ptr()

    def get_physical_size(self) -> int:
        phy = int(self._metadata.phy_size)
        return phy if phy > 0 else self._raw_u8.numel()

    def _group_offsets(self) -> list[tuple[int, int, torch.Size, torch.dtype]]:
        out, off = [], 0
        for shape, dtype in zip(self.get_shapes(), self.get_dtypes(), strict=False):
            numel = 1
            for d in shape:
                numel *= int(d)
            nbytes = numel * dtype.itemsize
            out.append((off, nbytes, torch.Size(shape), dtype))
            off += nbytes
        return out

    def get_tensor(self, index: int) -> torch.Tensor:
        groups = self._group_offsets()
        if index < 0 or index >= len(groups):
            raise IndexError(f"memory object has {len(groups)} groups, got index {index}")
        off, nbytes, shape, dtype = groups[index]
        return self._raw_u8[off : off + nbytes].view(dtype).view(shape)

    @property
    def tensor(self) -> torch.Tensor:
        return self.get_tensor(0)

    @property
    def byte_array(self) -> memoryview:
        n = self.get_size()
        if n > self._raw_u8.numel():
            raise ValueError(
                f"logical size {n} exceeds the backing buffer ({self._raw_u8.numel()})"
            )
        return _memoryview_at(self.data_ptr, n, self._raw_u8)

    def physical_byte_array(self) -> memoryview:
        n = min(self.get_physical_size(), self._raw_u8.numel())
        return _memoryview_at(self.data_ptr, n, self._raw_u8)

    def __repr__(self) -> str:
        return (
            f"TensorMemoryObj(address={self._metadata.address}, size={self.get_size()}, "
            f"phy_size={self.get_physical_size()})"
        )


class BytesBufferMemoryObj(MemoryObj):
    """A memory object over a Python bytes-like buffer (serde outputs, tests)."""

    def __init__(self, raw_bytes: bytes | bytearray | memoryview, metadata: Any = None) -> None:
        buf = bytearray(raw_bytes) if not isinstance(raw_bytes, bytearray) else raw_bytes
        if metadata is None:
            metadata = MemoryObjMetadata(
                shape=torch.Size([len(buf)]),
                dtype=torch.uint8,
                address=0,
                phy_size=len(buf),
                ref_count=1,
                fmt=MemoryFormat.BINARY_BUFFER,
            )
        super().__init__(metadata)
        self.raw_data = buf

    def get_size(self) -> int:
        return self._used_size if self._used_size is not None else len(self.raw_data)

    def get_physical_size(self) -> int:
        return len(self.raw_data)

    @property
    def byte_array(self) -> memoryview:
        return memoryview(self.raw_data)[: self.get_size()]

    def physical_byte_array(self) -> memoryview:
        return memoryview(self.raw_data)

    @property
    def data_ptr(self) -> int:
        if not self.raw_data:
            return 0
        return ctypes.addressof(ctypes.c_char.from_buffer(self.raw_data))

    @property
    def tensor(self) -> torch.Tensor:
        return (
            torch.frombuffer(self.raw_data, dtype=torch.uint8)
            if self.raw_data
            else torch.empty(0, dtype=torch.uint8)
        )

    @property
    def raw_tensor(self) -> torch.Tensor:
        return self.tensor

    def get_tensor(self, index: int) -> torch.Tensor:
        if index != 0:
            raise IndexError(f"a bytes buffer has one group, got index {index}")
        return self.tensor
