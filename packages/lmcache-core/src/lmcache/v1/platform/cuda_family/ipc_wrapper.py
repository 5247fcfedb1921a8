"""CUDA IPC wrappers (wire tag ``cuda``): torch storage IPC of one engine KV tensor.

The wire carries the 8-tuple of ``UntypedStorage._share_cuda_()`` (LMCache 0.5.6 field
layout) plus core's metadata; the receiver maps ``device_uuid`` to its own ordinal, so
worker and server may see the GPUs in different orders.
"""

from __future__ import annotations

from typing import Any, ClassVar

from lmcache.v1.platform.base.ipc_wrapper import (
    DeviceIPCWrapper,
    device_index_for_uuid,
    device_uuid_for_index,
)

# (device, handle, storage_size_bytes, storage_offset_bytes, ref_counter_handle,
#  ref_counter_offset, event_handle, event_sync_required)
_HANDLE_TYPES = (int, bytes, int, int, bytes, int, bytes, bool)


def _check_handle(handle: Any) -> tuple:
    if not isinstance(handle, (list, tuple)) or len(handle) != len(_HANDLE_TYPES):
        raise ValueError(
            f"cuda IPC wrapper: 'handle' must be the 8-tuple of storage._share_cuda_(), "
            f"got {handle!r:.120}"
        )
    out = []
    for i, (value, want) in enumerate(zip(handle, _HANDLE_TYPES, strict=True)):
        if want is bool and isinstance(value, int):
            value = bool(value)
        elif want is bytes and isinstance(value, (bytearray, memoryview)):
            value = bytes(value)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ValueError(
                f"cuda IPC wrapper: handle[{i}]={value!r:.60} should be {want.__name__}"
            )
        out.append(value)
    return tuple(out)


class CudaIPCWrapper(DeviceIPCWrapper):
    """Default CUDA wrapper: PyTorch storage IPC (cudaIpcMemHandle under the hood)."""

    device_type: ClassVar[str] = "cuda"
    wire_tag: ClassVar[str | None] = "cuda"

    def __init__(self, tensor: Any = None) -> None:
        super().__init__(tensor)
        if tensor is not None:
            import torch

            index = tensor.device.index
            if index is None:
                index = torch.cuda.current_device()
            self.handle = _check_handle(tensor.untyped_storage()._share_cuda_())
            self.device_uuid = device_uuid_for_index(torch.cuda, index)

    def to_tensor(self) -> Any:
        import torch

        handle = list(self.handle)
        if self.device_uuid:
            handle[0] = device_index_for_uuid(torch.cuda, self.device_uuid)
        storage = torch.UntypedStorage._new_shared_cuda(*handle)
        out = torch.empty(0, dtype=self.dtype, device=torch.device("cuda", handle[0]))
        out.set_(storage, self.storage_offset, self.shape, self.stride)
        return out

    def to_wire(self) -> dict[str, Any]:
        return {"handle": list(self.handle)}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> CudaIPCWrapper:
        wrapper = cls()
        wrapper.handle = _check_handle(data.get("handle"))
        return wrapper


class _LaterCudaIPCWrapper(DeviceIPCWrapper):
    device_type: ClassVar[str] = "cuda"
    _flag: ClassVar[str] = ""

    @classmethod
    def wrap(cls, tensor: Any) -> DeviceIPCWrapper:
        raise NotImplementedError(
            f"{cls.__name__} (wire tag {cls.wire_tag!r}) is not implemented yet; start "
            f"lmcache server without {cls._flag} to use the default CUDA storage IPC"
        )


class RawCudaIPCWrapper(_LaterCudaIPCWrapper):
    """LATER: raw cudaIpcMemHandle for --isolated-ipc."""

    wire_tag: ClassVar[str | None] = "cuda_raw"
    _flag: ClassVar[str] = "--isolated-ipc"


class VmmCudaIPCWrapper(_LaterCudaIPCWrapper):
    """LATER: CUDA VMM export for --use-vmm-api."""

    wire_tag: ClassVar[str | None] = "cuda_vmm"
    _flag: ClassVar[str] = "--use-vmm-api"
