"""``GPUCacheContext``: the LMCache-driven server's view of a worker's CUDA/HIP KV caches.

The worker's per-layer tensors arrive as IPC wrappers (``cuda`` tag) and are opened
here. Transfers run on one dedicated stream per context; block ids, layer pointers
and the per-batch temporary chunk buffers live on the same device, allocated once
(``TorchCacheContext``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from lmcache.v1.platform.base.cache_context import TorchCacheContext


class GPUCacheContext(TorchCacheContext):
    device_type: ClassVar[str] = "cuda"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._stream = torch.cuda.Stream(device=self.device)

    def _kv_device(self, first_tensors: list[Any]) -> Any:
        devices = set()
        for first in first_tensors:
            if first.device.type != "cuda":
                raise ValueError(
                    f"GPUCacheContext got a KV tensor on {first.device}; every layer must be "
                    "a CUDA/HIP tensor"
                )
            devices.add(first.device)
        if len(devices) != 1:
            raise ValueError(
                f"GPUCacheContext needs every KV layer on one device, got {sorted(map(str, devices))}"
            )
        return devices.pop()

    @property
    def stream(self) -> Any:
        return self._stream

    def close(self) -> None:
        self._stream.synchronize()
        super().close()
