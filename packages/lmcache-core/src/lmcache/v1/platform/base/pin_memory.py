"""Host-memory registration (pinning) contract; pinning is optional everywhere."""

from __future__ import annotations

import ctypes
from typing import Any, ClassVar

from lmcache.utils import init_logger
from lmcache.v1.platform.base.runtime_lib import load_first_library

logger = init_logger(__name__)

__all__ = ["HostRegisterPinMemoryBackend", "PinMemoryBackend"]


class PinMemoryBackend:
    """Base backend: pinning unsupported, every call answers False."""

    def pin_memory(self, ptr: int, size: int, flags: int = 0) -> bool:
        """Register ``size`` bytes of host memory at address ``ptr`` with the device runtime
        so copies to and from it can be asynchronous; ``flags`` is passed to the runtime
        (0 = its default). Returns whether it worked: callers (the shared-memory allocator,
        the engine-driven SHM context) fall back to pageable memory, never fail, on False."""
        return False

    def unpin_memory(self, ptr: int) -> bool:
        """Undo :meth:`pin_memory` for the region starting at ``ptr``; returns whether the
        runtime accepted it. Called before the memory is freed or unmapped."""
        return False

    @property
    def is_pin_supported(self) -> bool:
        """Whether :meth:`pin_memory` can work in this process (the runtime library loads);
        the allocator asks once before pinning its arena."""
        return False


class HostRegisterPinMemoryBackend(PinMemoryBackend):
    """Pinning through a vendor runtime's ``<x>HostRegister(ptr, size, flags)`` and
    ``<x>HostUnregister(ptr)`` (0 = success), loaded lazily with ctypes.

    Subclasses name the library candidates and the two symbols. A missing runtime or a
    failing call answers False with a WARNING; nothing raises.
    """

    library_names: ClassVar[tuple[str, ...]] = ()
    runtime_name: ClassVar[str] = ""  # for messages, e.g. "CUDA runtime"
    register_symbol: ClassVar[str] = ""
    unregister_symbol: ClassVar[str] = ""

    def __init__(self) -> None:
        self._rt: Any = None

    def _load_runtime(self) -> Any:
        """An object with the two symbols as callables taking plain ints."""
        lib = load_first_library(
            self.library_names, self.runtime_name, (self.register_symbol, self.unregister_symbol)
        )
        register = getattr(lib, self.register_symbol)
        register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        register.restype = ctypes.c_int
        unregister = getattr(lib, self.unregister_symbol)
        unregister.argtypes = [ctypes.c_void_p]
        unregister.restype = ctypes.c_int
        return lib

    def _runtime(self) -> Any:
        if self._rt is None:
            self._rt = self._load_runtime()
        return self._rt

    def _clear_error(self, runtime: Any) -> None:
        """Called after a failed call; runtimes with sticky errors reset them here."""

    @property
    def is_pin_supported(self) -> bool:
        """True when the vendor runtime library loads (it is loaded at most once)."""
        try:
            self._runtime()
        except OSError:
            return False
        return True

    def pin_memory(self, ptr: int, size: int, flags: int = 0) -> bool:
        """``<x>HostRegister(ptr, size, flags)``; a missing runtime or a non-zero error code
        logs a warning and answers False."""
        name = self.register_symbol
        try:
            runtime = self._runtime()
            err = getattr(runtime, name)(ptr, size, flags)
        except Exception as exc:
            logger.warning("%s(%#x, %d) unavailable: %s", name, ptr, size, exc)
            return False
        if int(err) != 0:
            self._clear_error(runtime)
            logger.warning("%s(%#x, %d) failed with error %s", name, ptr, size, err)
            return False
        return True

    def unpin_memory(self, ptr: int) -> bool:
        """``<x>HostUnregister(ptr)``; False (no log on an error code) when it fails."""
        name = self.unregister_symbol
        try:
            runtime = self._runtime()
            err = getattr(runtime, name)(ptr)
        except Exception as exc:
            logger.warning("%s(%#x) unavailable: %s", name, ptr, exc)
            return False
        if int(err) != 0:
            self._clear_error(runtime)
            return False
        return True
