"""Device backend registry: discovery through entry points, detection and lookups.

A :class:`DeviceRegistry` owns everything: the registered specs, where they came from,
the plugins that failed, and this process's detection result. Registration order
(docs/design/platform.md#registration-order): core's CPU spec, then the registry's ``extra_specs``
(tests), then entry points of group ``lmcache.device_plugins``, first-party (``lmcache.devices.*``)
before third-party, each sorted by (name, value). Everything is computed on first use
and kept until :meth:`DeviceRegistry.reset`.

The module-level functions (0.5.6's names) answer from the default registry; tests build
their own and install it with :func:`use_device_registry`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from lmcache.utils import init_logger
from lmcache.v1.entry_points import ProcessDefault, entry_points_of, load_entry_point_group
from lmcache.v1.errors import DeviceBackendError, PluginError
from lmcache.v1.platform.base.device_spec import DeviceSpec

logger = init_logger(__name__)

DEVICE_PLUGIN_ENTRY_POINT_GROUP = "lmcache.device_plugins"
DEVICE_BACKEND_ENV_VAR = "LMCACHE_DEVICE_BACKEND"
DEVICE_TYPE_ENV_VAR = "DEVICE_TYPE"
FIRST_PARTY_PREFIX = "lmcache.devices."

__all__ = [
    "DEVICE_BACKEND_ENV_VAR",
    "DEVICE_PLUGIN_ENTRY_POINT_GROUP",
    "DEVICE_TYPE_ENV_VAR",
    "BackendSource",
    "Detection",
    "DeviceRegistry",
    "backend_sources",
    "current_device_spec",
    "default_device_registry",
    "failed_device_plugins",
    "get_device_spec",
    "get_torch_device",
    "reset_caches",
    "resolve_device_ops",
    "use_device_registry",
]


@dataclass(frozen=True)
class BackendSource:
    """Where a registered backend came from (shown by ``lmcache plugins``)."""

    kind: str  # "built-in", "entry point" or "test"
    entry_point: str = ""
    value: str = ""
    distribution: str = ""
    version: str = ""
    first_party: bool = True


class Detection(NamedTuple):
    """This process's accelerator: torch module, device_type, backend_name (None = stub)."""

    module: Any
    device_type: str
    backend: str | None


def _is_first_party(value: str) -> bool:
    return value.startswith(FIRST_PARTY_PREFIX)


