"""The ``checksum`` serde (ours): the object's bytes behind a header that lets a load prove
they are the bytes stored under that key, so a corrupt, truncated or misplaced L2 object is a
miss (counted in ``lmcache_mp_l2_serde_rejected_chunks_total``), never wrong KV.

Stored frame (little endian), 32 bytes of header then the object's bytes unchanged::

    0  4  magic b"LMCK"
    4  1  version (1)
    5  3  zero
    8  8  payload length
    16 16 BLAKE3 digest (16 bytes) of the key's identity and the payload

The key's identity is its chunk hash, model name, kv rank, object group and cache salt, so
an object copied under another key is rejected too. Options: ``max_workers`` (default 1).
"""

from __future__ import annotations

import struct

import blake3

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde._common import (
    byte_view,
    check_options,
    int_option,
    physical_bytes,
)
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

__all__ = ["ChecksumDeserializer", "ChecksumSerializer"]

MAGIC = b"LMCK"
VERSION = 1
DIGEST_LEN = 16
_HEADER = struct.Struct("<4sB3xQ16s")
HEADER_LEN = _HEADER.size  # 32


def _digest(key: ObjectKey, payload: memoryview) -> bytes:
    h = blake3.blake3()
    for part in (
        key.chunk_hash,
        key.model_name.encode("utf-8"),
        str(key.kv_rank).encode(),
        str(key.object_group_id).encode(),
        key.cache_salt.encode("utf-8"),
    ):
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    h.update(payload)
    return h.digest(length=DIGEST_LEN)


class ChecksumSerializer(Serializer):
    """The object's bytes behind the checksum header."""

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        payload = byte_view(src)
        out = byte_view(dst)
        end = HEADER_LEN + len(payload)
        out[HEADER_LEN:end] = payload
        out[:HEADER_LEN] = _HEADER.pack(MAGIC, VERSION, len(payload), _digest(key, payload))
        return end

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        return HEADER_LEN + layout_nbytes(layout_desc)  # exact


class ChecksumDeserializer(Deserializer):
    """The payload of a checksum frame whose header and digest match the key and object; any other input is rejected."""

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        out = byte_view(dst)
        data = byte_view(src)
        if len(data) < HEADER_LEN + len(out):
            data = physical_bytes(src)
        if len(data) < HEADER_LEN:
            raise SerdeRejectedError(f"checksum: {len(data)} bytes, shorter than the header")
        magic, version, length, digest = _HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise SerdeRejectedError(
                f"checksum: not a checksum frame (magic {bytes(magic)!r}, version {version})"
            )
        if length != len(out):
            raise SerdeRejectedError(
                f"checksum: frame holds {length} bytes, the object has {len(out)}"
            )
        if len(data) < HEADER_LEN + length:
            raise SerdeRejectedError(
                f"checksum: truncated ({len(data) - HEADER_LEN} of {length} payload bytes)"
            )
        payload = data[HEADER_LEN : HEADER_LEN + length]
        if _digest(key, payload) != digest:
            raise SerdeRejectedError("checksum: digest mismatch (corrupt or another key's data)")
        out[:] = payload


def _create_checksum_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    check_options("checksum", kwargs, {"max_workers"})
    return AsyncSerdeProcessor(
        ChecksumSerializer(), ChecksumDeserializer(), int_option(kwargs, "max_workers", 1)
    )


register_serde_factory("checksum", _create_checksum_serde)
