"""``XpuDeviceOps``: torch baseline, overlaid by the SYCL module when it is importable."""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

from lmcache.v1.platform.api import init_logger
from lmcache.v1.platform.base.device_ops import DeviceOps

logger = init_logger(__name__)

NATIVE_MODULE = "lmcache.devices.xpu.xpu_ops"

_native: dict[str, Any] = {}


def native_module() -> Any:
    """The SYCL module, or None when it is not importable (probed once per process)."""
    if "module" not in _native:
        try:
            _native["module"] = importlib.import_module(NATIVE_MODULE)
        except (ImportError, OSError) as exc:
            _native["module"] = None
            _native["error"] = exc
    return _native["module"]


class XpuDeviceOps(DeviceOps):
    device_type: ClassVar[str] = "xpu"
    # The baseline takes tensors; a bound SYCL module declares its own operands.
    kv_transfer_operands: ClassVar[str | None] = "tensor"

    def ensure_native(self) -> None:
        if self._native_bound:
            return
        self._native_bound = True
        module = native_module()
        if module is None:
            logger.warning(
                "XPU native module %s is not available (%s); using the torch baseline ops",
                NATIVE_MODULE,
                _native.get("error"),
            )
            return
        self.bind_native(module)
        if "multi_layer_block_kv_transfer" in dir(module):
            # SYCL kernels take device addresses, like the CUDA ones, unless they say otherwise.
            self.kv_transfer_operands = getattr(module, "KV_TRANSFER_OPERANDS", "pointer")
            self.max_objects_per_call = getattr(module, "MAX_OBJECTS_PER_CALL", None)
