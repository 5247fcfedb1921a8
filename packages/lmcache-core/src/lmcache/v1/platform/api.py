"""The device plugin API: everything a device wheel may import from lmcache-core, in one place.

A device wheel (``lmcache-cuda``, a vendor's ``lmcache-foo``) imports from core only:

- this module, which re-exports every name below;
- the LMCache 0.5.6 paths the device guide documents, listed in :data:`FACE_MODULES`
  (``lmcache.v1.platform.base.device_spec.DeviceSpec``, ``...base.device_ops.DeviceOps``,
  ``lmcache.v1.platform.torch_ops``, ``lmcache.v1.platform.ops_types``, ...).

Anything else in core is internal and may change in any release. Device wheels never import
the storage plugin API (``lmcache.v1.distributed.l2_adapters.api``) nor each other; code two
backends share (the ``torch.cuda`` family layer used by CUDA and ROCm) lives in core and is
re-exported here.

Versioning: :data:`PLUGIN_API_VERSION` is ``"0.5.6.1"``. The first three numbers are the LMCache
release whose plugin contract we implement; the fourth is our own release on that line. A
plugin that imports this module pins ``lmcache>=0.5.6.1,<0.6``; one written only against the
0.5.x paths pins ``lmcache>=0.5,<0.6``.

Importing this module is cheap (no torch, no device detection): entry-point modules import
it while the device registry is built. Names whose modules import torch (``torch_ops``,
the device ops classes, the CPU wrappers) load on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache.utils import RateLimitedLog, init_logger
from lmcache.utils.lazy import lazy_attributes, lazy_dir
from lmcache.v1.platform.base.block_transfer import BlockTransferPlan, plan_block_transfer
from lmcache.v1.platform.base.cache_context import BaseCacheContext, KernelGroup, ObjectGroup
from lmcache.v1.platform.base.device_ops import DeviceOps, StreamWaitRecorders
from lmcache.v1.platform.base.device_spec import DeviceSpec
from lmcache.v1.platform.base.event_ipc import (
    DefaultEventIPCBackend,
    DeviceEvent,
    DeviceLike,
    DeviceStream,
    EventIPCBackend,
)
from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper, TensorMetadata
from lmcache.v1.platform.base.pin_memory import HostRegisterPinMemoryBackend, PinMemoryBackend
from lmcache.v1.platform.cuda_family.spec import CudaFamilyDeviceSpec
from lmcache.v1.platform.ops_types import (
    EngineKVFormat,
    PageBufferShapeDesc,
    TransferDirection,
)
from lmcache.v1.platform.transfer_mode import MPTransferMode

if TYPE_CHECKING:
    # Typed views of the lazy names below; at run time __getattr__ imports them.
    from lmcache.v1.platform import torch_ops
    from lmcache.v1.platform.cuda_family.device_ops import CudaFamilyDeviceOps, DeviceViewOps
    from lmcache.v1.platform.cuda_family.native_shim import make_native_ops
    from lmcache.v1.platform.devices.cpu.cache_context import CPUCacheContext
    from lmcache.v1.platform.devices.cpu.ipc_wrapper import CpuShmTensorWrapper

PLUGIN_API_VERSION = "0.5.6.1"
"""Version of this contract: LMCache release implemented (0.5.6) + our release on it (.1).
Plugins importing this module declare ``lmcache>=0.5.6.1,<0.6``."""

FACE_MODULES: tuple[str, ...] = (
    "lmcache.v1.platform.api",
    "lmcache.v1.platform.base.block_transfer",
    "lmcache.v1.platform.base.cache_context",
    "lmcache.v1.platform.base.device_ops",
    "lmcache.v1.platform.base.device_spec",
    "lmcache.v1.platform.base.event_ipc",
    "lmcache.v1.platform.base.ipc_wire",
    "lmcache.v1.platform.base.ipc_wrapper",
    "lmcache.v1.platform.base.pin_memory",
    "lmcache.v1.platform.ops_types",
    "lmcache.v1.platform.torch_ops",
)
"""Every lmcache-core module a device wheel may import: this module plus the 0.5.6 paths.
The plugin-faces test enforces it on our wheels; ``nox -s typecheck`` runs mypy on them."""

# Names whose modules import torch: resolved on first access (PEP 562) so that importing
# this module from an entry point stays cheap.
# name -> (module, attribute); attribute None means the module itself.
_LAZY: dict[str, tuple[str, str | None]] = {
    "torch_ops": ("lmcache.v1.platform.torch_ops", None),
    "CudaFamilyDeviceOps": ("lmcache.v1.platform.cuda_family.device_ops", "CudaFamilyDeviceOps"),
    "DeviceViewOps": ("lmcache.v1.platform.cuda_family.device_ops", "DeviceViewOps"),
    "make_native_ops": ("lmcache.v1.platform.cuda_family.native_shim", "make_native_ops"),
    "CPUCacheContext": ("lmcache.v1.platform.devices.cpu.cache_context", "CPUCacheContext"),
    "CpuShmTensorWrapper": ("lmcache.v1.platform.devices.cpu.ipc_wrapper", "CpuShmTensorWrapper"),
}

__all__ = [
    "FACE_MODULES",
    "PLUGIN_API_VERSION",
    # contract classes (0.5.6 paths under lmcache.v1.platform.base)
    "BaseCacheContext",
    "BlockTransferPlan",
    "DefaultEventIPCBackend",
    "DeviceEvent",
    "DeviceIPCWrapper",
    "DeviceLike",
    "DeviceOps",
    "DeviceSpec",
    "DeviceStream",
    "EventIPCBackend",
    "HostRegisterPinMemoryBackend",
    "KernelGroup",
    "ObjectGroup",
    "PinMemoryBackend",
    "StreamWaitRecorders",
    "TensorMetadata",
    "plan_block_transfer",
    # shared types
    "EngineKVFormat",
    "MPTransferMode",
    "PageBufferShapeDesc",
    "TransferDirection",
    # reusable implementations: torch baseline, torch.cuda family, CPU shared memory
    "CPUCacheContext",
    "CpuShmTensorWrapper",
    "CudaFamilyDeviceOps",
    "CudaFamilyDeviceSpec",
    "DeviceViewOps",
    "make_native_ops",
    "torch_ops",
    # logging (the same helpers the storage API re-exports)
    "RateLimitedLog",
    "init_logger",
]


# Hidden from type checkers: with a visible module __getattr__, mypy would accept any
# misspelt name imported from this module as Any.
if not TYPE_CHECKING:
    __getattr__ = lazy_attributes(__name__, _LAZY)


__dir__ = lazy_dir(globals(), _LAZY)
