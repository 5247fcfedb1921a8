"""Paged KV <-> host chunk copies, the one copy module of both sides: the server's engine
(lmcache_driven stores and retrieves) and the worker transfer contexts (engine_driven) use it.
It sits below both and imports neither; ``transfer_context.base`` re-exports its names.

Both functions run on the platform's ``multi_layer_block_kv_transfer`` resolved for the
KV tensor's own device (``resolve_device_ops(t.device.type)``), and produce/consume the
canonical host chunk of docs/design/storage-formats.md#host-chunk: ``[2, L, T, NH*HS]`` (``[L, T,
HS]`` for MLA).

``kv_caches`` is a list of per-layer tensors in a vLLM layout: vLLM >= 0.29's fused views
``[NB, NH, BS, 2*HS]`` (HND) / ``[NB, BS, NH, 2*HS]`` (NHD), NHD ``[2, NB, BS, NH, HS]``,
HND ``[2, NB, NH, BS, HS]`` (pass ``layout_hints={"kv_layout": "HND"}``), flashinfer
``[NB, 2, BS, NH, HS]`` / ``[NB, 2, NH, BS, HS]`` or MLA ``[NB, BS, HS]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lmcache.utils import init_logger
from lmcache.v1.platform import resolve_device_ops
from lmcache.v1.platform.base.device_ops import resolve_kv_transfer_operands
from lmcache.v1.platform.kv_layout import detect_engine_kv_format, shape_desc_for
from lmcache.v1.platform.ops_types import (
    EngineKVFormat,
    PageBufferShapeDesc,
    TransferDirection,
    kv_size_of,
)

logger = init_logger(__name__)


@dataclass(frozen=True)
class KVGeometry:
    fmt: EngineKVFormat
    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def block_axis(self) -> int:
        """The num_blocks axis of one layer's tensor."""
        two_first = (EngineKVFormat.NL_X_TWO_NB_BS_NH_HS, EngineKVFormat.NL_X_TWO_NB_NH_BS_HS)
        return 1 if self.fmt in two_first else 0

    @property
    def kv_size(self) -> int:
        """Planes per chunk: 2 (K and V), or 1 for MLA and for fused formats, whose one
        plane holds K and V together (``head_size`` is then the fused width, 2 * HS)."""
        return kv_size_of(self.fmt)

    @property
    def hidden_dim(self) -> int:
        return self.num_heads * self.head_size

    def chunk_shape(self, tokens_per_chunk: int) -> tuple[int, ...]:
        if self.kv_size == 1:
            return (self.num_layers, tokens_per_chunk, self.hidden_dim)
        return (2, self.num_layers, tokens_per_chunk, self.hidden_dim)

    def shape_desc(self) -> PageBufferShapeDesc:
        return PageBufferShapeDesc(
            kv_size=self.kv_size,
            nl=self.num_layers,
            nb=self.num_blocks,
            bs=self.block_size,
            nh=self.num_heads,
            hs=self.head_size,
            element_size=self.dtype.itemsize,
            dtype=self.dtype,
        )


def kv_geometry(
    kv_caches: list[torch.Tensor],
    layout_hints: dict[str, Any] | None = None,
    engine_kv_format: Any = None,
) -> KVGeometry:
    """The engine layout of per-layer KV tensors (the layout hint decides NHD vs HND)."""
    if not kv_caches:
        raise ValueError("kv_caches is empty")
    t = kv_caches[0]
    hint = str((layout_hints or {}).get("kv_layout") or "NHD").upper()
    if engine_kv_format is not None:
        fmt = EngineKVFormat(int(engine_kv_format))
    else:
        fmt = detect_engine_kv_format(t, hint)
    try:
        sd = shape_desc_for(t, fmt, len(kv_caches))
    except ValueError:
        raise ValueError(
            f"engine_kv_format {fmt.name} is not supported by the MP copy path"
        ) from None
    return KVGeometry(fmt, sd.nl, sd.nb, sd.bs, max(1, sd.nh), sd.hs, t.dtype)


def compute_kv_layout(
    kv_caches: Mapping[str, torch.Tensor] | list[torch.Tensor],
    layout_hints: dict[str, Any] | None = None,
    engine_type: Any = None,
) -> tuple[int, int, int, str, EngineKVFormat, int]:
    """0.5.6's summary of a KV layout: ``(block_size, num_layers, hidden_dim_size, dtype_str,
    engine_kv_format, kv_size)``; ``kv_caches`` per layer, by name (0.5.6) or in order."""
    tensors = list(kv_caches.values()) if isinstance(kv_caches, Mapping) else list(kv_caches)
    geo = kv_geometry(tensors, layout_hints)
    dtype_str = str(geo.dtype).removeprefix("torch.")
    return geo.block_size, geo.num_layers, geo.hidden_dim, dtype_str, geo.fmt, geo.kv_size


def _ops_for(t: torch.Tensor) -> Any:
    return resolve_device_ops(t.device.type)


def _select(
    block_ids: list[int], bpc: int, chunk_indices: list[int] | None
) -> tuple[list[int], list[int]]:
    n_chunks = (len(block_ids) + bpc - 1) // bpc
    idx = list(range(n_chunks)) if chunk_indices is None else list(chunk_indices)
    flat: list[int] = []
    for i in idx:
        flat.extend(block_ids[i * bpc : (i + 1) * bpc])
    return idx, flat


