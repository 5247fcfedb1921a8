"""A stand-in for a torch device module when no accelerator is present.

It answers the calls LMCache makes on ``torch_dev`` (streams, events, device
queries) with no-ops, so CPU code paths need no special cases.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any


class StubEvent:
    """Completed-at-once event; IPC handles are a fixed marker."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ):
        self.interprocess = interprocess

    def ipc_handle(self) -> bytes:
        return b"stub_ipc_handle"

    @classmethod
    def from_ipc_handle(cls, device: Any, handle: bytes) -> StubEvent:
        return cls(interprocess=True)

    def query(self) -> bool:
        return True

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


class StubStream:
    """A stream on which everything is already complete."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
        self.device = device

    def synchronize(self) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> StubEvent:
        return event if event is not None else StubEvent()

    def query(self) -> bool:
        return True

    def __enter__(self) -> StubStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_NAMES = frozenset(
    {
        "Event",
        "Stream",
        "is_available",
        "device",
        "stream",
        "current_stream",
        "default_stream",
        "synchronize",
        "set_stream",
        "set_device",
        "empty_cache",
        "init",
        "device_count",
        "current_device",
        "get_device_properties",
    }
)


class StubCPUDevice:
    """Mimics ``torch.<accelerator>`` for CPU-only processes."""

    Event = StubEvent
    Stream = StubStream

    def __init__(self, device_type: str = "cpu"):
        self.device_type = device_type
        self._stream = StubStream(device_type)

    def __repr__(self) -> str:
        return f"StubCPUDevice(device_type={self.device_type})"

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"StubCPUDevice has no attribute {name!r}")

    def is_available(self) -> bool:
        return False

    def device(self, device: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def stream(self, stream: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def current_stream(self, device: Any = None) -> StubStream:
        return self._stream

    def default_stream(self, device: Any = None) -> StubStream:
        return self._stream

    def synchronize(self, device: Any = None) -> None:
        return None

    def set_stream(self, stream: Any) -> None:
        return None

    def set_device(self, device: Any) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def init(self) -> None:
        return None

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, device: Any = None) -> SimpleNamespace:
        return SimpleNamespace(
            name="stub-cpu", uuid="stub-0000-0000-0000-000000000000", total_memory=0
        )
