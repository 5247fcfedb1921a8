"""Moore Threads MUSA backend (``lmcache-musa``): entry point ``musa``.

Engine-driven by default. LMCache-driven needs ``LMCACHE_MUSA_HANDLE_TRANSFER`` plus
memory and event IPC in ``torch_musa`` *and* a MUSA IPC wrapper, event backend and cache
context, which are not implemented yet (LATER): until then the flag stays False.
"""

from __future__ import annotations

import os

from lmcache.v1.platform.api import MPTransferMode
from lmcache.v1.platform.base.device_spec import DeviceSpec

__all__ = ["MusaDeviceSpec"]

HANDLE_TRANSFER_ENV_VAR = "LMCACHE_MUSA_HANDLE_TRANSFER"
_TRUE = {"1", "true", "yes", "on"}


class MusaDeviceSpec(DeviceSpec):
    name = "musa"
    ops_class = "lmcache.devices.musa.device_ops:MusaDeviceOps"
    stream_handle_attr = "musa_stream"
    pin_memory_class = "lmcache.devices.musa.pin_memory:MusaPinMemoryBackend"

    # torch_musa is optional here (a torch build may register torch.musa itself), so the
    # declarative vendor_module, whose import failure means unavailable, does not fit.
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
