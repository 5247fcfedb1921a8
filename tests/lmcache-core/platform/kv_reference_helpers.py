"""Independent reference for the 19 engine KV formats: build paged tensors from one
logical KV tensor ``[KV, NL, NB, BS, NH, HS]`` and the expected canonical host chunk."""

from __future__ import annotations

import torch

from lmcache.v1.platform.ops_types import EngineKVFormat as F
from lmcache.v1.platform.ops_types import PageBufferShapeDesc

SPLIT = {0, 1, 2, 4, 6, 7, 8, 9, 15, 16}
MLA = {3, 5, 14}
FUSED = {10, 11, 12, 13}
SINGLE = {18}
POINTER_FORMATS = [f for f in range(19) if f not in (16, 17)]


def kv_planes(fmt: int) -> int:
    return 2 if fmt in SPLIT else 1


def logical_kv(
    fmt: int, nl: int, nb: int, bs: int, nh: int, hs: int, seed: int = 0
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if fmt == 14:
        return torch.randint(0, 256, (1, nl, nb, bs, 1, 132), generator=g, dtype=torch.uint8)
    if fmt in MLA:
        nh = 1
    if fmt in FUSED:
        hs = 2 * hs  # packed K/V width per head
    return torch.randn(kv_planes(fmt), nl, nb, bs, nh, hs, generator=g).to(torch.float16)


def make_paged(fmt: int, L: torch.Tensor, kv_list_nested: bool = True):
    """Paged operands of ``fmt`` holding the logical KV ``L``."""
    KV, NL, NB, BS, NH, HS = L.shape
    c = lambda t: t.contiguous()  # noqa: E731
    if fmt == 0:
        return c(L.permute(2, 1, 0, 3, 4, 5))
    if fmt == 8:
        return c(L.permute(2, 1, 0, 4, 3, 5))
    if fmt in (4, 9):
        ks, vs = [], []
        for layer in range(NL):
            for k, dst in ((0, ks), (1, vs)):
                t = c(L[k, layer])
                dst.append(t.view(NB * BS, NH, HS) if fmt == 4 else t)
        return [ks, vs] if kv_list_nested else ks + vs
    out = []
    for layer in range(NL):
        x = L[:, layer]  # [KV, NB, BS, NH, HS]
        if fmt == 1:
            t = c(x)
        elif fmt == 2:
            t = c(x.permute(1, 0, 2, 3, 4))
        elif fmt in (3, 14):
            t = c(x[0, :, :, 0, :])
        elif fmt == 5:
            t = c(x[0]).view(NB * BS, 1, HS)
        elif fmt == 6:
            t = c(x.permute(0, 1, 3, 2, 4))
        elif fmt == 7:
            t = c(x.permute(1, 0, 3, 2, 4))
        elif fmt == 10:
            t = c(x[0].view(NB, BS, NH, 2, HS // 2).permute(0, 2, 1, 3, 4))
        elif fmt == 11:
            t = c(x[0]).view(NB, BS, NH, 2, HS // 2)
        elif fmt == 12:
            t = c(x[0].permute(0, 2, 1, 3))
        elif fmt in (13, 18):
            t = c(x[0])
        elif fmt == 15:
            t = c(x.permute(0, 1, 3, 2, 4).unsqueeze(3))
        elif fmt == 16:
            t = (c(x[0]), c(x[1]))
        else:
            raise AssertionError(fmt)
        out.append(t)
    return out


def expected_rows(L: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Canonical rows ``[KV, NL, len(ids)*BS, NH*HS]`` of the given blocks."""
    KV, NL, NB, BS, NH, HS = L.shape
    sel = L[:, :, ids]
    return sel.reshape(KV, NL, len(ids) * BS, NH * HS)


def shape_desc(fmt: int, L: torch.Tensor, with_dtype: bool = True) -> PageBufferShapeDesc:
    KV, NL, NB, BS, NH, HS = L.shape
    return PageBufferShapeDesc(
        kv_size=KV,
        nl=NL,
        nb=NB,
        bs=BS,
        nh=NH,
        hs=HS,
        element_size=L.element_size(),
        block_stride_elems=0,
        dtype=L.dtype if with_dtype else None,
    )


def host_chunk(fmt: int, L: torch.Tensor, chunk_tokens: int, fill: float = 7.0) -> torch.Tensor:
    KV, NL, NB, BS, NH, HS = L.shape
    t = torch.empty(KV, NL, chunk_tokens, NH * HS, dtype=L.dtype)
    if t.dtype == torch.uint8:
        t.fill_(int(fill))
    else:
        t.fill_(fill)
    return t


def paged_blocks(fmt: int, paged, L_shape) -> torch.Tensor:
    """Read paged operands back into the logical layout (inverse of make_paged)."""
    KV, NL, NB, BS, NH, HS = L_shape
    if fmt == 0:
        return paged.permute(2, 1, 0, 3, 4, 5)
    if fmt == 8:
        return paged.permute(2, 1, 0, 4, 3, 5)
    if fmt in (4, 9):
        ks, vs = (paged[0], paged[1]) if isinstance(paged[0], list) else (paged[:NL], paged[NL:])
        return torch.stack(
            [torch.stack([t.reshape(NB, BS, NH, HS) for t in group]) for group in (ks, vs)]
        )
    layers = []
    for t in paged:
        if fmt == 1:
            x = t
        elif fmt == 2:
            x = t.permute(1, 0, 2, 3, 4)
        elif fmt in (3, 14):
            x = t.unsqueeze(2).unsqueeze(0)
        elif fmt == 5:
            x = t.reshape(NB, BS, 1, HS).unsqueeze(0)
        elif fmt == 6:
            x = t.permute(0, 1, 3, 2, 4)
        elif fmt == 7:
            x = t.permute(1, 0, 3, 2, 4)
        elif fmt == 10:
            x = t.permute(0, 2, 1, 3, 4).reshape(NB, BS, NH, HS).unsqueeze(0)
        elif fmt == 11:
            x = t.reshape(NB, BS, NH, HS).unsqueeze(0)
        elif fmt == 12:
            x = t.permute(0, 2, 1, 3).unsqueeze(0)
        elif fmt in (13, 18):
            x = t.unsqueeze(0)
        elif fmt == 15:
            x = t.squeeze(3).permute(0, 1, 3, 2, 4)
        elif fmt == 16:
            x = torch.stack(list(t))
        layers.append(x)
    return torch.stack(layers, dim=1)


def pointer_operands(fmt: int, paged) -> torch.Tensor:
    if fmt in (0, 8):
        return torch.tensor([paged.data_ptr()], dtype=torch.int64)
    if fmt in (4, 9):
        flat = paged[0] + paged[1] if isinstance(paged[0], list) else paged
        return torch.tensor([t.data_ptr() for t in flat], dtype=torch.int64)
    return torch.tensor([t.data_ptr() for t in paged], dtype=torch.int64)


_ = F
