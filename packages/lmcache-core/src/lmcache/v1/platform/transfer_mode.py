"""MP transfer mode enum and its resolution (dependency-free; re-exported upward).

Defined in the platform layer so ``DeviceSpec`` can answer ``default_mp_transfer_mode()``
without importing the multiprocess package.
"""

from __future__ import annotations

import enum
import os
from typing import Any

from lmcache.utils import init_logger

logger = init_logger(__name__)

MP_TRANSFER_MODE_ENV_VAR = "LMCACHE_MP_TRANSFER_MODE"

__all__ = [
    "MP_TRANSFER_MODE_ENV_VAR",
    "MPTransferMode",
    "effective_default_mode",
    "effective_lmcache_driven_available",
    "resolve_mp_transfer_mode",
]


class MPTransferMode(str, enum.Enum):
    AUTO = "auto"
    ENGINE_DRIVEN = "engine_driven"
    LMCACHE_DRIVEN = "lmcache_driven"

    def __str__(self) -> str:
        return self.value


def _parse(value: Any) -> MPTransferMode:
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
        return _parse(mode)
    return _parse(os.environ.get(MP_TRANSFER_MODE_ENV_VAR, "auto") or "auto")


_warned: set[tuple[str, str]] = set()


def _warn_once(key: tuple[str, str], msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


def effective_lmcache_driven_available(spec: Any) -> bool:
    """The router's capability gate (platform.md §2.3): ``is_lmcache_driven_available()``.

    Logs once when a spec overrides both flags and they disagree.
    """
    from lmcache.v1.platform.base.device_spec import overrides

    lmc = bool(spec.is_lmcache_driven_available())
    if overrides(spec, "is_lmcache_driven_available") and overrides(
        spec, "is_handle_transfer_available"
    ):
        handle = bool(spec.is_handle_transfer_available())
        if handle != lmc:
            _warn_once(
                ("disagree", type(spec).__qualname__),
                "DeviceSpec %s: is_lmcache_driven_available()=%s disagrees with "
                "is_handle_transfer_available()=%s; using the former",
                type(spec).__qualname__,
                lmc,
                handle,
            )
    return lmc


def effective_default_mode(spec: Any) -> MPTransferMode:
    """What AUTO means for ``spec``: never AUTO; a raising/AUTO answer becomes ENGINE_DRIVEN."""
    if spec is None:
        return MPTransferMode.ENGINE_DRIVEN
    name = getattr(spec, "backend_name", "?")
    try:
        mode = _parse(spec.default_mp_transfer_mode())
    except Exception as exc:
        _warn_once(
            ("raise", str(name)),
            "DeviceSpec %s (backend %r): default_mp_transfer_mode() raised %s; using engine_driven",
            type(spec).__qualname__,
            name,
            exc,
        )
        return MPTransferMode.ENGINE_DRIVEN
    if mode is MPTransferMode.AUTO:
        _warn_once(
            ("auto", str(name)),
            "DeviceSpec %s (backend %r): default_mp_transfer_mode() returned AUTO; using engine_driven",
            type(spec).__qualname__,
            name,
        )
        return MPTransferMode.ENGINE_DRIVEN
    return mode
