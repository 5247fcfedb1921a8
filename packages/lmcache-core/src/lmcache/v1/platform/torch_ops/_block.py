"""``multi_layer_block_kv_transfer``: paged engine blocks <-> canonical host chunks.

Every format is normalised to a list of *planes*: one engine tensor view per
(k_or_v, layer[, plane]) whose first axis is the block axis, plus where its rows go in
the host chunk (viewed as ``[KV, NL, T, W]``). NHD planes are ``[NB, BS, w]`` and move
with one ``index_select``/``index_copy_`` per plane and chunk; HND planes are
``[NB, NH, BS, x]`` and are permuted so each host row is head-major
(docs/design/storage-formats.md#host-chunk).

Runs of consecutive block ids (what an engine hands out for a fresh prompt) move as
slices instead: one strided ``copy_`` per run and layer, the K and V planes of a layer
merged into one view when they share a storage. A copy is memcpy-like and spreads over
the intra-op threads; an index kernel pays per element and runs on one core, so a chunk
whose blocks form a few long runs moves about twice as fast (``lmcache bench kernels``).
Whole chunks that are adjacent slots of one buffer (an SHM pool) and whose blocks continue
one run move together: one copy per layer for the whole request.

The planes of a set of paged tensors are built once and cached while those tensors live.

Why one module of ~780 lines: the plane layout and the copy loops are one algorithm; the
copy paths (runs, whole chunks, index kernels) read ``_Plane``/``_Layout``/``_Group``
directly, and a split would export those internals across files. The seam if it grows:
layout building (``_Plane`` .. ``_cached_layout``) apart from copying (``transfer_blocks``
onwards).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from lmcache.v1.platform.base.block_transfer import BlockTransferPlan, plan_block_transfer
from lmcache.v1.platform.ops_types import (
    EngineKVFormat,
    is_cross_layer,
    is_fused_packed,
    is_hnd,
    is_kv_list,
    is_kv_second_tuple,
    is_mla,
    is_pbs_fused,
    is_single_kv,
)
from lmcache.v1.platform.torch_ops._memory import pointer_view

F = EngineKVFormat

_ELEMENT_DTYPES = {1: torch.uint8, 2: torch.float16, 4: torch.float32}


def is_pointer_tensor(paged: Any) -> bool:
    """True for pointer operands (docs/design/platform.md#operand-mode): a 1-D int64/uint64 tensor
    of addresses."""
    return (
        isinstance(paged, torch.Tensor)
        and paged.dim() == 1
        and paged.dtype in (torch.int64, torch.uint64)
    )


@dataclass
class _Plane:
    view: torch.Tensor  # NHD: [NB, BS, w]; HND: [NB, NH, BS, x]
    hnd: bool
    k: int  # index on the host chunk's KV axis
    layer: int
    col: tuple[int, int] | None = None  # host column slice (plane tuples), else all columns


@dataclass
class _Layout:
    planes: list[_Plane]
    kv: int
    nl: int
    bs: int
    width: int  # host row width in elements of ``dtype``
    dtype: torch.dtype
    device: torch.device

    @functools.cached_property
    def groups(self) -> list[_Group]:
        """The planes merged for slice copies; built only when a chunk moves by runs."""
        return _plane_groups(self.planes)


@dataclass
class _Group:
    """Planes ``k .. k+G-1`` of one layer as one view ``[G, NB, BS, w]`` (HND:
    ``[G, NB, NH, BS, x]``), for slice copies of block runs."""

    view: torch.Tensor
    hnd: bool
    k: int
    layer: int
    col: tuple[int, int] | None


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _plane_groups(planes: list[_Plane]) -> list[_Group]:
    """Merge the planes of a layer that sit at one constant distance in one storage
    (K and V of ``[2, NB, ...]`` or ``[NB, 2, ...]`` layer tensors) into one view."""
    groups: list[_Group] = []
    i = 0
    while i < len(planes):
        p = planes[i]
        v = p.view
        j = i + 1
        step = 0
        while j < len(planes) and p.col is None:
            q = planes[j]
            if (
                q.layer != p.layer
                or q.hnd != p.hnd
                or q.col is not None
                or q.k != p.k + (j - i)
                or q.view.shape != v.shape
                or q.view.stride() != v.stride()
                or q.view.dtype != v.dtype
                or not _same_storage(q.view, v)
            ):
                break
            d = int(q.view.storage_offset()) - int(planes[j - 1].view.storage_offset())
            if d <= 0 or (step and d != step):
                break
            step = d
            j += 1
        if j - i > 1:
            view = v.as_strided((j - i, *v.shape), (step, *v.stride()), v.storage_offset())
        else:
            view = v.unsqueeze(0)
        groups.append(_Group(view, p.hnd, p.k, p.layer, p.col))
        i = j
    return groups


# A chunk moves by slices when its blocks average at least this many per run; below it
# the per-copy overhead costs more than the index kernel (measured on CPU: break-even
# near 4 blocks of 32 KiB).
_MIN_AVG_RUN = 4


def _block_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """``(first block id, offset in ids, length)`` of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    j = 0
    n = len(ids)
    while j < n:
        a = ids[j]
        m = j + 1
        while m < n and ids[m] == a + (m - j):
            m += 1
        runs.append((a, j, m - j))
        j = m
    return runs


def _view(t: torch.Tensor, *shape: int, what: str) -> torch.Tensor:
    try:
        return t.view(*shape)
    except RuntimeError as exc:
        raise ValueError(
            f"cannot view {what} of shape {list(t.shape)} (stride {list(t.stride())}) as "
            f"{list(shape)} without copying: {exc}"
        ) from None


def _check_rank(t: torch.Tensor, ranks: tuple[int, ...], fmt: EngineKVFormat, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{fmt.name}: {what} must be a tensor, got {type(t).__name__}")
    if t.dim() not in ranks:
        raise ValueError(
            f"{fmt.name}: {what} has shape {list(t.shape)}; expected rank {' or '.join(map(str, ranks))}"
        )


def _as_list(paged: Any) -> list:
    if isinstance(paged, torch.Tensor):
        return [paged]
    return list(paged)


def _layer_planes(t: torch.Tensor, fmt: EngineKVFormat, layer: int, bs: int) -> list[_Plane]:
    """Planes of one layer tensor of a layer-list format (not the tuple formats)."""
    if fmt in (F.NL_X_TWO_NB_BS_NH_HS,):
        _check_rank(t, (5, 4), fmt, "layer tensor")
        return [
            _Plane(_view(t[k], t.shape[1], t.shape[2], -1, what="K/V plane"), False, k, layer)
            for k in range(2)
        ]
    if fmt == F.NL_X_NB_TWO_BS_NH_HS:
        _check_rank(t, (5, 4), fmt, "layer tensor")
        return [
            _Plane(_view(t[:, k], t.shape[0], t.shape[2], -1, what="K/V plane"), False, k, layer)
            for k in range(2)
        ]
    if fmt == F.NL_X_TWO_NB_NH_BS_HS:
        _check_rank(t, (5,), fmt, "layer tensor")
        return [_Plane(t[k], True, k, layer) for k in range(2)]
    if fmt == F.NL_X_NB_TWO_NH_BS_HS:
        _check_rank(t, (5,), fmt, "layer tensor")
        return [_Plane(t[:, k], True, k, layer) for k in range(2)]
    if fmt == F.NL_X_TWO_NB_NH_ONE_BS_HS:
        _check_rank(t, (6,), fmt, "layer tensor")
        if t.shape[3] != 1:
            raise ValueError(f"{fmt.name}: dim 3 of {list(t.shape)} must be 1")
        return [_Plane(t[k].select(2, 0), True, k, layer) for k in range(2)]
    if fmt in (F.NL_X_NB_BS_HS, F.NL_X_NB_BSV_BSS):
        _check_rank(t, (3,), fmt, "layer tensor")
        return [_Plane(t, False, 0, layer)]
    if fmt == F.NL_X_NBBS_ONE_HS:
        _check_rank(t, (3, 2), fmt, "layer tensor")
        return [_Plane(_view(t, -1, bs, t.shape[-1], what="MLA layer"), False, 0, layer)]
    if fmt in (F.NL_X_NB_NH_BS_TWO_HS, F.NL_X_NB_NH_BS_CS):
        _check_rank(t, (5, 4), fmt, "layer tensor")
        return [
            _Plane(
                _view(t, t.shape[0], t.shape[1], t.shape[2], -1, what="fused layer"), True, 0, layer
            )
        ]
    if fmt in (F.NL_X_NB_BS_NH_TWO_HS, F.NL_X_NB_BS_NH_CS, F.NL_X_NB_BS_NH_HS):
        _check_rank(t, (5, 4, 3), fmt, "layer tensor")
        return [_Plane(_view(t, t.shape[0], t.shape[1], -1, what="layer"), False, 0, layer)]
    raise ValueError(f"{fmt.name} is not a per-layer tensor format")  # pragma: no cover


def _plane_bs(p: _Plane) -> int:
    return int(p.view.shape[2] if p.hnd else p.view.shape[1])


def _plane_width(p: _Plane) -> int:
    v = p.view
    return int(v.shape[1] * v.shape[3]) if p.hnd else int(v.shape[2])


def _prod(dims: Any) -> int:
    out = 1
    for d in dims:
        out *= int(d)
    return out


def _pointer_tensors(
    ptrs: torch.Tensor, fmt: EngineKVFormat, sd: Any, dtype: torch.dtype, device: Any
) -> Any:
    """Rebuild paged tensors from device addresses (docs/design/platform.md#block-transfer)."""
    if is_kv_second_tuple(fmt):
        raise ValueError(f"{fmt.name} (a tuple format) has no pointer form; pass tensors")
    nb, nl, bs, nh, hs = int(sd.nb), int(sd.nl), int(sd.bs), int(sd.nh), int(sd.hs)
    if min(nb, bs, hs) <= 0:
        raise ValueError(
            f"pointer operands need shape_desc nb/bs/hs > 0 (got nb={nb}, bs={bs}, hs={hs})"
        )
    nh = nh or 1
    per: list[tuple[int, ...]]  # one shape per pointer
    if fmt == F.NB_NL_TWO_BS_NH_HS:
        per = [(nb, nl, 2, bs, nh, hs)]
    elif fmt == F.NB_NL_TWO_NH_BS_HS:
        per = [(nb, nl, 2, nh, bs, hs)]
    elif fmt == F.TWO_X_NL_X_NBBS_NH_HS:
        per = [(nb * bs, nh, hs)] * (2 * nl)
    elif fmt == F.TWO_X_NL_X_NB_BS_NH_HS:
        per = [(nb, bs, nh, hs)] * (2 * nl)
    else:
        shape = {
            F.NL_X_NBBS_ONE_HS: (nb * bs, 1, hs),
            F.NL_X_NB_BS_HS: (nb, bs, hs),
            F.NL_X_NB_BSV_BSS: (nb, bs, hs),
            F.NL_X_NB_NH_BS_TWO_HS: (nb, nh, bs, hs),
            F.NL_X_NB_NH_BS_CS: (nb, nh, bs, hs),
            F.NL_X_NB_BS_NH_TWO_HS: (nb, bs, nh, hs),
            F.NL_X_NB_BS_NH_CS: (nb, bs, nh, hs),
            F.NL_X_NB_BS_NH_HS: (nb, bs, nh, hs),
            F.NL_X_TWO_NB_NH_BS_HS: (2, nb, nh, bs, hs),
            F.NL_X_TWO_NB_BS_NH_HS: (2, nb, bs, nh, hs),
            F.NL_X_NB_TWO_NH_BS_HS: (nb, 2, nh, bs, hs),
            F.NL_X_NB_TWO_BS_NH_HS: (nb, 2, bs, nh, hs),
            F.NL_X_TWO_NB_NH_ONE_BS_HS: (2, nb, nh, 1, bs, hs),
        }[fmt]
        per = [shape] * int(ptrs.numel())
    shape0 = per[0]
    if is_pbs_fused(fmt):
        natural = bs * _prod(shape0[1:])
    elif shape0[0] == 2 and not is_cross_layer(fmt):  # two-major: blocks live inside one plane
        natural = _prod(shape0[2:])
    else:
        natural = _prod(shape0[1:])
    stride = int(getattr(sd, "block_stride_elems", 0) or 0)
    if stride and stride != natural:
        raise NotImplementedError(
            f"block_stride_elems={stride} (non-tight blocks; tight is {natural}) is not "
            f"supported with pointer operands by the torch baseline for {fmt.name}; pass tensors"
        )
    addrs = [int(a) for a in ptrs.tolist()]
    if len(addrs) != len(per):
        raise ValueError(f"{fmt.name}: expected {len(per)} paged pointers, got {len(addrs)}")
    tensors = [pointer_view(a, shape, dtype, device) for a, shape in zip(addrs, per, strict=False)]
    if is_cross_layer(fmt):
        return tensors[0]
    return tensors


def _build_layout(paged: Any, fmt: EngineKVFormat, sd: Any) -> _Layout:
    bs_hint = int(getattr(sd, "bs", 0) or 0)
    planes: list[_Plane] = []
    if is_cross_layer(fmt):
        items = _as_list(paged)
        if len(items) != 1:
            raise ValueError(f"{fmt.name}: expected one cross-layer tensor, got {len(items)}")
        t = items[0]
        _check_rank(t, (6,), fmt, "cross-layer tensor")
        nl, kv = int(t.shape[1]), 2
        hnd = is_hnd(fmt)
        for layer in range(nl):
            for k in range(2):
                v = t[:, layer, k]
                if not hnd:
                    v = _view(v, v.shape[0], v.shape[1], -1, what="cross-layer plane")
                planes.append(_Plane(v, hnd, k, layer))
    elif is_kv_list(fmt):
        items = list(paged)
        if len(items) == 2 and isinstance(items[0], (list, tuple)):
            keys, values = list(items[0]), list(items[1])
        else:
            if len(items) % 2:
                raise ValueError(
                    f"{fmt.name}: a flat K/V list needs an even length, got {len(items)}"
                )
            keys, values = items[: len(items) // 2], items[len(items) // 2 :]
        if len(keys) != len(values):
            raise ValueError(f"{fmt.name}: {len(keys)} K tensors but {len(values)} V tensors")
        nl, kv = len(keys), 2
        for k, group in enumerate((keys, values)):
            for layer, t in enumerate(group):
                if is_pbs_fused(fmt):
                    _check_rank(t, (3, 2), fmt, "K/V tensor")
                    if bs_hint <= 0:
                        raise ValueError(f"{fmt.name} needs shape_desc.bs > 0 (tokens per block)")
                    v = _view(t, -1, bs_hint, t[0].numel(), what="K/V tensor")
                else:
                    _check_rank(t, (4, 3), fmt, "K/V tensor")
                    v = _view(t, t.shape[0], t.shape[1], -1, what="K/V tensor")
                planes.append(_Plane(v, False, k, layer))
    elif is_kv_second_tuple(fmt):
        layers = _as_list(paged)
        nl = len(layers)
        if is_mla(fmt):  # plane tuples, possibly mixed dtypes: move raw bytes
            kv, width = 1, None
            for layer, group in enumerate(layers):
                col = 0
                for p in group if isinstance(group, (list, tuple)) else (group,):
                    _check_rank(p, (4, 3), fmt, "plane")
                    raw = _view(p, p.shape[0], p.shape[1], -1, what="plane").view(torch.uint8)
                    planes.append(_Plane(raw, False, 0, layer, (col, col + raw.shape[2])))
                    col += raw.shape[2]
                if width is None:
                    width = col
                elif width != col:
                    raise ValueError(
                        f"{fmt.name}: layer {layer} has {col} bytes per token, expected {width}"
                    )
            dtype = torch.uint8
        else:
            kv = 2
            for layer, pair in enumerate(layers):
                if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                    raise ValueError(f"{fmt.name}: layer {layer} must be a (K, V) tuple")
                for k in range(2):
                    t = pair[k]
                    _check_rank(t, (4, 3), fmt, "K/V tensor")
                    planes.append(
                        _Plane(_view(t, t.shape[0], t.shape[1], -1, what="K/V"), False, k, layer)
                    )
    else:
        layers = _as_list(paged)
        nl = len(layers)
        kv = 1 if (is_mla(fmt) or is_fused_packed(fmt) or is_single_kv(fmt)) else 2
        for layer, t in enumerate(layers):
            planes.extend(_layer_planes(t, fmt, layer, bs_hint))
    if not planes:
        raise ValueError(f"{fmt.name}: no paged KV tensors given")
    bs = _plane_bs(planes[0])
    if bs_hint and bs_hint != bs:
        raise ValueError(
            f"shape_desc.bs={bs_hint} does not match the {bs} tokens per block of the "
            f"{fmt.name} tensors; check engine_kv_format and the layout hint"
        )
    if fmt != F.NL_X_NP_X_NB_BS_ONE_HS:
        width = _plane_width(planes[0])
        dtype = planes[0].view.dtype
    for p in planes:
        if _plane_bs(p) != bs or (p.col is None and _plane_width(p) != width):
            raise ValueError(f"{fmt.name}: paged tensors disagree on block size or row width")
    return _Layout(planes, kv, nl, bs, width, dtype, planes[0].view.device)  # type: ignore[arg-type]


# Layouts of the paged tensors an engine passes on every call (the same tensor objects for
# its lifetime): building one costs about 1 ms for 32 layers, a tenth of a 64 MiB copy.
# An entry goes when any of its tensors is freed, so it never keeps a KV cache alive.
_LAYOUTS: dict[tuple, tuple[list[weakref.ref], tuple, _Layout]] = {}
_LAYOUTS_MAX = 16


def _paged_tensors(paged: Any) -> tuple[list[torch.Tensor], tuple[int, ...]] | None:
    """The tensors of a paged operand and how they nest (part of the cache key), or None
    when it holds anything else (then no layout is cached)."""
    if isinstance(paged, torch.Tensor):
        return [paged], ()
    if not isinstance(paged, (list, tuple)):
        return None
    tensors: list[torch.Tensor] = []
    nesting: list[int] = []
    for item in paged:
        if isinstance(item, torch.Tensor):
            tensors.append(item)
            nesting.append(-1)
        elif isinstance(item, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in item):
            tensors.extend(item)
            nesting.append(len(item))
        else:
            return None
    return tensors, tuple(nesting)


def _detached(paged: Any) -> Any:
    if isinstance(paged, torch.Tensor):
        return paged.detach()
    return type(paged)(_detached(item) for item in paged)


def _tensor_facts(tensors: list[torch.Tensor]) -> tuple:
    # What a cached layout's views depend on; an in-place set_/resize_ changes it.
    return tuple((t.data_ptr(), t.shape, t.stride()) for t in tensors)


def _cached_layout(paged: Any, fmt: EngineKVFormat, sd: Any) -> _Layout:
    found = _paged_tensors(paged)
    if found is None:
        return _build_layout(paged, fmt, sd)
    tensors, nesting = found
    key = (fmt, int(getattr(sd, "bs", 0) or 0), nesting, tuple(map(id, tensors)))
    facts = _tensor_facts(tensors)
    entry = _LAYOUTS.get(key)
    if entry is not None:
        refs, known, layout = entry
        if known == facts and all(r() is t for r, t in zip(refs, tensors, strict=True)):
            return layout
    # Built from detached aliases: a view keeps its base tensor alive (``_base``), which
    # would keep the engine's tensors, and so this entry, alive forever.
    layout = _build_layout(_detached(paged), fmt, sd)

    def forget(_ref: weakref.ref, key: tuple = key, layouts: dict = _LAYOUTS) -> None:
        layouts.pop(key, None)  # bound here: at interpreter exit module globals are None

    try:
        refs = [weakref.ref(t, forget) for t in tensors]
    except TypeError:  # a tensor subclass without weak references: nothing is cached
        return layout
    while len(_LAYOUTS) >= _LAYOUTS_MAX:
        try:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        except (StopIteration, KeyError, RuntimeError):  # emptied by another thread
            break
    _LAYOUTS[key] = (refs, facts, layout)
    return layout


def infer_pointer_dtype(sd: Any, objects: Any) -> torch.dtype:
    """KV dtype for pointer operands: ``sd.dtype``, else the first tensor object's dtype,
    else the dtype of ``sd.element_size`` (1, 2, 4 bytes); ValueError otherwise.
    Backends that rebuild device tensors from addresses use it too."""
    dt = getattr(sd, "dtype", None)
    if isinstance(dt, torch.dtype):
        return dt
    for obj in objects:
        if isinstance(obj, torch.Tensor):
            return obj.dtype
    es = int(getattr(sd, "element_size", 0) or 0)
    if es in _ELEMENT_DTYPES:
        return _ELEMENT_DTYPES[es]
    if es:
        raise ValueError(f"shape_desc.element_size={es} has no dtype; set shape_desc.dtype")
    raise ValueError("cannot infer the KV dtype: set shape_desc.dtype or shape_desc.element_size")


def _host_view(obj: Any, layout: _Layout, index: int) -> torch.Tensor:
    """Object ``index`` as ``[KV, NL, T_obj, W]`` in the layout's dtype (zero-copy)."""
    if isinstance(obj, int) and not isinstance(obj, bool):
        raise AssertionError("pointer objects are rebuilt before this point")  # pragma: no cover
    if not isinstance(obj, torch.Tensor):
        raise ValueError(
            f"lmcache object {index} must be a tensor or a host address, got {type(obj).__name__}"
        )
    t = obj
    if t.dtype != layout.dtype and t.element_size() == layout.dtype.itemsize:
        t = t.view(layout.dtype)  # bitwise: same element size, reinterpret in place
    elif t.dtype != layout.dtype:
        if not t.is_contiguous():
            raise ValueError(
                f"lmcache object {index} ({t.dtype}) must be contiguous to be reinterpreted as {layout.dtype}"
            )
        t = t.reshape(-1).view(layout.dtype)
    per_token = layout.kv * layout.nl * layout.width
    if t.numel() % per_token:
        raise ValueError(
            f"lmcache object {index} has {t.numel()} elements, not a multiple of "
            f"{layout.kv}x{layout.nl}x{layout.width} (KV x layers x row width)"
        )
    return _view(t, layout.kv, layout.nl, -1, layout.width, what=f"lmcache object {index}")


def _check_block_range(lo: int, hi: int, nb: int) -> None:
    # Checked on the host so a bad id never reaches a device-side index (a fatal assert).
    if lo < 0 or hi >= nb:
        bad = lo if lo < 0 else hi
        raise ValueError(f"block id {bad} is outside the paged cache's {nb} blocks [0, {nb})")


def transfer_blocks(plan: BlockTransferPlan) -> None:
    """The torch baseline of ``DeviceOps.transfer_blocks``: runs ``plan`` on any device."""
    fmt = plan.engine_kv_format
    objects: list[Any]  # host addresses or chunk tensors
    if isinstance(plan.objects, torch.Tensor):  # a tensor of host addresses
        objects = [int(a) for a in plan.objects.reshape(-1).tolist()]
    else:
        objects = list(plan.objects)
    paged, shape_desc = plan.paged, plan.shape_desc
    if is_pointer_tensor(paged):
        dtype = infer_pointer_dtype(shape_desc, objects)
        dev = torch.device(plan.device) if plan.device is not None else torch.device("cpu")
        paged = _pointer_tensors(paged, fmt, shape_desc, dtype, dev)
        layout = _build_layout(paged, fmt, shape_desc)
    else:
        layout = _cached_layout(paged, fmt, shape_desc)
    bs = layout.bs
    bpo = plan.blocks_per_object(bs)

    nb = int(layout.planes[0].view.shape[0])
    id_list: list[int] | None = None  # host copy of the ids, for finding runs
    block_ids = plan.block_ids
    if isinstance(block_ids, torch.Tensor):
        flat_ids = block_ids.reshape(-1)
        if flat_ids.device.type == "cpu" and flat_ids.numel():
            _check_block_range(int(flat_ids.min()), int(flat_ids.max()), nb)
            id_list = [int(b) for b in flat_ids.tolist()]
        ids = flat_ids.to(device=layout.device, dtype=torch.long)
    else:
        id_list = [int(b) for b in block_ids]
        if id_list:
            _check_block_range(min(id_list), max(id_list), nb)
        ids = torch.as_tensor(id_list, dtype=torch.long, device=layout.device)
    n = int(ids.numel())
    spans = plan.replace(objects=objects).chunk_spans(n, bs)
    if not spans:
        return

    if any(isinstance(o, int) and not isinstance(o, bool) for o in objects):
        if fmt == F.NL_X_NP_X_NB_BS_ONE_HS:
            raise ValueError(f"{fmt.name} has no pointer form for lmcache objects; pass tensors")
        shape = (layout.kv, layout.nl, plan.chunk_size, layout.width)
        objects = [
            pointer_view(o, shape, layout.dtype, "cpu") if isinstance(o, int) else o
            for o in objects
        ]

    d2h = plan.d2h
    moved = _copy_whole_chunks(layout, objects, id_list, bpo, plan.skip_blocks, n, d2h)
    for span in spans:
        i = span.index
        if i in moved:
            continue
        host = _host_view(objects[i], layout, i)
        t0, nt = span.first_token, span.num_tokens
        if t0 + nt > host.shape[2]:
            raise ValueError(
                f"lmcache object {i} holds {host.shape[2]} tokens; rows {t0}..{t0 + nt} needed"
            )
        idx = ids[span.blocks]
        nblk = span.num_blocks
        runs = _block_runs(id_list[span.blocks]) if id_list is not None else None
        if runs is not None and len(runs) * _MIN_AVG_RUN > nblk:
            runs = None
        if d2h:
            if runs is not None:
                _copy_runs(layout, host.unsqueeze(0), runs, t0, d2h=True)
            else:
                _gather(layout, host, idx, nblk, t0, nt)
        else:
            src = (
                host if host.device == layout.device else host.to(layout.device, non_blocking=True)
            )
            if runs is not None:
                _copy_runs(layout, src.unsqueeze(0), runs, t0, d2h=False)
            else:
                _scatter(layout, src, idx, nblk, t0, nt)


def _copy_whole_chunks(
    layout: _Layout,
    objects: list[Any],
    id_list: list[int] | None,
    bpo: int,
    skip: int,
    n: int,
    d2h: bool,
) -> range:
    """Move the wholly transferred chunks in one copy per layer group when their blocks are
    one run of consecutive ids and their host chunks lie at one stride in one storage
    (adjacent slots of a pool, as a fresh prompt gets): a 512-token request then takes 32
    copies instead of 64, each with its thread fork/join and view setup. Returns the chunks
    moved, an empty range when the case does not apply."""
    lo, hi = -(-skip // bpo), n // bpo
    if id_list is None or hi - lo < 2:
        return range(0)
    first = id_list[lo * bpo]
    if id_list[lo * bpo : hi * bpo] != list(range(first, first + (hi - lo) * bpo)):
        return range(0)
    hosts = [_host_view(objects[i], layout, i) for i in range(lo, hi)]
    stacked = _stacked(hosts, layout.device, bpo * layout.bs)
    if stacked is None:
        return range(0)
    _copy_runs(layout, stacked, [(first, 0, bpo)], 0, d2h)
    return range(lo, hi)


def _stacked(hosts: list[torch.Tensor], device: torch.device, rows: int) -> torch.Tensor | None:
    """Host chunks ``[KV, NL, T, W]`` as one view ``[C, KV, NL, T, W]`` when they share a
    storage, shape and strides and start at one constant, non-overlapping distance; else None."""
    h0 = hosts[0]
    if h0.device != device or h0.shape[2] < rows:
        return None
    shape, stride, off = h0.shape, h0.stride(), h0.storage_offset()
    step = hosts[1].storage_offset() - off
    extent = 1 + sum((d - 1) * st for d, st in zip(shape, stride, strict=True))
    if step < extent:
        return None
    base = h0.untyped_storage().data_ptr()
    for i, h in enumerate(hosts):
        if (
            h.storage_offset() != off + i * step
            or h.shape != shape
            or h.stride() != stride
            or h.dtype != h0.dtype
            or h.device != device
            or h.untyped_storage().data_ptr() != base
        ):
            return None
    return h0.as_strided((len(hosts), *shape), (step, *stride), off)


def _rows(host: torch.Tensor, p: _Plane, t0: int, nt: int) -> torch.Tensor:
    rows = host[p.k, p.layer, t0 : t0 + nt]
    if p.col is not None:
        rows = rows[:, p.col[0] : p.col[1]]
    return rows


# Widest element type first: CPU index_copy_ costs per element, so moving rows as
# 16-byte elements is several times faster than as fp16. Copies stay bitwise.
_CARRIERS = (torch.complex128, torch.int64, torch.int32, torch.int16)


def _as_carrier(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if a.dtype != b.dtype or a.device.type != "cpu":
        return a, b
    for dt in _CARRIERS:
        if dt.itemsize <= a.element_size():
            break
        try:
            return a.view(dt), b.view(dt)
        except RuntimeError:
            continue
    return a, b


def _gather(
    layout: _Layout, host: torch.Tensor, idx: torch.Tensor, nblk: int, t0: int, nt: int
) -> None:
    same_device = host.device == layout.device
    for p in layout.planes:
        dst = _rows(host, p, t0, nt).unflatten(0, (nblk, layout.bs))
        if p.hnd:
            g = p.view.index_select(0, idx)  # [n, NH, BS, x]
            dst.unflatten(2, (g.shape[1], g.shape[3])).copy_(
                g.permute(0, 2, 1, 3), non_blocking=True
            )
        elif same_device and dst.is_contiguous():
            src, out = _as_carrier(p.view, dst)
            torch.index_select(src, 0, idx, out=out)  # one pass, straight into the chunk
        else:
            dst.copy_(p.view.index_select(0, idx), non_blocking=True)


def _scatter(
    layout: _Layout, host: torch.Tensor, idx: torch.Tensor, nblk: int, t0: int, nt: int
) -> None:
    for p in layout.planes:
        src = _rows(host, p, t0, nt).unflatten(0, (nblk, layout.bs))
        if p.hnd:
            # index_copy_ from the permuted rows costs per (2-byte) element: lay the blocks
            # out in the engine's order first, then copy them as wide elements.
            nh, x = p.view.shape[1], p.view.shape[3]
            blocks = src.unflatten(2, (nh, x)).permute(0, 2, 1, 3).contiguous()
            dst, blocks = _as_carrier(p.view, blocks)
            dst.index_copy_(0, idx, blocks)
        else:
            dst, src = _as_carrier(p.view, src)
            dst.index_copy_(0, idx, src)


def _run_pair(
    layout: _Layout, host: torch.Tensor, g: _Group, a: int, j: int, n: int, t0: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(host rows, engine blocks) for group ``g`` of ``host`` ``[C, KV, NL, T, W]``: rows
    ``t0 + j*BS`` on of each of the C chunks take ``n`` blocks each, the engine blocks from
    ``a`` on (``C*n`` in one run). Both shaped ``[G, C, n, BS, ...]`` in host row order, each
    built as one strided view (the slicing it replaces cost more than a 1 MiB copy's setup)."""
    bs = layout.bs
    c = host.shape[0]
    h_c, h_k, h_l, h_t, h_w = host.stride()
    off = host.storage_offset() + g.k * h_k + g.layer * h_l + (t0 + j * bs) * h_t
    v = g.view
    if g.hnd:
        n_g, _, nh, _, x = v.shape
        s_g, s_b, s_h, s_t, s_x = v.stride()
        shape: tuple[int, ...] = (n_g, c, n, bs, nh, x)
        blocks = v.as_strided(
            shape, (s_g, n * s_b, s_b, s_t, s_h, s_x), v.storage_offset() + a * s_b
        )
        rows = host.as_strided(shape, (h_k, h_c, bs * h_t, h_t, x * h_w, h_w), off)
        return rows, blocks
    n_g, _, _, w = v.shape
    s_g, s_b, s_t, s_w = v.stride()
    if g.col is not None:
        off += g.col[0] * h_w
    shape = (n_g, c, n, bs, w)
    blocks = v.as_strided(shape, (s_g, n * s_b, s_b, s_t, s_w), v.storage_offset() + a * s_b)
    rows = host.as_strided(shape, (h_k, h_c, bs * h_t, h_t, h_w), off)
    return rows, blocks


def _copy_runs(
    layout: _Layout, host: torch.Tensor, runs: list[tuple[int, int, int]], t0: int, d2h: bool
) -> None:
    """Slice copies of block runs ``(first id, block offset in each chunk, blocks per chunk)``
    between ``host`` ``[C, KV, NL, T, W]`` and the engine tensors."""
    for g in layout.groups:
        for a, j, n in runs:
            rows, blocks = _run_pair(layout, host, g, a, j, n, t0)
            if d2h:
                rows.copy_(blocks, non_blocking=True)
            else:
                blocks.copy_(rows)


def multi_layer_block_kv_transfer(
    paged_buffer_ptrs_tensor: Any,
    lmcache_objects_ptrs: Any,
    block_ids: Any,
    device: Any,
    direction: Any,
    shape_desc: Any,
    lmcache_chunk_size: int,
    engine_kv_format: Any,
    skip_prefix_n_blocks: int,
) -> None:
    """The torch baseline of ``DeviceOps.multi_layer_block_kv_transfer``: check the nine
    arguments into a plan (``base.block_transfer.plan_block_transfer``), then
    ``transfer_blocks``."""
    transfer_blocks(
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
