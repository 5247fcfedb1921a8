"""``GPUCacheContext``: the LMCache-driven server's view of a worker's CUDA/HIP KV caches.

The worker's per-layer tensors arrive as IPC wrappers (``cuda`` tag) and are opened
here. Transfers run on one dedicated stream per context; block ids, layer pointers
and the per-batch temporary chunk buffers live on the same device, allocated once.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from lmcache.v1.platform.base.cache_context import (
    BaseCacheContext,
    KernelGroup,
    KVLayerGroupsManager,
    ObjectGroup,
)
from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper

_MAX_BATCH = 4


class GPUCacheContext(BaseCacheContext):
    device_type: ClassVar[str] = "cuda"

    def __init__(
        self,
        kv_caches: list[Any],
        lmcache_tokens_per_chunk: int = 256,
        layout_hints: Any = None,
        engine_group_infos: Any = (),
        engine_type: Any = "vllm",
        separate_object_groups: bool = False,
        full_sw_kv: bool = False,
    ) -> None:
        if not kv_caches:
            raise ValueError("GPUCacheContext requires a non-empty kv_caches list")
        self._wrappers: list[DeviceIPCWrapper] = []
        tensors: list[Any] = []
        for layer in kv_caches:
            if isinstance(layer, DeviceIPCWrapper):
                self._wrappers.append(layer)
                tensors.append(layer.to_tensor())
            else:
                tensors.append(layer)
        devices = set()
        for t in tensors:
            first = t[0] if isinstance(t, (tuple, list)) else t
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
        device = devices.pop()
        manager = KVLayerGroupsManager.build(
            tensors, layout_hints, engine_group_infos, separate_object_groups
        )
        capacity = max((int(kg.shape_desc.nb) for kg in manager.kernel_groups), default=0)
        super().__init__(
            kv_caches=tensors,
            device=device,
            num_layers=len(tensors),
            kv_layer_groups_manager=manager,
            block_ids_buffer=torch.zeros(max(capacity, 1), dtype=torch.long, device=device),
            lmcache_tokens_per_chunk=lmcache_tokens_per_chunk,
        )
        self.engine_type = engine_type
        self.full_sw_kv = bool(full_sw_kv)
        self._stream = torch.cuda.Stream(device=device)
        self._temp: dict[tuple[int, int], torch.Tensor] = {}
        self._pointers: dict[int, torch.Tensor] = {}

    @property
    def stream(self) -> Any:
        return self._stream

    @property
    def cupy_stream(self) -> Any:
        return None  # no cupy dependency; kernels take stream handles directly

    @property
    def max_batch_size(self) -> int:
        return _MAX_BATCH

    def close(self) -> None:
        self._stream.synchronize()
        self._temp.clear()
        self._pointers.clear()
        self._kv_caches = []
        for w in self._wrappers:
            w.close()
        self._wrappers = []

    def get_kernel_group_kv_pointers(self, kg: KernelGroup) -> torch.Tensor:
        ptrs = self._pointers.get(kg.group_id)
        if ptrs is None:
            values = []
            for layer in self.kernel_group_layers(kg):
                t = layer[0] if isinstance(layer, (tuple, list)) else layer
                values.append(t.data_ptr())
            ptrs = torch.tensor(values, dtype=torch.int64, device=self.device)
            self._pointers[kg.group_id] = ptrs
        return ptrs

    def get_temp_object_group_buffer(self, batch_idx: int, og: ObjectGroup) -> torch.Tensor:
        if not 0 <= batch_idx < _MAX_BATCH:
            raise ValueError(f"batch_idx={batch_idx} outside [0, {_MAX_BATCH})")
        key = (batch_idx, og.group_id)
        buf = self._temp.get(key)
        if buf is None:
            nbytes = og.bytes_per_token() * self.lmcache_tokens_per_chunk
            buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            self._temp[key] = buf
        return buf

    def get_temp_kernel_group_buffer(self, batch_idx: int, kg: KernelGroup) -> torch.Tensor:
        og = self.object_groups[kg.object_group]
        flat = self.get_temp_object_group_buffer(batch_idx, og)
        tokens = self.lmcache_tokens_per_chunk
        off = og.kernel_group_offset(kg, tokens)
        shape, dtype = self.get_kernel_group_shape_dtype(tokens, kg)
        n = kg.bytes_per_token() * tokens
        return flat[off : off + n].view(dtype).view(shape)

    def get_kernel_group_shape_dtype(self, num_tokens: int, kg: KernelGroup) -> tuple[Any, Any]:
        return torch.Size([kg.kv_size, kg.num_layers, int(num_tokens), kg.hidden_dim]), kg.dtype

    def cache_size_per_token(self) -> int:
        return sum(kg.bytes_per_token() for kg in self.kernel_groups)
