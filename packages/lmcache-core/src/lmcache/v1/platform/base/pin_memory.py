"""Host-memory registration (pinning) contract; pinning is optional everywhere."""

from __future__ import annotations


class PinMemoryBackend:
    """Base backend: pinning unsupported, every call answers False."""

    def pin_memory(self, ptr: int, size: int, flags: int = 0) -> bool:
        return False

    def unpin_memory(self, ptr: int) -> bool:
        return False

    @property
    def is_pin_supported(self) -> bool:
        return False
