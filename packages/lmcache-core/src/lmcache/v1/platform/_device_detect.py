"""Device backend registry, discovery through entry points, detection and lookups.

Registration order (platform.md §5.1): core's CPU spec, then entry points of group
``lmcache.device_plugins`` — first-party (``lmcache.devices.*``) before third-party,
each sorted by (name, value). Everything here is cached for the process;
``reset_platform_caches()`` (facade) clears it for tests.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import os
import threading
from dataclasses import dataclass
from typing import Any

from lmcache.utils import init_logger
from lmcache.v1.platform.base.device_spec import DeviceSpec

logger = init_logger(__name__)

DEVICE_PLUGIN_ENTRY_POINT_GROUP = "lmcache.device_plugins"
DEVICE_BACKEND_ENV_VAR = "LMCACHE_DEVICE_BACKEND"
DEVICE_TYPE_ENV_VAR = "DEVICE_TYPE"
FIRST_PARTY_PREFIX = "lmcache.devices."


@dataclass(frozen=True)
class BackendSource:
    """Where a registered backend came from (shown by ``lmcache plugins``)."""

    kind: str  # "built-in", "entry point" or "test"
    entry_point: str = ""
    value: str = ""
    distribution: str = ""
    version: str = ""
    first_party: bool = True


_state_lock = threading.RLock()
_failed: list[tuple[str, str, str]] = []
_sources: dict[str, BackendSource] = {}
# Specs injected by lmcache.v1.platform.testing (registered after CPU, before entry points).
_test_specs: list[DeviceSpec] = []
_detection_done = False


def _is_first_party(value: str) -> bool:
    return value.startswith(FIRST_PARTY_PREFIX)


def _check_name(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value or value != value.lower():
        raise ValueError(f"{field} must be a non-empty lowercase string")
    return value


def _load_entry_point(ep: Any) -> DeviceSpec:
    obj = ep.load()
    if not isinstance(obj, type) or obj is DeviceSpec or not issubclass(obj, DeviceSpec):
        raise TypeError("entry point must resolve to a DeviceSpec subclass")
    spec = obj()
    if not isinstance(spec, DeviceSpec):
        raise TypeError("entry point must construct a DeviceSpec instance")
    _check_name("device_type", spec.device_type)
    backend = _check_name("backend_name", spec.backend_name)
    if backend != ep.name:
        raise ValueError(
            f"entry-point name must match DeviceSpec.backend_name ({ep.name!r} != {backend!r})"
        )
    return spec


def _ep_dist(ep: Any) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "", ""
    try:
        return str(dist.metadata["Name"]), str(dist.version)
    except Exception:
        return "", ""


def _load_external_device_specs() -> list[tuple[DeviceSpec, BackendSource]]:
    """Load every entry point of the group; failures are logged, recorded and skipped."""
    eps = list(md.entry_points(group=DEVICE_PLUGIN_ENTRY_POINT_GROUP))
    first = sorted((e for e in eps if _is_first_party(e.value)), key=lambda e: (e.name, e.value))
    third = sorted(
        (e for e in eps if not _is_first_party(e.value)), key=lambda e: (e.name, e.value)
    )
    loaded: list[tuple[DeviceSpec, BackendSource]] = []
    failed: list[tuple[str, str, str]] = []
    for ep in first + third:
        try:
            spec = _load_entry_point(ep)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "Failed to load LMCache device plugin %r (%s): %s", ep.name, ep.value, reason
            )
            logger.debug("traceback of device plugin %r", ep.name, exc_info=True)
            failed.append((ep.name, ep.value, reason))
            continue
        dist, version = _ep_dist(ep)
        loaded.append(
            (
                spec,
                BackendSource(
                    "entry point", ep.name, ep.value, dist, version, _is_first_party(ep.value)
                ),
            )
        )
    with _state_lock:
        _failed[:] = failed
    return loaded


def _builtin_specs() -> list[DeviceSpec]:
    from lmcache.v1.platform.devices.cpu import CpuDeviceSpec

    return [CpuDeviceSpec()]


@functools.cache
def _build_backend_registry() -> dict[str, DeviceSpec]:
    """``backend_name -> spec`` in registration order; duplicates keep the first."""
    registry: dict[str, DeviceSpec] = {}
    sources: dict[str, BackendSource] = {}
    candidates: list[tuple[DeviceSpec, BackendSource]] = [
        (s, BackendSource("built-in")) for s in _builtin_specs()
    ]
    candidates += [
        (s, BackendSource("test", value=type(s).__qualname__, first_party=False))
        for s in _test_specs
    ]
    candidates += _load_external_device_specs()
    for spec, source in candidates:
        name = spec.backend_name
        if name in registry:
            logger.warning(
                "Ignoring DeviceSpec %s because backend_name %r is already registered by %s",
                type(spec).__qualname__,
                name,
                type(registry[name]).__qualname__,
            )
            continue
        registry[name] = spec
        sources[name] = source
    with _state_lock:
        _sources.clear()
        _sources.update(sources)
    return registry


@functools.cache
def _build_device_registry() -> dict[str, tuple[DeviceSpec, ...]]:
    """``device_type -> (specs...)`` in registration order."""
    out: dict[str, list[DeviceSpec]] = {}
    for spec in _build_backend_registry().values():
        out.setdefault(spec.device_type, []).append(spec)
    return {k: tuple(v) for k, v in out.items()}


def failed_device_plugins() -> list[tuple[str, str, str]]:
    """(entry-point name, value, reason) of every device plugin that failed to load."""
    _build_backend_registry()
    with _state_lock:
        return list(_failed)


def backend_sources() -> dict[str, BackendSource]:
    _build_backend_registry()
    with _state_lock:
        return dict(_sources)


def _probe(spec: DeviceSpec) -> bool:
    """``is_available()`` made exception-proof (any failure means unavailable)."""
    try:
        return bool(spec.is_available())
    except Exception as exc:
        logger.debug("is_available() of %r raised %s; treating as unavailable", spec, exc)
        return False


def _env(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def _stub_result() -> tuple[Any, str, str | None]:
    from lmcache.v1.platform.devices.cpu.stub_cpu_device import StubCPUDevice

    return StubCPUDevice("cpu"), "cpu", None


def _type_order(device_registry: dict[str, tuple[DeviceSpec, ...]]) -> list[str]:
    sources = backend_sources()

    def first_party(t: str) -> bool:
        return any(
            sources.get(s.backend_name, BackendSource("built-in")).first_party
            for s in device_registry[t]
        )

    types = list(device_registry)
    ordered = ["cuda"] if "cuda" in device_registry else []
    ordered += sorted(t for t in types if t != "cuda" and first_party(t))
    ordered += [t for t in types if t not in ordered]
    return ordered


def _usable(specs: tuple[DeviceSpec, ...], torch: Any, device_type: str) -> list[DeviceSpec]:
    out = []
    for spec in specs:
        if not _probe(spec):
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


def _multiple_error(device_type: str, specs: list[DeviceSpec]) -> RuntimeError:
    return RuntimeError(
        "Multiple LMCache backends are available for device_type {!r}: {}. Set "
        "LMCACHE_DEVICE_BACKEND=<backend_name> to choose one explicitly.".format(
            device_type, ", ".join(s.backend_name for s in specs)
        )
    )


def _detect_device() -> tuple[Any, str, str | None]:
    """(torch module, device_type, backend_name | None) per platform.md §5.4."""
    try:
        import torch
    except Exception as exc:
        logger.warning("load torch failed, error is %s", exc)
        return None, "cpu", None

    backends = _build_backend_registry()
    devices = _build_device_registry()

    explicit = _env(DEVICE_BACKEND_ENV_VAR)
    if explicit:
        spec = backends.get(explicit)
        if spec is None:
            names = ", ".join(sorted(backends)) or "<none>"
            raise RuntimeError(
                f"LMCACHE_DEVICE_BACKEND={explicit!r} is not registered. Available backends: {names}."
            )
        if not _probe(spec):
            raise RuntimeError(
                f"LMCACHE_DEVICE_BACKEND={explicit!r} is registered but not available on this host."
            )
        module = getattr(torch, spec.torch_module_name, None)
        if module is None:
            raise RuntimeError(
                f"LMCACHE_DEVICE_BACKEND={explicit!r} resolved to device_type={spec.device_type!r}, but torch has no module {spec.torch_module_name!r}."
            )
        return module, spec.device_type, spec.backend_name

    wanted = _env(DEVICE_TYPE_ENV_VAR)
    if wanted == "cpu":
        return _stub_result()
    if wanted:
        usable = _usable(devices.get(wanted, ()), torch, wanted)
        if len(usable) == 1:
            spec = usable[0]
            return getattr(torch, spec.torch_module_name), spec.device_type, spec.backend_name
        if len(usable) > 1:
            raise _multiple_error(wanted, usable)
        logger.warning(
            "DEVICE_TYPE=%r is not available or not registered, falling back to auto-detection.",
            wanted,
        )

    available: list[tuple[str, list[DeviceSpec]]] = []
    for device_type in _type_order(devices):
        usable = _usable(devices[device_type], torch, device_type)
        if usable:
            available.append((device_type, usable))
    if not available:
        return _stub_result()
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
    return getattr(torch, spec.torch_module_name), spec.device_type, spec.backend_name


@functools.cache
def _detected() -> tuple[Any, str, str | None]:
    global _detection_done
    result = _detect_device()
    _detection_done = True
    return result


@functools.cache
def get_torch_device() -> tuple[Any, str]:
    """(torch_dev, torch_device_type) of this process, detected once; logged once."""
    module, device_type, _backend = _detected()
    logger.info("torch_dev=%s, torch_device_type=%s", module, device_type)
    return module, device_type


def detected_backend_name() -> str | None:
    return _detected()[2]


def _explicit_match(device_type: str, specs: tuple[DeviceSpec, ...]) -> DeviceSpec | None:
    explicit = _env(DEVICE_BACKEND_ENV_VAR)
    if explicit:
        for spec in specs:
            if spec.backend_name == explicit:
                return spec
    return None


def _detected_match(specs: tuple[DeviceSpec, ...]) -> DeviceSpec | None:
    if not _detection_done:
        return None
    try:
        backend = _detected()[2]
    except Exception:
        return None
    for spec in specs:
        if backend is not None and spec.backend_name == backend:
            return spec
    return None


def get_device_spec(device_type: str) -> DeviceSpec | None:
    """The spec for ``device_type``, or None; never raises."""
    try:
        specs = _build_device_registry().get(str(device_type), ())
        if not specs:
            return None
        if len(specs) == 1:
            return specs[0]
        chosen = _detected_match(specs) or _explicit_match(device_type, specs)
        if chosen is not None:
            return chosen
        available = [s for s in specs if _probe(s)]
        if len(available) == 1:
            return available[0]
        for spec in specs:
            if spec.backend_name == device_type:
                return spec
        return None
    except Exception as exc:
        logger.debug("get_device_spec(%r) failed: %s", device_type, exc)
        return None


_fallback_lock = threading.Lock()
_fallback_spec: list[DeviceSpec] = []


def _fallback() -> DeviceSpec:
    with _fallback_lock:
        if not _fallback_spec:
            _fallback_spec.append(DeviceSpec())
        return _fallback_spec[0]


def _no_spec_error(device_type: str) -> RuntimeError:
    return RuntimeError(
        f"No DeviceSpec registered for accelerator {device_type!r}; refusing to silently fall back to the "
        "torch baseline on accelerator hardware. Ensure a built-in backend or an installed "
        "lmcache.device_plugins entry point defines this device. Install the "
        f"lmcache-{device_type} wheel if one exists."
    )


def _resolve_device_spec(device_type: str) -> DeviceSpec:
    """Spec used by resolve_device_ops / resolve_kv_wrapper_factory / synchronize_device."""
    device_type = str(device_type)
    specs = _build_device_registry().get(device_type, ())
    if len(specs) == 1:
        return specs[0]
    if specs:
        chosen = _explicit_match(device_type, specs) or _detected_match(specs)
        if chosen is not None:
            return chosen
        available = [s for s in specs if _probe(s)]
        if len(available) == 1:
            logger.info(
                "Auto-selected backend [%s] for accelerator %r from candidate backends [%s].",
                available[0].backend_name,
                device_type,
                ", ".join(s.backend_name for s in specs),
            )
            return available[0]
        if len(available) > 1:
            raise RuntimeError(
                "Multiple DeviceSpec backends are available for accelerator {!r}: {}. Set "
                "LMCACHE_DEVICE_BACKEND=<backend_name> to choose one explicitly.".format(
                    device_type, ", ".join(s.backend_name for s in available)
                )
            )
        for spec in specs:
            if spec.backend_name == device_type:
                return spec
    if device_type in ("", "cpu"):
        return _fallback()
    raise _no_spec_error(device_type)


def resolve_device_ops(device_type: str) -> Any:
    return _resolve_device_spec(device_type).get_ops()


@functools.cache
def current_device_spec() -> DeviceSpec:
    """Spec of the detected backend (a function here; an instance in the facade)."""
    _module, device_type, backend = _detected()
    if backend is not None:
        spec = _build_backend_registry().get(backend)
        if spec is not None:
            return spec
    spec = get_device_spec(device_type)
    if spec is not None:
        return spec
    if device_type != "cpu":
        logger.warning(
            "No DeviceSpec registered for %r; using fallback with no-op capabilities.", device_type
        )
    return DeviceSpec()


def reset_caches() -> None:
    global _detection_done
    for fn in (
        _build_backend_registry,
        _build_device_registry,
        _detected,
        get_torch_device,
        current_device_spec,
    ):
        clear = getattr(fn, "cache_clear", None)
        if clear is not None:  # tests may monkeypatch these functions
            clear()
    with _state_lock:
        _failed.clear()
        _sources.clear()
    with _fallback_lock:
        _fallback_spec.clear()
    _detection_done = False
