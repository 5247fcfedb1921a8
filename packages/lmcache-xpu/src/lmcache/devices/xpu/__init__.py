"""Intel XPU backend (``lmcache-xpu``): entry point ``xpu`` of ``lmcache.device_plugins``.

Engine-driven only. Ops come from the torch baseline unless the optional SYCL module
``lmcache.devices.xpu.xpu_ops`` is importable (it is not built by this wheel).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache.v1.platform.base.device_spec import DeviceSpec

if TYPE_CHECKING:
    from lmcache.v1.platform.base.pin_memory import PinMemoryBackend

__all__ = ["XpuDeviceSpec"]


class XpuDeviceSpec(DeviceSpec):
    """``torch.xpu`` (stock torch); engine-driven only: no IPC wrapper, event backend or
    cache context. Declarative, except pinning, which depends on the native module."""

    name = "xpu"
    ops_class = "lmcache.devices.xpu.device_ops:XpuDeviceOps"
    lmcache_driven = False
    stream_handle_attr = "sycl_queue"

    @property
    def pin_memory_backend(self) -> type[PinMemoryBackend] | None:
        # Only the native module can register host memory with the SYCL runtime.
        from lmcache.devices.xpu.device_ops import native_module

        module = native_module()
        if module is None or not hasattr(module, "xpu_host_register"):
            return None
        from lmcache.devices.xpu.pin_memory import XpuPinMemoryBackend

        return XpuPinMemoryBackend
