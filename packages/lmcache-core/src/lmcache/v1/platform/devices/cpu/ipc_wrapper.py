"""``CpuShmTensorWrapper`` (wire tag ``cpu_shm``): CPU KV tensors shared through POSIX SHM.

The server reads and writes a worker's CPU KV cache through a named segment
``/lmcache_kv_*``. Tensors made by :func:`create_shm_tensor` already live in one. For
any other tensor, ``wrap`` puts the memory of the tensor's whole storage into a segment
ONCE, however many tensors view it (vLLM views one buffer as every layer's cache):

* a storage of at least ``REMAP_MIN_BYTES`` is remapped in place: its pages are copied
  into the segment and the segment is mapped over the same addresses (``MAP_FIXED``),
  slice by slice, so at most one slice is held twice. Every tensor over that memory,
  including the views the engine made for itself (vLLM's attention layers hold their
  own), sees the server's writes without being told. Allocations this large are whole
  mappings of their own (glibc's ``mmap`` threshold is at most 32 MiB; tcmalloc and
  jemalloc give large objects whole pages), so no unrelated object shares the pages;
  A storage of whole pages (page-aligned start and end) is remapped in place too;
* any other storage (small ones: tests, toy models) may share its first and last page
  with other heap objects, so it is copied into a new segment and every tensor passed to
  ``wrap`` over it is moved there (``Tensor.set_``); views made before keep the old memory.

The creating process unlinks its segments (:meth:`CpuShmTensorWrapper.unlink`, or at exit).
"""

from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import sys
import threading
import uuid
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, ClassVar

import torch

from lmcache.utils import init_logger
from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper

logger = init_logger(__name__)

SHM_PREFIX = "/lmcache_kv_"
# Storages at least this large are shared in place (see the module docstring).
REMAP_MIN_BYTES = 32 << 20
_REMAP_SLICE_BYTES = 64 << 20
_PAGE = mmap.PAGESIZE
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)  # Python < 3.13 does not export it


@dataclass
class _Segment:
    name: str  # with the leading "/"
    base: int  # address of the segment's first byte in this process
    nbytes: int
    shm: shared_memory.SharedMemory
    in_place: bool  # mapped over the engine's own memory (MAP_FIXED)
    storage: torch.UntypedStorage | None = None  # the copy's storage (copied segments)
    # The storage a copied segment replaced, held so that its address, the key of _moved,
    # cannot be reused by a new allocation while this record lives (that tensor would be
    # moved onto this segment without its data).
    replaced: torch.UntypedStorage | None = None

    def contains(self, ptr: int, nbytes: int) -> bool:
        return self.base <= ptr and ptr + nbytes <= self.base + self.nbytes


_lock = threading.Lock()
_segments: list[_Segment] = []  # segments this process created (and unlinks)
# copied segments by the data_ptr of the storage they replaced: later layers over it follow
_moved: dict[int, _Segment] = {}


def _new_segment(nbytes: int) -> shared_memory.SharedMemory:
    name = f"{SHM_PREFIX[1:]}{os.getpid()}_{uuid.uuid4().hex[:12]}"
    return shared_memory.SharedMemory(name=name, create=True, size=max(int(nbytes), 1))


def _segment_storage(shm: shared_memory.SharedMemory, nbytes: int) -> torch.UntypedStorage:
    flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=max(int(nbytes), 1))
    return flat.untyped_storage()


