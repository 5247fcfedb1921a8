"""The errors LMCache raises on purpose, one small hierarchy.

Each class also derives from the built-in exception the same failure raised before it
existed, so ``except ValueError`` / ``except RuntimeError`` keep working. Messages name
the bad value and the fix; the ``lmcache`` CLI prints them without a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "DeviceBackendError",
    "LMCacheConfigError",
    "LMCacheError",
    "PluginError",
    "UnknownL2AdapterTypeError",
]


class LMCacheError(Exception):
    """Base of every error LMCache raises deliberately."""


class LMCacheConfigError(LMCacheError, ValueError):
    """A configuration value (flag, JSON field, environment variable) is wrong."""


class PluginError(LMCacheError, RuntimeError):
    """A plugin (device backend or L2 adapter type) is broken or incomplete."""


class DeviceBackendError(LMCacheError, RuntimeError):
    """No usable device backend, or several where exactly one must be chosen."""


class UnknownL2AdapterTypeError(LMCacheConfigError):
    """An ``--l2-adapter`` ``type`` that no installed package registers."""

    def __init__(self, type_name: object, known: Iterable[str], where: str = "") -> None:
        """``where`` prefixes the message (e.g. ``--l2-adapter #2``)."""
        self.type_name = type_name
        self.known = sorted(known)
        hint = (
            f" (pip install lmcache-{type_name}, if that wheel exists)"
            if isinstance(type_name, str) and type_name.isidentifier()
            else ""
        )
        super().__init__(
            f"{where + ': ' if where else ''}unknown L2 adapter type {type_name!r}; known types: "
            f"{', '.join(self.known) or '(none)'}. Fix the spelling, or install the wheel that "
            f"provides it{hint}; `lmcache plugins` lists the installed types and the plugins "
            "that failed to load"
        )
