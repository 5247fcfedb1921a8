"""The plan of one ``multi_layer_block_kv_transfer`` call, shared by every backend.

``plan_block_transfer`` takes the op's nine arguments (positionally or by name), checks the
scalar ones and returns a :class:`BlockTransferPlan`. ``DeviceOps.multi_layer_block_kv_transfer``
hands that plan to ``DeviceOps.transfer_blocks``, which backends override; a backend that
delegates passes the plan on unchanged (``torch_ops.transfer_blocks(plan)``).

``plan.chunk_spans(num_blocks, block_size)`` applies the chunking rules
(docs/design/platform.md#block-transfer):
block ``j`` of the flat id list belongs to lmcache object ``j // blocks_per_object``; the
first ``skip_prefix_n_blocks`` blocks of the whole list are not moved; a last, partial chunk
moves only the blocks it has.

A public contract for device wheels: it imports no torch and nothing above ``ops_types``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lmcache.v1.platform.ops_types import (
    EngineKVFormat,
    TransferDirection,
    parse_direction,
    to_engine_kv_format,
)

__all__ = [
    "BlockTransferPlan",
    "ChunkSpan",
    "parse_direction",
    "plan_block_transfer",
]


@dataclass(frozen=True)
class ChunkSpan:
    """The blocks one lmcache object takes part in: positions ``first_block:end_block`` of the
    flat block-id list, which fill rows ``first_token:first_token + num_tokens`` of the chunk."""

    index: int  # the lmcache object
    first_block: int
    end_block: int
    first_token: int
    num_tokens: int

    @property
    def blocks(self) -> slice:
        """``first_block:end_block`` as a slice of the flat block-id list."""
        return slice(self.first_block, self.end_block)

    @property
    def num_blocks(self) -> int:
        """How many blocks of this object the transfer moves."""
        return self.end_block - self.first_block


@dataclass(frozen=True)
class BlockTransferPlan:
    """The arguments of one block transfer, the scalar ones checked and normalised."""

    paged: Any  # paged_buffer_ptrs_tensor: engine tensors, or a 1-D tensor of addresses
    objects: Any  # lmcache_objects_ptrs: host chunk tensors or host addresses
    block_ids: Any
    device: Any
    direction: TransferDirection
    shape_desc: Any
    chunk_size: int  # tokens per lmcache object
    engine_kv_format: EngineKVFormat
    skip_blocks: int  # skip_prefix_n_blocks

    @property
    def d2h(self) -> bool:
        """True for a store (engine -> LMCache chunk), False for a retrieve."""
        return self.direction == TransferDirection.D2H

    def replace(self, **changes: Any) -> BlockTransferPlan:
        """A copy with some operands swapped (e.g. device tensors rebuilt from addresses)."""
        return dataclasses.replace(self, **changes)

    def require_format(self, backend: str, supported: Sequence[EngineKVFormat]) -> None:
        """ValueError naming the plan's format and the ``supported`` ones when it is not
        one of them (``backend`` starts the message)."""
        fmt = self.engine_kv_format
        if fmt not in supported:
            names = ", ".join(f"{f.name} (#{int(f)})" for f in supported)
            raise ValueError(
                f"{backend} multi_layer_block_kv_transfer does not support engine_kv_format "
                f"{fmt.name} (#{int(fmt)}); supported: {names}"
            )

    def blocks_per_object(self, block_size: int) -> int:
        """Engine blocks of ``block_size`` tokens per lmcache object (``chunk_size //
        block_size``); ``ValueError`` when the chunk size is not a multiple of it."""
        if block_size <= 0 or self.chunk_size % block_size:
            raise ValueError(
                f"lmcache_chunk_size={self.chunk_size} is not a multiple of the block size "
                f"{block_size}"
            )
        return self.chunk_size // block_size

    def chunk_spans(self, num_blocks: int, block_size: int) -> list[ChunkSpan]:
        """Where each of ``num_blocks`` block ids goes, object by object; objects with
        nothing to move (all skipped, or past the last block) are left out."""
        bpo = self.blocks_per_object(block_size)
        num_objects = len(self.objects)
        if num_blocks > num_objects * bpo:
            raise ValueError(
                f"{num_blocks} block ids need {-(-num_blocks // bpo)} lmcache objects of "
                f"{bpo} blocks, got {num_objects}"
            )
        spans = []
        for i in range(num_objects):
            start = i * bpo
            end = min(start + bpo, num_blocks)
            first = max(start, self.skip_blocks)  # the skip is global over the flat list
            if first < end:
                spans.append(
                    ChunkSpan(
                        i, first, end, (first - start) * block_size, (end - first) * block_size
                    )
                )
        return spans


def plan_block_transfer(
    paged_buffer_ptrs_tensor: Any,
    lmcache_objects_ptrs: Any,
    block_ids: Any,
    device: Any,
    direction: Any,
    shape_desc: Any,
    lmcache_chunk_size: int,
    engine_kv_format: Any,
    skip_prefix_n_blocks: int,
) -> BlockTransferPlan:
    """The plan of ``multi_layer_block_kv_transfer(...)`` called with these arguments."""
    fmt = to_engine_kv_format(engine_kv_format)
    parsed_direction = parse_direction(direction)
    chunk = int(lmcache_chunk_size)
    if chunk <= 0:
        raise ValueError(f"lmcache_chunk_size={lmcache_chunk_size} must be > 0")
    skip = int(skip_prefix_n_blocks)
    if skip < 0:
        raise ValueError(f"skip_prefix_n_blocks={skip_prefix_n_blocks} must be >= 0")
    return BlockTransferPlan(
        paged=paged_buffer_ptrs_tensor,
        objects=lmcache_objects_ptrs,
        block_ids=block_ids,
        device=device,
        direction=parsed_direction,
        shape_desc=shape_desc,
        chunk_size=chunk,
        engine_kv_format=fmt,
        skip_blocks=skip,
    )
