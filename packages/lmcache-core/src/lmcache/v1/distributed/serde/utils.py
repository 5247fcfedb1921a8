"""Helpers of the L2 serde wrapper (LMCache 0.5.6's ``lmcache.v1.distributed.serde.utils``)."""

from __future__ import annotations

import os

import torch

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde.base import SerdeProcessor

__all__ = ["layout_nbytes", "make_temp_key", "serialized_layout_desc"]


def layout_nbytes(layout_desc: MemoryLayoutDesc) -> int:
    """Bytes of the KV data ``layout_desc`` describes (all groups)."""
    total = 0
    for shape, dtype in zip(layout_desc.shapes, layout_desc.dtypes, strict=True):
        total += torch.Size(shape).numel() * dtype.itemsize
    return total


def serialized_layout_desc(
    layout_desc: MemoryLayoutDesc, serde: SerdeProcessor
) -> MemoryLayoutDesc:
    """The flat uint8 layout of a temporary buffer that holds one serialized object of
    ``layout_desc`` (``serde.estimate_serialized_size`` bytes, at least 1)."""
    n = int(serde.estimate_serialized_size(layout_desc))
    return MemoryLayoutDesc(shapes=[torch.Size([max(1, n)])], dtypes=[torch.uint8])


def make_temp_key(original_key: ObjectKey) -> ObjectKey:
    """A key no one else uses for a temporary buffer of ``original_key``: its chunk hash
    plus 16 random bytes; model, rank, group and salt kept (L1 accounting stays per
    tenant)."""
    return ObjectKey(
        chunk_hash=original_key.chunk_hash + os.urandom(16),
        model_name=original_key.model_name,
        kv_rank=original_key.kv_rank,
        object_group_id=original_key.object_group_id,
        cache_salt=original_key.cache_salt,
    )
