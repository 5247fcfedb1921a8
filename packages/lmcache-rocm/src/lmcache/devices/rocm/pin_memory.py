"""``RocmPinMemoryBackend``: hipHostRegister/hipHostUnregister through libamdhip64."""

from __future__ import annotations

import ctypes
from typing import Any

from lmcache.utils import init_logger
from lmcache.v1.platform.base.pin_memory import PinMemoryBackend

logger = init_logger(__name__)

_LIB_NAMES = ("libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5")


class RocmPinMemoryBackend(PinMemoryBackend):
    def __init__(self) -> None:
        self._lib: Any = None

    def _hip(self) -> Any:
        if self._lib is None:
            last: OSError | None = None
            for name in _LIB_NAMES:
                try:
                    lib = ctypes.CDLL(name)
                    break
                except OSError as exc:
                    last = exc
            else:
                raise OSError(f"no HIP runtime library found ({', '.join(_LIB_NAMES)}): {last}")
            lib.hipHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.hipHostRegister.restype = ctypes.c_int
            lib.hipHostUnregister.argtypes = [ctypes.c_void_p]
            lib.hipHostUnregister.restype = ctypes.c_int
            # A failed call leaves a sticky error; clear it so later HIP calls are clean.
            lib.hipGetLastError.argtypes = []
            lib.hipGetLastError.restype = ctypes.c_int
            self._lib = lib
        return self._lib

    @property
    def is_pin_supported(self) -> bool:
        try:
            import torch

            return getattr(torch.version, "hip", None) is not None and bool(
                torch.cuda.is_available()
            )
        except Exception:
            return False

    def pin_memory(self, ptr: int, size: int, flags: int = 0) -> bool:
        try:
            lib = self._hip()
        except OSError as exc:
            logger.warning("hipHostRegister(%#x, %d) unavailable: %s", ptr, size, exc)
            return False
        err = lib.hipHostRegister(ctypes.c_void_p(ptr), size, flags)
        if err != 0:
            lib.hipGetLastError()
            logger.warning("hipHostRegister(%#x, %d) failed with error %d", ptr, size, err)
            return False
        return True

    def unpin_memory(self, ptr: int) -> bool:
        try:
            lib = self._hip()
        except OSError as exc:
            logger.warning("hipHostUnregister(%#x) unavailable: %s", ptr, exc)
            return False
        err = lib.hipHostUnregister(ctypes.c_void_p(ptr))
        if err != 0:
            lib.hipGetLastError()
        return err == 0
