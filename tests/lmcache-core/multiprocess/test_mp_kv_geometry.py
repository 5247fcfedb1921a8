"""KV layouts as vLLM really passes them: vLLM >= 0.29 hands every layer as a 4-D
``[NB, H, N, C]`` view of ONE shared buffer, K and V fused in C (2 * head_size)."""

from __future__ import annotations

import pytest
import torch

from lmcache.v1.multiprocess.kv_copy import (
    gather_paged_kv_to_cpu,
    kv_geometry,
    scatter_cpu_to_paged_kv,
)
from lmcache.v1.platform.ops_types import EngineKVFormat

NL, NB, NH, BS, HS = 3, 12, 2, 16, 8


def vllm_fused_layers(hnd: bool) -> list[torch.Tensor]:
    per_layer = NB * NH * BS * 2 * HS
    buf = torch.randn(NL * per_layer).to(torch.bfloat16)
    shape = (NB, NH, BS, 2 * HS) if hnd else (NB, BS, NH, 2 * HS)
    return [buf[i * per_layer : (i + 1) * per_layer].view(shape) for i in range(NL)]


@pytest.mark.parametrize(
    ("hint", "fmt"),
    [("HND", EngineKVFormat.NL_X_NB_NH_BS_CS), ("NHD", EngineKVFormat.NL_X_NB_BS_NH_CS)],
)
def test_fused_rank4_views_are_detected_with_their_geometry(hint, fmt):
    geo = kv_geometry(vllm_fused_layers(hint == "HND"), {"kv_layout": hint})
    assert geo.fmt == fmt
    assert (geo.num_layers, geo.num_blocks, geo.block_size, geo.num_heads) == (NL, NB, BS, NH)
    assert geo.head_size == 2 * HS  # one fused plane as wide as K and V together
    assert geo.kv_size == 1
    # a chunk holds exactly the bytes of its blocks: the same as split K/V would
    assert geo.chunk_shape(2 * BS) == (NL, 2 * BS, NH * 2 * HS)


@pytest.mark.parametrize("hint", ["HND", "NHD"])
def test_fused_rank4_round_trip_touches_only_the_chosen_blocks(hint):
    src = vllm_fused_layers(hint == "HND")
    ids = [3, 7, 1, 10]
    chunks = gather_paged_kv_to_cpu(src, ids, 2, {"kv_layout": hint})
    assert [tuple(c.shape) for c in chunks] == [(NL, 2 * BS, NH * 2 * HS)] * 2
    dst = [torch.zeros_like(t) for t in src]
    scatter_cpu_to_paged_kv(dst, ids, chunks, 2, 0, {"kv_layout": hint})
    others = [b for b in range(NB) if b not in ids]
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(a[ids], b[ids])
        assert not b[others].any()


def test_unsupported_rank_names_the_shapes_vllm_passes():
    with pytest.raises(ValueError, match=r"fused \[NB, BS, NH, 2\*HS\]"):
        kv_geometry([torch.zeros(2, 2)])


@pytest.mark.parametrize("by_name", [True, False])
def test_compute_kv_layout_answers_0_5_6_tuple_at_its_path(by_name):
    from lmcache.v1.multiprocess.transfer_context import base, compute_kv_layout

    assert base.compute_kv_layout is compute_kv_layout
    layers = vllm_fused_layers(hnd=False)
    kv = {f"model.layers.{i}.attn": t for i, t in enumerate(layers)} if by_name else layers
    block_size, num_layers, hidden, dtype_str, fmt, kv_size = compute_kv_layout(kv)
    # 0.5.6: hidden_dim_size is num_heads times the packed (2 * head_size) width when K and V
    # are fused, and kv_size counts the planes of a chunk object (1 when fused).
    assert (block_size, num_layers, hidden, dtype_str) == (BS, NL, NH * 2 * HS, "bfloat16")
    assert (fmt, kv_size) == (EngineKVFormat.NL_X_NB_BS_NH_CS, 1)


def test_compute_kv_layout_rejects_no_layers():
    from lmcache.v1.multiprocess.kv_copy import compute_kv_layout

    with pytest.raises(ValueError, match="empty"):
        compute_kv_layout({})
