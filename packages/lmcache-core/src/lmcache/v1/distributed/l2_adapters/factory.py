"""Adapter factories and plugin discovery (spec §0.2, §6.2).

Built-in types register first (``plugin``, ``native_plugin``, ``mock``, ``fault_inject``), then
wheels through the ``lmcache.l2_adapters`` entry-point group, one pluggy ``PluginManager`` for the
group. Entry points load lazily, one at a time, sorted by name, each under its own try/except:
a broken plugin is logged (entry point, distribution, reason), listed by
``failed_l2_adapter_plugins()`` and skipped; the rest stays usable.

For ``lmcache plugins``: ``describe_l2_adapter_types()`` and ``failed_l2_adapter_plugins()``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from typing import TYPE_CHECKING, Any

import pluggy

from lmcache.utils import init_logger
from lmcache.v1.distributed.l2_adapters import config as _cfg
from lmcache.v1.distributed.l2_adapters.hookspecs import (
    ENTRY_POINT_GROUP,
    PROJECT_NAME,
    L2AdapterFactory,
    L2AdapterHookSpecs,
    L2AdapterTypeSpec,
)

if TYPE_CHECKING:
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
    from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

logger = init_logger(__name__)

__all__ = [
    "L2AdapterFactory",
    "add_pending_module",
    "create_l2_adapter_from_registry",
    "describe_l2_adapter_types",
    "ensure_adapter_loaded",
    "failed_l2_adapter_plugins",
    "get_all_registered_names",
    "load_all_l2_adapter_types",
    "refresh_l2_adapter_plugins",
    "register_l2_adapter_factory",
]

BUILTIN_MODULES: tuple[str, ...] = (
    "lmcache.v1.distributed.l2_adapters.plugin_l2_adapter",
    "lmcache.v1.distributed.l2_adapters.native_plugin_l2_adapter",
    "lmcache.v1.distributed.l2_adapters.mock_l2_adapter",
    "lmcache.v1.distributed.l2_adapters.fault_inject_l2_adapter",
)

_LOCK = threading.RLock()
_FACTORIES: dict[str, L2AdapterFactory] = {}
_PENDING: list[str] = list(BUILTIN_MODULES)
_builtins_loaded = False
# name -> {"source", "distribution", "version"}
_ORIGINS: dict[str, dict[str, Any]] = {}
_FAILED: list[tuple[str, str, str]] = []
_EP_DONE: set[str] = set()  # entry-point names already processed (loaded or failed)
_PM: pluggy.PluginManager | None = None


def register_l2_adapter_factory(name: str, fn: L2AdapterFactory) -> None:
    with _LOCK:
        if name in _FACTORIES:
            raise ValueError(f"L2 adapter factory already registered: {name}")
        _FACTORIES[name] = fn
        _ORIGINS.setdefault(name, {"source": "built-in"})


def add_pending_module(path: str) -> None:
    """Queue a module whose import registers adapter types (the 0.5.6 lazy mechanism)."""
    with _LOCK:
        if path not in _PENDING:
            _PENDING.append(path)


def _import_pending(stop_at: str | None) -> ImportError | None:
    last_error: ImportError | None = None
    while True:
        with _LOCK:
            if stop_at is not None and _cfg._is_registered(stop_at) and stop_at in _FACTORIES:
                return None
            if not _PENDING:
                return last_error
            path = _PENDING.pop(0)
        try:
            importlib.import_module(path)
        except ImportError as exc:
            logger.debug("L2 adapter module %s skipped: %s", path, exc)
            last_error = exc


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    with _LOCK:
        if _builtins_loaded:
            return
        for path in BUILTIN_MODULES:
            importlib.import_module(path)
            if path in _PENDING:
                _PENDING.remove(path)
        _builtins_loaded = True


def _plugin_manager() -> pluggy.PluginManager:
    global _PM
    if _PM is None:
        _PM = pluggy.PluginManager(PROJECT_NAME)
        _PM.add_hookspecs(L2AdapterHookSpecs)
    return _PM


_EP_CACHE: list[importlib.metadata.EntryPoint] | None = None


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    global _EP_CACHE
    if _EP_CACHE is not None:
        return _EP_CACHE
    eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    seen: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in eps:
        seen.setdefault(ep.name, ep)  # first on sys.path wins, like the import system
    _EP_CACHE = sorted(seen.values(), key=lambda e: e.name)
    return _EP_CACHE


def _dist_of(ep: importlib.metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    try:
        return dist.metadata["Name"], dist.version
    except Exception:
        return None, None


def _fail(ep: importlib.metadata.EntryPoint, reason: str) -> None:
    dist, _ = _dist_of(ep)
    _FAILED.append((ep.name, ep.value, reason))
    logger.warning(
        "L2 adapter plugin entry point %r (%s, distribution %s) skipped: %s",
        ep.name,
        ep.value,
        dist or "unknown",
        reason,
    )


def _validate_spec(spec: Any) -> str | None:
    from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

    if not isinstance(spec, L2AdapterTypeSpec):
        return f"hook returned {type(spec).__name__}, not L2AdapterTypeSpec"
    if not isinstance(spec.name, str) or not spec.name:
        return "spec has an empty name"
    if not (
        isinstance(spec.config_class, type) and issubclass(spec.config_class, L2AdapterConfigBase)
    ):
        return f"spec {spec.name!r}: config_class is not an L2AdapterConfigBase subclass"
    if not callable(spec.factory):
        return f"spec {spec.name!r}: factory is not callable"
    return None


def _load_entry_point(ep: importlib.metadata.EntryPoint) -> None:
    with _LOCK:
        if ep.name in _EP_DONE:
            return
        _EP_DONE.add(ep.name)
    try:
        obj = ep.load()
    except Exception as exc:
        _fail(ep, f"import failed: {type(exc).__name__}: {exc}")
        return
    pm = _plugin_manager()
    try:
        if not pm.is_registered(obj):
            pm.register(obj, name=f"entry-point:{ep.name}")
        specs: list[Any] = []
        for impl in pm.hook.lmcache_l2_adapter_types.get_hookimpls():
            if impl.plugin is obj:
                specs.extend(impl.function() or [])
    except Exception as exc:
        _fail(ep, f"hook failed: {type(exc).__name__}: {exc}")
        return
    if not specs:
        _fail(ep, "provides no lmcache_l2_adapter_types hook implementation or no types")
        return
    dist, version = _dist_of(ep)
    for spec in specs:
        problem = _validate_spec(spec)
        if problem:
            _fail(ep, problem)
            continue
        _register_spec(
            spec,
            {
                "source": "entry point",
                "distribution": dist,
                "version": version,
                "entry_point": ep.name,
            },
            ep,
        )


def _register_spec(spec: L2AdapterTypeSpec, origin: dict[str, Any], ep: Any) -> None:
    with _LOCK:
        for name in (spec.name, *spec.aliases):
            if _cfg._is_registered(name) or name in _FACTORIES:
                logger.warning(
                    "L2 adapter type %r from entry point %r ignored: the name is already registered",
                    name,
                    getattr(ep, "name", ep),
                )
                if name == spec.name:
                    return
        _cfg.register_l2_adapter_type(spec.name, spec.config_class)
        _FACTORIES[spec.name] = spec.factory
        _ORIGINS[spec.name] = origin
        for alias in spec.aliases:
            if not _cfg._is_registered(alias):
                _cfg._register_alias(alias, spec.name)


def register_l2_adapter_type_spec(spec: L2AdapterTypeSpec) -> None:
    """Register a spec directly (core's own wheels-in-tree use the hook; tests may use this)."""
    problem = _validate_spec(spec)
    if problem:
        raise ValueError(problem)
    _register_spec(spec, {"source": "built-in", "distribution": None, "version": None}, "direct")


def ensure_adapter_loaded(name: str, raise_import_error: bool = True) -> None:
    """Make ``name`` known: built-ins, then pending modules, then the entry point named ``name``,
    then every other entry point. Re-raises the last ``ImportError`` of a pending module when
    the name never appears (and ``raise_import_error``)."""
    _load_builtins()
    if name in _FACTORIES and _cfg._is_registered(name):
        return
    last = _import_pending(name)
    if _cfg._is_registered(name):
        return
    eps = _entry_points()
    for ep in sorted(eps, key=lambda e: e.name != name):
        _load_entry_point(ep)
        if _cfg._is_registered(name):
            return
    if last is not None and raise_import_error:
        raise last


def load_all_l2_adapter_types() -> None:
    _load_builtins()
    _import_pending(None)
    for ep in _entry_points():
        _load_entry_point(ep)


def get_all_registered_names() -> list[str]:
    load_all_l2_adapter_types()
    with _LOCK:
        return sorted(_FACTORIES)


def create_l2_adapter_from_registry(
    cfg: L2AdapterConfigBase, l1_memory_desc: L1MemoryDesc | None = None
) -> L2AdapterInterface:
    name = _cfg.get_type_name_for_config(cfg)
    fn = _FACTORIES.get(name)
    if fn is None:
        ensure_adapter_loaded(name, raise_import_error=False)
        fn = _FACTORIES.get(name)
    if fn is None:
        raise ValueError(
            f"No adapter factory registered for type {name}. Make sure the adapter module is imported."
        )
    return fn(cfg, l1_memory_desc)


def describe_l2_adapter_types() -> list[dict[str, Any]]:
    """One dict per canonical type: name, aliases, source, distribution, version."""
    load_all_l2_adapter_types()
    out = []
    with _LOCK:
        for name in sorted(_FACTORIES):
            origin = _ORIGINS.get(name, {})
            source = origin.get("source", "built-in")
            out.append(
                {
                    "name": name,
                    "aliases": list(_cfg.aliases_of(name)),
                    "source": source,
                    "distribution": origin.get("distribution")
                    if source == "entry point"
                    else "lmcache-core",
                    "version": origin.get("version") if source == "entry point" else None,
                }
            )
    return out


def failed_l2_adapter_plugins() -> list[tuple[str, str, str]]:
    """(entry-point name, value, reason) for each plugin that was skipped."""
    load_all_l2_adapter_types()
    with _LOCK:
        return list(_FAILED)


def refresh_l2_adapter_plugins() -> None:
    """Forget entry-point results and rescan (after installing a wheel at runtime, and in tests).

    Types already registered by entry points are removed so they can register again."""
    global _PM, _EP_CACHE
    with _LOCK:
        _EP_CACHE = None
        for name, origin in list(_ORIGINS.items()):
            if origin.get("source") == "entry point":
                _FACTORIES.pop(name, None)
                _ORIGINS.pop(name, None)
                for alias in _cfg.aliases_of(name):
                    _cfg._TYPES.pop(alias, None)
                    _cfg._ALIASES.pop(alias, None)
                _cfg._TYPES.pop(name, None)
        _FAILED.clear()
        _EP_DONE.clear()
        _PM = None
    importlib.invalidate_caches()
