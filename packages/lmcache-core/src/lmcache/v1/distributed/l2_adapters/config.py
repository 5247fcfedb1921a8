"""L2 adapter configuration (docs/design/storage-engine.md#l2-config).

Every JSON object given to ``--l2-adapter`` names a registered ``type``; its config class (a
:class:`L2AdapterConfigBase` subclass, which carries the type's name in ``type_name`` and its
help in ``help()``) parses the rest with ``from_options``: the type's own fields
(``from_dict``) and the generic ones (:data:`GENERIC_FIELDS`). The
``L2AdapterRegistry`` (``registry``) finds the class for a type name and the factory for a
config; ``L2AdapterRegistry.parse`` / ``create`` / ``build`` are the configuration path.

0.5.6's functions of this module (``register_l2_adapter_type``,
``get_l2_adapter_config_class``, ``get_registered_l2_adapter_types``,
``get_type_name_for_config``, ``create_l2_adapter_from_registry``, ``add_l2_adapters_args``,
``parse_args_to_l2_adapters_config``) and this project's earlier ``build_config_from_dict`` /
``parse_l2_adapter_dict`` live in ``lmcache.v1.distributed.compat_056`` and are importable
from here as before.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from lmcache.utils.lazy import lazy_attributes, lazy_dir
from lmcache.v1.distributed.compat_056_names import compat_lazy_table
from lmcache.v1.distributed.eviction_config import EvictionConfig
from lmcache.v1.distributed.serde.base import SerdeConfig

if TYPE_CHECKING:
    # Typed views of the 0.5.6 names below; at run time __getattr__ imports them.
    from lmcache.v1.distributed.compat_056 import (
        add_l2_adapters_args,
        build_config_from_dict,
        create_l2_adapter_from_registry,
        get_l2_adapter_config_class,
        get_registered_l2_adapter_types,
        get_type_name_for_config,
        parse_args_to_l2_adapters_config,
        parse_l2_adapter_dict,
        register_l2_adapter_type,
    )

__all__ = [
    "GENERIC_FIELDS",
    "L2AdapterConfigBase",
    "L2AdaptersConfig",
    "PersistConfig",
    "SerdeConfig",
    "add_l2_adapters_args",
    "build_config_from_dict",
    "create_l2_adapter_from_registry",
    "get_l2_adapter_config_class",
    "get_registered_l2_adapter_types",
    "get_type_name_for_config",
    "parse_args_to_l2_adapters_config",
    "parse_l2_adapter_dict",
    "register_l2_adapter_type",
]

# 0.5.6's functions (and two earlier names of ours): defined once, in the compat module,
# which imports this one; a table, not an import, so that no cycle results.
_LAZY = compat_lazy_table(__name__)

GENERIC_FIELDS = frozenset(
    {"type", "affinity_tag", "shared", "eviction", "persist_enabled", "serde"}
)
"""Top-level ``--l2-adapter`` keys the parser handles for every type (set on the config after
``from_dict``); a type's ``from_dict`` may ignore them."""


def _optional_dict(d: dict[str, Any], key: str) -> dict[str, Any] | None:
    """``d[key]`` when it is a dict, None when absent; anything else is an error."""
    value = d.get(key)
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{key!r} must be a dict, got {type(value).__name__}")
    return value


@dataclass
class PersistConfig:
    """Whether the store controller writes L1 objects behind to this adapter (``persist_enabled``
    in the adapter's JSON, default true)."""

    persist_enabled: bool = True


