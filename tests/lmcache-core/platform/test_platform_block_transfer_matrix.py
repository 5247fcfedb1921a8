"""multi_layer_block_kv_transfer: every format x direction x operand form x skip x partial chunk,
against an independent reference of the canonical host chunk
(docs/design/storage-formats.md#host-chunk, docs/design/platform.md#block-transfer)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_reference_helpers import (
    POINTER_FORMATS,
    expected_rows,
    host_chunk,
    logical_kv,
    make_paged,
    paged_blocks,
    pointer_operands,
    shape_desc,
)

from lmcache.v1.platform.ops_types import EngineKVFormat, PageBufferShapeDesc, TransferDirection
from lmcache.v1.platform.torch_ops import multi_layer_block_kv_transfer

D2H, H2D = TransferDirection.D2H, TransferDirection.H2D
TENSOR_FORMATS = [f for f in range(19) if f != 17]
NL, NB, BS, NH, HS = 2, 9, 4, 2, 8
BPO = 2  # blocks per chunk
CHUNK = BPO * BS
IDS = [7, 2, 5, 0, 8, 3, 6]  # 7 blocks -> 4 chunks, the last one partial


def _fill(obj: torch.Tensor, value: int) -> None:
    obj.fill_(value)


def _one_storage(objs):
    """The chunks as adjacent views of one buffer (slots of a pool)."""
    return list(torch.stack(objs)) if objs else objs


def _run(fmt, direction, pointer, skip, ids=IDS, kv_list_nested=True, bpo=BPO, pool=False):
    chunk = bpo * BS
    L = logical_kv(fmt, NL, NB, BS, NH, HS, seed=fmt)
    n_obj = -(-len(ids) // bpo)
    sd = shape_desc(fmt, L)
    if direction == D2H:
        paged = make_paged(fmt, L, kv_list_nested)
        objs = [host_chunk(fmt, L, chunk, fill=7) for _ in range(n_obj)]
        if pool:
            objs = _one_storage(objs)
        operand = pointer_operands(fmt, paged) if pointer else paged
        obj_arg = [o.data_ptr() for o in objs] if pointer else objs
        multi_layer_block_kv_transfer(operand, obj_arg, ids, "cpu", D2H, sd, chunk, fmt, skip)
        exp = expected_rows(L, ids)
        for i, obj in enumerate(objs):
            for j in range(bpo):
                pos = i * bpo + j
                rows = obj[:, :, j * BS : (j + 1) * BS]
                if skip <= pos < len(ids):
                    assert torch.equal(rows, exp[:, :, pos * BS : (pos + 1) * BS]), (i, j)
                else:
                    assert bool((rows == 7).all()), f"row block {pos} written"
    else:
        old = logical_kv(fmt, NL, NB, BS, NH, HS, seed=100 + fmt)
        new = logical_kv(fmt, NL, NB, BS, NH, HS, seed=200 + fmt)
        paged = make_paged(fmt, old, kv_list_nested)
        full = expected_rows(new, ids)
        objs = []
        for i in range(n_obj):
            o = host_chunk(fmt, new, chunk, fill=3)
            take = min(bpo, len(ids) - i * bpo)
            o[:, :, : take * BS] = full[:, :, i * chunk : i * chunk + take * BS]
            objs.append(o)
        if pool:
            objs = _one_storage(objs)
        operand = pointer_operands(fmt, paged) if pointer else paged
        obj_arg = [o.data_ptr() for o in objs] if pointer else objs
        multi_layer_block_kv_transfer(operand, obj_arg, ids, "cpu", H2D, sd, chunk, fmt, skip)
        back = paged_blocks(fmt, paged, old.shape)
        written = set(ids[skip:])
        for b in range(NB):
            want = new if b in written else old
            assert torch.equal(back[:, :, b], want[:, :, b]), f"block {b}"


@pytest.mark.parametrize("fmt", TENSOR_FORMATS, ids=lambda f: EngineKVFormat(f).name)
@pytest.mark.parametrize("direction", [D2H, H2D], ids=["D2H", "H2D"])
def test_tensor_operands_all_formats(fmt, direction):
    for skip in (0, 3, len(IDS), len(IDS) + 5):
        _run(fmt, direction, False, skip)


@pytest.mark.parametrize("fmt", POINTER_FORMATS, ids=lambda f: EngineKVFormat(f).name)
@pytest.mark.parametrize("direction", [D2H, H2D], ids=["D2H", "H2D"])
def test_pointer_operands_all_formats(fmt, direction):
    for skip in (0, 3, len(IDS)):
        _run(fmt, direction, True, skip)


# Chunks whose blocks are runs of consecutive ids move by slice copies (one per run and
# layer, K and V merged) instead of the index kernels: same bytes, every format.
RUN_IDS = ([1, 2, 3, 4, 5, 6, 7, 8, 0], [5, 6, 7, 8, 1, 2, 3, 4, 0])


RUN_CASES = [(f, False) for f in TENSOR_FORMATS] + [(f, True) for f in POINTER_FORMATS]


@pytest.mark.parametrize(
    "fmt,pointer",
    RUN_CASES,
    ids=lambda c: (
        EngineKVFormat(c).name
        if isinstance(c, int) and not isinstance(c, bool)
        else ("ptr" if c else "tensor")
    ),
)
@pytest.mark.parametrize("direction", [D2H, H2D], ids=["D2H", "H2D"])
def test_block_runs_all_formats(fmt, pointer, direction, monkeypatch):
    import lmcache.v1.platform.torch_ops._block as block

    real, calls = block._copy_runs, []
    monkeypatch.setattr(block, "_copy_runs", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    for ids in RUN_IDS:
        for skip in (0, 3, len(ids)):
            _run(fmt, direction, pointer, skip, ids=ids, bpo=8)
    assert calls, "no chunk took the block-run path"
    assert [r for r in calls if len(r) == 2 and r[1][1] == 4], "two runs in one chunk not seen"


# Whole chunks whose blocks are one run and whose host chunks are adjacent slots of one
# buffer move with one copy per layer group for all of them at once.
POOL_IDS = [1, 2, 3, 4, 5, 6, 7]  # chunks [1,2] [3,4] [5,6] [7]


@pytest.mark.parametrize("fmt", TENSOR_FORMATS, ids=lambda f: EngineKVFormat(f).name)
@pytest.mark.parametrize("direction", [D2H, H2D], ids=["D2H", "H2D"])
def test_adjacent_chunks_move_together_all_formats(fmt, direction, monkeypatch):
    import lmcache.v1.platform.torch_ops._block as block

    real, chunks_per_copy = block._copy_runs, []
    monkeypatch.setattr(
        block,
        "_copy_runs",
        lambda *a, **k: chunks_per_copy.append(a[1].shape[0]) or real(*a, **k),
    )
    # skip 1: chunk 0 alone (its second block), chunks 1-2 together; skip 2: chunks 1-2
    for skip in (0, 1, 2, 3):
        _run(fmt, direction, False, skip, ids=POOL_IDS, pool=True)
    assert 3 in chunks_per_copy and 2 in chunks_per_copy, chunks_per_copy
    # Not one run of blocks, or chunks apart in memory: chunk by chunk, same bytes.
    chunks_per_copy.clear()
    _run(fmt, direction, False, 0, ids=[1, 2, 3, 4, 6, 7, 8], pool=True)
    _run(fmt, direction, False, 0, ids=POOL_IDS, pool=False)
    assert set(chunks_per_copy) <= {1}


def test_chunks_of_one_buffer_out_of_order_or_overlapping_go_one_by_one(monkeypatch):
    import lmcache.v1.platform.torch_ops._block as block

    chunks_per_copy = []
    real = block._copy_runs
    monkeypatch.setattr(
        block, "_copy_runs", lambda *a, **k: chunks_per_copy.append(a[1].shape[0]) or real(*a, **k)
    )
    L = logical_kv(1, NL, NB, BS, NH, HS, seed=3)
    paged, sd = make_paged(1, L), shape_desc(1, L)
    ids = [1, 2, 3, 4]
    exp = expected_rows(L, ids)
    buf = torch.zeros(3, *host_chunk(1, L, CHUNK).shape, dtype=L.dtype)
    # descending slots: chunk 0 in buf[1], chunk 1 in buf[0]
    multi_layer_block_kv_transfer(paged, [buf[1], buf[0]], ids, "cpu", D2H, sd, CHUNK, 1, 0)
    assert torch.equal(buf[1], exp[:, :, :CHUNK]) and torch.equal(buf[0], exp[:, :, CHUNK:])
    # overlapping views of one buffer (the second starts one block row later)
    a = buf[1]
    b = buf.as_strided(a.shape, a.stride(), a.storage_offset() + BS * NH * HS)
    multi_layer_block_kv_transfer(paged, [a, b], ids, "cpu", D2H, sd, CHUNK, 1, 0)
    assert torch.equal(b, exp[:, :, CHUNK:])
    assert 2 not in chunks_per_copy


def test_layout_is_built_once_per_set_of_paged_tensors_and_follows_them(monkeypatch):
    import gc

    import lmcache.v1.platform.torch_ops._block as block

    real, builds = block._build_layout, []
    monkeypatch.setattr(block, "_build_layout", lambda *a: builds.append(1) or real(*a))
    monkeypatch.setattr(block, "_LAYOUTS", {})
    L = logical_kv(1, NL, NB, BS, NH, HS, seed=4)
    paged, sd = make_paged(1, L), shape_desc(1, L)
    for _ in range(3):
        obj = host_chunk(1, L, CHUNK, fill=0)
        multi_layer_block_kv_transfer(paged, [obj], [5, 6], "cpu", D2H, sd, CHUNK, 1, 0)
        assert torch.equal(obj, expected_rows(L, [5, 6]))
    assert len(builds) == 1
    # A tensor given new storage in place: the layout follows it (writes land in the new one).
    paged[0].set_(torch.zeros_like(paged[0]))
    obj = host_chunk(1, L, CHUNK, fill=5)
    multi_layer_block_kv_transfer(paged, [obj], [5, 6], "cpu", H2D, sd, CHUNK, 1, 0)
    assert len(builds) == 2
    assert bool((paged[0][:, 5:7] == 5).all()) and bool((paged[0][:, :5] == 0).all())
    # A list of other tensors gets its own layout; freed tensors take their entry with them.
    other = make_paged(1, L)
    multi_layer_block_kv_transfer(other, [obj], [5, 6], "cpu", D2H, sd, CHUNK, 1, 0)
    assert len(builds) == 3 and len(block._LAYOUTS) == 2
    del paged, other
    gc.collect()
    assert not block._LAYOUTS


@pytest.mark.parametrize("fmt", [4, 9])
def test_kv_list_flat_form(fmt):
    for direction in (D2H, H2D):
        _run(fmt, direction, False, 1, kv_list_nested=False)


def test_block_ids_as_tensor_and_mid_chunk_skip():
    L = logical_kv(1, NL, NB, BS, NH, HS)
    paged = make_paged(1, L)
    objs = [host_chunk(1, L, CHUNK) for _ in range(4)]
    multi_layer_block_kv_transfer(
        paged, objs, torch.tensor(IDS), torch.device("cpu"), D2H, shape_desc(1, L), CHUNK, 1, 1
    )
    exp = expected_rows(L, IDS)
    # object 0: block position 0 skipped, position 1 written at token offset BS
    assert bool((objs[0][:, :, :BS] == 7).all())
    assert torch.equal(objs[0][:, :, BS:CHUNK], exp[:, :, BS:CHUNK])


def _plane_tuple_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    layers, _expect_layers = [], []
    for _ in range(NL):
        p0 = torch.randn(NB, BS, 1, 6, generator=g).to(torch.bfloat16)
        p1 = torch.randint(0, 255, (NB, BS, 1, 4), generator=g, dtype=torch.uint8)
        layers.append((p0, p1))
    return layers


def test_plane_tuple_mla_bytes_layout_both_directions():
    fmt = EngineKVFormat.NL_X_NP_X_NB_BS_ONE_HS
    layers = _plane_tuple_case(1)
    width = 6 * 2 + 4
    ids = [4, 1, 7]
    objs = [torch.full((NL, CHUNK, width), 9, dtype=torch.uint8) for _ in range(2)]
    sd = PageBufferShapeDesc(kv_size=1, nl=NL, nb=NB, bs=BS, nh=1, hs=width)
    multi_layer_block_kv_transfer(layers, objs, ids, "cpu", D2H, sd, CHUNK, fmt, 0)
    for pos, b in enumerate(ids):
        obj, j = objs[pos // BPO], pos % BPO
        for layer, (p0, p1) in enumerate(layers):
            rows = obj[layer, j * BS : (j + 1) * BS]
            assert torch.equal(rows[:, :12], p0[b, :, 0].contiguous().view(torch.uint8))
            assert torch.equal(rows[:, 12:], p1[b, :, 0])
    assert bool((objs[1][:, BS:] == 9).all())  # partial last chunk untouched
    fresh = [(torch.zeros_like(p0), torch.zeros_like(p1)) for p0, p1 in layers]
    multi_layer_block_kv_transfer(fresh, objs, ids, "cpu", H2D, sd, CHUNK, fmt, 1)
    for layer in range(NL):
        for b in range(NB):
            for p in range(2):
                got, src = fresh[layer][p][b], layers[layer][p][b]
                if b in ids[1:]:
                    assert torch.equal(got.view(torch.uint8), src.view(torch.uint8))
                else:
                    assert bool((got.view(torch.uint8) == 0).all())
    with pytest.raises(ValueError, match="no pointer form"):
        multi_layer_block_kv_transfer(
            torch.tensor([1, 2], dtype=torch.int64), objs, ids, "cpu", D2H, sd, CHUNK, fmt, 0
        )


def test_objects_may_be_flat_uint8_buffers_and_copies_are_bitwise():
    # bf16 paged + uint8 object buffer (the server's temp buffers): reinterpreted, not converted
    L = logical_kv(1, NL, NB, BS, NH, HS).view(torch.int16)
    L = torch.randint(-32768, 32767, L.shape, dtype=torch.int16).view(torch.bfloat16)
    paged = make_paged(1, L)
    buf = torch.zeros(2 * NL * CHUNK * NH * HS * 2, dtype=torch.uint8)
    multi_layer_block_kv_transfer(paged, [buf], [3, 1], "cpu", D2H, shape_desc(1, L), CHUNK, 1, 0)
    got = buf.view(torch.bfloat16).view(2, NL, CHUNK, NH * HS)
    assert torch.equal(got.view(torch.int16), expected_rows(L, [3, 1]).view(torch.int16))
    # fp16 objects against bf16 paged: same element size, bytes preserved
    obj16 = torch.zeros(2, NL, CHUNK, NH * HS, dtype=torch.float16)
    multi_layer_block_kv_transfer(paged, [obj16], [3, 1], "cpu", D2H, shape_desc(1, L), CHUNK, 1, 0)
    assert torch.equal(obj16.view(torch.int16), expected_rows(L, [3, 1]).view(torch.int16))


def test_validation_errors():
    L = logical_kv(1, NL, NB, BS, NH, HS)
    paged = make_paged(1, L)
    sd = shape_desc(1, L)
    objs = [host_chunk(1, L, CHUNK)]
    call = multi_layer_block_kv_transfer
    with pytest.raises(ValueError, match="lmcache_chunk_size=0"):
        call(paged, objs, [1], "cpu", D2H, sd, 0, 1, 0)
    with pytest.raises(ValueError, match="not a multiple of the block size 4"):
        call(paged, objs, [1], "cpu", D2H, sd, 6, 1, 0)
    with pytest.raises(ValueError, match="skip_prefix_n_blocks=-1"):
        call(paged, objs, [1], "cpu", D2H, sd, CHUNK, 1, -1)
    with pytest.raises(ValueError, match="invalid transfer direction 5"):
        call(paged, objs, [1], "cpu", 5, sd, CHUNK, 1, 0)
    with pytest.raises(ValueError, match="3 block ids need 2 lmcache objects"):
        call(paged, objs, [1, 2, 3], "cpu", D2H, sd, CHUNK, 1, 0)
    with pytest.raises(ValueError, match="block id 9 is outside the paged cache's 9 blocks"):
        call(paged, objs, [1, 9], "cpu", D2H, sd, CHUNK, 1, 0)
    with pytest.raises(ValueError, match="block id -1 is outside"):
        call(paged, objs, torch.tensor([-1]), "cpu", H2D, sd, CHUNK, 1, 0)
    with pytest.raises(ValueError, match="unknown engine_kv_format 42"):
        call(paged, objs, [1], "cpu", D2H, sd, CHUNK, 42, 0)
    bad_bs = shape_desc(1, L)
    bad_bs.bs = 8
    with pytest.raises(ValueError, match="shape_desc.bs=8"):
        call(paged, objs, [1], "cpu", D2H, bad_bs, 16, 1, 0)
    ptrs = pointer_operands(1, paged)
    nodtype = PageBufferShapeDesc(kv_size=2, nl=NL, nb=NB, bs=BS, nh=NH, hs=HS)
    with pytest.raises(ValueError) as ei:
        call(ptrs, [objs[0].data_ptr()], [1], "cpu", D2H, nodtype, CHUNK, 1, 0)
    assert str(ei.value) == (
        "cannot infer the KV dtype: set shape_desc.dtype or shape_desc.element_size"
    )
    nodtype.element_size = 3
    with pytest.raises(ValueError, match="element_size=3"):
        call(ptrs, [objs[0].data_ptr()], [1], "cpu", D2H, nodtype, CHUNK, 1, 0)
    nodtype.element_size = 2  # -> float16, works
    call(ptrs, [objs[0].data_ptr()], [1], "cpu", D2H, nodtype, CHUNK, 1, 0)
    assert torch.equal(objs[0][:, :, :BS], expected_rows(L, [1]))
    strided = shape_desc(1, L)
    strided.block_stride_elems = BS * NH * HS + 64
    with pytest.raises(NotImplementedError, match="non-tight"):
        call(ptrs, objs, [1], "cpu", D2H, strided, CHUNK, 1, 0)
    strided.block_stride_elems = BS * NH * HS  # tight stated explicitly is fine
    call(ptrs, objs, [1], "cpu", D2H, strided, CHUNK, 1, 0)
    with pytest.raises(ValueError, match="no pointer form"):
        call(ptrs, objs, [1], "cpu", D2H, sd, CHUNK, 16, 0)


SPLIT_FAMILY = [0, 1, 2, 4, 6, 7, 8, 9, 15, 16]
FUSED_FAMILY = [10, 11, 12, 13]
MLA_FAMILY = [3, 5]


@pytest.mark.parametrize(
    "family", [SPLIT_FAMILY, FUSED_FAMILY, MLA_FAMILY], ids=["split", "fused", "mla"]
)
def test_host_chunk_bytes_identical_across_formats_with_the_same_kv(family):
    L = logical_kv(family[0], NL, NB, BS, NH, HS, seed=5)
    chunks = []
    for fmt in family:
        objs = [host_chunk(fmt, L, CHUNK, fill=0) for _ in range(4)]
        multi_layer_block_kv_transfer(
            make_paged(fmt, L), objs, IDS, "cpu", D2H, shape_desc(fmt, L), CHUNK, fmt, 0
        )
        chunks.append(b"".join(o.numpy().tobytes() for o in objs))
    assert all(c == chunks[0] for c in chunks[1:])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from(TENSOR_FORMATS),
    bs=st.sampled_from([1, 2, 4]),
    bpo=st.integers(1, 3),
    data=st.data(),
)
def test_roundtrip_through_host_chunks_property(fmt, bs, bpo, data):
    nb = 8
    n = data.draw(st.integers(1, nb), label="n_blocks")
    ids = data.draw(st.permutations(list(range(nb))), label="perm")[:n]
    skip = data.draw(st.integers(0, n + 1), label="skip")
    extra_objs = data.draw(st.integers(0, 1), label="extra_objects")
    chunk = bpo * bs
    L = logical_kv(fmt, 2, nb, bs, 2, 4, seed=fmt + 7 * bs)
    sd = shape_desc(fmt, L)
    n_obj = -(-n // bpo) + extra_objs
    objs = [host_chunk(fmt, L, chunk, fill=0) for _ in range(n_obj)]
    multi_layer_block_kv_transfer(make_paged(fmt, L), objs, ids, "cpu", D2H, sd, chunk, fmt, skip)
    target = torch.zeros_like(L)
    paged = make_paged(fmt, target)
    multi_layer_block_kv_transfer(paged, objs, ids, "cpu", H2D, sd, chunk, fmt, skip)
    back = paged_blocks(fmt, paged, L.shape)
    for b in range(nb):
        if b in ids[skip:]:
            assert torch.equal(back[:, :, b], L[:, :, b])
        else:
            assert bool((back[:, :, b] == 0).all())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from([SPLIT_FAMILY, FUSED_FAMILY, MLA_FAMILY]),
    bs=st.sampled_from([1, 2, 4]),
    data=st.data(),
)
def test_host_chunk_bytes_identical_across_formats_property(family, bs, data):
    nb, bpo = 6, 2
    n = data.draw(st.integers(1, nb), label="n_blocks")
    ids = data.draw(st.permutations(list(range(nb))), label="perm")[:n]
    skip = data.draw(st.integers(0, n), label="skip")
    L = logical_kv(family[0], 2, nb, bs, 2, 4, seed=bs)
    chunk = bpo * bs
    seen = None
    for fmt in family:
        objs = [host_chunk(fmt, L, chunk, fill=0) for _ in range(-(-n // bpo))]
        multi_layer_block_kv_transfer(
            make_paged(fmt, L), objs, ids, "cpu", D2H, shape_desc(fmt, L), chunk, fmt, skip
        )
        raw = b"".join(o.numpy().tobytes() for o in objs)
        assert seen is None or raw == seen, EngineKVFormat(fmt).name
        seen = raw
