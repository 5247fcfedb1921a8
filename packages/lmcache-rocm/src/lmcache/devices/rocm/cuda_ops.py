"""Native ops module bound by ``RocmDeviceOps.ensure_native``: the HIP build (hipcc) of
lmcache-cuda's kernel sources, same symbols and signatures. Without ``_C`` importing this
module raises ImportError and the torch baseline answers."""

from __future__ import annotations

from lmcache.devices.rocm import _C as _C
from lmcache.v1.platform.api import make_native_ops as _make

MAX_OBJECTS_PER_CALL = _C.MAX_OBJECTS_PER_LAUNCH

multi_layer_block_kv_transfer, lmcache_memcpy_async = _make(_C)
