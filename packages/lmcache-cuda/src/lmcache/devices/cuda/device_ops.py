"""``CudaDeviceOps``: the CUDA-family ops with this wheel's compiled kernels."""

from __future__ import annotations

from typing import ClassVar

from lmcache.v1.platform.api import CudaFamilyDeviceOps


class CudaDeviceOps(CudaFamilyDeviceOps):
    # Present when the wheel build found nvcc (LMCACHE_BUILD_CUDA=1 forces it); otherwise
    # ensure_native() logs one warning and the torch baseline answers.
    native_module_name: ClassVar[str | None] = "lmcache.devices.cuda.cuda_ops"
