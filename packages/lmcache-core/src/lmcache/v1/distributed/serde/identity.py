"""The ``identity`` serde (ours): the object's bytes unchanged. It exercises the serde path
and is the smallest example of a serde."""

from __future__ import annotations

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde._common import byte_view, check_options, int_option
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import (
    Deserializer,
    SerdeProcessor,
    SerdeRejectedError,
    Serializer,
)
from lmcache.v1.distributed.serde.factory import register_serde_factory
from lmcache.v1.distributed.serde.utils import layout_nbytes
from lmcache.v1.memory_management import MemoryObj

__all__ = ["IdentityDeserializer", "IdentitySerializer"]


class IdentitySerializer(Serializer):
    """The object's bytes, unchanged."""

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        data = byte_view(src)
        byte_view(dst)[: len(data)] = data
        return len(data)

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        return layout_nbytes(layout_desc)


class IdentityDeserializer(Deserializer):
    """The stored bytes back into the object, unchanged."""

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        out, data = byte_view(dst), byte_view(src)
        if len(data) < len(out):
            raise SerdeRejectedError(f"identity: {len(data)} bytes for a {len(out)}-byte object")
        out[:] = data[: len(out)]


def _create_identity_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    check_options("identity", kwargs, {"max_workers"})
    return AsyncSerdeProcessor(
        IdentitySerializer(), IdentityDeserializer(), int_option(kwargs, "max_workers", 1)
    )


register_serde_factory("identity", _create_identity_serde)
