"""LMCache-driven MUSA pieces, not implemented yet (LATER, docs/design/platform.md#device-musa).

The names exist so that callers and docs can refer to them; each fails with an error that
says what to use instead. ``MusaDeviceSpec`` does not expose them, so its capability flag
stays False and the router keeps MUSA on ``engine_driven``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper

_HINT = "LMCache-driven transfer is not implemented for MUSA yet; use mode 'engine_driven'"


class MusaIPCWrapper(DeviceIPCWrapper):
    device_type: ClassVar[str] = "musa"
    wire_tag: ClassVar[str | None] = "musa"

    @classmethod
    def wrap(cls, tensor: Any) -> DeviceIPCWrapper:
        raise NotImplementedError(f"MusaIPCWrapper: {_HINT}")


class MusaEventIPCBackend:
    device_type = "musa"

    def check_event_support(self, device: Any) -> None:
        raise RuntimeError(f"event IPC unsupported on device {device!r}: {_HINT}")


class MUSACacheContext:
    device_type: ClassVar[str] = "musa"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"MUSACacheContext: {_HINT}")
