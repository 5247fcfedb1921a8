"""Cambricon MLU backend (``lmcache-mlu``): entry point ``mlu``.

Engine-driven only, pure Python over ``torch_mlu`` tensor ops. Select it with
``LMCACHE_DEVICE_BACKEND=mlu`` and ``LMCACHE_MP_TRANSFER_MODE=engine_driven``; a
CPU-only LMCache server needs neither.
"""

from __future__ import annotations

from lmcache.v1.platform.base.device_spec import DeviceSpec

__all__ = ["MluDeviceSpec"]


class MluDeviceSpec(DeviceSpec):
    """``torch.mlu``, registered by importing ``torch_mlu``.

    Engine-driven only: no IPC wrapper, event backend, cache context or pinning
    (arbitrary host-memory registration is unsupported, so SHM D2H is synchronous).
    """

    name = "mlu"
    vendor_module = "torch_mlu"
    ops_class = "lmcache.devices.mlu.device_ops:MluDeviceOps"
    lmcache_driven = False
    stream_handle_attr = "mlu_stream"
