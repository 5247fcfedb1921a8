"""Python side of the CUDA/HIP kernels shared by lmcache-cuda and lmcache-rocm.

Each wheel's ``cuda_ops`` module imports its compiled ``_C`` (raw addresses + stream
handle, no torch C++ ABI) and calls :func:`make_native_ops` to get functions with the
baseline signatures, which ``bind_native`` then binds. Operands the kernels cannot take
(tuple formats, non-tight blocks, tensors off the GPU, pageable host chunks) go to the
torch baseline unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch as _torch

from lmcache.v1.platform import ops_types as _ops_types
from lmcache.v1.platform import torch_ops as _torch_ops
from lmcache.v1.platform.base.block_transfer import plan_block_transfer

# Tuple formats have no pointer form; everything else is one generic strided kernel.
_NO_POINTER_FORM = {
    int(_ops_types.EngineKVFormat.NL_X_TWO_X_NB_BS_NH_HS),
    int(_ops_types.EngineKVFormat.NL_X_NP_X_NB_BS_ONE_HS),
}


def _flatten(paged) -> list:
    out = []
    for item in paged:
        if isinstance(item, (list, tuple)):
            out.extend(_flatten(item))
        else:
            out.append(item)
    return out


def _plane_and_chunk_bytes(fmt: int, sd, elem: int, chunk: int) -> tuple[int, int]:
    """Bytes of one paged pointer's tensor and of one host chunk, from shape_desc."""
    nl, nb, bs, nh, hs = (int(sd.nl), int(sd.nb), int(sd.bs), int(sd.nh), int(sd.hs))
    kv = _ops_types.kv_size_of(fmt)
    plane = nb * bs * nh * hs * elem
    if _ops_types.is_cross_layer(fmt):
        plane *= nl * 2
    elif not _ops_types.is_kv_list(fmt):
        plane *= kv
    return plane, kv * nl * chunk * nh * hs * elem


def _paged_pointer_tensor(paged, device, plane_bytes: int):
    """int64 device tensor of plane addresses, or None when the operands need the
    Python path (non-contiguous tensors, tuples, tensors off the GPU, or tensors whose
    size disagrees with shape_desc: the kernel must never address past them)."""
    if _torch_ops.is_pointer_tensor(paged):
        return paged.to(device=device, dtype=_torch.int64).contiguous()
    if isinstance(paged, _torch.Tensor):
        tensors = [paged]
    else:
        tensors = _flatten(paged)
    ptrs = []
    for t in tensors:
        if not isinstance(t, _torch.Tensor) or t.device.type != "cuda" or not t.is_contiguous():
            return None
        if t.numel() * t.element_size() != plane_bytes:
            return None
        ptrs.append(t.data_ptr())
    return _torch.tensor(ptrs, dtype=_torch.int64, device=device)


def _object_pointers(objects, chunk_bytes: int):
    """Device-visible chunk addresses (ints pass through), or None for the Python path."""
    ptrs = []
    for obj in objects:
        if isinstance(obj, int):
            ptrs.append(obj)
            continue
        if not isinstance(obj, _torch.Tensor) or not obj.is_contiguous():
            return None
        if obj.numel() * obj.element_size() < chunk_bytes:
            return None
        if obj.device.type == "cpu" and not obj.is_pinned():
            return None  # the kernel can only reach pinned host memory
        ptrs.append(obj.data_ptr())
    return ptrs


def _element_size(shape_desc, paged, objects) -> int:
    if getattr(shape_desc, "dtype", None) is not None:
        return shape_desc.dtype.itemsize
    for t in _flatten(paged) if not isinstance(paged, _torch.Tensor) else [paged]:
        if isinstance(t, _torch.Tensor) and t.dtype not in (_torch.int64, _torch.uint64):
            return t.element_size()
    for obj in objects:
        if isinstance(obj, _torch.Tensor):
            return obj.element_size()
    if getattr(shape_desc, "element_size", 0):
        return int(shape_desc.element_size)
    raise ValueError("cannot infer the KV dtype: set shape_desc.dtype or shape_desc.element_size")


def make_native_ops(C: Any) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(multi_layer_block_kv_transfer, lmcache_memcpy_async) over the compiled module ``C``."""

    def multi_layer_block_kv_transfer(*args: Any, **kwargs: Any) -> None:
        """The op, arguments as ``plan_block_transfer`` takes them."""
        plan = plan_block_transfer(*args, **kwargs)
        fmt = int(plan.engine_kv_format)
        sd = plan.shape_desc
        fallback = fmt in _NO_POINTER_FORM or int(getattr(sd, "block_stride_elems", 0) or 0)
        dev = plan.device
        dev = _torch.device(dev) if not isinstance(dev, _torch.device) else dev
        paged = objs = None
        if not fallback:
            elem = _element_size(sd, plan.paged, plan.objects)
            plane, chunk = _plane_and_chunk_bytes(fmt, sd, elem, plan.chunk_size)
            paged = _paged_pointer_tensor(plan.paged, dev, plane)
            objs = None if paged is None else _object_pointers(plan.objects, chunk)
        if paged is None or objs is None:
            return _torch_ops.transfer_blocks(plan)
        block_ids = plan.block_ids
        if isinstance(block_ids, _torch.Tensor):
            ids = block_ids.reshape(-1)
            if ids.dtype not in (_torch.int32, _torch.int64):
                ids = ids.to(_torch.int64)
            ids = ids.to(dev).contiguous()
        else:
            ids = _torch.tensor(list(block_ids), dtype=_torch.int64, device=dev)
        stream = _torch.cuda.current_stream(dev).cuda_stream
        C.block_kv_transfer(
            paged.data_ptr(),
            paged.numel(),
            objs,
            ids.data_ptr(),
            ids.numel(),
            ids.dtype == _torch.int32,
            int(plan.direction),
            fmt,
            int(sd.nl),
            int(sd.nb),
            int(sd.bs),
            int(sd.nh),
            int(sd.hs),
            elem,
            plan.chunk_size,
            plan.skip_blocks,
            stream,
        )

    def lmcache_memcpy_async(
        dest, src, nbytes, direction, host_buffer_offset, host_buffer_alignments
    ):
        if not (isinstance(dest, int) and isinstance(src, int)):
            return _torch_ops.lmcache_memcpy_async(
                dest, src, nbytes, direction, host_buffer_offset, host_buffer_alignments
            )
        stream = _torch.cuda.current_stream().cuda_stream
        C.memcpy_async(
            dest, src, nbytes, int(direction), host_buffer_offset, host_buffer_alignments, stream
        )

    return multi_layer_block_kv_transfer, lmcache_memcpy_async
