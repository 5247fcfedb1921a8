"""calculate_cdf, stream-ordered recorders and the LATER ops."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from lmcache.v1.platform.base.active import active_platform


def calculate_cdf(input_tensor: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Per (layer, channel) 16-bit CDF of symbol ids over tokens
    (docs/design/platform.md#calculate-cdf)."""
    num_bins = int(num_bins)
    if num_bins <= 0:
        raise ValueError(f"num_bins={num_bins} must be > 0")
    if input_tensor.dim() != 3:
        raise ValueError(
            f"calculate_cdf expects [nlayers, ntokens, nchannels], got {list(input_tensor.shape)}"
        )
    nl, nt, nc = input_tensor.shape
    sym = input_tensor.to(torch.int64).clamp(0, num_bins - 1).permute(0, 2, 1)  # [L, C, T]
    counts = torch.zeros(nl, nc, num_bins, dtype=torch.int64, device=input_tensor.device)
    counts.scatter_add_(2, sym, torch.ones_like(sym))
    cdf = torch.zeros(nl, nc, num_bins + 1, dtype=torch.int64, device=input_tensor.device)
    cdf[:, :, 1:] = counts.cumsum(2)
    j = torch.arange(num_bins + 1, dtype=torch.int64, device=input_tensor.device)
    total = nt
    if total == 0:
        out = j.expand(nl, nc, num_bins + 1).clone()
    else:
        out = (0xFFFF - num_bins) * cdf // total + j
    out = torch.where(out >= 0x8000, out - 0x10000, out)
    return out.to(torch.int16)


_rec_lock = threading.Lock()
_completions: list[tuple[Any, bytes]] = []
_events: list[tuple[Any, Any, float, Any, Any]] = []


def _order_before_publish() -> None:
    """Without stream callbacks, the baseline orders by waiting for the active device."""
    platform = active_platform()
    if platform.get_torch_device()[1] != "cpu":
        platform.current_device_spec().synchronize_device(None)


def record_completion_on_stream(cuda_stream_ptr: int, kind: Any, payload: bytes) -> None:
    """Queue ``(kind, payload)`` for :func:`drain_recorded_completions` once the work queued
    so far has finished (the baseline synchronizes the active accelerator first; handle 0 is
    the default stream). The transfer paths use it to tell the server a store's copy is done."""
    _order_before_publish()
    with _rec_lock:
        _completions.append((kind, bytes(payload)))


def drain_recorded_completions() -> list[tuple[Any, bytes]]:
    """Return and clear every recorded ``(kind, payload)``, in record order (atomic: each
    record is returned once)."""
    with _rec_lock:
        out = list(_completions)
        _completions.clear()
    return out


def record_event_on_stream(
    cuda_stream_ptr: int,
    event_type_name: Any,
    session_id: Any,
    str_metadata: Any,
    int_metadata: Any,
) -> None:
    """Queue ``(event_type_name, session_id, time.time() at the call, str_metadata,
    int_metadata)`` for :func:`drain_recorded_events`, ordered like
    :func:`record_completion_on_stream` (tracing)."""
    ts = time.time()
    _order_before_publish()
    with _rec_lock:
        _events.append((event_type_name, session_id, ts, str_metadata, int_metadata))


def drain_recorded_events() -> list[tuple[Any, Any, float, Any, Any]]:
    """Return and clear every recorded event tuple, in record order."""
    with _rec_lock:
        out = list(_events)
        _events.clear()
    return out


def _later(op: str) -> NotImplementedError:
    return NotImplementedError(
        f"torch baseline for {op} is not implemented yet; a native backend may provide it"
    )


# LATER ops: no torch baseline yet. Each raises NotImplementedError naming itself; a native
# module bound by DeviceOps.ensure_native() may provide it with the same signature.


def multi_layer_kv_transfer_unilateral(
    key_value: torch.Tensor,
    key_value_ptrs: Any,
    slot_mapping: torch.Tensor,
    paged_memory_device: Any,
    page_buffer_size: int,
    direction: Any,
    engine_kv_format: Any,
) -> None:
    """One-direction variant of ``multi_layer_kv_transfer`` (native only; LATER here)."""
    raise _later("multi_layer_kv_transfer_unilateral")


def single_layer_kv_transfer(
    lmc_key_value_cache: torch.Tensor,
    vllm_key_value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    direction: Any,
    engine_kv_format: Any,
    token_major: bool = False,
) -> None:
    """Per-layer copy for layerwise pipelines (native only; LATER here)."""
    raise _later("single_layer_kv_transfer")


def single_layer_kv_transfer_sgl(
    lmc_key_value_cache: torch.Tensor,
    sgl_key_cache: torch.Tensor,
    sgl_value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    direction: Any,
    token_major: bool = False,
) -> None:
    """Per-layer copy against SGLang's separate K and V caches (native only; LATER here)."""
    raise _later("single_layer_kv_transfer_sgl")


def load_and_reshape_flash(
    key_value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer_idx: int,
) -> None:
    """Flash-attention layout load (native only; LATER here)."""
    raise _later("load_and_reshape_flash")


def reshape_and_cache_back_flash(
    key_value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer_idx: int,
) -> None:
    """Flash-attention layout store (native only; LATER here)."""
    raise _later("reshape_and_cache_back_flash")


def encode_fast_new(
    cdf: torch.Tensor,
    input_sym: torch.Tensor,
    output_buffer: torch.Tensor,
    output_lengths: torch.Tensor,
) -> None:
    """Arithmetic-coding encoder for KV compression (native only; LATER here)."""
    raise _later("encode_fast_new")


def decode_fast_new(
    cdf: torch.Tensor, bytestreams: torch.Tensor, lengths: torch.Tensor, output: torch.Tensor
) -> None:
    """Arithmetic-coding decoder (native only; LATER here)."""
    raise _later("decode_fast_new")


def decode_fast_prefsum(
    cdf: torch.Tensor,
    bytestreams: torch.Tensor,
    lengths_prefsum: torch.Tensor,
    output: torch.Tensor,
) -> None:
    """Arithmetic-coding decoder over prefix-summed lengths (native only; LATER here)."""
    raise _later("decode_fast_prefsum")


def rotary_embedding_k_fused(
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Re-rotate cached keys to new positions (CacheBlend; native only; LATER here)."""
    raise _later("rotary_embedding_k_fused")


def rotary_embedding_k_fused_strided(
    old_positions: torch.Tensor,
    new_positions: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    head_stride: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Strided variant of ``rotary_embedding_k_fused`` (native only; LATER here)."""
    raise _later("rotary_embedding_k_fused_strided")


def get_gpu_pci_bus_id(device_id: int = 0) -> str | None:
    """PCI bus id of device ``device_id`` (native only; LATER here)."""
    raise _later("get_gpu_pci_bus_id")
