"""``CudaPinMemoryBackend``: cudaHostRegister/cudaHostUnregister of existing host memory."""

from __future__ import annotations

from typing import Any, ClassVar

from lmcache.devices.cuda.device_ops import CudaDeviceOps
from lmcache.v1.platform.base.pin_memory import HostRegisterPinMemoryBackend


class CudaPinMemoryBackend(HostRegisterPinMemoryBackend):
    library_names: ClassVar[tuple[str, ...]] = CudaDeviceOps.runtime_library_names
    runtime_name: ClassVar[str] = "CUDA runtime"
    register_symbol: ClassVar[str] = "cudaHostRegister"
    unregister_symbol: ClassVar[str] = "cudaHostUnregister"

    def _load_runtime(self) -> Any:
        import torch

        try:
            return torch.cuda.cudart()
        except Exception:
            return super()._load_runtime()  # torch builds without cudart()

    @property
    def is_pin_supported(self) -> bool:
        try:
            import torch

            return bool(torch.cuda.is_available())
        except Exception:
            return False