def _check_name(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value or value != value.lower():
        raise PluginError(f"{field} must be a non-empty lowercase string")
    return value


def _spec_from_entry_point(ep: Any, obj: Any) -> DeviceSpec:
    """The ``validate`` step of device plugins: a DeviceSpec subclass named like its entry point."""
    if not isinstance(obj, type) or obj is DeviceSpec or not issubclass(obj, DeviceSpec):
        raise PluginError("entry point must resolve to a DeviceSpec subclass")
    spec = obj()
    if not isinstance(spec, DeviceSpec):
        raise PluginError("entry point must construct a DeviceSpec instance")
    _check_name("device_type", spec.device_type)
    backend = _check_name("backend_name", spec.backend_name)
    if backend != ep.name:
        raise PluginError(
            f"entry-point name must match DeviceSpec.backend_name ({ep.name!r} != {backend!r})"
        )
    return spec


def _env(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def _stub_detection() -> Detection:
    from lmcache.v1.platform.devices.cpu.stub_cpu_device import StubCPUDevice

    return Detection(StubCPUDevice("cpu"), "cpu", None)


def _multiple_error(device_type: str, specs: list[DeviceSpec]) -> DeviceBackendError:
    return DeviceBackendError(
        "Multiple LMCache backends are available for device_type {!r}: {}. Set "
        "LMCACHE_DEVICE_BACKEND=<backend_name> to choose one explicitly.".format(
            device_type, ", ".join(s.backend_name for s in specs)
        )
    )


def _no_spec_error(device_type: str) -> DeviceBackendError:
    return DeviceBackendError(
        f"No DeviceSpec registered for accelerator {device_type!r}; refusing to silently fall back to the "
        "torch baseline on accelerator hardware. Ensure a built-in backend or an installed "
        "lmcache.device_plugins entry point defines this device. Install the "
        f"lmcache-{device_type} wheel if one exists."
    )


class DeviceRegistry:
    """Registered device backends and this process's detection, computed on first use."""

    def __init__(
        self,
        extra_specs: Iterable[DeviceSpec] = (),
        *,
        entry_point_group: str | None = DEVICE_PLUGIN_ENTRY_POINT_GROUP,
    ) -> None:
        """``extra_specs`` register after CPU and before entry points (tests);
        ``entry_point_group=None`` loads no entry points."""
        self.extra_specs: tuple[DeviceSpec, ...] = tuple(extra_specs)
        self.entry_point_group = entry_point_group
        self._lock = threading.RLock()
        self.reset()

    def reset(self) -> None:
        """Forget discovery and detection (the next question redoes them)."""
        with self._lock:
            self._backends: dict[str, DeviceSpec] | None = None
            self._sources: dict[str, BackendSource] = {}
            self._failed: list[tuple[str, str, str]] = []
            self._detection: Detection | None = None
            self._torch_device_logged = False
            self._current: DeviceSpec | None = None
            self._fallback: DeviceSpec | None = None

    # ---- registration ---------------------------------------------------------------

    def _entry_point_specs(self) -> list[tuple[DeviceSpec, BackendSource]]:
        if self.entry_point_group is None:
            return []
        eps = entry_points_of(self.entry_point_group)
        first = sorted(
            (e for e in eps if _is_first_party(e.value)), key=lambda e: (e.name, e.value)
        )
        third = sorted(
            (e for e in eps if not _is_first_party(e.value)), key=lambda e: (e.name, e.value)
        )
        loaded, failed = load_entry_point_group(
            self.entry_point_group,
            _spec_from_entry_point,
            kind="device",
            entry_points=first + third,
        )
        self._failed = [f.as_tuple() for f in failed]
        return [
            (
                p.obj,
                BackendSource(
                    "entry point",
                    p.name,
                    p.value,
                    p.distribution,
                    p.version,
                    _is_first_party(p.value),
                ),
            )
            for p in loaded
        ]

    def _build(self) -> dict[str, DeviceSpec]:
        from lmcache.v1.platform.devices.cpu import CpuDeviceSpec

        candidates: list[tuple[DeviceSpec, BackendSource]] = [
            (CpuDeviceSpec(), BackendSource("built-in"))
        ]
        candidates += [
            (s, BackendSource("test", value=type(s).__qualname__, first_party=False))
            for s in self.extra_specs
        ]
        candidates += self._entry_point_specs()
        backends: dict[str, DeviceSpec] = {}
        for spec, source in candidates:
            name = spec.backend_name
            if name in backends:
                logger.warning(
                    "Ignoring DeviceSpec %s because backend_name %r is already registered by %s",
                    type(spec).__qualname__,
                    name,
                    type(backends[name]).__qualname__,
                )
                continue
            backends[name] = spec
            self._sources[name] = source
        return backends

    def _backend_map(self) -> dict[str, DeviceSpec]:
        with self._lock:
            if self._backends is None:
                self._backends = self._build()
            return self._backends

    def backends(self) -> dict[str, DeviceSpec]:
        """``backend_name -> spec`` in registration order; a duplicate name keeps the first."""
        return dict(self._backend_map())

    def device_types(self) -> dict[str, tuple[DeviceSpec, ...]]:
        """``device_type -> (specs...)`` in registration order."""
        out: dict[str, list[DeviceSpec]] = {}
        for spec in self._backend_map().values():
            out.setdefault(spec.device_type, []).append(spec)
        return {k: tuple(v) for k, v in out.items()}

    def sources(self) -> dict[str, BackendSource]:
        self._backend_map()
        with self._lock:
            return dict(self._sources)

    def failed_plugins(self) -> list[tuple[str, str, str]]:
        """(entry-point name, value, reason) of every device plugin that failed to load."""
        self._backend_map()
        with self._lock:
            return list(self._failed)

    @staticmethod
    def is_available(spec: DeviceSpec) -> bool:
        """``spec.is_available()`` made exception-proof (any failure means unavailable)."""
        try:
            return bool(spec.is_available())
        except Exception as exc:
            logger.debug("is_available() of %r raised %s; treating as unavailable", spec, exc)
            return False

    # ---- detection (docs/design/platform.md#detection) -------------------------------------------

    def _type_order(self, devices: dict[str, tuple[DeviceSpec, ...]]) -> list[str]:
        sources = self.sources()

        def first_party(t: str) -> bool:
            return any(
                sources.get(s.backend_name, BackendSource("built-in")).first_party
                for s in devices[t]
            )

        ordered = ["cuda"] if "cuda" in devices else []
        ordered += sorted(t for t in devices if t != "cuda" and first_party(t))
        ordered += [t for t in devices if t not in ordered]
        return ordered

    def _usable(
        self, specs: tuple[DeviceSpec, ...], torch: Any, device_type: str
    ) -> list[DeviceSpec]:
        out = []
        for spec in specs:
            if not self.is_available(spec):
                continue
            if getattr(torch, spec.torch_module_name, None) is None:
                logger.warning(
                    "backend [%s] for device [%s] is available, but torch module [%s] is not found.",
                    spec.backend_name,
                    device_type,
                    spec.torch_module_name,
                )
                continue
            out.append(spec)
        return out

    def _explicit_detection(self, torch: Any, explicit: str) -> Detection:
        backends = self._backend_map()
        spec = backends.get(explicit)
        if spec is None:
            names = ", ".join(sorted(backends)) or "<none>"
            raise DeviceBackendError(
                f"LMCACHE_DEVICE_BACKEND={explicit!r} is not registered. Available backends: {names}."
            )
        if not self.is_available(spec):
            raise DeviceBackendError(
                f"LMCACHE_DEVICE_BACKEND={explicit!r} is registered but not available on this host."
            )
        module = getattr(torch, spec.torch_module_name, None)
        if module is None:
            raise DeviceBackendError(
                f"LMCACHE_DEVICE_BACKEND={explicit!r} resolved to device_type={spec.device_type!r}, but torch has no module {spec.torch_module_name!r}."
            )
        return Detection(module, spec.device_type, spec.backend_name)

    def _run_detection(self) -> Detection:
        try:
            import torch
        except Exception as exc:
            logger.warning("load torch failed, error is %s", exc)
            return Detection(None, "cpu", None)

        explicit = _env(DEVICE_BACKEND_ENV_VAR)
        if explicit:
            return self._explicit_detection(torch, explicit)
        devices = self.device_types()
        wanted = _env(DEVICE_TYPE_ENV_VAR)
        if wanted == "cpu":
            return _stub_detection()
        if wanted:
            usable = self._usable(devices.get(wanted, ()), torch, wanted)
            if len(usable) == 1:
                spec = usable[0]
                return Detection(
                    getattr(torch, spec.torch_module_name), spec.device_type, spec.backend_name
                )
            if len(usable) > 1:
                raise _multiple_error(wanted, usable)
            logger.warning(
                "DEVICE_TYPE=%r is not available or not registered, falling back to auto-detection.",
                wanted,
            )

        available: list[tuple[str, list[DeviceSpec]]] = []
        for device_type in self._type_order(devices):
            usable = self._usable(devices[device_type], torch, device_type)
            if usable:
                available.append((device_type, usable))
        if not available:
            return _stub_detection()
        device_type, usable = available[0]
        if len(usable) > 1:
            raise _multiple_error(device_type, usable)
        if len(available) > 1:
            logger.warning(
                "Multiple device types are available (%s); selected %r. Set DEVICE_TYPE to choose another.",
                ", ".join(t for t, _ in available),
                device_type,
            )
        spec = usable[0]
        return Detection(
            getattr(torch, spec.torch_module_name), spec.device_type, spec.backend_name
        )

    def detect(self) -> Detection:
        """This process's device, detected once (errors are raised again on the next call)."""
        with self._lock:
            if self._detection is None:
                self._detection = self._run_detection()
            return self._detection

    @property
    def detection_done(self) -> bool:
        """Whether :meth:`detect` has succeeded (lookups never trigger it)."""
        return self._detection is not None

    def get_torch_device(self) -> tuple[Any, str]:
        """(torch_dev, torch_device_type) of this process; logged once."""
        module, device_type, _backend = self.detect()
        with self._lock:
            if not self._torch_device_logged:
                self._torch_device_logged = True
                logger.info("torch_dev=%s, torch_device_type=%s", module, device_type)
        return module, device_type

    def current_device_spec(self) -> DeviceSpec:
        """Spec of the detected backend; the no-op ``DeviceSpec()`` when none is registered."""
        with self._lock:
            if self._current is None:
                self._current = self._find_current()
            return self._current

    def _find_current(self) -> DeviceSpec:
        _module, device_type, backend = self.detect()
        if backend is not None:
            spec = self._backend_map().get(backend)
            if spec is not None:
                return spec
        spec = self.get_device_spec(device_type)
        if spec is not None:
            return spec
        if device_type != "cpu":
            logger.warning(
                "No DeviceSpec registered for %r; using fallback with no-op capabilities.",
                device_type,
            )
        return DeviceSpec()

    # ---- lookups ----------------------------------------------------------------------

    def _explicit_match(self, specs: tuple[DeviceSpec, ...]) -> DeviceSpec | None:
        explicit = _env(DEVICE_BACKEND_ENV_VAR)
        return next((s for s in specs if explicit and s.backend_name == explicit), None)

    def _detected_match(self, specs: tuple[DeviceSpec, ...]) -> DeviceSpec | None:
        detection = self._detection
        if detection is None or detection.backend is None:
            return None
        return next((s for s in specs if s.backend_name == detection.backend), None)

    def get_device_spec(self, device_type: str) -> DeviceSpec | None:
        """The spec for ``device_type``, or None; never raises."""
        try:
            specs = self.device_types().get(str(device_type), ())
            if not specs:
                return None
            if len(specs) == 1:
                return specs[0]
            chosen = self._detected_match(specs) or self._explicit_match(specs)
            if chosen is not None:
                return chosen
            available = [s for s in specs if self.is_available(s)]
            if len(available) == 1:
                return available[0]
            return next((s for s in specs if s.backend_name == device_type), None)
        except Exception as exc:
            logger.debug("get_device_spec(%r) failed: %s", device_type, exc)
            return None

    def resolve_device_spec(self, device_type: str) -> DeviceSpec:
        """The spec that must answer for ``device_type``; raises rather than guess."""
        device_type = str(device_type)
        specs = self.device_types().get(device_type, ())
        if len(specs) == 1:
            return specs[0]
        if specs:
            chosen = self._explicit_match(specs) or self._detected_match(specs)
            if chosen is not None:
                return chosen
            available = [s for s in specs if self.is_available(s)]
            if len(available) == 1:
                logger.info(
                    "Auto-selected backend [%s] for accelerator %r from candidate backends [%s].",
                    available[0].backend_name,
                    device_type,
                    ", ".join(s.backend_name for s in specs),
                )
                return available[0]
            if len(available) > 1:
                raise DeviceBackendError(
                    "Multiple DeviceSpec backends are available for accelerator {!r}: {}. Set "
                    "LMCACHE_DEVICE_BACKEND=<backend_name> to choose one explicitly.".format(
                        device_type, ", ".join(s.backend_name for s in available)
                    )
                )
            for spec in specs:
                if spec.backend_name == device_type:
                    return spec
        if device_type in ("", "cpu"):
            with self._lock:
                if self._fallback is None:
                    self._fallback = DeviceSpec()
                return self._fallback
        raise _no_spec_error(device_type)

    def resolve_device_ops(self, device_type: str) -> Any:
        return self.resolve_device_spec(device_type).get_ops()


# ---- the default registry and the 0.5.6 module-level functions --------------------------

_default: ProcessDefault[DeviceRegistry] = ProcessDefault(DeviceRegistry)


def default_device_registry() -> DeviceRegistry:
    """The registry this process uses (created on first use)."""
    return _default.get()


def use_device_registry(
    registry: DeviceRegistry,
) -> contextlib.AbstractContextManager[DeviceRegistry]:
    """Make ``registry`` the default for the duration of a ``with`` block (tests)."""
    return _default.use(registry)


def failed_device_plugins() -> list[tuple[str, str, str]]:
    """(entry-point name, value, reason) of every device plugin that failed to load."""
    return default_device_registry().failed_plugins()


def backend_sources() -> dict[str, BackendSource]:
    return default_device_registry().sources()


def get_torch_device() -> tuple[Any, str]:
    """(torch_dev, torch_device_type) of this process, detected once; logged once."""
    return default_device_registry().get_torch_device()


def get_device_spec(device_type: str) -> DeviceSpec | None:
    """The spec for ``device_type``, or None; never raises."""
    return default_device_registry().get_device_spec(device_type)


def resolve_device_ops(device_type: str) -> Any:
    return default_device_registry().resolve_device_ops(device_type)


def current_device_spec() -> DeviceSpec:
    """Spec of the detected backend (a function here; an instance in the facade)."""
    return default_device_registry().current_device_spec()


def reset_caches() -> None:
    """Forget the default registry's discovery and detection."""
    default_device_registry().reset()
