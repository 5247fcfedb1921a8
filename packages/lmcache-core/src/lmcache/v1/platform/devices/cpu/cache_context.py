"""``CPUCacheContext``: the LMCache-driven server's view of a worker's SHM-shared CPU KV caches."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from lmcache.v1.platform.base.cache_context import TorchCacheContext
from lmcache.v1.platform.devices.cpu.stub_cpu_device import StubCPUDevice


class CPUCacheContext(TorchCacheContext):
    device_type: ClassVar[str] = "cpu"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stub = StubCPUDevice("cpu")

    def _kv_device(self, first_tensors: list[Any]) -> Any:
        for first in first_tensors:
            if first.device.type != "cpu":
                raise ValueError(f"CPUCacheContext got a KV tensor on {first.device}")
        return torch.device("cpu")

    @property
    def stream(self) -> Any:
        return self._stub.current_stream()
