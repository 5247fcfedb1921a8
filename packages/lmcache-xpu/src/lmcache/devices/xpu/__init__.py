"""Intel XPU backend (``lmcache-xpu``): entry point ``xpu`` of ``lmcache.device_plugins``.

Engine-driven only. Ops come from the torch baseline unless the optional SYCL module
``lmcache.devices.xpu.xpu_ops`` is importable (it is not built by this wheel).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcache.v1.platform.base.device_spec import DeviceSpec
from lmcache.v1.platform.transfer_mode import MPTransferMode

if TYPE_CHECKING:
    from lmcache.v1.platform.base.device_ops import DeviceOps
    from lmcache.v1.platform.base.pin_memory import PinMemoryBackend

__all__ = ["XpuDeviceSpec"]


class XpuDeviceSpec(DeviceSpec):
    @property
    def device_type(self) -> str:
        return "xpu"

    @property
    def backend_name(self) -> str:
        return "xpu"

    @property
    def torch_module_name(self) -> str:
        return "xpu"

    @property
    def ops_cls(self) -> type[DeviceOps]:
        from lmcache.devices.xpu.device_ops import XpuDeviceOps

        return XpuDeviceOps

    def is_available(self) -> bool:
        try:
            import torch

            return hasattr(torch, "xpu") and bool(torch.xpu.is_available())
        except Exception:
            return False

    # Engine-driven only: no IPC wrapper, event backend or cache context.
    def is_lmcache_driven_available(self) -> bool:
        return False

    def is_handle_transfer_available(self) -> bool:
        return False

    def default_mp_transfer_mode(self) -> MPTransferMode:
        return MPTransferMode.ENGINE_DRIVEN

    def get_stream_handle(self, stream: Any) -> int:
        return int(stream.sycl_queue)

    @property
    def pin_memory_backend(self) -> type[PinMemoryBackend] | None:
        # Only the native module can register host memory with the SYCL runtime.
        from lmcache.devices.xpu.device_ops import native_module

        module = native_module()
        if module is None or not hasattr(module, "xpu_host_register"):
            return None
        from lmcache.devices.xpu.pin_memory import XpuPinMemoryBackend

        return XpuPinMemoryBackend
