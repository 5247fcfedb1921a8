"""Types vLLM's in-tree ``lmcache_mp_connector`` imports at load
(docs/design/architecture.md#vllm-imports).

The structs live in :mod:`lmcache.v1.multiprocess.protocol`; this module only gives
them the import path vLLM expects. Keep it import-light: no zmq, no server code.
"""

from __future__ import annotations

import torch

from lmcache.v1.multiprocess.protocol import (
    BlockAllocationRecord,
    IPCCacheServerKey,
    RequestAllocationRecord,
)

# What vLLM passes to ``register_kv_caches``: one tensor per layer (or per group).
KVCache = list[torch.Tensor]

__all__ = [
    "BlockAllocationRecord",
    "IPCCacheServerKey",
    "KVCache",
    "RequestAllocationRecord",
]
