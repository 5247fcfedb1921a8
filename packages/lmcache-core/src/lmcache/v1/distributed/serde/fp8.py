"""The ``fp8`` serde (LMCache 0.5.6's): each KV element cast to one fp8 byte on store and
cast back to the object's dtype on load. Lossy; 0.5.6's bytes: the elements in order, as
``torch.float8_e4m3fn`` (default) or the ``fp8_dtype`` named, nothing else. An object of
several groups is their concatenation (0.5.6 stores only the first).

Options: ``fp8_dtype`` (a torch float8 dtype name), ``max_workers`` (pool size, default 1).
"""

from __future__ import annotations

import torch

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde._common import (
    byte_tensor,
    check_options,
    fp8_decode_table,
    group_tensors,
    int_option,
)
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import (
    Deserializer,
    SerdeProcessor,
    SerdeRejectedError,
    Serializer,
)
from lmcache.v1.distributed.serde.factory import register_serde_factory
from lmcache.v1.memory_management import MemoryObj

__all__ = ["Fp8QuantizationDeserializer", "Fp8QuantizationSerializer"]


class Fp8QuantizationSerializer(Serializer):
    """Each element cast to one fp8 byte (0.5.6's bytes)."""

    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> None:
        self._fp8_dtype = fp8_dtype

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        out = byte_tensor(dst, "fp8")
        off = 0
        for t in group_tensors(src):
            q = t.to(self._fp8_dtype).contiguous().view(torch.uint8).reshape(-1)
            out[off : off + q.numel()].copy_(q)
            off += q.numel()
        return off

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        return sum(torch.Size(s).numel() for s in layout_desc.shapes)  # exact: 1 byte each


class Fp8QuantizationDeserializer(Deserializer):
    """fp8 bytes cast back to the destination's dtype."""

    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> None:
        self._fp8_dtype = fp8_dtype

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        data = byte_tensor(src, "fp8")
        groups = group_tensors(dst)
        need = sum(t.numel() for t in groups)
        if data.numel() < need:
            raise SerdeRejectedError(f"fp8: {data.numel()} bytes for {need} elements")
        off = 0
        for t in groups:
            idx = data[off : off + t.numel()].to(torch.int32)
            table = fp8_decode_table(self._fp8_dtype, t.dtype)
            if t.is_contiguous():
                torch.index_select(table, 0, idx, out=t.view(-1))
            else:
                t.copy_(table[idx].view(t.shape))
            off += t.numel()


def fp8_dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype.itemsize != 1 or not dtype.is_floating_point:
        choices = sorted(n for n in dir(torch) if n.startswith("float8_"))
        raise ValueError(
            f"fp8 serde: fp8_dtype {name!r} is not a float8 dtype; use one of {choices}"
        )
    return dtype


def _create_fp8_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    check_options("fp8", kwargs, {"fp8_dtype", "max_workers"})
    dtype = fp8_dtype_named(str(kwargs.get("fp8_dtype", "float8_e4m3fn")))
    return AsyncSerdeProcessor(
        Fp8QuantizationSerializer(dtype),
        Fp8QuantizationDeserializer(dtype),
        int_option(kwargs, "max_workers", 1),
    )


register_serde_factory("fp8", _create_fp8_serde)
