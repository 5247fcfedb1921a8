"""Core's built-in CPU device: the fallback when no accelerator is detected.

Never auto-selected (``is_available()`` is False); its ops, SHM IPC wrapper and cache
context make the engine-driven and the (opt-in) LMCache-driven paths work on CPU.
"""

from __future__ import annotations

from typing import Any

from lmcache.v1.platform.base.device_spec import DeviceSpec
from lmcache.v1.platform.transfer_mode import MPTransferMode

__all__ = ["CPUCacheContext", "CpuDeviceOps", "CpuDeviceSpec", "CpuShmTensorWrapper"]


class CpuDeviceSpec(DeviceSpec):
    _event_backend_cache: Any = None

    @property
    def device_type(self) -> str:
        return "cpu"

    @property
    def backend_name(self) -> str:
        return "cpu"

    @property
    def torch_module_name(self) -> str:
        return "cpu"

    def is_available(self) -> bool:
        return False  # CPU is reached only as the fallback

    @property
    def ops_cls(self) -> type:
        from lmcache.v1.platform.devices.cpu.device_ops import CpuDeviceOps

        return CpuDeviceOps

    @property
    def ipc_wrapper_cls(self) -> type:
        from lmcache.v1.platform.devices.cpu.ipc_wrapper import CpuShmTensorWrapper

        return CpuShmTensorWrapper

    @property
    def event_ipc_backend(self) -> Any:
        backend = self._event_backend_cache
        if backend is None:
            from lmcache.v1.platform.base.event_ipc import DefaultEventIPCBackend
            from lmcache.v1.platform.devices.cpu.stub_cpu_device import StubCPUDevice

            backend = DefaultEventIPCBackend(StubCPUDevice("cpu"), "cpu")
            self._event_backend_cache = backend
        return backend

    def is_lmcache_driven_available(self) -> bool:
        return True

    def is_handle_transfer_available(self) -> bool:
        return True

    def default_mp_transfer_mode(self) -> MPTransferMode:
        return MPTransferMode.ENGINE_DRIVEN  # SHM LMCache-driven is opt-in

    def get_stream_handle(self, stream: Any) -> int:
        return 0

    def create_cache_context(self, *args: Any, **kwargs: Any) -> Any:
        from lmcache.v1.platform.devices.cpu.cache_context import CPUCacheContext

        return CPUCacheContext(*args, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "CpuDeviceOps":
        from lmcache.v1.platform.devices.cpu.device_ops import CpuDeviceOps

        return CpuDeviceOps
    if name == "CpuShmTensorWrapper":
        from lmcache.v1.platform.devices.cpu.ipc_wrapper import CpuShmTensorWrapper

        return CpuShmTensorWrapper
    if name == "CPUCacheContext":
        from lmcache.v1.platform.devices.cpu.cache_context import CPUCacheContext

        return CPUCacheContext
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
