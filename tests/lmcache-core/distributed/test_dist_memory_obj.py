"""MemoryObj variants (docs/design/storage-formats.md#memory-object)."""

from __future__ import annotations

import torch

from lmcache.v1.memory_management import (
    BytesBufferMemoryObj,
    MemoryFormat,
    MemoryObjMetadata,
    TensorMemoryObj,
    _ubyte_array_type,
)


def test_example_construction_and_views():
    src = torch.arange(1024, dtype=torch.float32)
    meta = MemoryObjMetadata(
        shape=torch.Size([1024]), dtype=torch.float32, address=0, phy_size=4096, ref_count=1
    )
    obj = TensorMemoryObj(raw_data=src, metadata=meta, parent_allocator=None)
    assert obj.get_size() == 4096 and obj.get_physical_size() == 4096
    assert obj.metadata is obj.meta and obj.get_memory_format() is MemoryFormat.UNDEFINED
    view = obj.byte_array
    assert view.itemsize == 1 and len(view) == 4096 and not view.readonly
    assert bytes(view) == src.numpy().tobytes()
    view[0:4] = b"\x00\x00\x80\x3f"  # zero-copy write: float 1.0
    assert src[0].item() == 1.0
    assert obj.data_ptr == src.data_ptr()
    assert torch.equal(obj.tensor, src)


def test_multi_group_tensors_and_logical_size():
    raw = torch.zeros(8192, dtype=torch.uint8)
    meta = MemoryObjMetadata(
        shape=torch.Size([2, 3]),
        dtype=torch.float16,
        address=0,
        phy_size=8192,
        ref_count=1,
        shapes=[torch.Size([2, 3]), torch.Size([5])],
        dtypes=[torch.float16, torch.float32],
    )
    obj = TensorMemoryObj(raw, meta)
    assert obj.get_size() == 2 * 3 * 2 + 5 * 4
    g1 = obj.get_tensor(1)
    g1.fill_(2.0)
    assert g1.shape == torch.Size([5]) and g1.dtype == torch.float32
    # group 1 starts at the prefix-sum offset 12
    assert raw[12:32].view(torch.float32).tolist() == [2.0] * 5
    assert len(obj.byte_array) == obj.get_size()
    assert len(obj.physical_byte_array()) == 8192
    obj.set_used_size(10)
    assert len(obj.byte_array) == 10


def test_ctypes_array_type_is_cached_per_length():
    raw = torch.zeros(64, dtype=torch.uint8)
    meta = MemoryObjMetadata(torch.Size([64]), torch.uint8, 0, 64, 1)
    obj = TensorMemoryObj(raw, meta)
    before = _ubyte_array_type.cache_info()
    for _ in range(5):
        obj.byte_array  # noqa: B018
    after = _ubyte_array_type.cache_info()
    assert after.currsize - before.currsize <= 1
    assert _ubyte_array_type(64) is _ubyte_array_type(64)


def test_bytes_buffer_memory_obj():
    obj = BytesBufferMemoryObj(b"hello")
    assert obj.get_size() == 5 and bytes(obj.byte_array) == b"hello"
    obj.byte_array[0:1] = b"j"
    assert bytes(obj.raw_data) == b"jello"
    assert obj.tensor.numel() == 5
