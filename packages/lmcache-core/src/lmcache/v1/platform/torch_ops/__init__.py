"""Torch baseline ops: pure PyTorch, any device with standard tensor ops.

Every public op of docs/design/platform.md#baseline-ops is importable from here and mirrored by a
``DeviceOps`` method of the same name and signature. Helpers for backends, not ops:
``host_tensor_from_ptr`` (zero-copy view of a host address), ``is_pointer_tensor`` and
``infer_pointer_dtype`` (recognising pointer operands and their KV dtype),
``pointer_view`` (a view of an address through its backend's ``tensor_from_ptr``) and
``transfer_blocks`` (the baseline for a ``BlockTransferPlan``).
"""

from lmcache.v1.platform.torch_ops._block import (
    infer_pointer_dtype,
    is_pointer_tensor,
    multi_layer_block_kv_transfer,
    transfer_blocks,
)
from lmcache.v1.platform.torch_ops._legacy import multi_layer_kv_transfer
from lmcache.v1.platform.torch_ops._memory import (
    alloc_hugepage_pinned_numa_ptr,
    alloc_hugepage_pinned_ptr,
    alloc_numa_ptr,
    alloc_pinned_numa_ptr,
    alloc_pinned_ptr,
    alloc_shm_pinned_ptr,
    batched_memcpy,
    free_hugepage_pinned_numa_ptr,
    free_hugepage_pinned_ptr,
    free_numa_ptr,
    free_pinned_numa_ptr,
    free_pinned_ptr,
    free_shm_pinned_ptr,
    host_tensor_from_ptr,
    lmcache_memcpy_async,
    pointer_view,
)
from lmcache.v1.platform.torch_ops._misc import (
    calculate_cdf,
    decode_fast_new,
    decode_fast_prefsum,
    drain_recorded_completions,
    drain_recorded_events,
    encode_fast_new,
    get_gpu_pci_bus_id,
    load_and_reshape_flash,
    multi_layer_kv_transfer_unilateral,
    record_completion_on_stream,
    record_event_on_stream,
    reshape_and_cache_back_flash,
    rotary_embedding_k_fused,
    rotary_embedding_k_fused_strided,
    single_layer_kv_transfer,
    single_layer_kv_transfer_sgl,
)

#: Old name of ``pointer_view``, kept for code written against earlier releases.
_tensor_from_ptr = pointer_view

__all__ = [
    "_tensor_from_ptr",
    "alloc_hugepage_pinned_numa_ptr",
    "alloc_hugepage_pinned_ptr",
    "alloc_numa_ptr",
    "alloc_pinned_numa_ptr",
    "alloc_pinned_ptr",
    "alloc_shm_pinned_ptr",
    "batched_memcpy",
    "calculate_cdf",
    "decode_fast_new",
    "decode_fast_prefsum",
    "drain_recorded_completions",
    "drain_recorded_events",
    "encode_fast_new",
    "free_hugepage_pinned_numa_ptr",
    "free_hugepage_pinned_ptr",
    "free_numa_ptr",
    "free_pinned_numa_ptr",
    "free_pinned_ptr",
    "free_shm_pinned_ptr",
    "get_gpu_pci_bus_id",
    "host_tensor_from_ptr",
    "infer_pointer_dtype",
    "is_pointer_tensor",
    "lmcache_memcpy_async",
    "load_and_reshape_flash",
    "multi_layer_block_kv_transfer",
    "multi_layer_kv_transfer",
    "multi_layer_kv_transfer_unilateral",
    "pointer_view",
    "record_completion_on_stream",
    "record_event_on_stream",
    "reshape_and_cache_back_flash",
    "rotary_embedding_k_fused",
    "rotary_embedding_k_fused_strided",
    "single_layer_kv_transfer",
    "single_layer_kv_transfer_sgl",
    "transfer_blocks",
]
