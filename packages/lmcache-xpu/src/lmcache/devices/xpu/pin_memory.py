"""``XpuPinMemoryBackend``: host registration through the SYCL module's helpers."""

from __future__ import annotations

from lmcache.v1.platform.api import init_logger
from lmcache.v1.platform.base.pin_memory import PinMemoryBackend

logger = init_logger(__name__)


class XpuPinMemoryBackend(PinMemoryBackend):
    @property
    def is_pin_supported(self) -> bool:
        from lmcache.devices.xpu.device_ops import native_module

        module = native_module()
        return module is not None and hasattr(module, "xpu_host_register")

    def pin_memory(self, ptr: int, size: int, flags: int = 0) -> bool:
        from lmcache.devices.xpu.device_ops import native_module

        module = native_module()
        if module is None or not hasattr(module, "xpu_host_register"):
            return False
        try:
            return bool(module.xpu_host_register(ptr, size))
        except Exception as exc:
            logger.warning("xpu_host_register(%#x, %d) failed: %s", ptr, size, exc)
            return False

    def unpin_memory(self, ptr: int) -> bool:
        from lmcache.devices.xpu.device_ops import native_module

        module = native_module()
        unregister = getattr(module, "xpu_host_unregister", None)
        if unregister is None:
            return False
        try:
            return bool(unregister(ptr))
        except Exception as exc:
            logger.warning("xpu_host_unregister(%#x) failed: %s", ptr, exc)
            return False
