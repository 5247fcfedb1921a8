"""Serde types by name (LMCache 0.5.6's ``lmcache.v1.distributed.serde.factory``).

A serde registers ``factory(kwargs) -> SerdeProcessor`` under the name an adapter's
``"serde": {"type": <name>, ...}`` block uses; ``kwargs`` are the block's other keys. The
built-in serdes (``identity``, ``fp8``, ``aesgcm``, ``checksum``, ``turboquant``) are registered before the
first registration or lookup, so a plugin cannot take a built-in's name (as in 0.5.6, where
they register when the package is imported).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmcache.v1.distributed.serde.base import SerdeConfig, SerdeProcessor

__all__ = ["create_serde_processor", "get_registered_serde_types", "register_serde_factory"]

SerdeFactory = Callable[[dict[str, object]], "SerdeProcessor"]

_REGISTRY: dict[str, SerdeFactory] = {}
_LOCK = threading.Lock()
_BUILTINS = (
    "identity",
    "fp8",
    "aesgcm",
    "checksum",
    "turboquant",
)  # modules that register one each
_builtins_loaded = False


def register_serde_factory(name: str, factory: SerdeFactory) -> None:
    """Register ``factory`` under ``name``; a name registered twice is a ValueError."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"serde type name must be a non-empty string, got {name!r}")
    _load_builtins()
    with _LOCK:
        if name in _REGISTRY:
            raise ValueError(f"Serde type already registered: {name!r}")
        _REGISTRY[name] = factory


# LMCache 0.5.6 serdes that cannot run here: the reason replaces "unknown" (none today).
NOT_PROVIDED_SERDES: dict[str, str] = {}


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True  # first: each module's own registration comes back here
    for module in _BUILTINS:
        importlib.import_module(f"lmcache.v1.distributed.serde.{module}")


def get_registered_serde_types() -> list[str]:
    """The registered serde type names, sorted."""
    _load_builtins()
    with _LOCK:
        return sorted(_REGISTRY)


def create_serde_processor(config: SerdeConfig) -> SerdeProcessor:
    """The processor ``config`` names; an unknown type or bad options raise ValueError
    naming the registered types or the bad option."""
    known = get_registered_serde_types()
    with _LOCK:
        factory = _REGISTRY.get(config.type)
    if factory is None and config.type in NOT_PROVIDED_SERDES:
        raise ValueError(
            f"serde type {config.type!r} is not provided by this release: "
            f"{NOT_PROVIDED_SERDES[config.type]}. Registered: {', '.join(known)}"
        )
    if factory is None:
        raise ValueError(
            f"Unknown serde type {config.type!r}. Registered: {', '.join(known) or '(none)'} "
            "(a serde plugin adds one with lmcache.v1.distributed.serde.factory."
            "register_serde_factory)"
        )
    try:
        return factory(dict(config.kwargs))
    except (TypeError, KeyError) as e:
        raise ValueError(f"serde {config.type!r}: bad options {sorted(config.kwargs)}: {e}") from e
