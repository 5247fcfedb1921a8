"""``CudaPinMemoryBackend``: cudaHostRegister/cudaHostUnregister of existing host memory."""

from __future__ import annotations

import ctypes
from typing import Any

from lmcache.utils import init_logger
from lmcache.v1.platform.base.pin_memory import PinMemoryBackend

logger = init_logger(__name__)

_LIB_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")


class _CtypesCudart:
    """The two calls we need from libcudart, for torch builds without ``cudart()``."""

    def __init__(self) -> None:
        last: OSError | None = None
        for name in _LIB_NAMES:
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError as exc:
                last = exc
        else:
            raise OSError(f"no CUDA runtime library found ({', '.join(_LIB_NAMES)}): {last}")
        self._register = lib.cudaHostRegister
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._register.restype = ctypes.c_int
        self._unregister = lib.cudaHostUnregister
        self._unregister.argtypes = [ctypes.c_void_p]
        self._unregister.restype = ctypes.c_int

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        return self._register(ctypes.c_void_p(ptr), size, flags)

    def cudaHostUnregister(self, ptr: int) -> int:
        return self._unregister(ctypes.c_void_p(ptr))


class CudaPinMemoryBackend(PinMemoryBackend):
    def __init__(self) -> None:
        self._rt: Any = None

    def _runtime(self) -> Any:
        if self._rt is None:
            import torch

            try:
                self._rt = torch.cuda.cudart()
            except Exception:
                self._rt = _CtypesCudart()
        return self._rt

    @property
    def is_pin_supported(self) -> bool:
        try:
            import torch

            return bool(torch.cuda.is_available())
        except Exception:
            return False

    def pin_memory(self, ptr: int, size: int, flags: int = 0) -> bool:
        try:
            err = self._runtime().cudaHostRegister(ptr, size, flags)
        except Exception as exc:
            logger.warning("cudaHostRegister(%#x, %d) unavailable: %s", ptr, size, exc)
            return False
        if int(err) != 0:
            logger.warning("cudaHostRegister(%#x, %d) failed with error %s", ptr, size, err)
            return False
        return True

    def unpin_memory(self, ptr: int) -> bool:
        try:
            err = self._runtime().cudaHostUnregister(ptr)
        except Exception as exc:
            logger.warning("cudaHostUnregister(%#x) unavailable: %s", ptr, exc)
            return False
        return int(err) == 0
