"""The L2 adapter type registry: type names, their config classes and factories.

An :class:`L2AdapterRegistry` owns every piece of that state. This is the one place that
says how a type arrives; there are four ways:

1. core's built-in modules (``plugin``, ``native_plugin``, ``mock``, ``fault_inject``,
   :data:`BUILTIN_MODULES`), each a module of pluggy hook implementations, exactly like a
   wheel's;
2. entry points of group ``lmcache.l2_adapters`` (one pluggy ``PluginManager`` per
   registry), each naming a hooks module whose ``lmcache_l2_adapter_types()`` returns
   ``L2AdapterTypeSpec`` objects; loaded lazily, one at a time, sorted by name. A broken
   plugin is logged, listed by :meth:`~L2AdapterRegistry.failed_plugins` and skipped; the
   rest stays usable;
3. modules queued with :meth:`~L2AdapterRegistry.add_pending_module` (0.5.6's lazy
   mechanism: importing one registers its types the 0.5.6 way, below);
4. 0.5.6's ``register_l2_adapter_type(name, config_class)`` plus
   ``register_l2_adapter_factory(name, factory)``, called by third-party code
   (:meth:`~L2AdapterRegistry.register_type` / :meth:`~L2AdapterRegistry.register_factory`).

Whichever way it came, a type's config class carries its name (``type_name``; a class that
does not declare it gets it when it registers), so the configuration path is two calls:
:meth:`~L2AdapterRegistry.parse` turns one ``--l2-adapter`` object into its typed config and
:meth:`~L2AdapterRegistry.create` calls the factory of ``config.type_name``;
:meth:`~L2AdapterRegistry.build` does both. ``lmcache server --help`` names the types with
:meth:`~L2AdapterRegistry.names_without_plugins`, which imports no plugin.

0.5.6's module-level functions answer from the default registry
(``lmcache.v1.distributed.compat_056``); tests build their own registry and install it with
:func:`use_l2_adapter_registry`.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import json
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

from lmcache.utils import init_logger
from lmcache.v1.distributed.l2_adapters.config import GENERIC_FIELDS
from lmcache.v1.distributed.l2_adapters.hookspecs import (
    ENTRY_POINT_GROUP,
    PROJECT_NAME,
    L2AdapterFactory,
    L2AdapterHookSpecs,
    L2AdapterTypeSpec,
)
from lmcache.v1.entry_points import (
    FailedPlugin,
    ProcessDefault,
    entry_points_of,
    load_entry_point,
)
from lmcache.v1.errors import LMCacheConfigError, PluginError, UnknownL2AdapterTypeError

if TYPE_CHECKING:
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
    from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

logger = init_logger(__name__)

__all__ = [
    "BUILTIN_MODULES",
    "L2AdapterRegistry",
    "TypeOrigin",
    "default_l2_adapter_registry",
    "use_l2_adapter_registry",
]

BUILTIN_MODULES: tuple[str, ...] = (
    "lmcache.v1.distributed.l2_adapters.plugin_l2_adapter",
    "lmcache.v1.distributed.l2_adapters.native_plugin_l2_adapter",
    "lmcache.v1.distributed.l2_adapters.mock_l2_adapter",
    "lmcache.v1.distributed.l2_adapters.fault_inject_l2_adapter",
)


@dataclass(frozen=True)
class TypeOrigin:
    """Where a registered type came from (shown by ``lmcache plugins``)."""

    source: str = "built-in"  # "built-in" or "entry point"
    distribution: str = ""
    version: str = ""
    entry_point: str = ""


class DuplicateRegistrationError(PluginError, ValueError):
    """A type or factory name that is registered already (a ValueError, as in 0.5.6)."""


def _check_spec(spec: Any) -> L2AdapterTypeSpec:
    if not isinstance(spec, L2AdapterTypeSpec):
        raise PluginError(f"hook returned {type(spec).__name__}, not L2AdapterTypeSpec")
    if not isinstance(spec.name, str) or not spec.name:
        raise PluginError("spec has an empty name")
    config_class = spec.config_class
    if not (isinstance(config_class, type) and callable(getattr(config_class, "from_dict", None))):
        raise PluginError(
            f"spec {spec.name!r}: config_class is not an L2AdapterConfigBase subclass"
        )
    if not callable(spec.factory):
        raise PluginError(f"spec {spec.name!r}: factory is not callable")
    return spec


def _name_config_class(config_class: type[L2AdapterConfigBase], name: str) -> None:
    """A config class carries its type name. One written for 0.5.6 (or an older wheel's)
    does not declare it, so the first registration gives it; a declared name is kept."""
    if not vars(config_class).get("type_name"):
        config_class.type_name = name


class L2AdapterRegistry:
    """Registered L2 adapter types; built-ins and plugins load on first use."""

    def __init__(
        self,
        *,
        builtin_modules: tuple[str, ...] = BUILTIN_MODULES,
        entry_point_group: str | None = ENTRY_POINT_GROUP,
    ) -> None:
        """``entry_point_group=None`` loads no entry points (tests)."""
        self.builtin_modules = builtin_modules
        self.entry_point_group = entry_point_group
        self._lock = threading.RLock()
        self._configs: dict[str, type[L2AdapterConfigBase]] = {}  # canonical name -> class
        self._factories: dict[str, L2AdapterFactory] = {}
        self._aliases: dict[str, str] = {}  # alias -> canonical name
        self._origins: dict[str, TypeOrigin] = {}
        self._pending: list[str] = []
        self._builtins_loaded = False
        self._entry_points: list[Any] | None = None
        self._entry_points_done: set[str] = set()  # loaded or failed
        self._failed: list[FailedPlugin] = []
        self._pm = self._new_plugin_manager()

    @staticmethod
    def _new_plugin_manager() -> pluggy.PluginManager:
        pm = pluggy.PluginManager(PROJECT_NAME)
        pm.add_hookspecs(L2AdapterHookSpecs)
        return pm

    # ---- registration -------------------------------------------------------------------

    def _known(self, name: str) -> bool:
        return name in self._configs or name in self._aliases

    def register_type(self, name: str, config_class: type[L2AdapterConfigBase]) -> None:
        """0.5.6's ``register_l2_adapter_type``: ``name`` parses with ``config_class``."""
        self._load_builtins()  # a built-in name is never up for grabs
        with self._lock:
            if self._known(name):
                raise DuplicateRegistrationError(f"L2 adapter type already registered: {name!r}")
            self._configs[name] = config_class
            _name_config_class(config_class, name)

    def register_factory(self, name: str, factory: L2AdapterFactory) -> None:
        """0.5.6's ``register_l2_adapter_factory``: ``factory(config, l1_desc)`` builds ``name``."""
        self._load_builtins()
        with self._lock:
            if name in self._factories:
                raise DuplicateRegistrationError(f"L2 adapter factory already registered: {name}")
            self._factories[name] = factory
            self._origins.setdefault(name, TypeOrigin())

    def register_spec(self, spec: L2AdapterTypeSpec, origin: TypeOrigin | None = None) -> bool:
        """Register one type with its aliases; False (and a warning) when the name is taken.

        Raises :class:`PluginError` when the spec itself is malformed."""
        _check_spec(spec)
        origin = origin or TypeOrigin()
        self._load_builtins()
        with self._lock:
            if self._known(spec.name) or spec.name in self._factories:
                logger.warning(
                    "L2 adapter type %r from %s ignored: the name is already registered",
                    spec.name,
                    origin.entry_point or origin.source,
                )
                return False
            self._configs[spec.name] = spec.config_class
            _name_config_class(spec.config_class, spec.name)
            self._factories[spec.name] = spec.factory
            self._origins[spec.name] = origin
            for alias in spec.aliases:
                if self._known(alias) or alias in self._factories:
                    logger.warning(
                        "alias %r of L2 adapter type %r ignored: the name is already registered",
                        alias,
                        spec.name,
                    )
                    continue
                self._aliases[alias] = spec.name
            return True

    def add_pending_module(self, path: str) -> None:
        """Queue a module whose import registers adapter types (the 0.5.6 lazy mechanism)."""
        with self._lock:
            if path not in self._pending:
                self._pending.append(path)

    # ---- loading ------------------------------------------------------------------------

    def _specs_of(self, plugin: Any, plugin_name: str) -> list[L2AdapterTypeSpec]:
        """Run ``plugin``'s ``lmcache_l2_adapter_types`` hook; every spec must be valid."""
        with self._lock:
            if not self._pm.is_registered(plugin):
                self._pm.register(plugin, name=plugin_name)
            impls = self._pm.hook.lmcache_l2_adapter_types.get_hookimpls()
        specs: list[Any] = []
        for impl in impls:
            if impl.plugin is plugin:
                specs.extend(impl.function() or [])
        if not specs:
            raise PluginError(
                "provides no lmcache_l2_adapter_types hook implementation or no types"
            )
        return [_check_spec(s) for s in specs]

    def _load_builtins(self) -> None:
        with self._lock:
            if self._builtins_loaded:
                return
            self._builtins_loaded = True
            for path in self.builtin_modules:
                for spec in self._specs_of(importlib.import_module(path), f"builtin:{path}"):
                    self.register_spec(spec)

    def _import_pending(self, stop_at: str | None) -> ImportError | None:
        last_error: ImportError | None = None
        while True:
            with self._lock:
                if stop_at is not None and self._complete(stop_at):
                    return None
                if not self._pending:
                    return last_error
                path = self._pending.pop(0)
            try:
                importlib.import_module(path)
            except ImportError as exc:
                logger.debug("L2 adapter module %s skipped: %s", path, exc)
                last_error = exc

    def _entry_point_list(self) -> list[Any]:
        with self._lock:
            if self._entry_points is None:
                seen: dict[str, Any] = {}
                if self.entry_point_group is not None:
                    for ep in entry_points_of(self.entry_point_group):
                        seen.setdefault(ep.name, ep)  # first on sys.path wins, like imports
                self._entry_points = sorted(seen.values(), key=lambda e: e.name)
            return self._entry_points

    def _load_entry_point(self, ep: Any) -> None:
        with self._lock:
            if ep.name in self._entry_points_done:
                return
            self._entry_points_done.add(ep.name)
        result = load_entry_point(
            ep,
            lambda ep, module: self._specs_of(module, f"entry-point:{ep.name}"),
            kind="L2 adapter",
        )
        if isinstance(result, FailedPlugin):
            with self._lock:
                self._failed.append(result)
            return
        origin = TypeOrigin("entry point", result.distribution, result.version, ep.name)
        for spec in result.obj:
            self.register_spec(spec, origin)

    def _complete(self, name: str) -> bool:
        """``name`` has a config class and its canonical type a factory."""
        return self._known(name) and self._aliases.get(name, name) in self._factories

    def ensure_loaded(self, name: str, raise_import_error: bool = True) -> None:
        """Make ``name`` known: built-ins, then pending modules, then the entry point named
        ``name``, then every other entry point. Re-raises the last ``ImportError`` of a
        pending module when the name never appears (and ``raise_import_error``)."""
        self._load_builtins()
        if self._complete(name):
            return
        last = self._import_pending(name)
        if self._known(name):
            return
        for ep in sorted(self._entry_point_list(), key=lambda e: e.name != name):
            self._load_entry_point(ep)
            if self._known(name):
                return
        if last is not None and raise_import_error:
            raise last

    def load_all(self) -> None:
        """Load built-ins, pending modules and every entry point."""
        self._load_builtins()
        self._import_pending(None)
        for ep in self._entry_point_list():
            self._load_entry_point(ep)

    def refresh(self) -> None:
        """Forget entry points and rescan them (after installing a wheel at run time).

        Types registered by entry points are removed so they can register again."""
        with self._lock:
            for name, origin in list(self._origins.items()):
                if origin.source == "entry point":
                    for alias in self.aliases_of(name):
                        del self._aliases[alias]
                    self._configs.pop(name, None)
                    self._factories.pop(name, None)
                    del self._origins[name]
            self._entry_points = None
            self._entry_points_done.clear()
            self._failed.clear()
            self._pm = self._new_plugin_manager()
        importlib.invalidate_caches()

    # ---- lookups ------------------------------------------------------------------------

    def unknown_type_error(self, name: object, where: str = "") -> UnknownL2AdapterTypeError:
        """The one error for a type nobody registers (names the known types and the fix;
        the failed plugins tell an installed wheel that did not load from a missing one)."""
        names = self.names()  # loads everything, so the failures are complete
        with self._lock:
            failed = list(self._failed)
        return UnknownL2AdapterTypeError(name, names, where, failed_plugins=failed)

    def config_class(self, name: str) -> type[L2AdapterConfigBase]:
        """The config class of type (or alias) ``name``; loads plugins as needed."""
        if not self._known(name):
            self.ensure_loaded(name, raise_import_error=False)
        with self._lock:
            canonical = self._aliases.get(name, name)
            cls = self._configs.get(canonical)
        if cls is None:
            raise self.unknown_type_error(name)
        return cls

    def type_name_for_config(self, cfg: L2AdapterConfigBase) -> str:
        """The canonical type name whose config class is exactly ``type(cfg)``, found by
        scanning (0.5.6's ``get_type_name_for_config``; creation reads ``cfg.type_name``)."""
        cls = type(cfg)
        for attempt in range(2):
            with self._lock:
                names = [n for n, c in self._configs.items() if c is cls]
            if names:
                return names[0]
            if attempt == 0:
                self.load_all()
        raise LMCacheConfigError(
            f"Unregistered L2 adapter config type: {cls.__name__} (register it with "
            "register_l2_adapter_type or a lmcache_l2_adapter_types hook)"
        )

    def names(self) -> list[str]:
        """Every type name and alias, sorted (loads everything)."""
        self.load_all()
        with self._lock:
            return sorted([*self._configs, *self._aliases])

    def names_without_plugins(self) -> tuple[list[str], list[str]]:
        """What can be named without importing a plugin (``--help`` shows it):
        ``(types, entry points)``. ``types`` are the built-in types and every type
        registered so far, aliases included; ``entry points`` are the names of the group's
        entry points not loaded yet, read from the installed metadata. One entry point may
        provide several types (lmcache-fs's ``fs`` provides ``fs`` and ``fs_native``), which
        only importing it tells: ``names()`` and ``lmcache plugins`` load every one."""
        self._load_builtins()
        with self._lock:
            types = sorted([*self._configs, *self._aliases])
            done = set(self._entry_points_done)
        entry_points = [ep.name for ep in self._entry_point_list() if ep.name not in done]
        return types, sorted(entry_points)

    def factory_names(self) -> list[str]:
        """Every name with a factory, sorted (loads everything)."""
        self.load_all()
        with self._lock:
            return sorted(self._factories)

    def aliases_of(self, name: str) -> tuple[str, ...]:
        with self._lock:
            return tuple(sorted(a for a, c in self._aliases.items() if c == name))

    # ---- the configuration path: parse, create, build ---------------------------------

    def parse(self, spec: str | dict[str, Any], where: str = "--l2-adapter") -> L2AdapterConfigBase:
        """One ``--l2-adapter`` object (its JSON text, or the object decoded) as its typed
        config: the type's ``from_options`` (its own fields and the generic ones). Its class
        carries the canonical type name (``config.type_name``), which :meth:`create` reads.

        ``ValueError`` naming ``where`` (e.g. ``--l2-adapter #2``) on bad JSON, a missing
        type, an unknown type (``UnknownL2AdapterTypeError``, listing the known ones) or a
        field the type rejects (its help is logged)."""
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"Invalid JSON for {where}: {exc}") from exc
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(spec).__name__}")
        name = spec.get("type")
        if name is None:  # as 0.5.6: an explicit null is a missing type
            raise ValueError(f"{where}: missing 'type' field")
        try:
            cls = self.config_class(name) if isinstance(name, str) else None
        except UnknownL2AdapterTypeError:
            cls = None
        if cls is None:
            raise self.unknown_type_error(name, where=where)
        try:
            _warn_unknown_fields(where, name, cls, spec)
            cfg = cls.from_options(spec)
        except (TypeError, ValueError) as exc:
            rule = "-" * 60
            logger.error(
                "Error parsing %s (type %r): %s\n%s\n%s\n%s",
                where,
                name,
                exc,
                rule,
                cls.help(),
                rule,
            )
            raise ValueError(f"{where} ({name!r}): {exc}") from exc
        return cfg

    def create(
        self, cfg: L2AdapterConfigBase, l1_memory_desc: L1MemoryDesc | None = None
    ) -> L2AdapterInterface:
        """Build the adapter ``cfg`` configures with the factory of ``cfg.type_name``."""
        name = cfg.type_name
        if not name:  # a 0.5.6-style class learns its name when its type registers
            self.load_all()
            name = cfg.type_name
        if not name:
            raise LMCacheConfigError(
                f"Unregistered L2 adapter config type: {type(cfg).__name__} (register it with "
                "register_l2_adapter_type or a lmcache_l2_adapter_types hook)"
            )
        factory = self._factories.get(name)
        if factory is None:
            self.ensure_loaded(name, raise_import_error=False)
            factory = self._factories.get(name)
        if factory is None:
            raise PluginError(
                f"L2 adapter type {name!r} has a config class but no factory: the module that "
                f"registers it must also call register_l2_adapter_factory({name!r}, factory)"
            )
        return factory(cfg, l1_memory_desc)

    def build(
        self,
        type_name: str,
        options: dict[str, Any],
        l1_memory_desc: L1MemoryDesc | None = None,
    ) -> L2AdapterInterface:
        """The adapter of type ``type_name`` configured by ``options`` (the other keys of an
        ``--l2-adapter`` object): :meth:`parse` then :meth:`create`."""
        return self.create(self.parse({**options, "type": type_name}), l1_memory_desc)

    def describe(self) -> list[dict[str, Any]]:
        """One dict per type with a factory: name, aliases, source, distribution, version."""
        self.load_all()
        out = []
        with self._lock:
            for name in sorted(self._factories):
                origin = self._origins.get(name, TypeOrigin())
                from_wheel = origin.source == "entry point"
                out.append(
                    {
                        "name": name,
                        "aliases": list(self.aliases_of(name)),
                        "source": origin.source,
                        "distribution": origin.distribution or None
                        if from_wheel
                        else "lmcache-core",
                        "version": origin.version or None if from_wheel else None,
                    }
                )
        return out

    def failed_plugins(self) -> list[tuple[str, str, str]]:
        """(entry-point name, value, reason) of each plugin that was skipped (loads everything)."""
        self.load_all()
        with self._lock:
            return [f.as_tuple() for f in self._failed]

    def entry_points_tried(self) -> set[str]:
        """Names of the entry points loaded or failed so far (loading is lazy)."""
        with self._lock:
            return set(self._entry_points_done)


def _warn_unknown_fields(where: str, name: str, cls: type, spec: dict[str, Any]) -> None:
    """Log each top-level key that neither the type (its ``known_fields``, when it declares
    them) nor the generic fields know, with the closest known one; never reject it."""
    known = getattr(cls, "known_fields", None)
    if not known:
        return
    allowed = set(known) | GENERIC_FIELDS
    for k in sorted(set(spec) - allowed):
        close = difflib.get_close_matches(k, sorted(allowed), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        logger.warning("%s (type %r): unknown field %r ignored%s", where, name, k, hint)


# ---- the default registry ----------------------------------------------------------------

_default: ProcessDefault[L2AdapterRegistry] = ProcessDefault(L2AdapterRegistry)


def default_l2_adapter_registry() -> L2AdapterRegistry:
    """The registry this process uses (created on first use)."""
    return _default.get()


def use_l2_adapter_registry(
    registry: L2AdapterRegistry,
) -> contextlib.AbstractContextManager[L2AdapterRegistry]:
    """Make ``registry`` the default for the duration of a ``with`` block (tests)."""
    return _default.use(registry)
