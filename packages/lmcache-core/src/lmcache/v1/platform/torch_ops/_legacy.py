"""``multi_layer_kv_transfer``: the legacy slot-mapping copy
(docs/design/platform.md#legacy-transfer).

Each layer is normalised to a ``[KV, NB, BS, NH, x]``-ordered view (HND layouts are
permuted views), so one advanced-index gather/scatter per layer serves every format.
"""

from __future__ import annotations

from typing import Any

import torch

from lmcache.v1.platform.base.block_transfer import parse_direction
from lmcache.v1.platform.ops_types import EngineKVFormat, TransferDirection, to_engine_kv_format
from lmcache.v1.platform.torch_ops._memory import pointer_view

F = EngineKVFormat
_SUPPORTED = (
    F.NL_X_TWO_NB_BS_NH_HS,
    F.NL_X_NB_TWO_BS_NH_HS,
    F.NL_X_NB_BS_HS,
    F.NL_X_NBBS_ONE_HS,
    F.NL_X_NB_BSV_BSS,
    F.NL_X_TWO_NB_NH_BS_HS,
    F.NL_X_NB_TWO_NH_BS_HS,
)


def _slot_view(t: torch.Tensor, fmt: EngineKVFormat, hidden: int, bs: int, hs: int) -> torch.Tensor:
    """``[KV, NB, BS, hidden]``-indexable view of one layer (a view, never a copy)."""
    if fmt in (F.NL_X_NB_BS_HS, F.NL_X_NBBS_ONE_HS, F.NL_X_NB_BSV_BSS):
        return t.view(1, -1, 1, hidden)  # MLA: slot = row
    if fmt == F.NL_X_TWO_NB_BS_NH_HS:
        return t.view(2, -1, 1, hidden)  # two-major NHD: slot = row of a K/V plane
    if bs <= 0:
        raise ValueError(f"{fmt.name} needs block_size > 0 (tokens per block)")
    if fmt == F.NL_X_NB_TWO_BS_NH_HS:
        return t.view(-1, 2, bs, hidden).permute(1, 0, 2, 3)
    if hs <= 0 or hidden % hs:
        raise ValueError(f"{fmt.name} needs head_size > 0 dividing the hidden size {hidden}")
    nh = hidden // hs
    if fmt == F.NL_X_TWO_NB_NH_BS_HS:
        return t.view(2, -1, nh, bs, hs).permute(0, 1, 3, 2, 4)
    return t.view(-1, 2, nh, bs, hs).permute(1, 0, 3, 2, 4)  # NL_X_NB_TWO_NH_BS_HS


def _pointer_layers(
    ptrs: torch.Tensor,
    fmt: EngineKVFormat,
    dtype: torch.dtype,
    device: Any,
    pbs: int,
    hidden: int,
    bs: int,
    block_stride_elems: int,
) -> list[torch.Tensor]:
    if fmt in (F.NL_X_NB_BS_HS, F.NL_X_NBBS_ONE_HS, F.NL_X_NB_BSV_BSS):
        shape: tuple[int, ...] = (pbs, hidden)
        tight = bs * hidden
    elif fmt in (F.NL_X_NB_TWO_BS_NH_HS, F.NL_X_NB_TWO_NH_BS_HS):
        if bs <= 0:
            raise ValueError(f"{fmt.name} pointer operands need block_size > 0")
        shape = (pbs // bs, 2, bs, hidden)
        tight = 2 * bs * hidden
    else:
        shape = (2, pbs, hidden)
        tight = bs * hidden
    if block_stride_elems and block_stride_elems != tight:
        raise NotImplementedError(
            f"block_stride_elems={block_stride_elems} (non-tight blocks) is not supported with "
            f"pointer operands by the torch baseline for {fmt.name}"
        )
    return [pointer_view(int(a), shape, dtype, device) for a in ptrs.tolist()]


def multi_layer_kv_transfer(
    key_value: torch.Tensor,
    key_value_ptrs: Any,
    slot_mapping: torch.Tensor,
    paged_memory_device: Any,
    page_buffer_size: int,
    direction: Any,
    engine_kv_format: Any,
    block_size: int = 0,
    head_size: int = 0,
    skip_prefix_n_tokens: int = 0,
    block_stride_elems: int = 0,
) -> None:
    """Legacy per-token copy: ``key_value`` (``[2, NL, T, hidden]``, MLA ``[1, NL, T, hidden]``)
    to/from the slots ``slot_mapping[t]`` of the paged cache; negative slots and the first
    ``skip_prefix_n_tokens`` tokens are skipped. HND formats need ``block_size`` and
    ``head_size``; formats without a baseline raise ``NotImplementedError`` naming the format
    (use ``multi_layer_block_kv_transfer``)."""
    fmt = to_engine_kv_format(engine_kv_format)
    direction = parse_direction(direction)
    if fmt not in _SUPPORTED:
        raise NotImplementedError(
            f"multi_layer_kv_transfer does not support engine_kv_format {fmt.name} ({int(fmt)}) "
            "in the torch baseline; use multi_layer_block_kv_transfer"
        )
    if key_value.dim() != 4:
        raise ValueError(
            f"key_value must be [2 or 1, NL, T, hidden], got shape {list(key_value.shape)}"
        )
    kv_n, nl, ntok, hidden = key_value.shape
    if (
        isinstance(key_value_ptrs, torch.Tensor)
        and key_value_ptrs.dim() == 1
        and not key_value_ptrs.is_floating_point()
    ):
        layers = _pointer_layers(
            key_value_ptrs,
            fmt,
            key_value.dtype,
            paged_memory_device,
            int(page_buffer_size),
            hidden,
            int(block_size),
            int(block_stride_elems),
        )
    else:
        layers = list(key_value_ptrs)
    if len(layers) != nl:
        raise ValueError(f"key_value has {nl} layers but {len(layers)} paged tensors were given")
    bs = int(block_size)
    device = layers[0].device if layers else key_value.device
    slots = slot_mapping.reshape(-1).to(device=device, dtype=torch.long)
    if slots.numel() != ntok:
        raise ValueError(f"slot_mapping has {slots.numel()} entries for {ntok} tokens")
    tok = torch.arange(ntok, device=device)
    keep = (slots >= 0) & (tok >= int(skip_prefix_n_tokens))
    tok_sel = tok[keep]
    slot_sel = slots[keep]
    if tok_sel.numel() == 0:
        return
    for layer, t in enumerate(layers):
        if fmt == F.NL_X_NB_TWO_BS_NH_HS and bs <= 0 and t.dim() >= 3:
            bs_l = int(t.shape[2])
        elif fmt in (F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_TWO_NH_BS_HS) and bs <= 0 and t.dim() == 5:
            bs_l = int(t.shape[3])
        else:
            bs_l = bs
        hs_l = int(head_size) or (int(t.shape[-1]) if t.dim() == 5 else 0)
        view = _slot_view(t, fmt, hidden, bs_l, hs_l)
        blk_len = view.shape[2]
        b, o = slot_sel // blk_len, slot_sel % blk_len
        n = tok_sel.numel()
        if view.shape[0] != kv_n:
            raise ValueError(
                f"{fmt.name}: key_value has {kv_n} K/V planes, the paged layer has {view.shape[0]}"
            )
        tok_idx = tok_sel.to(key_value.device)
        if direction == TransferDirection.D2H:
            vals = view[:, b, o].reshape(kv_n, n, hidden)
            key_value[:, layer, tok_idx] = vals.to(key_value.device)
        else:
            vals = key_value[:, layer, tok_idx].to(device)
            view[:, b, o] = vals.view(kv_n, n, *view.shape[3:])
