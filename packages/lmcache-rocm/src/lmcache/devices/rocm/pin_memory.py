"""``RocmPinMemoryBackend``: hipHostRegister/hipHostUnregister through libamdhip64."""

from __future__ import annotations

import ctypes
from typing import Any, ClassVar

from lmcache.v1.platform.base.pin_memory import HostRegisterPinMemoryBackend


class RocmPinMemoryBackend(HostRegisterPinMemoryBackend):
    library_names: ClassVar[tuple[str, ...]] = (
        "libamdhip64.so",
        "libamdhip64.so.6",
        "libamdhip64.so.5",
    )
    runtime_name: ClassVar[str] = "HIP runtime"
    register_symbol: ClassVar[str] = "hipHostRegister"
    unregister_symbol: ClassVar[str] = "hipHostUnregister"

    def _load_runtime(self) -> Any:
        lib = super()._load_runtime()
        lib.hipGetLastError.argtypes = []
        lib.hipGetLastError.restype = ctypes.c_int
        return lib

    def _clear_error(self, runtime: Any) -> None:
        # A failed call leaves a sticky error; clear it so later HIP calls are clean.
        runtime.hipGetLastError()

    @property
    def is_pin_supported(self) -> bool:
        try:
            import torch

            return getattr(torch.version, "hip", None) is not None and bool(
                torch.cuda.is_available()
            )
        except Exception:
            return False
