"""``MusaPinMemoryBackend``: musaHostRegister/musaHostUnregister through libmusart."""

from __future__ import annotations

import ctypes
from typing import Any

from lmcache.utils import init_logger
from lmcache.v1.platform.base.pin_memory import PinMemoryBackend

logger = init_logger(__name__)

_LIB_NAMES = ("libmusart.so", "libmusart.so.4", "libmusart.so.3")


def _load_musart() -> Any:
    last: OSError | None = None
    for name in _LIB_NAMES:
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError as exc:
            last = exc
    else:
        raise OSError(f"no MUSA runtime library found ({', '.join(_LIB_NAMES)}): {last}")
    lib.musaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.musaHostRegister.restype = ctypes.c_int
    lib.musaHostUnregister.argtypes = [ctypes.c_void_p]
    lib.musaHostUnregister.restype = ctypes.c_int
    return lib


class MusaPinMemoryBackend(PinMemoryBackend):
    def __init__(self) -> None:
        self._lib: Any = None

    def _runtime(self) -> Any:
        if self._lib is None:
            self._lib = _load_musart()
        return self._lib

    @property
    def is_pin_supported(self) -> bool:
        try:
            self._runtime()
            return True
        except OSError:
            return False

    def pin_memory(self, ptr: int, size: int, flags: int = 0) -> bool:
        try:
            err = self._runtime().musaHostRegister(ctypes.c_void_p(ptr), size, flags)
        except OSError as exc:
            logger.warning("musaHostRegister(%#x, %d) unavailable: %s", ptr, size, exc)
            return False
        if int(err) != 0:
            logger.warning("musaHostRegister(%#x, %d) failed with error %s", ptr, size, err)
            return False
        return True

    def unpin_memory(self, ptr: int) -> bool:
        try:
            err = self._runtime().musaHostUnregister(ctypes.c_void_p(ptr))
        except OSError as exc:
            logger.warning("musaHostUnregister(%#x) unavailable: %s", ptr, exc)
            return False
        return int(err) == 0
