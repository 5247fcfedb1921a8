"""Shared CUDA/HIP layer over ``torch.cuda`` (docs/design/platform.md#device-cuda), used by the
``lmcache-cuda`` and ``lmcache-rocm`` wheels (device wheels never import each other).

Importing this package is cheap: only the spec is loaded eagerly (entry-point modules
import it while the registry is built); ops, IPC wrapper and cache context load lazily.
"""

from __future__ import annotations

from lmcache.utils.lazy import lazy_attributes
from lmcache.v1.platform.cuda_family.spec import CudaFamilyDeviceSpec

__all__ = [
    "CudaFamilyDeviceOps",
    "CudaFamilyDeviceSpec",
    "CudaIPCWrapper",
    "GPUCacheContext",
]

__getattr__ = lazy_attributes(
    __name__,
    {
        "CudaFamilyDeviceOps": (
            "lmcache.v1.platform.cuda_family.device_ops",
            "CudaFamilyDeviceOps",
        ),
        "CudaIPCWrapper": ("lmcache.v1.platform.cuda_family.ipc_wrapper", "CudaIPCWrapper"),
        "GPUCacheContext": ("lmcache.v1.platform.cuda_family.cache_context", "GPUCacheContext"),
    },
)
