"""Engine KV layout detection: which ``EngineKVFormat`` a layer tensor is, and its geometry.

NHD and HND tensors of the same rank look alike; the engine's ``layout_hint``
(``"NHD"``/``"HND"``) decides, and NHD is assumed without one (docs/design/platform.md#kv-layouts).
"""

from __future__ import annotations

from typing import Any

from lmcache.v1.platform.ops_types import EngineKVFormat, PageBufferShapeDesc

F = EngineKVFormat


def _norm_hint(layout_hint: Any) -> str:
    hint = str(layout_hint or "NHD").strip().upper()
    if hint not in ("NHD", "HND"):
        raise ValueError(f"invalid KV layout hint {layout_hint!r}: expected 'NHD' or 'HND'")
    return hint


def detect_engine_kv_format(layer: Any, layout_hint: Any = None) -> EngineKVFormat:
    """Format of one vLLM-style layer (a tensor or a K/V / plane tuple)."""
    hnd = _norm_hint(layout_hint) == "HND"
    if isinstance(layer, (tuple, list)):
        if len(layer) == 2 and layer[0].dim() == 4 and layer[0].shape == layer[1].shape:
            if layer[0].shape[2] == 1 and layer[0].dtype != layer[1].dtype:
                return F.NL_X_NP_X_NB_BS_ONE_HS
            return F.NL_X_TWO_X_NB_BS_NH_HS
        return F.NL_X_NP_X_NB_BS_ONE_HS
    shape = tuple(layer.shape)
    if len(shape) == 3:
        return F.NL_X_NB_BS_HS
    if len(shape) == 4:
        # vLLM >= 0.29: every layer a [NB, H, N, C] view of one buffer, K/V fused in C
        return F.NL_X_NB_NH_BS_CS if hnd else F.NL_X_NB_BS_NH_CS
    if len(shape) == 5 and shape[0] == 2:
        return F.NL_X_TWO_NB_NH_BS_HS if hnd else F.NL_X_TWO_NB_BS_NH_HS
    if len(shape) == 5 and shape[1] == 2:
        return F.NL_X_NB_TWO_NH_BS_HS if hnd else F.NL_X_NB_TWO_BS_NH_HS
    if len(shape) == 6 and shape[0] == 2 and shape[3] == 1:
        return F.NL_X_TWO_NB_NH_ONE_BS_HS
    raise ValueError(
        f"cannot detect the KV-cache format of a layer of shape {list(shape)}; expected "
        "vLLM's fused [NB, BS, NH, 2*HS], [2, NB, BS, NH, HS], [NB, 2, BS, NH, HS], their "
        "HND variants, or MLA [NB, BS, HS]"
    )


def shape_desc_for(layer: Any, fmt: Any, num_layers: int) -> PageBufferShapeDesc:
    """PageBufferShapeDesc of a layer-list format from one representative layer."""
    fmt = EngineKVFormat(int(fmt))
    t = layer[0] if isinstance(layer, (tuple, list)) else layer
    s = tuple(t.shape)
    kv, nh = 2, 0
    if fmt == F.NL_X_TWO_NB_BS_NH_HS:
        nb, bs, nh, hs = s[1], s[2], s[3], s[4]
    elif fmt == F.NL_X_TWO_NB_NH_BS_HS:
        nb, nh, bs, hs = s[1], s[2], s[3], s[4]
    elif fmt == F.NL_X_NB_TWO_BS_NH_HS:
        nb, bs, nh, hs = s[0], s[2], s[3], s[4]
    elif fmt == F.NL_X_NB_TWO_NH_BS_HS:
        nb, nh, bs, hs = s[0], s[2], s[3], s[4]
    elif fmt == F.NL_X_TWO_NB_NH_ONE_BS_HS:
        nb, nh, bs, hs = s[1], s[2], s[4], s[5]
    elif fmt in (F.NL_X_NB_BS_HS, F.NL_X_NB_BSV_BSS):
        kv, nb, bs, nh, hs = 1, s[0], s[1], 1, s[2]
    elif fmt == F.NL_X_NB_NH_BS_CS:  # one fused K/V plane: hs is its width, 2 * head_size
        kv, nb, nh, bs, hs = 1, s[0], s[1], s[2], s[3]
    elif fmt == F.NL_X_NB_BS_NH_CS:
        kv, nb, bs, nh, hs = 1, s[0], s[1], s[2], s[3]
    elif fmt == F.NL_X_TWO_X_NB_BS_NH_HS:
        nb, bs, nh, hs = s[0], s[1], s[2], s[3]
    else:
        raise ValueError(f"shape_desc_for does not handle {fmt.name}; build the descriptor by hand")
    return PageBufferShapeDesc(
        kv_size=kv,
        nl=int(num_layers),
        nb=int(nb),
        bs=int(bs),
        nh=int(nh),
        hs=int(hs),
        element_size=int(t.element_size()),
        block_stride_elems=0,
        dtype=t.dtype,
    )


def hidden_dim_of(desc: PageBufferShapeDesc) -> int:
    """Row width of the canonical host chunk for a descriptor."""
    return int(desc.hs) if desc.kv_size == 1 and desc.nh <= 1 else int(desc.nh * desc.hs)
