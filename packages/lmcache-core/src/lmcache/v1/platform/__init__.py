"""Platform facade: which accelerator this process uses and which ops answer it.

Everything is resolved lazily (PEP 562): importing this package never runs device
detection, never loads plugins and never imports torch. The first access to
``torch_dev``, ``device_ops`` etc. does, and errors surface there with their cause.
"""

from __future__ import annotations

import importlib
from typing import Any

from lmcache.utils.lazy import lazy_attributes
from lmcache.v1.platform.base.active import install_active_platform
from lmcache.v1.platform.base.device_spec import DeviceSpec

# name -> (module, attribute) for plain re-exports
_EXPORTS: dict[str, tuple[str, str]] = {
    "get_device_spec": ("lmcache.v1.platform._device_detect", "get_device_spec"),
    "get_torch_device": ("lmcache.v1.platform._device_detect", "get_torch_device"),
    "resolve_device_ops": ("lmcache.v1.platform._device_detect", "resolve_device_ops"),
    "failed_device_plugins": ("lmcache.v1.platform._device_detect", "failed_device_plugins"),
    "Detection": ("lmcache.v1.platform._device_detect", "Detection"),
    "DeviceRegistry": ("lmcache.v1.platform._device_detect", "DeviceRegistry"),
    "default_device_registry": ("lmcache.v1.platform._device_detect", "default_device_registry"),
    "use_device_registry": ("lmcache.v1.platform._device_detect", "use_device_registry"),
    "DEVICE_PLUGIN_ENTRY_POINT_GROUP": (
        "lmcache.v1.platform._device_detect",
        "DEVICE_PLUGIN_ENTRY_POINT_GROUP",
    ),
    "DEVICE_BACKEND_ENV_VAR": ("lmcache.v1.platform._device_detect", "DEVICE_BACKEND_ENV_VAR"),
    "MPTransferMode": ("lmcache.v1.platform.transfer_mode", "MPTransferMode"),
    "EventNotifier": ("lmcache.v1.platform.event_notifier", "EventNotifier"),
    "EventfdNotifier": ("lmcache.v1.platform.event_notifier", "EventfdNotifier"),
    "PipeNotifier": ("lmcache.v1.platform.event_notifier", "PipeNotifier"),
    "create_event_notifier": ("lmcache.v1.platform.event_notifier", "create_event_notifier"),
    "consume_fd": ("lmcache.v1.platform.event_notifier", "consume_fd"),
    "HAS_EVENTFD": ("lmcache.v1.platform.event_notifier", "HAS_EVENTFD"),
    "get_event_ipc_backend": ("lmcache.v1.platform.base.event_ipc", "get_event_ipc_backend"),
    "create_cache_context": ("lmcache.v1.platform.cache_context", "create_cache_context"),
}

__all__ = [
    "DeviceSpec",
    "current_device_spec",
    "device_ops",
    "get_device_ops",
    "reset_platform_caches",
    "resolve_kv_wrapper_factory",
    "synchronize_device",
    "torch_dev",
    "torch_device_type",
    *_EXPORTS,
]


def _detect() -> Any:
    return importlib.import_module("lmcache.v1.platform._device_detect")


def _registry() -> Any:
    return _detect().default_device_registry()


class _DefaultRegistryPlatform:
    """The active platform of base modules: whatever registry is the default when asked.

    Installed below at import; the registry module itself loads on the first question."""

    def get_torch_device(self) -> tuple[Any, str]:
        return _registry().get_torch_device()

    def current_device_spec(self) -> DeviceSpec:
        return _registry().current_device_spec()

    def get_device_spec(self, device_type: str) -> DeviceSpec | None:
        return _registry().get_device_spec(device_type)

    def resolve_device_ops(self, device_type: str) -> Any:
        return _registry().resolve_device_ops(device_type)

    def backends(self) -> dict[str, DeviceSpec]:
        return _registry().backends()


install_active_platform(_DefaultRegistryPlatform())


def get_device_ops() -> Any:
    """The DeviceOps singleton of the detected device type."""
    dd = _detect()
    return dd.resolve_device_ops(dd.get_torch_device()[1])


def resolve_kv_wrapper_factory(device_type: str) -> Any:
    """``wrap`` of the spec's IPC wrapper class (the lmcache_driven hard check #1)."""
    spec = _registry().resolve_device_spec(device_type)
    cls = spec.ipc_wrapper_cls
    if cls is None:
        raise ValueError(f"No KV-cache wrapper factory registered for device type {device_type!r}")
    return getattr(cls, "wrap", cls)


def synchronize_device(device: Any = None) -> None:
    """Wait for ``device``'s own module (index kept); a no-op for CPU."""
    import torch

    if device is None:
        device_type = _detect().get_torch_device()[1]
        if device_type == "cpu":
            return
        dev: Any = None
    else:
        dev = device
        if not isinstance(device, torch.device):
            try:
                dev = torch.device(device)
            except RuntimeError:  # an out-of-tree type torch has not registered
                dev = device
        device_type = dev.type if isinstance(dev, torch.device) else str(dev).split(":", 1)[0]
        if device_type == "cpu":
            return
    spec = _registry().resolve_device_spec(device_type)
    module = getattr(torch, spec.torch_module_name, None)
    if module is None:
        raise RuntimeError(
            f"torch has no module {spec.torch_module_name!r} for backend {spec.backend_name!r}"
        )
    module.synchronize(dev)


def reset_platform_caches() -> None:
    """Forget registries, detection, the current spec, op singletons and wire tags (tests)."""
    _detect().reset_caches()
    from lmcache.v1.platform.base.ipc_wire import reset_wire_registry
    from lmcache.v1.platform.torch_ops_state import reset_torch_ops_state

    reset_wire_registry()
    reset_torch_ops_state()


_exported = lazy_attributes(__name__, _EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return _exported(name)
    if name == "torch_dev":
        return _detect().get_torch_device()[0]
    if name == "torch_device_type":
        return _detect().get_torch_device()[1]
    if name == "device_ops":
        return get_device_ops()
    if name == "current_device_spec":
        return _detect().current_device_spec()
    # 0.5.6 module attributes: backend_name -> spec, device_type -> (specs...)
    if name == "_DEVICE_REGISTRY":
        return _registry().backends()
    if name == "_DEVICE_TYPE_REGISTRY":
        return _registry().device_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
