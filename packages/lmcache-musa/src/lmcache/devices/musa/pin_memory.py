"""``MusaPinMemoryBackend``: musaHostRegister/musaHostUnregister through libmusart."""

from __future__ import annotations

from typing import ClassVar

from lmcache.v1.platform.base.pin_memory import HostRegisterPinMemoryBackend


class MusaPinMemoryBackend(HostRegisterPinMemoryBackend):
    """Supported exactly when libmusart loads (the base ``is_pin_supported``)."""

    library_names: ClassVar[tuple[str, ...]] = ("libmusart.so", "libmusart.so.4", "libmusart.so.3")
    runtime_name: ClassVar[str] = "MUSA runtime"
    register_symbol: ClassVar[str] = "musaHostRegister"
    unregister_symbol: ClassVar[str] = "musaHostUnregister"
