"""Host memory helpers: async copies, aligned (pinned) allocation, SHM, raw pointers."""

from __future__ import annotations

import ctypes
import mmap
import threading
import warnings
from multiprocessing import resource_tracker, shared_memory
from typing import Any, cast

import torch

from lmcache.utils import init_logger
from lmcache.v1.platform.base.active import active_platform

logger = init_logger(__name__)

PAGE_SIZE = mmap.PAGESIZE

_alloc_lock = threading.Lock()
# aligned address -> backing tensor (kept alive until the matching free)
_host_allocs: dict[int, torch.Tensor] = {}
# aligned address -> (SharedMemory, size)
_shm_allocs: dict[int, tuple[shared_memory.SharedMemory, int]] = {}
_pin_state: dict[str, bool | None] = {"probe": None, "disabled": False}


def _active_device_type() -> str:
    return active_platform().get_torch_device()[1]


# ---- lmcache_memcpy_async ----------------------------------------------------------------


def lmcache_memcpy_async(
    dest: Any,
    src: Any,
    nbytes: int,
    direction: Any,
    host_buffer_offset: int,
    host_buffer_alignments: int,
) -> None:
    """Copy ``nbytes`` between a device buffer and host memory. Both operands are tensors or
    both raw addresses (mixed: ``TypeError``); ``host_buffer_alignments`` is a power of two
    (the pin-registration chunk) that no piece of the copy straddles, measured from
    ``host_buffer_offset`` (the host address's offset from its allocation base). The baseline
    copies raw addresses only in a CPU-only process; the caller synchronizes before using
    the destination."""
    dest_is_int = isinstance(dest, int) and not isinstance(dest, bool)
    src_is_int = isinstance(src, int) and not isinstance(src, bool)
    if dest_is_int != src_is_int:
        raise TypeError(
            "lmcache_memcpy_async needs both dest and src as int addresses or both as tensors "
            f"(got {type(dest).__name__} and {type(src).__name__})"
        )
    align = host_buffer_alignments
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(
            f"host_buffer_alignments={host_buffer_alignments!r} must be a positive power of two "
            "(callers pass the pin-registration chunk, e.g. 64 MiB)"
        )
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} must be >= 0")
    if not dest_is_int:
        if not isinstance(dest, torch.Tensor) or not isinstance(src, torch.Tensor):
            raise TypeError("lmcache_memcpy_async tensor mode needs torch.Tensor dest and src")
        es = dest.element_size()
        if nbytes % es:
            raise ValueError(f"nbytes={nbytes} is not a multiple of the element size {es}")
        n = nbytes // es
        dest.view(-1)[:n].copy_(src.reshape(-1)[:n], non_blocking=True)
        return
    device_type = _active_device_type()
    if device_type != "cpu":
        raise NotImplementedError(
            "lmcache_memcpy_async with raw pointers is not supported by the torch baseline on "
            f"device type {device_type!r}; the backend must override it"
        )
    if nbytes:
        ctypes.memmove(dest, src, nbytes)


# ---- aligned host allocation -------------------------------------------------------------


def _want_pinned() -> bool:
    if _pin_state["disabled"]:
        return False
    if _pin_state["probe"] is None:
        try:
            module = active_platform().get_torch_device()[0]
            _pin_state["probe"] = bool(module is not None and module.is_available())
        except Exception:
            _pin_state["probe"] = False
    return bool(_pin_state["probe"])


def _reset_pin_state() -> None:
    _pin_state["probe"] = None
    _pin_state["disabled"] = False


def _aligned_alloc(size: int) -> int:
    size = int(size)
    if size <= 0:
        raise ValueError(f"allocation size {size} must be > 0")
    total = size + PAGE_SIZE
    buf = None
    if _want_pinned():
        try:
            buf = torch.zeros(total, dtype=torch.uint8, pin_memory=True)
        except Exception as exc:
            with _alloc_lock:
                if not _pin_state["disabled"]:
                    _pin_state["disabled"] = True
                    logger.warning(
                        "pinned host allocation of %d bytes failed (%s); using unpinned host "
                        "memory for the rest of this process",
                        total,
                        exc,
                    )
    if buf is None:
        buf = torch.zeros(total, dtype=torch.uint8)
    base = buf.data_ptr()
    aligned = (base + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1)
    with _alloc_lock:
        _host_allocs[aligned] = buf
    return aligned


