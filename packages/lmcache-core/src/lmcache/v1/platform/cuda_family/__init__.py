"""Shared CUDA/HIP layer over ``torch.cuda`` (docs/design/platform.md#device-cuda), used by the
``lmcache-cuda`` and ``lmcache-rocm`` wheels (device wheels never import each other).

Importing this package is cheap: only the spec is loaded eagerly (entry-point modules
import it while the registry is built); ops, IPC wrapper and cache context load lazily.
"""

from __future__ import annotations

from typing import Any

from lmcache.v1.platform.cuda_family.spec import CudaFamilyDeviceSpec

__all__ = [
    "CudaFamilyDeviceOps",
    "CudaFamilyDeviceSpec",
    "CudaIPCWrapper",
    "GPUCacheContext",
]

_LAZY = {
    "CudaFamilyDeviceOps": "lmcache.v1.platform.cuda_family.device_ops",
    "CudaIPCWrapper": "lmcache.v1.platform.cuda_family.ipc_wrapper",
    "GPUCacheContext": "lmcache.v1.platform.cuda_family.cache_context",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
