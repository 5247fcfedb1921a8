"""L2 adapter configuration and ``--l2-adapter`` parsing (docs/design/storage-engine.md#l2-config).

Every JSON object given to ``--l2-adapter`` names a registered ``type``; its config class
(a ``L2AdapterConfigBase`` subclass) parses the rest with ``from_dict``. Types come from
core (plugin, native_plugin, mock, fault_inject) and from wheels through the
``lmcache.l2_adapters`` entry-point group; the ``L2AdapterRegistry`` (``registry``) owns
them, and the registry functions here answer from its default instance.
"""

from __future__ import annotations

import abc
import argparse
import difflib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmcache.utils import init_logger
from lmcache.v1.distributed.eviction_config import EvictionConfig
from lmcache.v1.distributed.l2_adapters.registry import default_l2_adapter_registry
from lmcache.v1.errors import UnknownL2AdapterTypeError

if TYPE_CHECKING:
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface

logger = init_logger(__name__)

__all__ = [
    "GENERIC_FIELDS",
    "L2AdapterConfigBase",
    "L2AdaptersConfig",
    "PersistConfig",
    "SerdeConfig",
    "add_l2_adapters_args",
    "create_l2_adapter_from_registry",
    "get_l2_adapter_config_class",
    "get_registered_l2_adapter_types",
    "get_type_name_for_config",
    "parse_args_to_l2_adapters_config",
    "register_l2_adapter_type",
]

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


@dataclass
class SerdeConfig:
    """The adapter's ``serde`` block: the serializer ``type`` wrapped around the adapter and
    its other keys as ``kwargs``."""

    type: str
    kwargs: dict[str, Any] = field(default_factory=dict)


class L2AdapterConfigBase(abc.ABC):
    """Base of every adapter config. The parser sets the generic attributes after ``from_dict``.

    A subclass MAY declare ``known_fields: frozenset[str]``; unknown top-level keys then log
    a warning naming the closest known field (they are never rejected).
    """

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


# --- registry (0.5.6's functions, answered by the default L2AdapterRegistry) ----------------


def register_l2_adapter_type(name: str, cls: type[L2AdapterConfigBase]) -> None:
    """Make JSON ``type`` ``name`` parse with ``cls`` (0.5.6 API; entry-point wheels use
    ``L2AdapterTypeSpec`` instead). A name already taken raises ``DuplicateRegistrationError``."""
    default_l2_adapter_registry().register_type(name, cls)


def get_l2_adapter_config_class(t: str) -> type[L2AdapterConfigBase]:
    """The config class of type (or alias) ``t``; ``UnknownL2AdapterTypeError`` otherwise."""
    return default_l2_adapter_registry().config_class(t)


def get_registered_l2_adapter_types() -> list[str]:
    """Every type name and alias, sorted (loads built-ins and plugins)."""
    return default_l2_adapter_registry().names()


def get_type_name_for_config(cfg: L2AdapterConfigBase) -> str:
    """The registered type name whose config class ``cfg`` is an instance of."""
    return default_l2_adapter_registry().type_name_for_config(cfg)


def create_l2_adapter_from_registry(
    cfg: L2AdapterConfigBase, l1_memory_desc: L1MemoryDesc | None = None
) -> L2AdapterInterface:
    """Also exported here (IMPROVE, docs/design/storage-engine.md#l2-packaging): builds the adapter
    ``cfg`` configures."""
    return default_l2_adapter_registry().create(cfg, l1_memory_desc)


# --- --l2-adapter ---------------------------------------------------------------------------


def _help_example(types: list[str]) -> str:
    if "fs" in types:
        return '{"type":"fs","base_path":"/data/lmcache"}'
    return '{"type":"mock","max_size_gb":1.0,"mock_bandwidth_gb":10.0}'


def add_l2_adapters_args(parser: argparse.ArgumentParser | Any) -> None:
    """Add the repeatable ``--l2-adapter JSON`` flag (group "L2 Adapters"). Its help names
    the built-in types and the installed ``lmcache.l2_adapters`` entry points without
    importing any plugin (``lmcache server --help`` stays fast and cannot fail on a broken
    plugin); ``lmcache plugins`` lists every type each entry point provides."""
    types, entry_points = default_l2_adapter_registry().names_without_plugins()
    plugins = (
        f"; installed plugins (entry points, each providing one or more types): "
        f"{', '.join(entry_points)}"
        if entry_points
        else ""
    )
    group = parser.add_argument_group("L2 Adapters")
    group.add_argument(
        "--l2-adapter",
        action="append",
        default=[],
        metavar="JSON",
        dest="l2_adapter",
        help=(
            "L2 adapter as a JSON object, repeatable (cascade in argument order). "
            f"Types: {', '.join(types) or '(none)'}{plugins}. `lmcache plugins` lists every "
            f"type. Example: '{_help_example([*types, *entry_points])}'"
        ),
    )


def _warn_unknown_fields(i: int, t: str, cls: type, d: dict[str, Any]) -> None:
    known = getattr(cls, "known_fields", None)
    if not known:
        return
    allowed = set(known) | GENERIC_FIELDS
    for k in sorted(set(d) - allowed):
        close = difflib.get_close_matches(k, sorted(allowed), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        logger.warning("--l2-adapter #%d (type %r): unknown field %r ignored%s", i, t, k, hint)


def build_config_from_dict(
    cls: type[L2AdapterConfigBase], d: dict[str, Any]
) -> L2AdapterConfigBase:
    """``cls.from_dict`` plus the generic fields (affinity_tag, shared, eviction, persist, serde)."""
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


def parse_l2_adapter_dict(i: int, d: Any) -> L2AdapterConfigBase:
    """Parse one decoded ``--l2-adapter`` object (``i`` is its 1-based index)."""
    if not isinstance(d, dict):
        raise ValueError(f"--l2-adapter #{i}: expected a JSON object, got {type(d).__name__}")
    if d.get("type") is None:  # as 0.5.6: an explicit null is a missing type
        raise ValueError(f"--l2-adapter #{i}: missing 'type' field")
    t = d["type"]
    registry = default_l2_adapter_registry()
    try:
        cls = registry.config_class(t) if isinstance(t, str) else None
    except UnknownL2AdapterTypeError:
        cls = None
    if cls is None:
        raise registry.unknown_type_error(t, where=f"--l2-adapter #{i}")
    try:
        _warn_unknown_fields(i, t, cls, d)
        cfg = build_config_from_dict(cls, d)
    except (TypeError, ValueError) as exc:
        rule = "-" * 60
        logger.error(
            "Error parsing --l2-adapter #%d (type %r): %s\n%s\n%s\n%s",
            i,
            t,
            exc,
            rule,
            cls.help(),
            rule,
        )
        raise ValueError(f"--l2-adapter #{i} ({t!r}): {exc}") from exc
    return cfg


def parse_args_to_l2_adapters_config(args: argparse.Namespace) -> L2AdaptersConfig:
    """Parse every ``--l2-adapter`` JSON string of ``args`` (see :func:`add_l2_adapters_args`);
    ``ValueError`` naming the adapter's position on bad JSON, an unknown type or a rejected
    field."""
    adapters = []
    for i, raw in enumerate(getattr(args, "l2_adapter", None) or [], start=1):
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"Invalid JSON for --l2-adapter #{i}: {exc}") from exc
        adapters.append(parse_l2_adapter_dict(i, d))
    return L2AdaptersConfig(adapters=adapters)
