"""Cambricon MLU backend (``lmcache-mlu``): entry point ``mlu``.

Engine-driven only, pure Python over ``torch_mlu`` tensor ops. Select it with
``LMCACHE_DEVICE_BACKEND=mlu`` and ``LMCACHE_MP_TRANSFER_MODE=engine_driven``; a
CPU-only LMCache server needs neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcache.v1.platform.base.device_spec import DeviceSpec
from lmcache.v1.platform.transfer_mode import MPTransferMode

if TYPE_CHECKING:
    from lmcache.v1.platform.base.device_ops import DeviceOps

__all__ = ["MluDeviceSpec"]


class MluDeviceSpec(DeviceSpec):
    @property
    def device_type(self) -> str:
        return "mlu"

    @property
    def backend_name(self) -> str:
        return "mlu"

    @property
    def torch_module_name(self) -> str:
        return "mlu"

    @property
    def ops_cls(self) -> type[DeviceOps]:
        from lmcache.devices.mlu.device_ops import MluDeviceOps

        return MluDeviceOps

    def is_available(self) -> bool:
        try:
            import torch
            import torch_mlu  # noqa: F401  (registers torch.mlu)

            return bool(torch.mlu.is_available())
        except Exception:
            return False

    # Engine-driven only: no IPC wrapper, event backend, cache context or pinning
    # (arbitrary host-memory registration is unsupported, so SHM D2H is synchronous).
    def is_lmcache_driven_available(self) -> bool:
        return False

    def is_handle_transfer_available(self) -> bool:
        return False

    def default_mp_transfer_mode(self) -> MPTransferMode:
        return MPTransferMode.ENGINE_DRIVEN

    def get_stream_handle(self, stream: Any) -> int:
        return int(stream.mlu_stream)