def gather_paged_kv_to_cpu(
    kv_caches: list[torch.Tensor],
    block_ids: list[int],
    blocks_per_chunk: int,
    layout_hints: dict[str, Any] | None = None,
    engine_kv_format: Any = None,
    out: list[torch.Tensor] | None = None,
    chunk_indices: list[int] | None = None,
    engine_type: Any = None,
) -> list[torch.Tensor]:
    """Copy the blocks of each selected chunk into host chunks (D2H).

    ``block_ids`` is flat in chunk-token order for the whole range; ``chunk_indices``
    selects chunks (0-based, relative to the range); ``out`` (aligned with the
    selection) receives the data, otherwise fresh CPU chunks are allocated.
    """
    geo = kv_geometry(kv_caches, layout_hints, engine_kv_format)
    idx, flat = _select(list(block_ids), blocks_per_chunk, chunk_indices)
    tokens = blocks_per_chunk * geo.block_size
    if out is None:
        # A last partial chunk (a tail) leaves rows unwritten: zeros, not stale memory.
        alloc = torch.zeros if len(flat) < len(idx) * blocks_per_chunk else torch.empty
        out = [alloc(geo.chunk_shape(tokens), dtype=geo.dtype) for _ in idx]
    if len(out) != len(idx):
        raise ValueError(f"out has {len(out)} chunks but {len(idx)} were selected")
    if not idx:
        return out
    _transfer(kv_caches, list(out), flat, blocks_per_chunk, TransferDirection.D2H, geo, 0)
    return out


def scatter_cpu_to_paged_kv(
    kv_caches: list[torch.Tensor],
    block_ids: list[int],
    chunks: list[torch.Tensor],
    blocks_per_chunk: int,
    skip_first_n_tokens: int = 0,
    layout_hints: dict[str, Any] | None = None,
    engine_kv_format: Any = None,
    engine_type: Any = None,
) -> None:
    """Copy host chunks into the paged KV blocks (H2D); the first ``skip_first_n_tokens``
    tokens (rounded down to whole blocks) are never written."""
    geo = kv_geometry(kv_caches, layout_hints, engine_kv_format)
    if skip_first_n_tokens % geo.block_size:
        logger.error(
            "skip_first_n_tokens %d is not a multiple of block_size %d; rounding down",
            skip_first_n_tokens,
            geo.block_size,
        )
    skip_blocks = skip_first_n_tokens // geo.block_size
    if not chunks:
        return
    _transfer(
        kv_caches,
        list(chunks),
        list(block_ids),
        blocks_per_chunk,
        TransferDirection.H2D,
        geo,
        skip_blocks,
    )


def _transfer(
    kv_caches: list[torch.Tensor],
    chunks: list[torch.Tensor],
    block_ids: list[int],
    bpc: int,
    direction: TransferDirection,
    geo: KVGeometry,
    skip_blocks: int,
) -> None:
    """One ``multi_layer_block_kv_transfer`` in tensor mode; batches of raw pointers of at
    most ``max_objects_per_call`` chunks in pointer mode (docs/design/platform.md#operand-mode)."""
    ops = _ops_for(kv_caches[0])
    device = kv_caches[0].device
    tokens = bpc * geo.block_size
    mode, limit = resolve_kv_transfer_operands(ops)
    if mode == "tensor":
        ops.multi_layer_block_kv_transfer(
            list(kv_caches),
            chunks,
            block_ids,
            device,
            direction,
            geo.shape_desc(),
            tokens,
            geo.fmt,
            skip_blocks,
        )
        return
    host = [_pinned_for_pointer_mode(c, device, direction) for c in chunks]
    paged_ptrs = torch.tensor([t.data_ptr() for t in kv_caches], dtype=torch.int64, device=device)
    step = max(1, int(limit or 1))
    for i in range(0, len(host), step):
        batch = host[i : i + step]
        first_block = i * bpc
        ids = block_ids[first_block : first_block + len(batch) * bpc]
        skip = min(max(0, skip_blocks - first_block), len(ids))
        if not ids or skip == len(ids):
            continue  # every block of this batch is in the skipped prefix
        ops.multi_layer_block_kv_transfer(
            paged_ptrs,
            torch.tensor([c.data_ptr() for c in batch], dtype=torch.int64),
            ids,
            device,
            direction,
            geo.shape_desc(),
            tokens,
            geo.fmt,
            skip,
        )
    if any(h is not c for h, c in zip(host, chunks, strict=True)):
        _synchronize(device)
        if direction == TransferDirection.D2H:
            for h, c in zip(host, chunks, strict=True):
                if h is not c:
                    c.copy_(h)


_warned_staging = False


def _pinned_for_pointer_mode(
    chunk: torch.Tensor, device: torch.device, direction: TransferDirection
) -> torch.Tensor:
    """Pointer kernels DMA to/from host memory: they need contiguous, pinned chunks.

    CPU KV caches need no pinning; unpinned chunks go through a pinned staging copy.
    """
    if device.type == "cpu":
        if not chunk.is_contiguous():
            raise ValueError("pointer-mode transfers need contiguous host chunks")
        return chunk
    if chunk.is_contiguous() and chunk.is_pinned():
        return chunk
    global _warned_staging
    if not _warned_staging:
        _warned_staging = True
        logger.warning(
            "pointer-mode KV transfer on %s got unpinned host chunks; copying through a "
            "pinned staging buffer (pin the chunks to avoid the extra copy)",
            device,
        )
    staged = torch.empty(chunk.shape, dtype=chunk.dtype).pin_memory()
    if direction == TransferDirection.H2D:
        staged.copy_(chunk)
    return staged


def _synchronize(device: torch.device) -> None:
    mod = getattr(torch, device.type, None)
    sync = getattr(mod, "synchronize", None)
    if callable(sync):
        sync()
