"""plan_block_transfer: the checked arguments and chunk spans every backend shares."""

from __future__ import annotations

import pytest

from lmcache.v1.platform.base.block_transfer import plan_block_transfer
from lmcache.v1.platform.ops_types import EngineKVFormat, TransferDirection


def _plan(objects=3, chunk=8, skip=0, direction=1, fmt=1):
    return plan_block_transfer(None, [None] * objects, [], "cpu", direction, None, chunk, fmt, skip)


def test_arguments_are_normalised_by_position_or_name():
    p = plan_block_transfer(
        paged_buffer_ptrs_tensor="paged",
        lmcache_objects_ptrs=["o"],
        block_ids=[0],
        device="cpu",
        direction=1,
        shape_desc="sd",
        lmcache_chunk_size="8",
        engine_kv_format=1,
        skip_prefix_n_blocks=0,
    )
    assert p.direction is TransferDirection.D2H and p.d2h
    assert p.engine_kv_format is EngineKVFormat(1)
    assert p.chunk_size == 8 and p.paged == "paged" and p.shape_desc == "sd"


def test_spans_apply_the_global_skip_and_the_partial_last_chunk():
    # 3 objects of 2 blocks (block size 4), 5 block ids, first 3 skipped.
    spans = _plan(skip=3).chunk_spans(num_blocks=5, block_size=4)
    assert [(s.index, s.blocks, s.first_token, s.num_tokens) for s in spans] == [
        (1, slice(3, 4), 4, 4),
        (2, slice(4, 5), 0, 4),
    ]


@pytest.mark.parametrize(
    ("kwargs", "spans_args", "message"),
    [
        ({"chunk": 0}, None, "lmcache_chunk_size=0 must be > 0"),
        ({"skip": -1}, None, "skip_prefix_n_blocks=-1 must be >= 0"),
        ({"direction": 5}, None, "invalid transfer direction 5"),
        ({"chunk": 6}, (1, 4), "lmcache_chunk_size=6 is not a multiple of the block size 4"),
        ({"objects": 1}, (3, 4), "3 block ids need 2 lmcache objects of 2 blocks, got 1"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, spans_args, message):
    with pytest.raises(ValueError, match=message):
        plan = _plan(**kwargs)
        plan.chunk_spans(*spans_args)
