"""Serdes of L2 adapters: LMCache 0.5.6's ``lmcache.v1.distributed.serde`` API and serdes
(``fp8``, ``aesgcm``, ``turboquant``) plus ours (``identity``, ``checksum``). docs/storage-backends.md#serdes
has the ``"serde"`` block and each serde's options and format.

The names below import their module on first use (importing the package stays cheap). The
built-in serdes are registered before the factory's first registration or lookup; a plugin
adds one with ``register_serde_factory(name, factory)``. Not provided: 0.5.6's multi-object
helpers (``multi``), see docs/compat.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmcache.utils.lazy import lazy_attributes, lazy_dir
from lmcache.v1.distributed.serde.base import (
    Deserializer,
    SerdeConfig,
    SerdeProcessor,
    SerdeRejectedError,
    SerdeTaskId,
    Serializer,
)

if TYPE_CHECKING:
    from lmcache.v1.distributed.serde.aesgcm import AesGcmDeserializer, AesGcmSerializer
    from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
    from lmcache.v1.distributed.serde.checksum import ChecksumDeserializer, ChecksumSerializer
    from lmcache.v1.distributed.serde.factory import (
        create_serde_processor,
        get_registered_serde_types,
        register_serde_factory,
    )
    from lmcache.v1.distributed.serde.fp8 import (
        Fp8QuantizationDeserializer,
        Fp8QuantizationSerializer,
    )
    from lmcache.v1.distributed.serde.identity import IdentityDeserializer, IdentitySerializer
    from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider, KeyProvider
    from lmcache.v1.distributed.serde.turboquant import (
        TurboQuantDeserializer,
        TurboQuantSerdeConfig,
        TurboQuantSerializer,
    )
    from lmcache.v1.distributed.serde.utils import make_temp_key, serialized_layout_desc

_P = "lmcache.v1.distributed.serde."
_LAZY: dict[str, tuple[str, str | None]] = {
    name: (_P + module, name)
    for module, names in {
        "aesgcm": ("AesGcmDeserializer", "AesGcmSerializer"),
        "async_processor": ("AsyncSerdeProcessor",),
        "checksum": ("ChecksumDeserializer", "ChecksumSerializer"),
        "factory": (
            "create_serde_processor",
            "get_registered_serde_types",
            "register_serde_factory",
        ),
        "fp8": ("Fp8QuantizationDeserializer", "Fp8QuantizationSerializer"),
        "identity": ("IdentityDeserializer", "IdentitySerializer"),
        "key_provider": ("HkdfKeyProvider", "KeyProvider"),
        "turboquant": (
            "TurboQuantDeserializer",
            "TurboQuantSerdeConfig",
            "TurboQuantSerializer",
        ),
        "utils": ("make_temp_key", "serialized_layout_desc"),
    }.items()
    for name in names
}

__all__ = [
    "AesGcmDeserializer",
    "AesGcmSerializer",
    "AsyncSerdeProcessor",
    "ChecksumDeserializer",
    "ChecksumSerializer",
    "Deserializer",
    "Fp8QuantizationDeserializer",
    "Fp8QuantizationSerializer",
    "HkdfKeyProvider",
    "IdentityDeserializer",
    "IdentitySerializer",
    "KeyProvider",
    "SerdeConfig",
    "SerdeProcessor",
    "SerdeRejectedError",
    "SerdeTaskId",
    "Serializer",
    "TurboQuantDeserializer",
    "TurboQuantSerdeConfig",
    "TurboQuantSerializer",
    "create_serde_processor",
    "get_registered_serde_types",
    "make_temp_key",
    "register_serde_factory",
    "serialized_layout_desc",
]
__getattr__ = lazy_attributes(__name__, _LAZY)
__dir__ = lazy_dir(globals(), _LAZY)
