"""``CudaFamilyDeviceOps``: torch-baseline ops plus what ``torch.cuda`` devices need.

- ``tensor_from_ptr`` builds a non-owning view through ``__cuda_array_interface__``
  (any dtype via a same-width integer view), else copies device-to-device.
- ``lmcache_memcpy_async`` pointer mode (``DeviceViewOps``, shared with MUSA):
  stream-ordered copies split at ``host_buffer_alignments`` boundaries (a piece never
  spans two pin registrations).
- ``ensure_native`` binds the wheel's compiled module (``native_module_name``) with a
  soft fail; a successful bind switches the instance to pointer operands (the kernels
  take raw addresses, at most 4 objects per call).
"""

from __future__ import annotations

import ctypes
import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from lmcache.utils import init_logger
from lmcache.v1.platform import torch_ops
from lmcache.v1.platform.base.device_ops import DeviceOps
from lmcache.v1.platform.base.runtime_lib import load_first_library
from lmcache.v1.platform.ops_types import TransferDirection

if TYPE_CHECKING:
    import torch

logger = init_logger(__name__)

_INT_BY_WIDTH = {1: "|i1", 2: "<i2", 4: "<i4", 8: "<i8"}


def host_pieces(host_offset: int, nbytes: int, alignment: int) -> list[tuple[int, int]]:
    """(offset into the copy, length) pieces that never cross a multiple of
    ``alignment`` measured from the host allocator's base."""
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(
            f"host_buffer_alignments={alignment!r} must be a positive power of two "
            "(callers pass the pin-registration chunk, e.g. 64 MiB)"
        )
    if nbytes < 0 or host_offset < 0:
        raise ValueError(f"nbytes={nbytes!r} and host_buffer_offset={host_offset!r} must be >= 0")
    pieces: list[tuple[int, int]] = []
    done = 0
    while done < nbytes:
        room = alignment - (host_offset + done) % alignment
        length = min(nbytes - done, room)
        pieces.append((done, length))
        done += length
    return pieces