def _aligned_free(ptr: int) -> None:
    with _alloc_lock:
        buf = _host_allocs.pop(int(ptr), None)
    if buf is None:
        logger.warning("free of unknown host address 0x%x ignored", int(ptr))


def alloc_pinned_ptr(size: int, device_id: int = 0) -> int:
    """``size`` bytes of page-aligned, zero-filled host memory, pinned when the device runtime
    allows (else unpinned, one warning); the address, valid until :func:`free_pinned_ptr`."""
    return _aligned_alloc(size)


def free_pinned_ptr(ptr: int) -> None:
    """Free memory from :func:`alloc_pinned_ptr`; an unknown address is logged and ignored."""
    _aligned_free(ptr)


def alloc_pinned_numa_ptr(size: int, numa_id: int = 0) -> int:
    """Like :func:`alloc_pinned_ptr`; the baseline ignores ``numa_id`` (no NUMA placement)."""
    return _aligned_alloc(size)


def free_pinned_numa_ptr(ptr: int, size: int | None = None) -> None:
    """Free memory from :func:`alloc_pinned_numa_ptr` (``size`` is not needed)."""
    _aligned_free(ptr)


def alloc_numa_ptr(size: int, numa_id: int = 0) -> int:
    """Alias of :func:`alloc_pinned_numa_ptr` (0.5.6 name)."""
    return alloc_pinned_numa_ptr(size, numa_id)


def free_numa_ptr(ptr: int, size: int | None = None) -> None:
    """Free memory from :func:`alloc_numa_ptr`."""
    free_pinned_numa_ptr(ptr, size)


def _hugepage_warning(name: str) -> None:
    warnings.warn(
        f"{name}: the torch baseline has no hugepage allocator; falling back to the regular "
        "pinned allocation",
        RuntimeWarning,
        stacklevel=3,
    )


def alloc_hugepage_pinned_ptr(size: int, device_id: int = 0) -> int:
    """No hugepages in the baseline: warns (``RuntimeWarning``), then :func:`alloc_pinned_ptr`."""
    _hugepage_warning("alloc_hugepage_pinned_ptr")
    return alloc_pinned_ptr(size, device_id)


def free_hugepage_pinned_ptr(ptr: int, size: int = 0) -> None:
    """Free memory from :func:`alloc_hugepage_pinned_ptr`."""
    free_pinned_ptr(ptr)


def alloc_hugepage_pinned_numa_ptr(size: int, numa_id: int = 0) -> int:
    """No hugepages in the baseline: warns, then :func:`alloc_pinned_numa_ptr`."""
    _hugepage_warning("alloc_hugepage_pinned_numa_ptr")
    return alloc_pinned_numa_ptr(size, numa_id)


def free_hugepage_pinned_numa_ptr(ptr: int, size: int = 0) -> None:
    """Free memory from :func:`alloc_hugepage_pinned_numa_ptr`."""
    free_pinned_numa_ptr(ptr)


# ---- POSIX shared memory -----------------------------------------------------------------


def _buffer_address(buf: memoryview) -> int:
    anchor = ctypes.c_char.from_buffer(buf)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # release the buffer export so the segment can be closed later


def _unlink_stale(name: str) -> None:
    try:
        stale = shared_memory.SharedMemory(name=name, create=False)
    except FileNotFoundError:
        return
    logger.warning("replacing stale shared-memory segment /%s", name)
    try:
        stale.close()
    finally:
        stale.unlink()  # also unregisters it from this process's resource tracker


