"""Byte-exact L2 object names (docs/design/storage-formats.md#l2-names). Every adapter uses this
codec.

Native string: ``<model>@<kv_rank 8 hex>@<gid hex>@<hash hex>[@<salt>]``.
File name: ``<model, "/" -> "-SEP-">@0x<kv_rank 8 hex>@<gid hex>@<hash hex>[@<salt>].data``.
Parsers return ``None`` for anything that is not exactly such a name.
"""

from __future__ import annotations

from lmcache.v1.distributed.api import ObjectKey

__all__ = [
    "filename_to_object_key",
    "object_key_to_filename",
    "object_key_to_string",
    "string_to_object_key",
]

_SEP = "-SEP-"
_SUFFIX = ".data"


def _fields(key: ObjectKey, rank_prefix: str, model: str) -> str:
    s = f"{model}@{rank_prefix}{key.kv_rank & 0xFFFFFFFF:08x}@{key.object_group_id:x}@{bytes(key.chunk_hash).hex()}"
    if key.cache_salt:
        s += f"@{key.cache_salt}"
    return s


def object_key_to_string(key: ObjectKey) -> str:
    """The L2 name of ``key`` for native connectors, RESP keys and S3 objects:
    ``<model>@<kv_rank: 8 hex>@<group hex>@<hash hex>[@<salt>]`` (byte-exact with 0.5.6)."""
    return _fields(key, "", key.model_name)


def object_key_to_filename(key: ObjectKey) -> str:
    """The file name of ``key`` for file backends: ``/`` in the model becomes ``-SEP-``, the
    rank gets a ``0x`` prefix and the name ends in ``.data`` (byte-exact with 0.5.6)."""
    return _fields(key, "0x", key.model_name.replace("/", _SEP)) + _SUFFIX


def _hex_int(s: str) -> int | None:
    if s[:2] in ("0x", "0X"):
        s = s[2:]
    if not s or any(c not in "0123456789abcdefABCDEF" for c in s):
        return None
    return int(s, 16)


def _parse(parts: list[str], model: str) -> ObjectKey | None:
    rank = _hex_int(parts[1])
    gid = _hex_int(parts[2])
    h = parts[3]
    if h[:2] in ("0x", "0X"):
        h = h[2:]
    # An empty hash field names no chunk: a foreign name, not a key with chunk_hash=b"".
    if rank is None or gid is None or not h or len(h) % 2 or _hex_int(h) is None:
        return None
    salt = parts[4] if len(parts) == 5 else ""
    if len(parts) == 5 and not salt:
        return None
    try:
        return ObjectKey(bytes.fromhex(h), model, rank, gid, salt)
    except (ValueError, TypeError):
        return None


def string_to_object_key(s: str) -> ObjectKey | None:
    """Inverse of :func:`object_key_to_string`; ``None`` for anything that is not such a name
    (wrong field count, bad hex, invalid salt), so listings skip foreign objects."""
    parts = s.split("@")
    if len(parts) not in (4, 5) or not parts[0]:
        return None
    return _parse(parts, parts[0])


def filename_to_object_key(name: str) -> ObjectKey | None:
    """Inverse of :func:`object_key_to_filename`; ``None`` for foreign or temporary files
    (no ``.data`` suffix, wrong field count, bad hex, invalid salt)."""
    if not name.endswith(_SUFFIX):
        return None
    parts = name[: -len(_SUFFIX)].split("@")
    if len(parts) not in (4, 5) or not parts[0]:
        return None
    return _parse(parts, parts[0].replace(_SEP, "/"))
