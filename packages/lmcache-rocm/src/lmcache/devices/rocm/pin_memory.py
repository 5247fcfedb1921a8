"""``RocmPinMemoryBackend``: hipHostRegister/hipHostUnregister through libamdhip64."""

from __future__ import annotations

import ctypes
from typing import Any, ClassVar

from lmcache.devices.rocm.device_ops import RocmDeviceOps
from lmcache.v1.platform.base.pin_memory import HostRegisterPinMemoryBackend


class RocmPinMemoryBackend(HostRegisterPinMemoryBackend):
    library_names: ClassVar[tuple[str, ...]] = RocmDeviceOps.runtime_library_names
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
        # Exactly when the backend is: a HIP build of torch with a visible device.
        from lmcache.devices.rocm import RocmDeviceSpec

        return RocmDeviceSpec().is_available()
