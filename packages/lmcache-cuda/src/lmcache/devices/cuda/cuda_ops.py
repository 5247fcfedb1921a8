"""Native ops module bound by ``CudaDeviceOps.ensure_native`` (docs/design/platform.md#bind-native).

``_C`` is built when the wheel build finds nvcc (unless NO_GPU_EXT=1); without it
importing this module raises ImportError and the ops stay on the torch baseline (one WARNING). ``bind_native``
binds every public callable here, so everything else is private.
"""

from __future__ import annotations

from lmcache.devices.cuda import _C as _C
from lmcache.v1.platform.api import make_native_ops as _make

MAX_OBJECTS_PER_CALL = _C.MAX_OBJECTS_PER_LAUNCH

multi_layer_block_kv_transfer, lmcache_memcpy_async = _make(_C)
