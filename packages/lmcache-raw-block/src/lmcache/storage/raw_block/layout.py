"""The on-disk format of a ``raw_block`` device, LMCache 0.5.6's byte for byte
(docs/design/storage-formats.md#raw-block).

A device (or pre-sized file) of ``capacity`` bytes (the device size, or ``capacity_bytes``
when smaller) is laid out as::

    [0, meta_total_bytes)            two metadata containers (checkpoints), each
                                     (meta_total_bytes // 2) rounded down to block_align
    [meta_total_bytes, ...)          slots of slot_bytes each, (capacity - meta_total) // slot_bytes

A **slot** starts with a ``header_bytes`` header, then the object's bytes::

    0   8s   magic b"LMCBLK01"
    8   u64  identity: blake2b-8 (little endian) of the encoded key (UTF-8)
    16  u64  payload length
    24  ...  zeros up to header_bytes

A **container** starts with a ``block_align`` header block, ``struct "<8sIQQI"``: the metadata
magic (``meta_magic``, default ``b"LMCIDX01"``), ``meta_version``, sequence number, payload length
and CRC-32 of the payload; the payload (at container + block_align) is compact ASCII JSON:
``{"version": 1, "device_path", "capacity_bytes", "block_align", "header_bytes", "slot_bytes",
"meta_total_bytes", "meta_magic", "meta_version", "data_base_offset", "next_slot", "entries":
{encoded_key: {"offset", "size", "shape", "dtype", "fmt", "cached_positions"}}}``. Checkpoint
``seq`` goes to container ``(seq - 1) % 2``; a reader takes the valid one with the highest seq.
Slots below ``next_slot`` that no entry names are free.

**Encoded keys** are raw_block's own: ``quote(model, safe="")@0x<kv_rank 8 hex>@<group hex>@
<chunk hash hex>[@<cache_salt>]`` (note the ``0x``; not the fs/redis object names).

Everything here is pure (no I/O), so the format has one definition and tests read it.
"""

from __future__ import annotations

import hashlib
import json
import struct
import urllib.parse
import zlib
from dataclasses import dataclass
from typing import Any

from lmcache.v1.distributed.api import ObjectKey

SLOT_MAGIC = b"LMCBLK01"
SLOT_HEADER_MIN_BYTES = 24
META_HEADER = struct.Struct("<8sIQQI")  # magic, version, seq, payload_len, crc32
META_COPIES = 2
CHECKPOINT_VERSION = 1

# 0.5.6's dtype names in checkpoints (lmcache.utils.TORCH_DTYPE_TO_STR_DTYPE), keyed by
# str(torch dtype) so this module needs no torch.
DTYPE_NAMES: dict[str, str] = {
    "torch.float16": "half",
    "torch.bfloat16": "bfloat16",
    "torch.float32": "float",
    "torch.float64": "double",
    "torch.int8": "int8",
    "torch.uint8": "uint8",
    "torch.int16": "int16",
    "torch.int32": "int32",
    "torch.int64": "int64",
    "torch.bool": "bool",
    "torch.float8_e4m3fn": "fp8_e4m3fn",
    "torch.float8_e4m3fnuz": "fp8_e4m3fnuz",
    "torch.float8_e5m2": "fp8_e5m2",
    "torch.float8_e5m2fnuz": "fp8_e5m2fnuz",
}


