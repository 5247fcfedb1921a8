"""The registered L1 arena as NIXL sees it: one DRAM region cut into page descriptors, and the
checks that map a buffer onto those pages (or reject it with the reason)."""

from __future__ import annotations

from typing import Any

import numpy as np

#: Smaller pages would mean one NIXL descriptor per few bytes of L1 (millions per GiB).
MIN_PAGE_BYTES = 512


class BufferRejected(ValueError):
    """A buffer that cannot be moved by NIXL; the message says why and what to change."""


def buffer_address(buf: Any) -> int:
    """Host address of a MemoryObj (``data_ptr``) or a buffer-protocol object."""
    ptr = getattr(buf, "data_ptr", None)
    if ptr is not None:
        return int(ptr() if callable(ptr) else ptr)
    view = memoryview(buf)
    if view.nbytes == 0:
        raise BufferRejected("the buffer is empty")
    return int(np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data)


class Arena:
    """``[base, base + size)`` in pages of ``page`` bytes; page i is descriptor i."""

    def __init__(self, l1_memory_desc: Any, type_name: str) -> None:
        if l1_memory_desc is None:
            raise ValueError(f"{type_name} requires an L1MemoryDesc (the L1 arena to register)")
        base, size, page = (
            int(l1_memory_desc.ptr),
            int(l1_memory_desc.size),
            int(l1_memory_desc.align_bytes),
        )
        if base <= 0 or size <= 0:
            raise ValueError(
                f"{type_name} requires a non-empty L1 memory arena (got ptr={base:#x}, size={size})"
            )
        if page <= 0 or page & (page - 1):
            raise ValueError(f"{type_name} requires a power-of-two L1 alignment (got {page})")
        if page < MIN_PAGE_BYTES:
            raise ValueError(
                f"{type_name} needs an L1 alignment of at least {MIN_PAGE_BYTES} bytes (got "
                f"{page}): every L1 page is one NIXL descriptor. Use --l1-align-bytes 4096 "
                "(the server default; `lmcache bench l2` defaults to 1)"
            )
        if size // page >= 2**31:
            raise ValueError(
                f"{type_name}: {size // page} L1 pages exceed NIXL's 32-bit descriptor index; "
                "raise --l1-align-bytes"
            )
        self.base, self.size, self.page = base, size, page
        self.num_pages = size // page

    def region(self) -> list[tuple[int, int, int, str]]:
        """The registration list: the whole arena, device 0, no metadata."""
        return [(self.base, self.num_pages * self.page, 0, "")]

    def page_descs(self) -> np.ndarray:
        """``(address, page, 0)`` per page, as NIXL's Nx3 descriptor array."""
        descs = np.empty((self.num_pages, 3), dtype=np.uint64)
        descs[:, 0] = self.base + np.arange(self.num_pages, dtype=np.uint64) * self.page
        descs[:, 1] = self.page
        descs[:, 2] = 0
        return descs

    def pages_of(self, obj: Any) -> tuple[int, int, int]:
        """``(first_page, num_pages, logical_bytes)`` of a MemoryObj whose pages all lie in the
        arena and inside the object's own slot; raises ``BufferRejected`` otherwise."""
        try:
            addr = buffer_address(obj)
            nbytes = int(obj.get_size())
        except BufferRejected:
            raise
        except Exception as exc:
            raise BufferRejected(f"the buffer has no host address ({exc})") from None
        if nbytes <= 0:
            raise BufferRejected("the buffer is empty")
        end = self.base + self.num_pages * self.page
        if not self.base <= addr < end:
            raise BufferRejected(
                f"the buffer at {addr:#x} lies outside the registered L1 arena "
                f"[{self.base:#x}, {end:#x}); NIXL moves only buffers of the L1 pool"
            )
        offset = addr - self.base
        if offset % self.page:
            raise BufferRejected(
                f"the buffer at arena offset {offset} is not aligned to the {self.page}-byte "
                "L1 page"
            )
        n = -(-nbytes // self.page)
        if offset + n * self.page > self.num_pages * self.page:
            raise BufferRejected(
                f"the buffer's {n} pages from arena offset {offset} run past the end of the "
                "registered arena"
            )
        slot = _physical_size(obj, nbytes)
        if n * self.page > slot:
            raise BufferRejected(
                f"the buffer's slot holds {slot} bytes but a transfer moves whole pages "
                f"({n} x {self.page} bytes); allocate L1 with --l1-align-bytes {self.page}"
            )
        return offset // self.page, n, nbytes


def _physical_size(obj: Any, default: int) -> int:
    get = getattr(obj, "get_physical_size", None)
    if get is None:
        return default
    try:
        return int(get())
    except Exception:
        return default