def alloc_shm_pinned_ptr(size: int, shm_name: str = "") -> int:
    """``size`` bytes of POSIX shared memory named ``shm_name`` (anonymous when empty; a
    stale segment of that name is replaced), pinned through the active device spec when
    possible; the address. The server's shared-memory L1 pool is allocated with it."""
    size = int(size)
    if size <= 0:
        raise ValueError(f"allocation size {size} must be > 0")
    name = (shm_name or "").lstrip("/") or None
    if name:
        _unlink_stale(name)
    shm = shared_memory.SharedMemory(name=name, create=True, size=size)
    ptr = _buffer_address(cast(memoryview, shm.buf))  # None only once closed
    with _alloc_lock:
        _shm_allocs[ptr] = (shm, size)
    try:
        pinned = active_platform().current_device_spec().pin_memory(ptr, size)
    except Exception as exc:
        logger.warning("pinning shared memory /%s failed: %s", shm.name, exc)
        pinned = False
    logger.debug("allocated shared memory /%s (%d bytes, pinned=%s)", shm.name, size, pinned)
    return ptr


def free_shm_pinned_ptr(ptr: int, size: int = 0, shm_name: str = "") -> None:
    """Unpin, close and unlink memory from :func:`alloc_shm_pinned_ptr`; an unknown address
    is logged and ignored."""
    with _alloc_lock:
        entry = _shm_allocs.pop(int(ptr), None)
    if entry is None:
        logger.warning("free of unknown shared-memory address 0x%x ignored", int(ptr))
        return
    shm, _size = entry
    try:
        active_platform().current_device_spec().unpin_memory(int(ptr))
    except Exception as exc:
        logger.warning("unpinning shared memory /%s failed: %s", shm.name, exc)
    try:
        shm.close()
    except BufferError:
        logger.warning("shared memory /%s still has live views; unlinking only", shm.name)
    try:
        shm.unlink()
    except FileNotFoundError:
        pass


def untrack_shm(shm: shared_memory.SharedMemory) -> None:
    """Stop this process's resource tracker from unlinking a segment it only attached."""
    try:
        resource_tracker.unregister("/" + shm.name.lstrip("/"), "shared_memory")
    except Exception:
        pass


# ---- raw pointers ----------------------------------------------------------------------


def batched_memcpy(src_ptrs: Any, dst_ptrs: Any, sizes: Any) -> None:
    """Host-to-host ``memmove`` of ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]``
    (sequences or int tensors of equal length, else ``ValueError``; sizes <= 0 skipped)."""
    src = [int(x) for x in (src_ptrs.tolist() if isinstance(src_ptrs, torch.Tensor) else src_ptrs)]
    dst = [int(x) for x in (dst_ptrs.tolist() if isinstance(dst_ptrs, torch.Tensor) else dst_ptrs)]
    nb = [int(x) for x in (sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes)]
    if not (len(src) == len(dst) == len(nb)):
        raise ValueError(
            f"batched_memcpy: {len(src)} sources, {len(dst)} destinations and {len(nb)} sizes "
            "must have the same length"
        )
    for s, d, n in zip(src, dst, nb, strict=False):
        if n > 0:
            ctypes.memmove(d, s, n)


def host_tensor_from_ptr(ptr: int, shape: Any, dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy CPU view of ``ptr`` (the caller keeps the memory alive)."""
    shape = tuple(int(d) for d in shape)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = (ctypes.c_char * nbytes).from_address(int(ptr))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(raw, dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def pointer_view(ptr: int, shape: Any, dtype: torch.dtype, device: Any = None) -> torch.Tensor:
    """A non-owning tensor view of address ``ptr`` on ``device`` (CPU when None), built by
    the ``tensor_from_ptr`` op of that device type's backend; ``ValueError`` for a null
    address. The baseline ops use it to turn pointer operands into tensors."""
    if not ptr:
        raise ValueError("pointer_view: ptr is 0 (null address)")
    dev = torch.device(device if device is not None else "cpu")
    return active_platform().resolve_device_ops(dev.type).tensor_from_ptr(ptr, shape, dtype, device)
