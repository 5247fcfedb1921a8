"""NVIDIA CUDA backend (``lmcache-cuda``): entry point ``cuda`` of ``lmcache.device_plugins``.

Cheap to import: the spec only; ops, the compiled kernels and the pin backend load lazily.
"""

from __future__ import annotations

from lmcache.v1.platform.api import CudaFamilyDeviceSpec

__all__ = ["CudaDeviceSpec"]


class CudaDeviceSpec(CudaFamilyDeviceSpec):
    """CUDA build of torch: ``torch.cuda`` available and ``torch.version.cuda`` set."""

    name = "cuda"
    ops_class = "lmcache.devices.cuda.device_ops:CudaDeviceOps"
    pin_memory_class = "lmcache.devices.cuda.pin_memory:CudaPinMemoryBackend"
    torch_version_attr = "cuda"