class DeviceViewOps(DeviceOps):
    """Ops of a backend whose device memory torch can view (the CUDA family, MUSA).

    ``lmcache_memcpy_async`` with tensors (and the mixed-operand TypeError) is the
    baseline's. With raw addresses it issues one stream-ordered ``copy_`` per
    ``host_pieces`` piece, so a piece never spans two pin registrations of the host
    allocator. A subclass provides ``tensor_from_ptr`` (its view of a device address) and
    ``_current_device()`` (its active device).
    """

    def _current_device(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must define _current_device()")

    def lmcache_memcpy_async(
        self,
        dest: torch.Tensor | int,
        src: torch.Tensor | int,
        nbytes: int,
        direction: TransferDirection,
        host_buffer_offset: int,
        host_buffer_alignments: int,
    ) -> None:
        """Tensors (or a mixed pair, rejected there): the torch baseline. Raw addresses: one
        stream-ordered ``copy_`` per :func:`host_pieces` piece between a host view and this
        backend's device view (``tensor_from_ptr``) on the current device."""
        if not (isinstance(dest, int) and isinstance(src, int)):
            torch_ops.lmcache_memcpy_async(
                dest, src, nbytes, direction, host_buffer_offset, host_buffer_alignments
            )
            return None
        import torch

        pieces = host_pieces(host_buffer_offset, int(nbytes), host_buffer_alignments)
        d = TransferDirection(int(direction))
        host, dev = (src, dest) if d == TransferDirection.H2D else (dest, src)
        device = self._current_device()
        for off, length in pieces:
            host_view = torch_ops.host_tensor_from_ptr(host + off, (length,), torch.uint8)
            dev_view = self.tensor_from_ptr(dev + off, (length,), torch.uint8, device)
            if d == TransferDirection.H2D:
                dev_view.copy_(host_view, non_blocking=True)
            else:
                host_view.copy_(dev_view, non_blocking=True)
        return None


class _ArrayInterface:
    """Minimal ``__cuda_array_interface__`` (v3) exporter for a raw device address."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str):
        self.__cuda_array_interface__ = {
            "shape": tuple(int(s) for s in shape),
            "typestr": typestr,
            "data": (int(ptr), False),
            "version": 3,
            "strides": None,
        }


class CudaFamilyDeviceOps(DeviceViewOps):
    """Ops of the ``torch.cuda`` backends (CUDA, ROCm): the torch baseline until
    ``ensure_native`` binds the wheel's compiled module (``native_module_name``), then the
    kernels with pointer operands. Each wheel subclasses it, setting ``device_type`` and
    ``native_module_name`` (and the runtime library names for ROCm)."""

    device_type: ClassVar[str] = "cuda"
    # The Python fallback takes tensors; a successful native bind switches the instance.
    kv_transfer_operands: ClassVar[str | None] = "tensor"
    # Module bound by ensure_native(); set by each wheel's subclass.
    native_module_name: ClassVar[str | None] = None
    # Runtime libraries tried (in order) for the device-to-device copy fallback; the
    # wheels' pin backends load the same list.
    runtime_library_names: ClassVar[tuple[str, ...]] = (
        "libcudart.so",
        "libcudart.so.13",
        "libcudart.so.12",
        "libcudart.so.11.0",
    )
    runtime_memcpy_symbol: ClassVar[str] = "cudaMemcpy"
    # Named in the fallback warning: the wheel's variable that forces the kernel build
    # (ROCm overrides it with LMCACHE_BUILD_HIP).
    native_build_env: ClassVar[str] = "LMCACHE_BUILD_CUDA"

    def ensure_native(self) -> None:
        if self._native_bound:
            return
        self._native_bound = True
        name = self.native_module_name
        if not name:
            return
        try:
            module = importlib.import_module(name)
        except (ImportError, OSError) as exc:
            logger.warning(
                "Native CUDA-family module %s is not available (%s); falling back to the "
                "torch baseline ops (reinstall the wheel with %s=1 and the toolkit's "
                "compiler on PATH for kernels)",
                name,
                exc,
                self.native_build_env,
            )
            return
        self.bind_native(module)
        # The contract declares these per class (ClassVar: what plugins set); this ops object
        # switches to pointer operands only once its native kernels are bound, per instance.
        self.kv_transfer_operands = "pointer"  # type: ignore[misc]
        self.max_objects_per_call = getattr(module, "MAX_OBJECTS_PER_CALL", 4)  # type: ignore[misc]

    # ---- raw pointers ------------------------------------------------------------------
    def tensor_from_ptr(
        self,
        ptr: int,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """A non-owning view of device address ``ptr`` through ``__cuda_array_interface__``
        (any dtype, via a same-width integer view); when torch cannot attribute the address
        to a device, a device-to-device copy instead. ``device="cpu"`` views host memory."""
        import torch

        if not ptr:
            raise ValueError("tensor_from_ptr: ptr must be a non-zero device address")
        if device is not None and torch.device(device).type == "cpu":
            # Host address (tests, staging): the CPU backend's zero-copy view.
            return torch_ops.pointer_view(ptr, shape, dtype, device)
        shape = tuple(int(s) for s in shape)
        itemsize = dtype.itemsize
        typestr = _INT_BY_WIDTH.get(itemsize)
        if typestr is not None:
            try:
                raw = torch.as_tensor(_ArrayInterface(ptr, shape, typestr), device=device)
                return raw.view(dtype)
            except Exception as exc:  # e.g. an address torch cannot attribute to a device
                logger.debug("tensor_from_ptr: CUDA array interface failed (%s); copying", exc)
        return self._copy_from_device_ptr(ptr, shape, dtype, device, itemsize)

    def _copy_from_device_ptr(
        self,
        ptr: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str | None,
        itemsize: int,
    ) -> torch.Tensor:
        import math

        import torch

        out = torch.empty(shape, dtype=dtype, device=device)
        nbytes = math.prod(shape) * itemsize
        memcpy = _runtime_memcpy(self.runtime_library_names, self.runtime_memcpy_symbol)
        device_to_device = 3  # cudaMemcpyDeviceToDevice == hipMemcpyDeviceToDevice
        err = memcpy(
            ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(ptr), nbytes, device_to_device
        )
        if err != 0:
            raise RuntimeError(
                f"tensor_from_ptr: device-to-device copy from {ptr:#x} failed with error {err}"
            )
        return out

    def _current_device(self) -> Any:
        import torch

        return torch.device(self.device_type, torch.cuda.current_device())


_RUNTIME_MEMCPY: dict[tuple[tuple[str, ...], str], Any] = {}


def _runtime_memcpy(names: tuple[str, ...], symbol: str) -> Any:
    key = (names, symbol)
    fn = _RUNTIME_MEMCPY.get(key)
    if fn is None:
        try:
            lib = load_first_library(names, "GPU runtime", (symbol,))
        except OSError as exc:
            raise RuntimeError(
                f"tensor_from_ptr: cannot copy from a raw device pointer: {exc}"
            ) from None
        fn = getattr(lib, symbol)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _RUNTIME_MEMCPY[key] = fn
    return fn
