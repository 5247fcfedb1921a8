"""Command-line flags declared on config dataclasses, so that an option is declared once.

A config field that ``lmcache server`` (or a benchmark) also takes as a flag says so in its
own declaration: :func:`flag` returns the ``dataclasses.field`` whose metadata holds a
:class:`Flag` (the flag's name, help, type, choices, argparse action). :func:`add_flags`
adds a class's flags to an argparse group, and :func:`flag_value` reads a field's value back
from the parsed options by the flag's argparse dest; the flag's name (for error messages)
comes from :func:`flag_of`. The flag's default is the field's default unless the flag
declares its own: a flag given in GiB for a field held in bytes, or a required value whose
absence the parser must see (default ``None``).

This module imports nothing of the project, so every config module can use it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Flag", "add_flags", "flag", "flag_of", "flag_value"]


class _FieldDefault:
    """The flag's default is the field's (the marker of :attr:`Flag.default`)."""

    def __repr__(self) -> str:
        return "FIELD_DEFAULT"


FIELD_DEFAULT: Any = _FieldDefault()


@dataclass(frozen=True)
class Flag:
    """How one config field appears on the command line."""

    name: str  # "--eviction-ratio"
    help: str
    type: Any = None
    choices: tuple[str, ...] | None = None
    action: Any = None  # argparse.BooleanOptionalAction, "append", ...
    metavar: str | None = None
    default: Any = FIELD_DEFAULT

    @property
    def dest(self) -> str:
        """The attribute argparse stores the value under."""
        return self.name.lstrip("-").replace("-", "_")


def flag(
    name: str,
    help: str,
    *,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
    flag_default: Any = FIELD_DEFAULT,
    type: Any = None,
    choices: tuple[str, ...] | None = None,
    action: Any = None,
    metavar: str | None = None,
) -> Any:
    """A dataclass field that is also the flag ``name`` (``default``/``default_factory``
    are the field's; ``flag_default`` the flag's, when it differs)."""
    metadata = {
        "flag": Flag(name, help, type, choices, action, metavar, flag_default),
    }
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _field(cls: type, name: str) -> dataclasses.Field[Any]:
    for f in dataclasses.fields(cls):
        if f.name == name:
            if "flag" not in f.metadata:
                raise LookupError(f"{cls.__name__}.{name} declares no flag")
            return f
    raise LookupError(f"{cls.__name__} has no field {name!r}")


def flag_of(cls: type, name: str) -> Flag:
    """The flag of field ``name`` of the dataclass ``cls``."""
    flag_info: Flag = _field(cls, name).metadata["flag"]
    return flag_info


def _flag_default(f: dataclasses.Field[Any]) -> Any:
    declared = f.metadata["flag"].default
    if declared is not FIELD_DEFAULT:
        return declared
    if f.default is not dataclasses.MISSING:
        return f.default
    return None


def add_flags(
    group: argparse.ArgumentParser | Any,
    cls: type,
    names: Iterable[str],
    *,
    help_suffix: Mapping[str, str] | None = None,
) -> None:
    """Add the flags of ``cls``'s fields ``names`` to ``group``, in that order.
    ``help_suffix`` appends text to a field's help (e.g. the caller's default)."""
    for name in names:
        f = _field(cls, name)
        info: Flag = f.metadata["flag"]
        kwargs: dict[str, Any] = {
            "default": _flag_default(f),
            "help": info.help + (help_suffix or {}).get(name, ""),
        }
        for key in ("type", "choices", "action", "metavar"):
            value = getattr(info, key)
            if value is not None:
                kwargs[key] = value
        group.add_argument(info.name, **kwargs)


def flag_value(cls: type, name: str, options: Mapping[str, Any]) -> Any:
    """The value given for field ``name``'s flag in the parsed ``options`` (``vars(args)``),
    or its default when the parser had no such flag; in the flag's own unit."""
    f = _field(cls, name)
    return options.get(f.metadata["flag"].dest, _flag_default(f))
