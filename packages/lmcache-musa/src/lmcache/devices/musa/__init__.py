"""Moore Threads MUSA backend (``lmcache-musa``): entry point ``musa``.

Engine-driven by default. LMCache-driven needs ``LMCACHE_MUSA_HANDLE_TRANSFER`` plus
memory and event IPC in ``torch_musa`` *and* a MUSA IPC wrapper, event backend and cache
context, which are not implemented yet (LATER): until then the flag stays False.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from lmcache.v1.platform.base.device_spec import DeviceSpec
from lmcache.v1.platform.transfer_mode import MPTransferMode

if TYPE_CHECKING:
    from lmcache.v1.platform.base.device_ops import DeviceOps
    from lmcache.v1.platform.base.pin_memory import PinMemoryBackend

__all__ = ["MusaDeviceSpec"]

HANDLE_TRANSFER_ENV_VAR = "LMCACHE_MUSA_HANDLE_TRANSFER"
_TRUE = {"1", "true", "yes", "on"}


class MusaDeviceSpec(DeviceSpec):
    @property
    def device_type(self) -> str:
        return "musa"

    @property
    def backend_name(self) -> str:
        return "musa"

    @property
    def torch_module_name(self) -> str:
        return "musa"

    @property
    def ops_cls(self) -> type[DeviceOps]:
        from lmcache.devices.musa.device_ops import MusaDeviceOps

        return MusaDeviceOps

    def is_available(self) -> bool:
        try:
            import torch

            try:
                import torch_musa  # noqa: F401  (registers torch.musa)
            except ImportError:
                pass
            return hasattr(torch, "musa") and bool(torch.musa.is_available())
        except Exception:
            return False

    def get_stream_handle(self, stream: Any) -> int:
        return int(stream.musa_stream)

    def handle_transfer_prerequisites(self) -> bool:
        """Opt-in env var set, and torch_musa offers memory IPC and event IPC."""
        if os.environ.get(HANDLE_TRANSFER_ENV_VAR, "").strip().lower() not in _TRUE:
            return False
        try:
            import torch

            musa = torch.musa
            ipc = getattr(musa, "ipc", None)
            if not (hasattr(ipc, "export_tensor") and hasattr(ipc, "open_tensor")):
                return False
            from lmcache.v1.platform.base.event_ipc import DefaultEventIPCBackend

            DefaultEventIPCBackend(event_module=musa, device_type="musa").check_event_support(
                "musa"
            )
            return True
        except Exception:
            return False

    def is_lmcache_driven_available(self) -> bool:
        # MusaIPCWrapper / MusaEventIPCBackend / MUSACacheContext are LATER: without them
        # the router's hard checks would fail later, so the capability is off for now.
        return self.handle_transfer_prerequisites() and self.ipc_wrapper_cls is not None

    def is_handle_transfer_available(self) -> bool:
        return self.is_lmcache_driven_available()

    def default_mp_transfer_mode(self) -> MPTransferMode:
        return MPTransferMode.ENGINE_DRIVEN

    @property
    def pin_memory_backend(self) -> type[PinMemoryBackend]:
        from lmcache.devices.musa.pin_memory import MusaPinMemoryBackend

        return MusaPinMemoryBackend
