"""Cross-process device events for the LMCache-driven path (docs/design/platform.md#event-ipc)."""

from __future__ import annotations

import collections
import inspect
import threading
from typing import Any, Protocol, runtime_checkable

from lmcache.v1.platform.base.active import active_platform


@runtime_checkable
class EventIPCBackend(Protocol):
    """Create, export, import, record, wait on, query and synchronize device events."""

    device_type: str

    def check_event_support(self, device: Any) -> None: ...

    def create_event(self, device: Any) -> Any: ...

    def export_event(self, event: Any, device: Any) -> bytes: ...

    def import_event(self, handle: bytes, device: Any) -> Any: ...

    def record_event(self, event: Any, stream: Any) -> None: ...

    def wait_event(self, event: Any, stream: Any) -> None: ...

    def query_event(self, event: Any) -> bool: ...

    def synchronize_event(self, event: Any, device: Any) -> None: ...


_EXPORTED_RING = 2048


def _accepts_interprocess(event_cls: Any) -> bool:
    for target in (
        event_cls,
        getattr(event_cls, "__init__", None),
        getattr(event_cls, "__new__", None),
    ):
        if target is None:
            continue
        try:
            if "interprocess" in inspect.signature(target).parameters:
                return True
        except (TypeError, ValueError):
            continue
    return False


class DefaultEventIPCBackend:
    """Adapter over any CUDA-style module exposing ``Event(interprocess=True)``."""

    def __init__(self, event_module: Any = None, device_type: str | None = None):
        if event_module is None or device_type is None:
            active_module, active_type = active_platform().get_torch_device()
            event_module = active_module if event_module is None else event_module
            device_type = active_type if device_type is None else device_type
        self.event_module = event_module
        self.device_type = device_type
        # Exported events must outlive the peer's import; keep the most recent ones alive.
        self._exported: collections.deque = collections.deque(maxlen=_EXPORTED_RING)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"DefaultEventIPCBackend(device_type={self.device_type!r})"

    def check_event_support(self, device: Any) -> None:
        event_cls = getattr(self.event_module, "Event", None)
        where = f"device {device!r} (device_type={self.device_type!r})"
        if event_cls is None:
            raise RuntimeError(f"event IPC unsupported on {where}: the torch module has no Event")
        if not _accepts_interprocess(event_cls):
            raise RuntimeError(
                f"event IPC unsupported on {where}: Event does not accept interprocess=True"
            )
        if not hasattr(event_cls, "from_ipc_handle"):
            raise RuntimeError(f"event IPC unsupported on {where}: Event has no from_ipc_handle")

    def create_event(self, device: Any) -> Any:
        return self.event_module.Event(interprocess=True)

    def export_event(self, event: Any, device: Any) -> bytes:
        handle = event.ipc_handle()
        with self._lock:
            self._exported.append(event)
        return bytes(handle)

    def import_event(self, handle: bytes, device: Any) -> Any:
        return self.event_module.Event.from_ipc_handle(device, handle)

    def record_event(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, event: Any, stream: Any) -> None:
        event.wait(stream)

    def query_event(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize_event(self, event: Any, device: Any) -> None:
        event.synchronize()


def _device_type_of(device: Any) -> str:
    if isinstance(device, bool):
        raise TypeError(f"invalid device {device!r}")
    if isinstance(device, int):
        return active_platform().get_torch_device()[1]
    dev_type = getattr(device, "type", None)
    if isinstance(dev_type, str):
        return dev_type
    if isinstance(device, str):
        return device.split(":", 1)[0].strip().lower()
    raise TypeError(f"invalid device {device!r}: expected an int, str or torch.device")


def get_event_ipc_backend(device: Any) -> EventIPCBackend:
    """The event backend of ``device``'s own spec; never the active accelerator's."""
    device_type = _device_type_of(device)
    spec = active_platform().get_device_spec(device_type)
    if spec is None:
        raise RuntimeError(f"No DeviceSpec registered for device type {device_type!r}.")
    backend = spec.event_ipc_backend
    if backend is None:
        raise RuntimeError(f"Device type {device_type!r} does not support event IPC.")
    return backend
