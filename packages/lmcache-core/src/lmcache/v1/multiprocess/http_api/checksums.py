"""The digests of /cache/checksums."""

from __future__ import annotations

import hashlib
from typing import Any


def block_checksums(
    kv_caches: list[Any],
    layout_hints: dict[str, Any] | None,
    block_ids: list[int],
    blocks_per_chunk: int,
    layerwise: bool,
) -> dict[str, Any]:
    """MD5 digests of the paged KV blocks ``block_ids``, ``blocks_per_chunk`` per chunk.

    A chunk's digest covers, layer after layer, that layer's blocks of the chunk taken along
    its block axis (bfloat16 hashed as float32); with ``layerwise`` each layer gets its own
    list under ``"layer_<i>"``. These are the digests 0.5.6's ``/cache/checksums`` and its
    bench client compute, so digests from either server compare equal for equal KV data."""
    import torch

    from lmcache.v1.multiprocess.kv_copy import kv_geometry

    axis = kv_geometry(kv_caches, layout_hints).block_axis
    n = len(block_ids)
    bounds = [(s, min(s + blocks_per_chunk, n)) for s in range(0, n, blocks_per_chunk)]
    per_layer = []
    for kv in kv_caches:
        idx = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
        blocks = kv.index_select(axis, idx).cpu()
        if blocks.dtype == torch.bfloat16:
            blocks = blocks.to(torch.float32)
        per_layer.append(blocks)

    def chunk_bytes(blocks: Any, s: int, e: int) -> bytes:
        return blocks.narrow(axis, s, e - s).contiguous().view(torch.uint8).numpy().tobytes()

    if layerwise:
        sums: Any = {
            f"layer_{li}": [hashlib.md5(chunk_bytes(b, s, e)).hexdigest() for s, e in bounds]
            for li, b in enumerate(per_layer)
        }
    else:
        sums = []
        for s, e in bounds:
            md5 = hashlib.md5()
            for b in per_layer:
                md5.update(chunk_bytes(b, s, e))
            sums.append(md5.hexdigest())
    return {
        "status": "success",
        "chunk_size": blocks_per_chunk,
        "num_chunks": len(bounds),
        "chunk_checksums": sums,
        "layerwise": layerwise,
    }


def compress_ranges(ids: list[int]) -> list[int | list[int]]:
    """Runs of 3+ consecutive ids as ``[first, last]``, the rest as they are, order kept:
    ``[1, 2, 3, 4, 7, 8] -> [[1, 4], 7, 8]``."""
    out: list[int | list[int]] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        if j - i >= 2:
            out.append([ids[i], ids[j]])
        else:
            out.extend(ids[i : j + 1])
        i = j + 1
    return out
