"""Cross-process device events for the LMCache-driven path (docs/design/platform.md#event-ipc).

In LMCache-driven mode the engine worker and the cache server share KV memory but not a
stream. Per STORE or RETRIEVE the worker creates an interprocess event, records it on its
current stream after the KV writes it wants the server to see, and sends the exported handle
bytes in the request; the server imports the handle, makes its cache context's stream wait
on the event (no device-wide sync), transfers, and the worker's future polls the event.

Events, streams and devices belong to the device's torch module (``torch.cuda``,
``torch.musa``, ...); :class:`DeviceEvent` and :class:`DeviceStream` describe the part of
them this contract relies on, :data:`DeviceLike` the accepted device designations.
"""

from __future__ import annotations

import collections
import inspect
import threading
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, Union, cast, runtime_checkable

from lmcache.v1.platform.base.active import active_platform

if TYPE_CHECKING:
    import torch

__all__ = [
    "DefaultEventIPCBackend",
    "DeviceEvent",
    "DeviceLike",
    "DeviceStream",
    "EventIPCBackend",
    "get_event_ipc_backend",
]

DeviceLike: TypeAlias = Union[int, str, "torch.device"]
"""A device as callers name it: an index of the active accelerator (``0``), a
``"type:index"`` or ``"type"`` string (``"cuda:1"``, ``"cpu"``) or a ``torch.device``."""


class DeviceStream(Protocol):
    """A stream of the device's torch module (``torch.cuda.Stream``, ``torch.musa.Stream``, a
    fake device's stream in tests). Event backends only hand it to the event's ``record`` and
    ``wait``; core never creates one through this contract."""

    def synchronize(self) -> None:
        """Block the calling thread until all work queued on the stream has finished."""
        ...


class DeviceEvent(Protocol):
    """An event of the device's torch module, created for interprocess use (for example
    ``torch.cuda.Event(interprocess=True)``) or imported from a peer's handle."""

    def record(self, stream: DeviceStream) -> None:
        """Mark the point in ``stream`` that the event completes at."""
        ...

    def wait(self, stream: DeviceStream) -> None:
        """Make future work on ``stream`` wait for the event (no host-side blocking)."""
        ...

    def query(self) -> bool:
        """Whether the recorded work has finished; never blocks."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until the recorded work has finished."""
        ...


class _HandleEvent(DeviceEvent, Protocol):
    """A CUDA-style interprocess event, which exports its own IPC handle."""

    def ipc_handle(self) -> bytes: ...