class L2AdapterConfigBase(abc.ABC):
    """Base of every adapter config: a type's options, declared once, in its class.

    A subclass declares ``type_name`` (its JSON ``type``; a class without one, as written
    for 0.5.6, gets the name it registers under) and implements ``from_dict`` and ``help``.
    It MAY declare ``known_fields: frozenset[str]``; unknown top-level keys then log a
    warning naming the closest known field (they are never rejected). ``from_options`` adds
    the generic attributes to what ``from_dict`` returns.
    """

    #: The JSON ``type`` this class configures (the canonical name, never an alias), so that
    #: creating an adapter from a config never searches the registry for it.
    type_name: ClassVar[str] = ""
    affinity_tag: str = "_default"
    shared: bool = False
    eviction_config: EvictionConfig | None = None
    persist_config: PersistConfig = PersistConfig(persist_enabled=True)
    serde_config: SerdeConfig | None = None
    # Declared by the configs of capacity-bound backends (``max_capacity_bytes`` reads it).
    max_capacity_gb: float

    @classmethod
    @abc.abstractmethod
    def from_dict(cls, d: dict[str, Any]) -> L2AdapterConfigBase:
        """Build the config from one ``--l2-adapter`` JSON object (``type`` and the generic
        keys included). Raise ``ValueError`` naming the bad field; the parser adds which
        ``--l2-adapter`` it was and prints :meth:`help`."""

    @classmethod
    @abc.abstractmethod
    def help(cls) -> str:
        """The type's fields, their defaults and an example, shown when its JSON is rejected
        and by ``lmcache server --help``."""

    @classmethod
    def from_options(cls, d: dict[str, Any]) -> L2AdapterConfigBase:
        """The config of one ``--l2-adapter`` object: ``from_dict`` (given every key but
        ``affinity_tag``) plus the generic fields (affinity_tag, shared, eviction,
        persist_enabled, serde)."""
        cfg = cls.from_dict({k: v for k, v in d.items() if k != "affinity_tag"})
        tag = d.get("affinity_tag", "_default")
        if not isinstance(tag, str) or not tag:
            raise ValueError("affinity_tag must be a non-empty string")
        cfg.affinity_tag = tag
        cfg.shared = bool(d.get("shared", False))
        cfg.eviction_config = L2AdapterConfigBase._parse_eviction_config(d)
        cfg.persist_config = L2AdapterConfigBase._parse_persist_config(d)
        cfg.serde_config = L2AdapterConfigBase._parse_serde_config(d)
        return cfg

    # --- static helpers for subclasses and the parser ---------------------------------

    @staticmethod
    def _parse_eviction_config(d: dict[str, Any]) -> EvictionConfig | None:
        ev = _optional_dict(d, "eviction")
        if ev is None:
            return None
        policy = ev.get("eviction_policy")
        if policy not in ("LRU", "ARC", "IsolatedLRU", "noop"):
            raise ValueError(
                f"eviction.eviction_policy must be 'LRU', 'ARC', 'IsolatedLRU', or 'noop', got {policy!r}"
            )
        return EvictionConfig(
            eviction_policy=policy,
            trigger_watermark=ev.get("trigger_watermark", 0.8),
            eviction_ratio=ev.get("eviction_ratio", 0.2),
        )

    @staticmethod
    def _parse_persist_config(d: dict[str, Any]) -> PersistConfig:
        return PersistConfig(persist_enabled=bool(d.get("persist_enabled", True)))

    @staticmethod
    def _parse_serde_config(d: dict[str, Any]) -> SerdeConfig | None:
        s = _optional_dict(d, "serde")
        if s is None:
            return None
        if "type" not in s:
            raise ValueError("'serde' dict must include a 'type' field")
        kwargs = {k: v for k, v in s.items() if k != "type"}
        return SerdeConfig(type=str(s["type"]), kwargs=kwargs)

    @staticmethod
    def _parse_max_capacity_gb(d: dict[str, Any]) -> float:
        cap = d.get("max_capacity_gb", 0)
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0:
            raise ValueError("max_capacity_gb must be a non-negative number")
        return float(cap)

    @property
    def max_capacity_bytes(self) -> int:
        """``max_capacity_gb`` in bytes (0 = unlimited), for configs that have that field."""
        return int(self.max_capacity_gb * (1 << 30))

    @staticmethod
    def _validate_num_workers(raw: Any) -> int:
        if isinstance(raw, bool) or not isinstance(raw, int) or raw <= 0:
            raise ValueError("num_workers must be a positive integer")
        return raw

    @staticmethod
    def _validate_per_op_workers(m: dict[str, Any]) -> dict[str, int]:
        for k, v in m.items():
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"per_op_workers[{k!r}] must be a positive integer, got {v!r}")
        return dict(m)

    @staticmethod
    def _parse_per_op_workers_from_dict(d: dict[str, Any]) -> dict[str, int]:
        m = d.get("per_op_workers", {})
        if not isinstance(m, dict):
            raise ValueError("per_op_workers must be a dict")
        for k, v in m.items():
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(
                    f"per_op_workers[{k!r}] must be an integer, got {type(v).__name__}"
                )
        return L2AdapterConfigBase._validate_per_op_workers(m)


@dataclass
class L2AdaptersConfig:
    """Every parsed ``--l2-adapter``, in command-line order (the cascade order)."""

    adapters: list[L2AdapterConfigBase] = field(default_factory=list)


# Hidden from type checkers: with a visible module __getattr__, mypy would accept any
# misspelt name imported from this module as Any.
if not TYPE_CHECKING:
    __getattr__ = lazy_attributes(__name__, _LAZY)


__dir__ = lazy_dir(globals(), _LAZY)
