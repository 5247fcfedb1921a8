"""Module attributes that import their module on first access (PEP 562 ``__getattr__``).

Several packages re-export names whose modules import torch or scan entry points; importing
the package itself must stay cheap, so those names resolve when first used. This is the one
implementation of that table lookup.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_attributes", "lazy_dir"]


def lazy_attributes(
    module_name: str, table: Mapping[str, tuple[str, str | None]]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``table``: ``name -> (module, attribute)``; attribute
    ``None`` means the module itself. Resolved on every access (nothing is cached in the
    package, so a test that patches the source module is seen); unknown names raise the
    ``AttributeError`` Python would."""

    def __getattr__(name: str) -> Any:
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        module = importlib.import_module(target[0])
        return module if target[1] is None else getattr(module, target[1])

    return __getattr__


def lazy_dir(namespace: Mapping[str, Any], table: Mapping[str, Any]) -> Callable[[], list[str]]:
    """A module ``__dir__`` that lists the lazy names of ``table`` beside the module's own
    ``namespace`` (its ``globals()``)."""

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __dir__
