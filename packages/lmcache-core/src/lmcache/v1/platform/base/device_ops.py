"""``DeviceOps``: the ops strategy a backend hands out through ``DeviceSpec.get_ops()``.

Every op is declared on the class body and forwards to the same-named function of
``lmcache.v1.platform.torch_ops``; ``bind_native(module)`` overlays native symbols on one
instance. Anything else (optional native-only symbols) raises AttributeError, so callers
probe with ``hasattr(device_ops, name)``.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

from lmcache.utils import init_logger
from lmcache.v1.platform import ops_types
from lmcache.v1.platform.base.block_transfer import BlockTransferPlan, plan_block_transfer

logger = init_logger(__name__)

# The 33 ops of platform.md §4.2, in table order.
DEVICE_OP_NAMES: tuple[str, ...] = (
    "multi_layer_block_kv_transfer",
    "multi_layer_kv_transfer",
    "lmcache_memcpy_async",
    "calculate_cdf",
    "alloc_pinned_ptr",
    "free_pinned_ptr",
    "alloc_pinned_numa_ptr",
    "free_pinned_numa_ptr",
    "alloc_numa_ptr",
    "free_numa_ptr",
    "alloc_hugepage_pinned_ptr",
    "free_hugepage_pinned_ptr",
    "alloc_hugepage_pinned_numa_ptr",
    "free_hugepage_pinned_numa_ptr",
    "alloc_shm_pinned_ptr",
    "free_shm_pinned_ptr",
    "batched_memcpy",
    "tensor_from_ptr",
    "record_completion_on_stream",
    "drain_recorded_completions",
    "record_event_on_stream",
    "drain_recorded_events",
    "multi_layer_kv_transfer_unilateral",
    "single_layer_kv_transfer",
    "single_layer_kv_transfer_sgl",
    "load_and_reshape_flash",
    "reshape_and_cache_back_flash",
    "encode_fast_new",
    "decode_fast_new",
    "decode_fast_prefsum",
    "rotary_embedding_k_fused",
    "rotary_embedding_k_fused_strided",
    "get_gpu_pci_bus_id",
)

DEFAULT_MAX_OBJECTS_PER_CALL = 4


def _t() -> Any:
    # Lazy: importing DeviceOps must not import torch (device specs import this cheaply).
    from lmcache.v1.platform import torch_ops

    return torch_ops


class DeviceOps:
    """Strategy base: every op delegates to the torch baseline."""

    device_type: ClassVar[str] = ""
    # §3.5: "tensor" or "pointer" operands for multi_layer_block_kv_transfer; None = infer.
    kv_transfer_operands: ClassVar[str | None] = None
    # Pointer-mode batch limit; None = 4 (0.5.6's CUDA kernel limit).
    max_objects_per_call: ClassVar[int | None] = None

    PageBufferShapeDesc = ops_types.PageBufferShapeDesc
    StagingCopy = ops_types.StagingCopy
    LaunchVar = ops_types.LaunchVar
    BatchStep = ops_types.BatchStep
    KernelGroupSpec = ops_types.KernelGroupSpec

    def __init__(self) -> None:
        self._native_bound = False

    def __getattr__(self, name: str) -> Any:
        # Only reached for names found nowhere else: optional native-only symbols.
        raise AttributeError(f"{type(self).__name__} has no device operation '{name}'")

    # ---- native binding ------------------------------------------------------------
    def ensure_native(self) -> None:
        """Base backends are pure baseline; subclasses bind a native module here."""
        return None

    def bind_native(self, module: Any) -> None:
        n_ops = n_types = 0
        for name in dir(module):
            if name.startswith("_"):
                continue
            sym = getattr(module, name, None)
            if sym is None or inspect.ismodule(sym):
                continue
            if isinstance(sym, type):
                setattr(self, name, sym)
                n_types += 1
            elif callable(sym):
                setattr(self, name, sym)
                n_ops += 1
        exported = getattr(module, "EngineKVFormat", None)
        if isinstance(exported, type):
            self.GPUKVFormat = exported
        logger.debug(
            "bind_native: %s <- %s (%d ops, %d types)",
            type(self).__name__,
            getattr(module, "__name__", repr(module)),
            n_ops,
            n_types,
        )

    def set_shape_desc_dtype(self, shape_desc: Any, dtype: Any) -> None:
        shape_desc.dtype = dtype

    # ---- required ops ------------------------------------------------------------------
    def multi_layer_block_kv_transfer(
        self,
        paged_buffer_ptrs_tensor,
        lmcache_objects_ptrs,
        block_ids,
        device,
        direction,
        shape_desc,
        lmcache_chunk_size,
        engine_kv_format,
        skip_prefix_n_blocks,
    ):
        return self.transfer_blocks(
            plan_block_transfer(
                paged_buffer_ptrs_tensor,
                lmcache_objects_ptrs,
                block_ids,
                device,
                direction,
                shape_desc,
                lmcache_chunk_size,
                engine_kv_format,
                skip_prefix_n_blocks,
            )
        )

    def transfer_blocks(self, plan: BlockTransferPlan) -> None:
        """Run a checked ``multi_layer_block_kv_transfer`` (see ``base.block_transfer``).
        Backends override this rather than the nine-argument op; the default is the torch
        baseline."""
        return _t().transfer_blocks(plan)

    def multi_layer_kv_transfer(
        self,
        key_value,
        key_value_ptrs,
        slot_mapping,
        paged_memory_device,
        page_buffer_size,
        direction,
        engine_kv_format,
        block_size=0,
        head_size=0,
        skip_prefix_n_tokens=0,
        block_stride_elems=0,
    ):
        return _t().multi_layer_kv_transfer(
            key_value,
            key_value_ptrs,
            slot_mapping,
            paged_memory_device,
            page_buffer_size,
            direction,
            engine_kv_format,
            block_size,
            head_size,
            skip_prefix_n_tokens,
            block_stride_elems,
        )

    def lmcache_memcpy_async(
        self, dest, src, nbytes, direction, host_buffer_offset, host_buffer_alignments
    ):
        return _t().lmcache_memcpy_async(
            dest, src, nbytes, direction, host_buffer_offset, host_buffer_alignments
        )

    def calculate_cdf(self, input_tensor, num_bins):
        return _t().calculate_cdf(input_tensor, num_bins)

    def alloc_pinned_ptr(self, size, device_id=0):
        return _t().alloc_pinned_ptr(size, device_id)

    def free_pinned_ptr(self, ptr):
        return _t().free_pinned_ptr(ptr)

    def alloc_pinned_numa_ptr(self, size, numa_id=0):
        return _t().alloc_pinned_numa_ptr(size, numa_id)

    def free_pinned_numa_ptr(self, ptr, size=None):
        return _t().free_pinned_numa_ptr(ptr, size)

    def alloc_numa_ptr(self, size, numa_id=0):
        return _t().alloc_numa_ptr(size, numa_id)

    def free_numa_ptr(self, ptr, size=None):
        return _t().free_numa_ptr(ptr, size)

    def alloc_hugepage_pinned_ptr(self, size, device_id=0):
        return _t().alloc_hugepage_pinned_ptr(size, device_id)

    def free_hugepage_pinned_ptr(self, ptr, size=0):
        return _t().free_hugepage_pinned_ptr(ptr, size)

    def alloc_hugepage_pinned_numa_ptr(self, size, numa_id=0):
        return _t().alloc_hugepage_pinned_numa_ptr(size, numa_id)

    def free_hugepage_pinned_numa_ptr(self, ptr, size=0):
        return _t().free_hugepage_pinned_numa_ptr(ptr, size)

    def alloc_shm_pinned_ptr(self, size, shm_name=""):
        return _t().alloc_shm_pinned_ptr(size, shm_name)

    def free_shm_pinned_ptr(self, ptr, size=0, shm_name=""):
        return _t().free_shm_pinned_ptr(ptr, size, shm_name)

    def batched_memcpy(self, src_ptrs, dst_ptrs, sizes):
        return _t().batched_memcpy(src_ptrs, dst_ptrs, sizes)

    def tensor_from_ptr(self, ptr, shape, dtype, device=None):
        # No generic implementation: only the backend knows its address space.
        raise ValueError(
            f"Device backend {self.device_type or type(self).__name__!r} does not support tensor construction from raw pointers."
        )

    def record_completion_on_stream(self, cuda_stream_ptr, kind, payload):
        return _t().record_completion_on_stream(cuda_stream_ptr, kind, payload)

    def drain_recorded_completions(self):
        return _t().drain_recorded_completions()

    def record_event_on_stream(
        self, cuda_stream_ptr, event_type_name, session_id, str_metadata, int_metadata
    ):
        return _t().record_event_on_stream(
            cuda_stream_ptr, event_type_name, session_id, str_metadata, int_metadata
        )

    def drain_recorded_events(self):
        return _t().drain_recorded_events()

    # ---- LATER ops (the baseline raises; a native module may provide them) ------------
    def multi_layer_kv_transfer_unilateral(
        self,
        key_value,
        key_value_ptrs,
        slot_mapping,
        paged_memory_device,
        page_buffer_size,
        direction,
        engine_kv_format,
    ):
        return _t().multi_layer_kv_transfer_unilateral(
            key_value,
            key_value_ptrs,
            slot_mapping,
            paged_memory_device,
            page_buffer_size,
            direction,
            engine_kv_format,
        )

    def single_layer_kv_transfer(
        self,
        lmc_key_value_cache,
        vllm_key_value_cache,
        slot_mapping,
        direction,
        engine_kv_format,
        token_major=False,
    ):
        return _t().single_layer_kv_transfer(
            lmc_key_value_cache,
            vllm_key_value_cache,
            slot_mapping,
            direction,
            engine_kv_format,
            token_major,
        )

    def single_layer_kv_transfer_sgl(
        self,
        lmc_key_value_cache,
        sgl_key_cache,
        sgl_value_cache,
        slot_mapping,
        direction,
        token_major=False,
    ):
        return _t().single_layer_kv_transfer_sgl(
            lmc_key_value_cache,
            sgl_key_cache,
            sgl_value_cache,
            slot_mapping,
            direction,
            token_major,
        )

    def load_and_reshape_flash(self, key_value, key_cache, value_cache, slot_mapping, layer_idx):
        return _t().load_and_reshape_flash(
            key_value, key_cache, value_cache, slot_mapping, layer_idx
        )

    def reshape_and_cache_back_flash(
        self, key_value, key_cache, value_cache, slot_mapping, layer_idx
    ):
        return _t().reshape_and_cache_back_flash(
            key_value, key_cache, value_cache, slot_mapping, layer_idx
        )

    def encode_fast_new(self, cdf, input_sym, output_buffer, output_lengths):
        return _t().encode_fast_new(cdf, input_sym, output_buffer, output_lengths)

    def decode_fast_new(self, cdf, bytestreams, lengths, output):
        return _t().decode_fast_new(cdf, bytestreams, lengths, output)

    def decode_fast_prefsum(self, cdf, bytestreams, lengths_prefsum, output):
        return _t().decode_fast_prefsum(cdf, bytestreams, lengths_prefsum, output)

    def rotary_embedding_k_fused(
        self, old_positions, new_positions, key, head_size, cos_sin_cache, is_neox
    ):
        return _t().rotary_embedding_k_fused(
            old_positions, new_positions, key, head_size, cos_sin_cache, is_neox
        )

    def rotary_embedding_k_fused_strided(
        self, old_positions, new_positions, key, head_size, head_stride, cos_sin_cache, is_neox
    ):
        return _t().rotary_embedding_k_fused_strided(
            old_positions, new_positions, key, head_size, head_stride, cos_sin_cache, is_neox
        )

    def get_gpu_pci_bus_id(self, device_id=0):
        return _t().get_gpu_pci_bus_id(device_id)


def resolve_kv_transfer_operands(ops: Any) -> tuple[str, int | None]:
    """Operand mode for ``multi_layer_block_kv_transfer`` (platform.md §3.5).

    Returns ``("tensor", None)`` (all objects in one call) or ``("pointer", n)`` (at most
    ``n`` objects per call). Order: the ops' ``kv_transfer_operands`` attribute; tensor
    when the bound op is the baseline; else 0.5.6's annotation rule.
    """
    declared = getattr(ops, "kv_transfer_operands", None)
    mode: str | None = None
    if declared is not None:
        if declared not in ("tensor", "pointer"):
            raise ValueError(
                f"{type(ops).__name__}.kv_transfer_operands={declared!r}: "
                "expected 'tensor' or 'pointer'"
            )
        mode = declared
    else:
        op = ops.multi_layer_block_kv_transfer
        func = getattr(op, "__func__", op)
        if func is DeviceOps.multi_layer_block_kv_transfer or func is getattr(
            _t(), "multi_layer_block_kv_transfer", None
        ):
            mode = "tensor"
        else:
            mode = "pointer"
            try:
                param = inspect.signature(op).parameters.get("lmcache_objects_ptrs")
            except (TypeError, ValueError):
                param = None
            if param is not None and param.annotation is not inspect.Parameter.empty:
                ann = param.annotation
                text = ann if isinstance(ann, str) else str(ann)
                if "Tensor" in text:
                    mode = "tensor"
    if mode == "tensor":
        return "tensor", None
    limit = getattr(ops, "max_objects_per_call", None)
    return "pointer", int(limit) if limit else DEFAULT_MAX_OBJECTS_PER_CALL
