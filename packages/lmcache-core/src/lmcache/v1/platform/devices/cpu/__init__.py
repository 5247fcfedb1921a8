"""Core's built-in CPU device: the fallback when no accelerator is detected.

Never auto-selected (``is_available()`` is False); its ops, SHM IPC wrapper and cache
context make the engine-driven and the (opt-in) LMCache-driven paths work on CPU.
"""

from __future__ import annotations

from typing import Any

from lmcache.utils.lazy import lazy_attributes
from lmcache.v1.platform.base.device_spec import DeviceSpec
from lmcache.v1.platform.transfer_mode import MPTransferMode

__all__ = ["CPUCacheContext", "CpuDeviceOps", "CpuDeviceSpec", "CpuShmTensorWrapper"]


class CpuDeviceSpec(DeviceSpec):
    name = "cpu"
    ops_class = "lmcache.v1.platform.devices.cpu.device_ops:CpuDeviceOps"
    ipc_wrapper_class = "lmcache.v1.platform.devices.cpu.ipc_wrapper:CpuShmTensorWrapper"
    event_ipc = True  # over the stub CPU device
    cache_context_class = "lmcache.v1.platform.devices.cpu.cache_context:CPUCacheContext"
    lmcache_driven = True

    def is_available(self) -> bool:
        return False  # CPU is reached only as the fallback

    def default_mp_transfer_mode(self) -> MPTransferMode:
        return MPTransferMode.ENGINE_DRIVEN  # SHM LMCache-driven is opt-in

    def get_stream_handle(self, stream: Any) -> int:
        return 0


__getattr__ = lazy_attributes(
    __name__,
    {
        "CpuDeviceOps": ("lmcache.v1.platform.devices.cpu.device_ops", "CpuDeviceOps"),
        "CpuShmTensorWrapper": (
            "lmcache.v1.platform.devices.cpu.ipc_wrapper",
            "CpuShmTensorWrapper",
        ),
        "CPUCacheContext": ("lmcache.v1.platform.devices.cpu.cache_context", "CPUCacheContext"),
    },
)
