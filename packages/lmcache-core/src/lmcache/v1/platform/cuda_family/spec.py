"""``CudaFamilyDeviceSpec``: what CUDA and ROCm (both ``torch.cuda``) share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcache.v1.platform.base.device_spec import DeviceSpec
from lmcache.v1.platform.transfer_mode import MPTransferMode

if TYPE_CHECKING:
    from lmcache.v1.platform.base.device_ops import DeviceOps
    from lmcache.v1.platform.base.event_ipc import EventIPCBackend
    from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper


class CudaFamilyDeviceSpec(DeviceSpec):
    """``torch.cuda`` device with LMCache-driven IPC (wrapper, event IPC, cache context).

    Subclasses set ``backend_name`` and ``is_available`` (CUDA vs HIP build of torch).
    """

    _event_backend_cache: EventIPCBackend | None = None

    @property
    def device_type(self) -> str:
        return "cuda"

    @property
    def torch_module_name(self) -> str:
        return "cuda"

    @property
    def ops_cls(self) -> type[DeviceOps]:
        from lmcache.v1.platform.cuda_family.device_ops import CudaFamilyDeviceOps

        return CudaFamilyDeviceOps

    def is_available(self) -> bool:
        try:
            import torch

            return bool(torch.cuda.is_available())
        except Exception:
            return False

    # Both flags and the default are explicit (docs/design/platform.md#capability-flags): no bridge
    # guessing.
    def is_lmcache_driven_available(self) -> bool:
        return True

    def is_handle_transfer_available(self) -> bool:
        return True

    def default_mp_transfer_mode(self) -> MPTransferMode:
        return MPTransferMode.LMCACHE_DRIVEN

    def get_stream_handle(self, stream: Any) -> int:
        return int(stream.cuda_stream)

    @property
    def event_ipc_backend(self) -> EventIPCBackend:
        backend = self._event_backend_cache
        if backend is None:
            import torch

            from lmcache.v1.platform.base.event_ipc import DefaultEventIPCBackend

            backend = DefaultEventIPCBackend(event_module=torch.cuda, device_type=self.device_type)
            self._event_backend_cache = backend
        return backend

    @property
    def ipc_wrapper_cls(self) -> type[DeviceIPCWrapper]:
        # Choice per IPCPolicy (docs/design/platform.md#ipc-policy): VMM, else raw driver IPC, else
        # torch storage IPC (the default and the only one implemented so far).
        from lmcache.v1.platform.cuda_family import ipc_wrapper

        policy = _ipc_policy()
        if policy is not None and getattr(policy, "use_vmm_api", False):
            return ipc_wrapper.VmmCudaIPCWrapper
        if policy is not None and getattr(policy, "isolated_ipc", False):
            return ipc_wrapper.RawCudaIPCWrapper
        return ipc_wrapper.CudaIPCWrapper

    @property
    def ipc_wire_types(self) -> tuple[type[DeviceIPCWrapper], ...]:
        # Only wrappers that can cross the wire both ways; cuda_raw/cuda_vmm are LATER.
        from lmcache.v1.platform.cuda_family.ipc_wrapper import CudaIPCWrapper

        return (CudaIPCWrapper,)

    def create_cache_context(self, *args: Any, **kwargs: Any) -> Any:
        from lmcache.v1.platform.cuda_family.cache_context import GPUCacheContext

        return GPUCacheContext(*args, **kwargs)


def _ipc_policy() -> Any:
    try:
        from lmcache.v1.platform.ipc_policy import get_ipc_policy
    except ImportError:
        return None
    return get_ipc_policy()
