"""``RocmDeviceOps``: the CUDA-family ops with the HIP build of the same kernels."""

from __future__ import annotations

from typing import ClassVar

from lmcache.v1.platform.api import CudaFamilyDeviceOps


class RocmDeviceOps(CudaFamilyDeviceOps):
    # Built when the wheel's build finds hipcc (LMCACHE_BUILD_HIP=1 forces it); otherwise
    # the torch baseline answers.
    native_module_name: ClassVar[str | None] = "lmcache.devices.rocm.cuda_ops"
    native_build_env: ClassVar[str] = "LMCACHE_BUILD_HIP"
    # Also the pin backend's candidates (one list of HIP runtime libraries).
    runtime_library_names: ClassVar[tuple[str, ...]] = (
        "libamdhip64.so",
        "libamdhip64.so.6",
        "libamdhip64.so.5",
    )
    runtime_memcpy_symbol: ClassVar[str] = "hipMemcpy"
