"""``CudaFamilyDeviceSpec``: what CUDA and ROCm (both ``torch.cuda``) share."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcache.v1.platform.base.device_spec import DeviceSpec

if TYPE_CHECKING:
    from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper


class CudaFamilyDeviceSpec(DeviceSpec):
    """``torch.cuda`` device with LMCache-driven IPC (wrapper, event IPC, cache context).

    Subclasses declare ``name``, ``ops_class`` and ``torch_version_attr`` (which build of
    torch they run on).
    """

    torch_device_type = "cuda"
    torch_module = "cuda"
    ops_class = "lmcache.v1.platform.cuda_family.device_ops:CudaFamilyDeviceOps"
    # Both flags and the default are explicit (docs/design/platform.md#capability-flags): no bridge
    # guessing.
    lmcache_driven = True
    stream_handle_attr = "cuda_stream"
    event_ipc = True
    cache_context_class = "lmcache.v1.platform.cuda_family.cache_context:GPUCacheContext"
    # The ``torch.version`` attribute a torch build for this backend sets: "cuda" (CUDA) or
    # "hip" (ROCm). Both builds answer to ``torch.cuda``; at most one sets either.
    torch_version_attr = "cuda"

    def is_available(self) -> bool:
        if not type(self).name:  # the shared layer itself is no backend
            return False
        try:
            import torch

            built_for_it = getattr(torch.version, self.torch_version_attr, None) is not None
            return built_for_it and bool(torch.cuda.is_available())
        except Exception:
            return False

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


def _ipc_policy() -> Any:
    try:
        from lmcache.v1.platform.ipc_policy import get_ipc_policy
    except ImportError:
        return None
    return get_ipc_policy()