def create_shm_tensor(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor backed by a new ``/lmcache_kv_*`` segment."""
    shape = tuple(int(d) for d in shape)
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    shm = _new_segment(nbytes)
    storage = _segment_storage(shm, nbytes)
    t = torch.empty(0, dtype=dtype)
    t.set_(storage, 0, shape)
    seg = _Segment("/" + shm.name.lstrip("/"), storage.data_ptr(), nbytes, shm, False, storage)
    with _lock:
        _segments.append(seg)
    return t


def _mapped_path(addr: int) -> str | None:
    """The file mapped at ``addr`` in this process (``/proc/self/maps``), None if none."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi:
                    return parts[5].strip() if len(parts) > 5 else None
    except OSError:
        return None
    return None


def _live(seg: _Segment) -> bool:
    """An in-place segment stays valid while it is still mapped where we put it: the engine
    may free its buffer (unmapping ours) and get new memory at the same address."""
    if not seg.in_place:
        return True
    path = _mapped_path(seg.base) or ""
    return path.removesuffix(" (deleted)") == "/dev/shm" + seg.name


def _segment_of(ptr: int, nbytes: int) -> _Segment | None:
    with _lock:
        candidates = [s for s in _segments if s.contains(ptr, nbytes)] + (
            [_moved[ptr]] if ptr in _moved else []
        )
    for seg in candidates:
        if _live(seg):
            return seg
    return None


def shm_segment_of(tensor: torch.Tensor) -> tuple[str, int] | None:
    """(segment name, segment bytes) of the segment holding ``tensor``'s storage, if any."""
    storage = tensor.untyped_storage()
    seg = _segment_of(storage.data_ptr(), storage.nbytes())
    return (
        (seg.name, seg.nbytes)
        if seg is not None and seg.contains(storage.data_ptr(), storage.nbytes())
        else None
    )


def _libc_mmap() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.mmap
    fn.restype = ctypes.c_void_p
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    return fn


def _share_in_place(ptr: int, nbytes: int) -> _Segment:
    """Put the pages under ``[ptr, ptr + nbytes)`` into a new segment at the same address."""
    base = ptr - ptr % _PAGE
    end = -(-(ptr + nbytes) // _PAGE) * _PAGE
    size = end - base
    shm = _new_segment(size)
    name = "/" + shm.name.lstrip("/")
    try:
        fd = os.open("/dev/shm" + name, os.O_RDWR)
    except OSError:
        shm.close()
        shm.unlink()
        raise
    mmap_fn = _libc_mmap()
    seg_addr = ctypes.addressof(ctypes.c_char.from_buffer(shm.buf))
    seg = _Segment(name, base, size, shm, True)
    done = 0
    try:
        while done < size:
            n = min(_REMAP_SLICE_BYTES, size - done)
            ctypes.memmove(seg_addr + done, base + done, n)
            flags = mmap.MAP_SHARED | _MAP_FIXED
            got = mmap_fn(base + done, n, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, done)
            if got != base + done:
                err = ctypes.get_errno()
                raise OSError(err, f"mmap over the CPU KV buffer failed: {os.strerror(err)}")
            done += n
    except BaseException:
        if done == 0:  # nothing remapped: the engine's memory is untouched
            shm.close()
            shm.unlink()
        else:  # remapped slices live in the segment (same bytes): unlink it at exit
            with _lock:
                _segments.append(seg)
        raise
    finally:
        os.close(fd)
    shm.close()  # drops only our second view of the segment; [base, end) keeps its mapping
    with _lock:
        _segments.append(seg)
    logger.info("shared a CPU KV buffer of %d bytes in place through /dev/shm%s", nbytes, name)
    return seg


def _copy_into_segment(tensor: torch.Tensor) -> _Segment:
    storage = tensor.untyped_storage()
    old_ptr, nbytes = storage.data_ptr(), storage.nbytes()
    shm = _new_segment(nbytes)
    new_storage = _segment_storage(shm, nbytes)
    new_storage.copy_(storage)
    seg = _Segment(
        "/" + shm.name.lstrip("/"), new_storage.data_ptr(), nbytes, shm, False, new_storage, storage
    )
    with _lock:
        _segments.append(seg)
        _moved[old_ptr] = seg
    logger.info("copied a CPU KV buffer (%d bytes) into shared memory %s", nbytes, seg.name)
    return seg


def _segment_for(tensor: torch.Tensor) -> _Segment:
    storage = tensor.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    seg = _segment_of(ptr, nbytes)
    if seg is None:
        whole_pages = ptr % _PAGE == 0 and (ptr + nbytes) % _PAGE == 0
        in_place = sys.platform.startswith("linux") and (nbytes >= REMAP_MIN_BYTES or whole_pages)
        seg = _share_in_place(ptr, nbytes) if in_place else _copy_into_segment(tensor)
    if not seg.contains(ptr, nbytes):  # copied: move this tensor onto the copy
        assert seg.storage is not None
        tensor.set_(seg.storage, tensor.storage_offset(), tensor.shape, tensor.stride())
    return seg


def _unlink_name(name: str) -> None:
    try:
        seg = shared_memory.SharedMemory(name=name.lstrip("/"), create=False)
    except FileNotFoundError:
        return
    try:
        seg.close()
    finally:
        seg.unlink()


@atexit.register
def _unlink_all_owned() -> None:
    with _lock:
        entries = list(_segments)
        _segments.clear()
        _moved.clear()
    for seg in entries:
        try:
            seg.shm.unlink()
        except Exception:
            pass


class CpuShmTensorWrapper(DeviceIPCWrapper):
    device_type: ClassVar[str] = "cpu"
    wire_tag: ClassVar[str | None] = "cpu_shm"

    def __init__(self, tensor: torch.Tensor | None = None, shm_name: str = "", nbytes: int = 0):
        super().__init__(tensor)
        self.shm_name = shm_name
        self.nbytes = int(nbytes)
        self.handle = shm_name
        self._attached: shared_memory.SharedMemory | None = None

    @classmethod
    def wrap(cls, tensor: Any) -> CpuShmTensorWrapper:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"cpu_shm wraps one CPU tensor per layer, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"cpu_shm wraps CPU tensors, got a tensor on {tensor.device}")
        seg = _segment_for(tensor)
        wrapper = cls(tensor, shm_name=seg.name, nbytes=seg.nbytes)
        # Offsets on the wire count from the segment's start, not the storage's.
        delta = tensor.untyped_storage().data_ptr() - seg.base
        if delta % tensor.element_size():
            raise ValueError(
                f"cpu_shm: a {tensor.dtype} tensor whose storage starts {delta} bytes into its "
                "segment cannot be addressed in elements; allocate it element-aligned"
            )
        wrapper.storage_offset = tensor.storage_offset() + delta // tensor.element_size()
        return wrapper

    def to_tensor(self) -> torch.Tensor:
        md = self.wire_metadata()
        md.check_fits(self.nbytes)
        if self._attached is None:
            shm = shared_memory.SharedMemory(name=self.shm_name.lstrip("/"), create=False)
            from lmcache.v1.platform.torch_ops._memory import untrack_shm

            with _lock:
                ours = any(seg.name == self.shm_name for seg in _segments)
            if not ours:
                untrack_shm(shm)  # the creating process owns (and unlinks) the segment
            if shm.size < self.nbytes:
                shm.close()
                raise ValueError(
                    f"shared memory {self.shm_name} has {shm.size} bytes, wrapper says {self.nbytes}"
                )
            self._attached = shm
        usable = self.nbytes - self.nbytes % self.dtype.itemsize
        flat = torch.frombuffer(self._attached.buf, dtype=torch.uint8, count=max(usable, 1))
        typed = flat[:usable].view(self.dtype)
        return torch.as_strided(typed, self.shape, self.stride, self.storage_offset)

    def close(self) -> None:
        shm, self._attached = self._attached, None
        if shm is not None:
            try:
                shm.close()
            except BufferError:
                pass  # tensors still view it; the mapping goes away with them

    def unlink(self) -> None:
        """Remove the segment (the creating process's job)."""
        with _lock:
            mine = [seg for seg in _segments if seg.name == self.shm_name]
            for seg in mine:
                _segments.remove(seg)
            for old_ptr in [p for p, seg in _moved.items() if seg.name == self.shm_name]:
                del _moved[old_ptr]
        if not mine:
            _unlink_name(self.shm_name)
        for seg in mine:
            try:
                seg.shm.unlink()
            except FileNotFoundError:
                pass

    def to_wire(self) -> dict[str, Any]:
        return {"shm_name": self.shm_name, "nbytes": self.nbytes}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> CpuShmTensorWrapper:
        name, nbytes = data.get("shm_name"), data.get("nbytes")
        if not isinstance(name, str) or not name.startswith(SHM_PREFIX) or "/" in name[1:]:
            raise ValueError(f"cpu_shm: invalid shm_name {name!r} (expected '{SHM_PREFIX}*')")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"cpu_shm: invalid nbytes {nbytes!r}")
        return cls(None, shm_name=name, nbytes=nbytes)
