"""``CPUCacheContext``: the LMCache-driven server's view of a worker's SHM-shared CPU KV caches."""

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
from lmcache.v1.platform.devices.cpu.stub_cpu_device import StubCPUDevice

_MAX_BATCH = 4


class CPUCacheContext(BaseCacheContext):
    device_type: ClassVar[str] = "cpu"

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
            raise ValueError("CPUCacheContext requires a non-empty kv_caches list")
        self._wrappers: list[DeviceIPCWrapper] = []
        tensors: list[Any] = []
        for layer in kv_caches:
            if isinstance(layer, DeviceIPCWrapper):
                self._wrappers.append(layer)
                tensors.append(layer.to_tensor())
            else:
                tensors.append(layer)
        for t in tensors:
            first = t[0] if isinstance(t, (tuple, list)) else t
            if first.device.type != "cpu":
                raise ValueError(f"CPUCacheContext got a KV tensor on {first.device}")
        manager = KVLayerGroupsManager.build(
            tensors, layout_hints, engine_group_infos, separate_object_groups
        )
        capacity = max((int(kg.shape_desc.nb) for kg in manager.kernel_groups), default=0)
        super().__init__(
            kv_caches=tensors,
            device=torch.device("cpu"),
            num_layers=len(tensors),
            kv_layer_groups_manager=manager,
            block_ids_buffer=torch.zeros(max(capacity, 1), dtype=torch.long),
            lmcache_tokens_per_chunk=lmcache_tokens_per_chunk,
        )
        self.engine_type = engine_type
        self.full_sw_kv = bool(full_sw_kv)
        self._stub = StubCPUDevice("cpu")
        self._temp: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def stream(self) -> Any:
        return self._stub.current_stream()

    @property
    def cupy_stream(self) -> Any:
        return None

    @property
    def max_batch_size(self) -> int:
        return _MAX_BATCH

    def close(self) -> None:
        self._temp.clear()
        self._kv_caches = []
        for w in self._wrappers:
            w.close()
        self._wrappers = []

    def get_kernel_group_kv_pointers(self, kg: KernelGroup) -> torch.Tensor:
        ptrs = []
        for layer in self.kernel_group_layers(kg):
            t = layer[0] if isinstance(layer, (tuple, list)) else layer
            ptrs.append(t.data_ptr())
        return torch.tensor(ptrs, dtype=torch.int64)

    def get_temp_object_group_buffer(self, batch_idx: int, og: ObjectGroup) -> torch.Tensor:
        if not 0 <= batch_idx < _MAX_BATCH:
            raise ValueError(f"batch_idx={batch_idx} outside [0, {_MAX_BATCH})")
        key = (batch_idx, og.group_id)
        buf = self._temp.get(key)
        if buf is None:
            buf = torch.zeros(
                og.bytes_per_token() * self.lmcache_tokens_per_chunk, dtype=torch.uint8
            )
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
