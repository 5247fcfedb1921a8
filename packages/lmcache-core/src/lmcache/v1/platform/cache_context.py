"""``create_cache_context``: route to the device spec's cache-context hook
(docs/design/platform.md#cache-context)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Test hooks: device_type -> callable taking the seven factory values; wins over the spec.
_overrides: dict[str, Callable[..., Any]] = {}


def snapshot_backends() -> dict[str, Callable[..., Any]]:
    return dict(_overrides)


def restore_backends(state: dict[str, Callable[..., Any]]) -> None:
    _overrides.clear()
    _overrides.update(state)


def register_cache_context_backend(device_type: str, factory: Callable[..., Any]) -> None:
    """Install a test override for ``device_type`` (use snapshot/restore around it)."""
    _overrides[str(device_type)] = factory


def _device_type_of(layer: Any) -> str:
    first = layer[0] if isinstance(layer, (tuple, list)) and layer else layer
    dev = getattr(first, "device", None)
    if dev is not None and hasattr(dev, "type"):
        return str(dev.type)
    dtype = getattr(type(first), "device_type", None)  # an IPC wrapper
    if isinstance(dtype, str) and dtype:
        return dtype
    raise ValueError(f"cannot tell the device of KV cache entry {type(first).__name__}")


def create_cache_context(
    kv_caches: Any,
    lmcache_tokens_per_chunk: int = 256,
    layout_hints: Any = None,
    engine_group_infos: Any = (),
    engine_type: Any = "vllm",
    separate_object_groups: bool = False,
    full_sw_kv: bool = False,
) -> Any:
    layers = list(kv_caches.values()) if isinstance(kv_caches, dict) else list(kv_caches or [])
    if not layers:
        raise ValueError("create_cache_context requires a non-empty kv_caches list")
    types = sorted({_device_type_of(layer) for layer in layers})
    if len(types) != 1:
        raise ValueError(f"all KV caches must share one device type; got {', '.join(types)}")
    device_type = types[0]
    args = (
        layers,
        lmcache_tokens_per_chunk,
        layout_hints,
        engine_group_infos,
        engine_type,
        separate_object_groups,
        full_sw_kv,
    )
    override = _overrides.get(device_type)
    if override is not None:
        return override(*args)
    from lmcache.v1.platform._device_detect import get_device_spec

    spec = get_device_spec(device_type)
    if spec is None:
        raise ValueError(
            f"No cache-context class registered for device type {device_type!r}. Install the device wheel "
            "that provides it, or use the engine_driven transfer mode."
        )
    return spec.create_cache_context(*args)