def round_up(x: int, align: int) -> int:
    return -(-x // align) * align


# ---- keys -----------------------------------------------------------------------------------


def encode_key(key: ObjectKey) -> str:
    """The key's name on a raw_block device."""
    name = (
        f"{urllib.parse.quote(key.model_name, safe='')}@{key.kv_rank:#010x}"
        f"@{key.object_group_id:x}@{key.chunk_hash.hex()}"
    )
    return f"{name}@{key.cache_salt}" if key.cache_salt else name


def decode_key(encoded: str) -> ObjectKey:
    """``encode_key`` reversed; ``ValueError`` naming the string when it is not one."""
    parts = encoded.split("@", 4)
    if len(parts) not in (4, 5):
        raise ValueError(f"not a raw_block key (model@0xrank@group@hash[@salt]): {encoded!r}")
    try:
        return ObjectKey(
            chunk_hash=bytes.fromhex(parts[3]),
            model_name=urllib.parse.unquote(parts[0]),
            kv_rank=int(parts[1], 16),
            object_group_id=int(parts[2], 16),
            cache_salt=parts[4] if len(parts) == 5 else "",
        )
    except ValueError as exc:
        raise ValueError(f"not a raw_block key ({exc}): {encoded!r}") from exc


def slot_identity(encoded: str) -> int:
    """The identity a slot header carries for ``encoded``."""
    return int.from_bytes(hashlib.blake2b(encoded.encode(), digest_size=8).digest(), "little")


# ---- slots ----------------------------------------------------------------------------------


def encode_slot_header(encoded: str, payload_len: int, header_bytes: int) -> bytes:
    hdr = bytearray(header_bytes)
    hdr[0:8] = SLOT_MAGIC
    hdr[8:16] = slot_identity(encoded).to_bytes(8, "little")
    hdr[16:24] = int(payload_len).to_bytes(8, "little")
    return bytes(hdr)


def decode_slot_header(hdr: bytes | bytearray | memoryview) -> tuple[int, int] | None:
    """``(identity, payload_len)``, or None when ``hdr`` is not a slot header."""
    hdr = bytes(hdr[:SLOT_HEADER_MIN_BYTES])
    if len(hdr) < SLOT_HEADER_MIN_BYTES or hdr[0:8] != SLOT_MAGIC:
        return None
    return int.from_bytes(hdr[8:16], "little"), int.from_bytes(hdr[16:24], "little")


# ---- geometry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """Where things are on one device."""

    capacity: int  # bytes in use: min(device size, capacity_bytes or device size)
    block_align: int
    header_bytes: int
    slot_bytes: int
    meta_total_bytes: int

    @property
    def data_base(self) -> int:
        return self.meta_total_bytes

    @property
    def max_slots(self) -> int:
        return max(0, (self.capacity - self.data_base) // self.slot_bytes)

    @property
    def container_bytes(self) -> int:
        return (self.meta_total_bytes // META_COPIES) // self.block_align * self.block_align

    @property
    def meta_payload_capacity(self) -> int:
        return self.container_bytes - self.block_align

    def container_offset(self, index: int) -> int:
        return index * self.container_bytes

    def slot_offset(self, slot: int) -> int:
        return self.data_base + slot * self.slot_bytes

    def slot_of(self, offset: int) -> int | None:
        """The slot starting at ``offset``, or None when no slot starts there."""
        rel = offset - self.data_base
        if rel < 0 or rel % self.slot_bytes:
            return None
        slot = rel // self.slot_bytes
        return slot if slot < self.max_slots else None

    def payload_capacity(self) -> int:
        return self.slot_bytes - self.header_bytes


# ---- checkpoints ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MetaHeader:
    seq: int
    payload_len: int
    crc: int


def encode_meta_header(
    magic: bytes, version: int, seq: int, payload: bytes, block_align: int
) -> bytes:
    block = bytearray(block_align)
    crc = zlib.crc32(payload) & 0xFFFFFFFF
    block[: META_HEADER.size] = META_HEADER.pack(magic, version, seq, len(payload), crc)
    return bytes(block)


def decode_meta_header(
    block: bytes | bytearray, magic: bytes, version: int, payload_capacity: int
) -> MetaHeader | None:
    """The header of a container, or None when it is not a valid one for this config."""
    got_magic, got_version, seq, payload_len, crc = META_HEADER.unpack(
        bytes(block[: META_HEADER.size])
    )
    if got_magic != magic or got_version != version:
        return None
    if payload_len <= 0 or payload_len > payload_capacity:
        return None
    return MetaHeader(int(seq), int(payload_len), int(crc))


def payload_matches(header: MetaHeader, payload: bytes) -> bool:
    return (zlib.crc32(payload) & 0xFFFFFFFF) == header.crc


@dataclass
class EntryMeta:
    """One checkpoint entry: where the object is and what 0.5.6 records about it."""

    offset: int
    size: int
    shape: list[int] | None = None
    dtype: str | None = None
    fmt: str | None = None
    cached_positions: list[int] | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "offset": self.offset,
            "size": self.size,
            "shape": self.shape,
            "dtype": self.dtype,
            "fmt": self.fmt,
            "cached_positions": self.cached_positions,
        }


def encode_checkpoint(
    *,
    device_path: str,
    geometry: Geometry,
    meta_magic: str,
    meta_version: int,
    next_slot: int,
    entries: dict[str, EntryMeta],
) -> bytes:
    state = {
        "version": CHECKPOINT_VERSION,
        "device_path": device_path,
        "capacity_bytes": geometry.capacity,
        "block_align": geometry.block_align,
        "header_bytes": geometry.header_bytes,
        "slot_bytes": geometry.slot_bytes,
        "meta_total_bytes": geometry.meta_total_bytes,
        "meta_magic": meta_magic,
        "meta_version": meta_version,
        "data_base_offset": geometry.data_base,
        "next_slot": next_slot,
        "entries": {k: e.as_json() for k, e in entries.items()},
    }
    return json.dumps(state, separators=(",", ":"), ensure_ascii=True).encode()


def decode_checkpoint(
    payload: bytes,
    *,
    device_path: str,
    geometry: Geometry,
    meta_magic: str,
    meta_version: int,
) -> tuple[int, dict[str, EntryMeta]] | str:
    """``(next_slot, entries)`` of a checkpoint written with this geometry, or the reason it
    does not apply (a string). Entries that name no slot or an impossible size are dropped."""
    try:
        data = json.loads(payload.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        return f"its JSON does not decode ({exc})"
    if not isinstance(data, dict) or data.get("version") != CHECKPOINT_VERSION:
        return "its version is not 1"
    recorded_path = data.get("device_path")
    if recorded_path and recorded_path != device_path:
        return f"it was written for device_path {recorded_path!r}"
    expected = {
        "block_align": geometry.block_align,
        "header_bytes": geometry.header_bytes,
        "slot_bytes": geometry.slot_bytes,
        "meta_total_bytes": geometry.meta_total_bytes,
        "meta_magic": meta_magic,
        "meta_version": meta_version,
    }
    for field, want in expected.items():
        got = data.get(field, want)
        if got != want:
            return f"it was written with {field}={got!r} (this config has {want!r})"
    next_slot = data.get("next_slot", 0)
    if not isinstance(next_slot, int) or not 0 <= next_slot <= geometry.max_slots:
        return f"its next_slot {next_slot!r} is outside 0..{geometry.max_slots}"
    entries: dict[str, EntryMeta] = {}
    raw = data.get("entries")
    for key, e in (raw if isinstance(raw, dict) else {}).items():
        if not isinstance(e, dict):
            continue
        offset, size = e.get("offset"), e.get("size")
        if not isinstance(offset, int) or not isinstance(size, int):
            continue
        if geometry.slot_of(offset) is None or not 0 < size <= geometry.payload_capacity():
            continue
        entries[str(key)] = EntryMeta(
            offset,
            size,
            e.get("shape"),
            e.get("dtype") if isinstance(e.get("dtype"), str) else None,
            e.get("fmt") if isinstance(e.get("fmt"), str) else None,
            e.get("cached_positions"),
        )
    return next_slot, entries
