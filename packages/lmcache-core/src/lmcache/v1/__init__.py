"""LMCache v1 core.

Importing any ``lmcache.v1`` module installs a PEP 562 ``__getattr__`` on the
``lmcache`` namespace package (which has no ``__init__.py``), so ``lmcache.device_ops``,
``lmcache.torch_dev`` and ``lmcache.torch_device_type`` resolve lazily on first access.
Importing never runs device detection.
"""

from __future__ import annotations

import sys
from typing import Any

_LAZY = ("device_ops", "torch_dev", "torch_device_type")
_cli_only_logged = False


def _lmcache_getattr(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lmcache' has no attribute {name!r}")
    try:
        import torch  # noqa: F401
    except ImportError as exc:
        global _cli_only_logged
        if not _cli_only_logged:
            _cli_only_logged = True
            from lmcache.utils import init_logger

            init_logger("lmcache").warning(
                "No compute backend loaded; CLI-only mode (torch not installed). Reason: %s", exc
            )
        raise AttributeError(
            f"lmcache.{name} is unavailable: torch is not installed (CLI-only mode)"
        ) from exc
    from lmcache.v1.platform import _device_detect as dd

    if name == "device_ops":
        return dd.resolve_device_ops(dd.get_torch_device()[1])
    module, device_type = dd.get_torch_device()
    return module if name == "torch_dev" else device_type


def _install() -> None:
    pkg = sys.modules.get("lmcache")
    if pkg is not None and getattr(pkg, "__getattr__", None) is not _lmcache_getattr:
        pkg.__getattr__ = _lmcache_getattr  # type: ignore[attr-defined]


_install()
