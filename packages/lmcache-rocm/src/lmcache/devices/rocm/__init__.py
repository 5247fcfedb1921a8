"""AMD ROCm backend (``lmcache-rocm``): entry point ``rocm`` of ``lmcache.device_plugins``.

A HIP build of torch also answers to ``torch.cuda`` (device_type ``cuda``); this spec
shares the CUDA-family layer of core and differs only in availability, name, pinning
and the native module. CUDA and ROCm availability are mutually exclusive.
"""

from __future__ import annotations

from lmcache.v1.platform.api import CudaFamilyDeviceSpec

__all__ = ["RocmDeviceSpec"]


class RocmDeviceSpec(CudaFamilyDeviceSpec):
    name = "rocm"
    ops_class = "lmcache.devices.rocm.device_ops:RocmDeviceOps"
    pin_memory_class = "lmcache.devices.rocm.pin_memory:RocmPinMemoryBackend"
    torch_version_attr = "hip"
