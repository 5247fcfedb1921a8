"""CPU ops: the torch baseline plus zero-copy host views of raw addresses."""

from __future__ import annotations

from typing import Any, ClassVar

from lmcache.v1.platform.base.device_ops import DeviceOps


class CpuDeviceOps(DeviceOps):
    device_type: ClassVar[str] = "cpu"
    kv_transfer_operands: ClassVar[str | None] = "tensor"

    def tensor_from_ptr(self, ptr: Any, shape: Any, dtype: Any, device: Any = None) -> Any:
        from lmcache.v1.platform.torch_ops import host_tensor_from_ptr

        if not ptr:
            raise ValueError("tensor_from_ptr: ptr is 0 (null address)")
        return host_tensor_from_ptr(int(ptr), shape, dtype)
