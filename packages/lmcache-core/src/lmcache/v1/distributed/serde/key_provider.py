"""AES keys per ``cache_salt`` for the ``aesgcm`` serde (LMCache 0.5.6's
``lmcache.v1.distributed.serde.key_provider``), and where the master key comes from.

``HkdfKeyProvider`` derives one key per tenant (``cache_salt``) from a master key with
HKDF-SHA256, ``info = info_prefix + cache_salt`` (0.5.6's derivation: keys derived by 0.5.6
and by us from the same master key are the same). ``read_master_key`` reads the master key
from a file (``master_key_path``, 0.5.6's option) or an environment variable
(``master_key_env``, ours). Key material never appears in a repr, a log line or an error.
"""

from __future__ import annotations

import abc
import os
import threading

from cryptography.hazmat.primitives.hashes import SHA256
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["HkdfKeyProvider", "KeyProvider", "read_master_key"]


class KeyProvider(abc.ABC):
    """The AES key of a ``cache_salt``; ``get_key`` may be called from several threads."""

    @abc.abstractmethod
    def get_key(self, cache_salt: str) -> bytes:
        """16 or 32 key bytes for ``cache_salt``."""


class HkdfKeyProvider(KeyProvider):
    def __init__(self, master_key: bytes, key_len: int, info_prefix: bytes) -> None:
        if not master_key:
            raise ValueError("master_key must be non-empty")
        if key_len not in (16, 32):
            raise ValueError(f"key_len must be 16 (AES-128) or 32 (AES-256), got {key_len}")
        self._master_key = bytes(master_key)
        self._key_len = key_len
        self._info_prefix = bytes(info_prefix)
        self._derived: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get_key(self, cache_salt: str) -> bytes:
        with self._lock:
            key = self._derived.get(cache_salt)
            if key is None:
                hkdf = HKDF(
                    algorithm=SHA256(),
                    length=self._key_len,
                    salt=None,
                    info=self._info_prefix + cache_salt.encode("utf-8"),
                )
                key = hkdf.derive(self._master_key)
                self._derived[cache_salt] = key
            return key

    def __repr__(self) -> str:  # never the key
        return f"HkdfKeyProvider(key_len={self._key_len}, master_key=<redacted>)"


def read_master_key(master_key_path: str = "", master_key_env: str = "") -> bytes:
    """The master key: the bytes of the file ``master_key_path`` or the value (UTF-8) of
    the environment variable ``master_key_env``; exactly one of the two must be given.
    Errors name the path or variable, never the key."""
    if bool(master_key_path) == bool(master_key_env):
        raise ValueError(
            "aesgcm serde needs exactly one of 'master_key_path' (a file holding the master "
            "key) or 'master_key_env' (an environment variable holding it)"
        )
    if master_key_path:
        try:
            with open(master_key_path, "rb") as f:
                key = f.read()
        except OSError as e:
            raise ValueError(
                f"aesgcm serde: cannot read master_key_path {master_key_path!r}: {e.strerror}"
            ) from None
        if not key:
            raise ValueError(f"aesgcm serde: master_key_path {master_key_path!r} is empty")
        return key
    value = os.environ.get(master_key_env)
    if not value:
        raise ValueError(
            f"aesgcm serde: environment variable {master_key_env!r} (master_key_env) is unset "
            "or empty; set it to the master key"
        )
    return value.encode("utf-8")
