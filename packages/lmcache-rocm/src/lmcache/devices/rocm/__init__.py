"""AMD ROCm backend (``lmcache-rocm``): entry point ``rocm`` of ``lmcache.device_plugins``.

A HIP build of torch also answers to ``torch.cuda`` (device_type ``cuda``); this spec
shares the CUDA-family layer of core and differs only in availability, name, pinning
and the native module. CUDA and ROCm availability are mutually exclusive.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache.v1.platform.cuda_family.spec import CudaFamilyDeviceSpec

if TYPE_CHECKING:
    from lmcache.v1.platform.base.device_ops import DeviceOps
    from lmcache.v1.platform.base.pin_memory import PinMemoryBackend

__all__ = ["RocmDeviceSpec"]


class RocmDeviceSpec(CudaFamilyDeviceSpec):
    @property
    def backend_name(self) -> str:
        return "rocm"

    @property
    def ops_cls(self) -> type[DeviceOps]:
        from lmcache.devices.rocm.device_ops import RocmDeviceOps

        return RocmDeviceOps

    def is_available(self) -> bool:
        try:
            import torch

            return getattr(torch.version, "hip", None) is not None and bool(
                torch.cuda.is_available()
            )
        except Exception:
            return False

    @property
    def pin_memory_backend(self) -> type[PinMemoryBackend]:
        from lmcache.devices.rocm.pin_memory import RocmPinMemoryBackend

        return RocmPinMemoryBackend
