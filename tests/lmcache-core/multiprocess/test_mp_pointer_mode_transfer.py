"""docs/design/platform.md#operand-mode: the copy path resolves the operand mode and, for
pointer-mode backends, passes raw pointers in batches of at most ``max_objects_per_call`` chunks.

The accelerator is faked (a pointer-mode DeviceOps over CPU memory); the copies it does
are real: it maps the pointers back to the tensors and runs the torch baseline.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import pytest
import torch

from lmcache.v1.multiprocess import kv_copy
from lmcache.v1.platform import torch_ops
from lmcache.v1.platform.base.device_ops import DeviceOps

NB, BS, NH, HS, NL = 24, 4, 2, 8, 3
BPC = 2  # blocks per chunk


class PointerOps(DeviceOps):
    kv_transfer_operands: ClassVar[str | None] = "pointer"
    max_objects_per_call: ClassVar[int | None] = None  # default 4

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.calls: list[tuple[int, list[int], int]] = []
        self._by_ptr: dict[int, torch.Tensor] = {}
        self.know(tensors)

    def know(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self._by_ptr[t.data_ptr()] = t

    def multi_layer_block_kv_transfer(
        self,
        paged_buffer_ptrs_tensor,
        lmcache_objects_ptrs,
        block_ids,
        device,
        direction,
        shape_desc,
        lmcache_chunk_size,
        engine_kv_format,
        skip_prefix_n_blocks,
    ):
        assert paged_buffer_ptrs_tensor.dtype == torch.int64
        assert lmcache_objects_ptrs.dtype == torch.int64
        objs = [self._by_ptr[int(p)] for p in lmcache_objects_ptrs.tolist()]
        self.calls.append((len(objs), list(block_ids), int(skip_prefix_n_blocks)))
        torch_ops.multi_layer_block_kv_transfer(
            [self._by_ptr[int(p)] for p in paged_buffer_ptrs_tensor.tolist()],
            objs,
            block_ids,
            device,
            direction,
            shape_desc,
            lmcache_chunk_size,
            engine_kv_format,
            skip_prefix_n_blocks,
        )


class PointerOps3(PointerOps):
    max_objects_per_call: ClassVar[int | None] = 3


def _kv(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NB, BS, NH, HS, generator=g).half() for _ in range(NL)]


def _expected_chunk(kv: list[torch.Tensor], blocks: list[int]) -> torch.Tensor:
    # canonical host chunk [2, L, T, NH*HS] of the given blocks (NHD)
    return torch.stack(
        [torch.cat([t[:, b] for b in blocks], dim=1).reshape(2, -1, NH * HS) for t in kv], dim=1
    )


@pytest.mark.parametrize(
    ("ops_cls", "batches"), [(PointerOps, [4, 4, 2]), (PointerOps3, [3, 3, 3, 1])]
)
def test_gather_batches_pointers_and_copies_exactly(monkeypatch, ops_cls, batches):
    kv = _kv(1)
    block_ids = list(range(3, 3 + 10 * BPC))  # 10 chunks
    out = [torch.empty(2, NL, BPC * BS, NH * HS, dtype=torch.float16) for _ in range(10)]
    ops = ops_cls(kv + out)
    monkeypatch.setattr(kv_copy, "_ops_for", lambda t: ops)

    kv_copy.gather_paged_kv_to_cpu(kv, block_ids, BPC, out=out)

    assert [n for n, _, _ in ops.calls] == batches
    # each call carries exactly the blocks of its own chunks, in order
    assert sum((ids for _, ids, _ in ops.calls), []) == block_ids
    for i, chunk in enumerate(out):
        assert torch.equal(chunk, _expected_chunk(kv, block_ids[i * BPC : (i + 1) * BPC]))


@pytest.mark.parametrize("skip_blocks", [0, 5, 9])
def test_scatter_batches_pointers_and_honours_the_skipped_prefix(monkeypatch, skip_blocks):
    src = _kv(2)
    block_ids = list(range(2, 2 + 10 * BPC))
    chunks = [_expected_chunk(src, block_ids[i * BPC : (i + 1) * BPC]) for i in range(10)]
    dst = _kv(3)
    before = [t.clone() for t in dst]
    ops = PointerOps(dst + chunks)
    monkeypatch.setattr(kv_copy, "_ops_for", lambda t: ops)

    kv_copy.scatter_cpu_to_paged_kv(
        dst, block_ids, chunks, BPC, skip_first_n_tokens=skip_blocks * BS
    )

    # batches of 4 chunks (8 blocks); a batch wholly inside the skipped prefix is not sent
    expected_calls = []
    for i in range(0, 10, 4):
        first = i * BPC
        ids = block_ids[first : first + min(4, 10 - i) * BPC]
        skip = min(max(0, skip_blocks - first), len(ids))
        if skip < len(ids):
            expected_calls.append((len(ids) // BPC, ids, skip))
    assert ops.calls == expected_calls
    for t_dst, t_src, t_before in zip(dst, src, before, strict=True):
        for j, b in enumerate(block_ids):
            want = t_before[:, b] if j < skip_blocks else t_src[:, b]
            assert torch.equal(t_dst[:, b], want), (j, b)
        untouched = [b for b in range(NB) if b not in block_ids]
        assert torch.equal(t_dst[:, untouched], t_before[:, untouched])


def test_tensor_mode_backend_gets_one_call_with_tensors(monkeypatch):
    kv = _kv(4)
    seen = []

    class TensorOps(DeviceOps):
        kv_transfer_operands: ClassVar[str | None] = "tensor"

        def multi_layer_block_kv_transfer(self, paged, objs, *rest):
            seen.append((type(paged), len(objs)))
            torch_ops.multi_layer_block_kv_transfer(paged, objs, *rest)

    monkeypatch.setattr(kv_copy, "_ops_for", lambda t: TensorOps())
    out = kv_copy.gather_paged_kv_to_cpu(kv, list(range(12 * BPC)), BPC)
    assert seen == [(list, 12)]
    assert torch.equal(out[11], _expected_chunk(kv, list(range(22, 24))))


def test_router_logs_the_capability_disagreement(caplog):
    from lmcache.v1.multiprocess.transfer_context import worker_transfer
    from lmcache.v1.platform.base.device_spec import DeviceSpec

    class Disagreeing(DeviceSpec):
        def is_lmcache_driven_available(self) -> bool:
            return False

        def is_handle_transfer_available(self) -> bool:
            return True

    import lmcache.v1.platform as platform

    with caplog.at_level(logging.WARNING), pytest.MonkeyPatch.context() as mp:
        mp.setattr(platform, "get_device_spec", lambda device_type: Disagreeing())
        mp.setattr(platform, "resolve_kv_wrapper_factory", lambda device_type: object())
        with pytest.raises(ValueError, match="not available"):
            worker_transfer._build_lmcache_driven_context([torch.zeros(1)], "fakedev")
    assert "disagrees with" in caplog.text