@runtime_checkable
class EventIPCBackend(Protocol):
    """Create, export, import, record, wait on, query and synchronize device events.

    A device's :class:`~lmcache.v1.platform.base.device_spec.DeviceSpec` returns one from
    ``event_ipc_backend`` (cached: futures poll it); ``get_event_ipc_backend(device)`` finds it.
    Most CUDA-style modules are served by :class:`DefaultEventIPCBackend`. Every method may be
    called from any thread of the worker or the server; an implementation keeps exported
    events alive until the peer has imported them.
    """

    device_type: str
    """The torch device type the backend serves (``"cuda"``, ``"musa"``, ...)."""

    def check_event_support(self, device: DeviceLike) -> None:
        """Raise ``RuntimeError`` naming ``device`` when interprocess events cannot work on it.

        Called when a worker registers in LMCache-driven mode (worker side, then the server
        again on its cache context's device) so a missing capability fails the registration
        up front, before any cross-process transfer relies on it."""
        ...

    def create_event(self, device: DeviceLike) -> DeviceEvent:
        """A new interprocess event on ``device``, not yet recorded. Called by the worker once
        per STORE/RETRIEVE it hands to the server."""
        ...

    def export_event(self, event: DeviceEvent, device: DeviceLike) -> bytes:
        """The opaque handle bytes a peer passes to :meth:`import_event`; sent in the request.
        The backend keeps ``event`` alive until the peer can have imported it."""
        ...

    def import_event(self, handle: bytes, device: DeviceLike) -> DeviceEvent:
        """Open a peer's exported ``handle`` on ``device`` (server side). The caller holds the
        result (``BaseCacheContext.hold_imported_event``) until its waits have drained."""
        ...

    def record_event(self, event: DeviceEvent, stream: DeviceStream) -> None:
        """Record ``event`` on ``stream``: it completes when the work queued so far does."""
        ...

    def wait_event(self, event: DeviceEvent, stream: DeviceStream) -> None:
        """Make ``stream`` wait for ``event`` on the device; the host does not block."""
        ...

    def query_event(self, event: DeviceEvent) -> bool:
        """Whether ``event`` has completed. Must never block: transfer futures poll it."""
        ...

    def synchronize_event(self, event: DeviceEvent, device: DeviceLike) -> None:
        """Block the calling thread until ``event`` has completed on ``device``."""
        ...


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
    """Adapter over any CUDA-style module exposing ``Event(interprocess=True)``.

    ``event_module`` is the device's torch module (``torch.cuda``, ``torch.musa``, a fake in
    tests) and ``device_type`` its device type; both default to the active accelerator's.
    The module's ``Event`` must accept ``interprocess=True``, have ``ipc_handle()`` and
    ``Event.from_ipc_handle(device, handle)``. The last 2048 exported events are kept alive
    so a peer can still import a handle after the exporter dropped its reference.
    """

    def __init__(self, event_module: Any = None, device_type: str | None = None) -> None:
        if event_module is None or device_type is None:
            active_module, active_type = active_platform().get_torch_device()
            event_module = active_module if event_module is None else event_module
            device_type = active_type if device_type is None else device_type
        self.event_module = event_module
        self.device_type: str = str(device_type)
        # Exported events must outlive the peer's import; keep the most recent ones alive.
        self._exported: collections.deque[DeviceEvent] = collections.deque(maxlen=_EXPORTED_RING)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"DefaultEventIPCBackend(device_type={self.device_type!r})"

    def check_event_support(self, device: DeviceLike) -> None:
        """Raise ``RuntimeError`` naming ``device`` unless the module's ``Event`` takes
        ``interprocess=True`` and has ``from_ipc_handle``."""
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

    def create_event(self, device: DeviceLike) -> DeviceEvent:
        """``Event(interprocess=True)`` of the module; ``device`` is the current one."""
        return cast(DeviceEvent, self.event_module.Event(interprocess=True))

    def export_event(self, event: DeviceEvent, device: DeviceLike) -> bytes:
        """``event.ipc_handle()`` as bytes; ``event`` joins the ring of kept-alive events."""
        handle = cast(_HandleEvent, event).ipc_handle()
        with self._lock:
            self._exported.append(event)
        return bytes(handle)

    def import_event(self, handle: bytes, device: DeviceLike) -> DeviceEvent:
        """``Event.from_ipc_handle(device, handle)`` of the module."""
        return cast(DeviceEvent, self.event_module.Event.from_ipc_handle(device, handle))

    def record_event(self, event: DeviceEvent, stream: DeviceStream) -> None:
        """``event.record(stream)``."""
        event.record(stream)

    def wait_event(self, event: DeviceEvent, stream: DeviceStream) -> None:
        """``event.wait(stream)``: a stream-side wait, the host does not block."""
        event.wait(stream)

    def query_event(self, event: DeviceEvent) -> bool:
        """``event.query()`` as a bool; non-blocking."""
        return bool(event.query())

    def synchronize_event(self, event: DeviceEvent, device: DeviceLike) -> None:
        """``event.synchronize()``: blocks the calling thread until the event completes."""
        event.synchronize()


def _device_type_of(device: DeviceLike) -> str:
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


def get_event_ipc_backend(device: DeviceLike) -> EventIPCBackend:
    """The event backend of ``device``'s own spec; never the active accelerator's.

    ``device`` is an index of the active accelerator, ``"type:index"``, ``"type"`` or a
    ``torch.device``; ``"cpu"`` always gets the CPU spec's stub backend. Raises
    ``RuntimeError`` when no spec serves the device type or the spec has no event backend."""
    device_type = _device_type_of(device)
    spec = active_platform().get_device_spec(device_type)
    if spec is None:
        raise RuntimeError(f"No DeviceSpec registered for device type {device_type!r}.")
    backend = spec.event_ipc_backend
    if backend is None:
        raise RuntimeError(f"Device type {device_type!r} does not support event IPC.")
    return backend
