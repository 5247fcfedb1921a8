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
    _order_before_publish()
    with _rec_lock:
        _completions.append((kind, bytes(payload)))


def drain_recorded_completions() -> list[tuple[Any, bytes]]:
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
    ts = time.time()
    _order_before_publish()
    with _rec_lock:
        _events.append((event_type_name, session_id, ts, str_metadata, int_metadata))


def drain_recorded_events() -> list[tuple[Any, Any, float, Any, Any]]:
    with _rec_lock:
        out = list(_events)
        _events.clear()
    return out


def _later(op: str) -> NotImplementedError:
    return NotImplementedError(
        f"torch baseline for {op} is not implemented yet; a native backend may provide it"
    )


def multi_layer_kv_transfer_unilateral(
    key_value,
    key_value_ptrs,
    slot_mapping,
    paged_memory_device,
    page_buffer_size,
    direction,
    engine_kv_format,
):
    raise _later("multi_layer_kv_transfer_unilateral")


def single_layer_kv_transfer(
    lmc_key_value_cache,
    vllm_key_value_cache,
    slot_mapping,
    direction,
    engine_kv_format,
    token_major=False,
):
    raise _later("single_layer_kv_transfer")


def single_layer_kv_transfer_sgl(
    lmc_key_value_cache, sgl_key_cache, sgl_value_cache, slot_mapping, direction, token_major=False
):
    raise _later("single_layer_kv_transfer_sgl")


def load_and_reshape_flash(key_value, key_cache, value_cache, slot_mapping, layer_idx):
    raise _later("load_and_reshape_flash")


def reshape_and_cache_back_flash(key_value, key_cache, value_cache, slot_mapping, layer_idx):
    raise _later("reshape_and_cache_back_flash")


def encode_fast_new(cdf, input_sym, output_buffer, output_lengths):
    raise _later("encode_fast_new")


def decode_fast_new(cdf, bytestreams, lengths, output):
    raise _later("decode_fast_new")


def decode_fast_prefsum(cdf, bytestreams, lengths_prefsum, output):
    raise _later("decode_fast_prefsum")


def rotary_embedding_k_fused(old_positions, new_positions, key, head_size, cos_sin_cache, is_neox):
    raise _later("rotary_embedding_k_fused")


def rotary_embedding_k_fused_strided(
    old_positions, new_positions, key, head_size, head_stride, cos_sin_cache, is_neox
):
    raise _later("rotary_embedding_k_fused_strided")


def get_gpu_pci_bus_id(device_id=0):
    raise _later("get_gpu_pci_bus_id")
