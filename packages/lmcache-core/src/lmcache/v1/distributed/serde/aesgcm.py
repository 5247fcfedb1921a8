"""The ``aesgcm`` serde (LMCache 0.5.6's): L2 data encrypted at rest with AES-GCM, one key
per tenant (``cache_salt``) derived from a master key (key_provider.py).

Stored frame, 0.5.6's bytes: ``[1 byte version = 1][12-byte random IV][ciphertext][16-byte
tag]``, the ciphertext as long as the object's bytes, no associated data. A frame that is
truncated, altered, of another version or sealed with another key is rejected (a load miss,
counted in ``lmcache_mp_l2_serde_rejected_chunks_total``), never decrypted into wrong KV.

Options: ``master_key_path`` (0.5.6's: a file holding the master key) or ``master_key_env``
(ours: an environment variable holding it), ``aes_bits`` (128, the default, or 256),
``key_provider`` (``"hkdf"``, the only one 0.5.6 implements), ``max_workers`` (default 1).
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

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
from lmcache.v1.distributed.serde.key_provider import (
    HkdfKeyProvider,
    KeyProvider,
    read_master_key,
)
from lmcache.v1.distributed.serde.utils import layout_nbytes
from lmcache.v1.memory_management import MemoryObj

__all__ = ["AesGcmDeserializer", "AesGcmSerializer"]

FRAME_VERSION = 1
IV_LEN = 12
TAG_LEN = 16
HEADER_LEN = 1 + IV_LEN
HKDF_INFO_PREFIX = b"lmcache-l2-aesgcm-v1"  # 0.5.6's: the same master key, the same keys


class AesGcmSerializer(Serializer):
    """The object's bytes sealed with AES-GCM under its ``cache_salt``'s key (0.5.6's frame)."""

    def __init__(self, key_provider: KeyProvider) -> None:
        self._keys = key_provider

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        iv = os.urandom(IV_LEN)
        sealed = AESGCM(self._keys.get_key(key.cache_salt)).encrypt(iv, bytes(byte_view(src)), None)
        out = byte_view(dst)
        end = HEADER_LEN + len(sealed)
        out[0] = FRAME_VERSION
        out[1:HEADER_LEN] = iv
        out[HEADER_LEN:end] = sealed
        return end

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        return layout_nbytes(layout_desc) + HEADER_LEN + TAG_LEN  # exact


class AesGcmDeserializer(Deserializer):
    """Opens a frame of ``AesGcmSerializer``; any other input is rejected."""

    def __init__(self, key_provider: KeyProvider) -> None:
        self._keys = key_provider

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        out = byte_view(dst)
        frame_len = HEADER_LEN + len(out) + TAG_LEN
        data = byte_view(src)
        if len(data) < frame_len:
            data = physical_bytes(src)
        if len(data) < frame_len:
            raise SerdeRejectedError(
                f"aesgcm: {len(data)} stored bytes, a {len(out)}-byte object needs {frame_len}"
            )
        if data[0] != FRAME_VERSION:
            raise SerdeRejectedError(f"aesgcm: frame version {data[0]}, expected {FRAME_VERSION}")
        try:
            plain = AESGCM(self._keys.get_key(key.cache_salt)).decrypt(
                bytes(data[1:HEADER_LEN]), bytes(data[HEADER_LEN:frame_len]), None
            )
        except InvalidTag:
            raise SerdeRejectedError(
                "aesgcm: authentication failed (altered data or another master key)"
            ) from None
        out[:] = plain


def _create_aesgcm_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    check_options(
        "aesgcm",
        kwargs,
        {"key_provider", "aes_bits", "master_key_path", "master_key_env", "max_workers"},
    )
    provider_name = str(kwargs.get("key_provider", "hkdf"))
    if provider_name != "hkdf":
        raise ValueError(
            f"aesgcm serde: key_provider {provider_name!r} is not supported; use 'hkdf'"
        )
    aes_bits = int_option(kwargs, "aes_bits", 128)
    if aes_bits not in (128, 256):
        raise ValueError(f"aesgcm serde: aes_bits must be 128 or 256, got {aes_bits}")
    master = read_master_key(
        str(kwargs.get("master_key_path") or ""), str(kwargs.get("master_key_env") or "")
    )
    provider = HkdfKeyProvider(master, key_len=aes_bits // 8, info_prefix=HKDF_INFO_PREFIX)
    return AsyncSerdeProcessor(
        AesGcmSerializer(provider),
        AesGcmDeserializer(provider),
        int_option(kwargs, "max_workers", 1),
    )


register_serde_factory("aesgcm", _create_aesgcm_serde)
