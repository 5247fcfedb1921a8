"""Device-neutral stream helpers dispatched through the spec of the given device.

CPU devices always use the stub, never the active accelerator
(docs/design/platform.md#event-notifiers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _spec_for(device: Any) -> Any:
    from lmcache.v1.platform._device_detect import default_device_registry

    registry = default_device_registry()
    if device is None or isinstance(device, int) and not isinstance(device, bool):
        device_type = registry.get_torch_device()[1]
    elif hasattr(device, "type"):
        device_type = str(device.type)
    else:
        device_type = str(device).split(":", 1)[0]
    return registry.resolve_device_spec(device_type)


def _torch_device(device: Any) -> Any:
    if device is None or isinstance(device, int) or hasattr(device, "type"):
        return device
    import torch

    try:
        return torch.device(device)
    except RuntimeError:  # an out-of-tree type torch has not registered (e.g. fakes)
        return device


def current_stream(device: Any = None) -> Any:
    return _spec_for(device).current_stream(_torch_device(device))


def stream_handle(stream: Any, device: Any = None) -> int:
    return int(_spec_for(device).get_stream_handle(stream))


def synchronize_stream(stream: Any, device: Any = None) -> None:
    _spec_for(device).synchronize_stream(stream)


def synchronize_device(device: Any = None) -> None:
    from lmcache.v1.platform import synchronize_device as _sync

    _sync(device)


@dataclass
class CompletionEvent:
    """A recorded stream event plus the spec that can query it."""

    event: Any
    spec: Any

    def query(self) -> bool:
        return bool(self.spec.is_stream_event_complete(self.event))

    def synchronize(self) -> None:
        sync = getattr(self.event, "synchronize", None)
        if callable(sync):
            sync()


def record_completion_event(stream: Any = None, device: Any = None) -> CompletionEvent:
    spec = _spec_for(device)
    if stream is None:
        stream = spec.current_stream(_torch_device(device))
    event = spec.create_stream_event(_torch_device(device))
    spec.record_stream_event(event, stream)
    return CompletionEvent(event, spec)
