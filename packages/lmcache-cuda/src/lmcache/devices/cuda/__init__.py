"""NVIDIA CUDA backend (``lmcache-cuda``): entry point ``cuda`` of ``lmcache.device_plugins``.

Cheap to import: the spec only; ops, the compiled kernels and the pin backend load lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache.v1.platform.cuda_family.spec import CudaFamilyDeviceSpec

if TYPE_CHECKING:
    from lmcache.v1.platform.base.device_ops import DeviceOps
    from lmcache.v1.platform.base.pin_memory import PinMemoryBackend

__all__ = ["CudaDeviceSpec"]


class CudaDeviceSpec(CudaFamilyDeviceSpec):
    """CUDA build of torch: ``torch.cuda`` available and ``torch.version.cuda`` set."""

    @property
    def backend_name(self) -> str:
        return "cuda"

    @property
    def ops_cls(self) -> type[DeviceOps]:
        from lmcache.devices.cuda.device_ops import CudaDeviceOps

        return CudaDeviceOps

    def is_available(self) -> bool:
        try:
            import torch

            return torch.version.cuda is not None and bool(torch.cuda.is_available())
        except Exception:
            return False

    @property
    def pin_memory_backend(self) -> type[PinMemoryBackend]:
        from lmcache.devices.cuda.pin_memory import CudaPinMemoryBackend

        return CudaPinMemoryBackend
