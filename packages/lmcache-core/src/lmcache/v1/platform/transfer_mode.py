"""MP transfer mode enum and its resolution (dependency-free; re-exported upward).

Defined in the platform layer so ``DeviceSpec`` can answer ``default_mp_transfer_mode()``
without importing the multiprocess package. What a spec's answers mean for the mode
(``effective_default_mode``, ``effective_lmcache_driven_available``) lives with
``DeviceSpec`` in ``base.device_spec``: this module stays below it.
"""

from __future__ import annotations

import enum
import os
from typing import Any

MP_TRANSFER_MODE_ENV_VAR = "LMCACHE_MP_TRANSFER_MODE"

__all__ = [
    "MP_TRANSFER_MODE_ENV_VAR",
    "MPTransferMode",
    "parse_mp_transfer_mode",
    "resolve_mp_transfer_mode",
]


class MPTransferMode(str, enum.Enum):
    AUTO = "auto"
    ENGINE_DRIVEN = "engine_driven"
    LMCACHE_DRIVEN = "lmcache_driven"

    def __str__(self) -> str:
        return self.value


def parse_mp_transfer_mode(value: Any) -> MPTransferMode:
    """``value`` (enum, its name or value, any case) as an MPTransferMode; ValueError otherwise."""
    if isinstance(value, MPTransferMode):
        return value
    text = str(value.value if isinstance(value, enum.Enum) else value).strip().lower()
    try:
        return MPTransferMode(text)
    except ValueError:
        raise ValueError(
            f"Invalid MP transfer mode {value!r} (valid: auto, engine_driven, lmcache_driven)"
        ) from None


def resolve_mp_transfer_mode(mode: Any = None) -> MPTransferMode:
    """Explicit ``mode`` wins; else ``LMCACHE_MP_TRANSFER_MODE`` (default ``auto``)."""
    if mode is not None:
        return parse_mp_transfer_mode(mode)
    return parse_mp_transfer_mode(os.environ.get(MP_TRANSFER_MODE_ENV_VAR, "auto") or "auto")
