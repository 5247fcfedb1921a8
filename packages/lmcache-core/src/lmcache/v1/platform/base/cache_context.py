"""``BaseCacheContext``: the server-side view of one worker's registered KV caches.

Used by the LMCache-driven server module. Layers with the same format, geometry, dtype
and engine group form a *kernel group* (one transfer call); kernel groups stored in one
memory object form an *object group*. Inside an object, each kernel group is a
C-contiguous ``[kv_size, num_layers, tokens, hidden_dim]`` array, in group order.
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

from lmcache.v1.platform.ops_types import EngineKVFormat, PageBufferShapeDesc

__all__ = [
    "BaseCacheContext",
    "KVLayerGroupsManager",
    "KernelGroup",
    "ObjectGroup",
    "TorchCacheContext",
]


@dataclass
class KernelGroup:
    """Layers that one transfer call moves together: same engine KV format, geometry, dtype
    and engine group. ``layer_indices`` index the context's ``kv_tensors``; ``object_group``
    is the :class:`ObjectGroup` whose memory objects hold this group's bytes."""

    group_id: int
    layer_indices: list[int]
    engine_kv_format: EngineKVFormat
    shape_desc: PageBufferShapeDesc
    dtype: Any
    engine_group: int = 0
    object_group: int = 0

    @property
    def kv_size(self) -> int:
        """Planes per token in the host chunk: 2 (K and V) or 1 (MLA, fused, single)."""
        return int(self.shape_desc.kv_size)

    @property
    def num_layers(self) -> int:
        """Layers in the group."""
        return len(self.layer_indices)

    @property
    def block_size(self) -> int:
        """Tokens per engine block (``shape_desc.bs``)."""
        return int(self.shape_desc.bs)

    @property
    def hidden_dim(self) -> int:
        """Elements per token, layer and plane in the host chunk (``NH*HS``, ``HS`` for MLA,
        the packed width for fused formats)."""
        from lmcache.v1.platform.kv_layout import hidden_dim_of

        return hidden_dim_of(self.shape_desc)

    def bytes_per_token(self) -> int:
        """Host-chunk bytes one token of this group takes, all its layers and planes."""
        return self.kv_size * self.num_layers * self.hidden_dim * int(self.shape_desc.element_size)


@dataclass
class ObjectGroup:
    """Kernel groups stored in one memory object: each group's array follows the previous
    one's, in ``kernel_groups`` order."""

    group_id: int
    kernel_groups: list[KernelGroup] = field(default_factory=list)

    def bytes_per_token(self) -> int:
        """Bytes one token takes in an object of this group (sum over its kernel groups)."""
        return sum(kg.bytes_per_token() for kg in self.kernel_groups)

    def kernel_group_offset(self, kg: KernelGroup, num_tokens: int) -> int:
        """Byte offset of ``kg``'s array inside an object of ``num_tokens`` tokens."""
        off = 0
        for g in self.kernel_groups:
            if g is kg:
                return off
            off += g.bytes_per_token() * num_tokens
        raise ValueError(f"kernel group {kg.group_id} is not in object group {self.group_id}")


@dataclass
class KVLayerGroupsManager:
    """The kernel groups of one worker's KV caches and the object groups that store them;
    built once per registration by :meth:`build`."""

    kernel_groups: list[KernelGroup]
    object_groups: list[ObjectGroup]

    @classmethod
    def build(
        cls,
        kv_tensors: list[Any],
        layout_hints: Any = None,
        engine_group_infos: Any = (),
        separate_object_groups: bool = False,
    ) -> KVLayerGroupsManager:
        """Group layers by (format, geometry, dtype, engine group)."""
        from lmcache.v1.platform.kv_layout import detect_engine_kv_format, shape_desc_for

        engine_group_of = _engine_groups(engine_group_infos, len(kv_tensors))
        keyed: dict[tuple, list[int]] = {}
        formats: dict[tuple, EngineKVFormat] = {}
        for i, layer in enumerate(kv_tensors):
            hint = layout_hints[i] if isinstance(layout_hints, (list, tuple)) else layout_hints
            fmt = detect_engine_kv_format(layer, hint)
            t = layer[0] if isinstance(layer, (tuple, list)) else layer
            key = (int(fmt), tuple(t.shape), str(t.dtype), engine_group_of[i])
            keyed.setdefault(key, []).append(i)
            formats[key] = fmt
        kernel_groups: list[KernelGroup] = []
        for gid, (key, layers) in enumerate(keyed.items()):
            fmt = formats[key]
            desc = shape_desc_for(kv_tensors[layers[0]], fmt, len(layers))
            kernel_groups.append(KernelGroup(gid, layers, fmt, desc, desc.dtype, key[3]))
        object_groups: list[ObjectGroup] = []
        if separate_object_groups:
            by_engine: dict[int, ObjectGroup] = {}
            for kg in kernel_groups:
                og = by_engine.get(kg.engine_group)
                if og is None:
                    og = ObjectGroup(len(object_groups))
                    by_engine[kg.engine_group] = og
                    object_groups.append(og)
                kg.object_group = og.group_id
                og.kernel_groups.append(kg)
        else:
            og = ObjectGroup(0, list(kernel_groups))
            object_groups.append(og)
        return cls(kernel_groups, object_groups)


def _engine_groups(engine_group_infos: Any, num_layers: int) -> list[int]:
    """Engine group id per layer; infos are sequences of layer indices (or dicts with them)."""
    out = [0] * num_layers
    for gid, info in enumerate(engine_group_infos or ()):
        layers = info.get("layer_indices", ()) if isinstance(info, dict) else info
        try:
            for li in layers:
                if 0 <= int(li) < num_layers:
                    out[int(li)] = gid
        except TypeError:
            continue
    return out


class BaseCacheContext(abc.ABC):
    """Server-side handle on a worker's KV caches; one per registered instance."""

    device_type: ClassVar[str] = ""

    def __init__(
        self,
        *,
        kv_caches: list[Any],
        device: Any,
        num_layers: int,
        kv_layer_groups_manager: KVLayerGroupsManager,
        block_ids_buffer: Any,
        lmcache_tokens_per_chunk: int,
    ) -> None:
        if not type(self).device_type:
            raise TypeError(f"{type(self).__name__} must set the device_type class attribute")
        self._kv_caches = list(kv_caches)
        self._device = device
        self._num_layers = int(num_layers)
        self.kv_layer_groups_manager = kv_layer_groups_manager
        self._block_ids_buffer = block_ids_buffer
        self.lmcache_tokens_per_chunk = int(lmcache_tokens_per_chunk)
        self._held_events: list[Any] = []
        self._event_lock = threading.Lock()

    # ---- abstract ------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def stream(self) -> Any:
        """The server-side stream every transfer of this context runs on; imported worker
        events are waited on it before a transfer reads the worker's KV."""

    @property
    @abc.abstractmethod
    def cupy_stream(self) -> Any:
        """The same stream as a CuPy stream for backends whose kernels take one, else
        ``None`` (core's contexts pass raw stream handles)."""

    @property
    @abc.abstractmethod
    def max_batch_size(self) -> int:
        """How many chunks one transfer may stage at once: the number of per-batch temporary
        buffers (``batch_idx`` runs over ``range(max_batch_size)``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the temporary buffers and close the worker's IPC wrappers. Called once when
        the worker unregisters or the server stops; the context is unusable afterwards."""

    @abc.abstractmethod
    def get_kernel_group_kv_pointers(self, kg: KernelGroup) -> Any:
        """A 1-D int64 device tensor of ``kg``'s layer base addresses (pointer-mode operand
        of ``multi_layer_block_kv_transfer``); built once and cached."""

    @abc.abstractmethod
    def get_temp_kernel_group_buffer(self, batch_idx: int, kg: KernelGroup) -> Any:
        """``kg``'s part of the temporary chunk buffer of batch slot ``batch_idx``, shaped and
        typed as :meth:`get_kernel_group_shape_dtype` says for a full chunk."""

    @abc.abstractmethod
    def get_temp_object_group_buffer(self, batch_idx: int, og: ObjectGroup) -> Any:
        """A flat uint8 device buffer holding one full chunk of ``og`` for batch slot
        ``batch_idx`` (``0 <= batch_idx < max_batch_size``, else ``ValueError``); allocated
        on first use and reused."""

    @abc.abstractmethod
    def get_kernel_group_shape_dtype(self, num_tokens: int, kg: KernelGroup) -> tuple[Any, Any]:
        """``(torch.Size([kv_size, num_layers, num_tokens, hidden_dim]), dtype)`` of ``kg``'s
        array inside a memory object of ``num_tokens`` tokens."""

    @abc.abstractmethod
    def cache_size_per_token(self) -> int:
        """Bytes one token takes in a memory object, every kernel group included."""

    # ---- concrete helpers --------------------------------------------------------------
    @property
    def device(self) -> Any:
        """The device holding every KV layer (a ``torch.device``)."""
        return self._device

    @property
    def kv_tensors(self) -> list[Any]:
        """The worker's KV layers opened in this process, in layer order."""
        return self._kv_caches

    @property
    def num_layers(self) -> int:
        """Number of KV layers registered."""
        return self._num_layers

    @property
    def kernel_groups(self) -> list[KernelGroup]:
        """Every kernel group, in ``group_id`` order."""
        return self.kv_layer_groups_manager.kernel_groups

    @property
    def object_groups(self) -> list[ObjectGroup]:
        """Every object group, in ``group_id`` order."""
        return self.kv_layer_groups_manager.object_groups

    @property
    def num_blocks(self) -> int:
        """Blocks in the engine's paged cache (of the first kernel group; 0 when empty)."""
        return int(self.kernel_groups[0].shape_desc.nb) if self.kernel_groups else 0

    def _kg(self, kg: KernelGroup | None) -> KernelGroup:
        return kg if kg is not None else self.kernel_groups[0]

    def get_shape_desc(self, kg: KernelGroup | None = None) -> PageBufferShapeDesc:
        """The paged-buffer geometry of ``kg`` (default: the first kernel group)."""
        return self._kg(kg).shape_desc

    def get_engine_kv_format(self, kg: KernelGroup | None = None) -> EngineKVFormat:
        """The engine KV format of ``kg`` (default: the first kernel group)."""
        return self._kg(kg).engine_kv_format

    @property
    def engine_kv_formats(self) -> list[EngineKVFormat]:
        """The engine KV format of each kernel group, in group order."""
        return [kg.engine_kv_format for kg in self.kernel_groups]

    def kernel_group_layers(self, kg: KernelGroup) -> list[Any]:
        """The paged tensors of ``kg`` (tensor operands for multi_layer_block_kv_transfer)."""
        return [self._kv_caches[i] for i in kg.layer_indices]

    def stage_block_ids(self, block_ids: Any) -> Any:
        """Copy block ids into the pre-allocated buffer (non-blocking); returns the slice."""
        import torch

        ids = torch.as_tensor(block_ids, dtype=self._block_ids_buffer.dtype).reshape(-1)
        n = int(ids.numel())
        cap = int(self._block_ids_buffer.numel())
        if n > cap:
            raise ValueError(f"{n} block ids exceed the staging buffer capacity {cap}")
        out = self._block_ids_buffer[:n]
        out.copy_(ids, non_blocking=True)
        return out

    def report_status(self) -> dict[str, Any]:
        """A JSON-safe summary (device, layers, blocks, chunk size, kernel groups) shown by
        the server's status and debug endpoints."""
        return {
            "device_type": self.device_type,
            "device": str(self._device),
            "num_layers": self._num_layers,
            "num_blocks": self.num_blocks,
            "lmcache_tokens_per_chunk": self.lmcache_tokens_per_chunk,
            "kernel_groups": [
                {
                    "layers": len(kg.layer_indices),
                    "format": kg.engine_kv_format.name,
                    "block_size": kg.block_size,
                    "hidden_dim": kg.hidden_dim,
                    "dtype": str(kg.dtype),
                }
                for kg in self.kernel_groups
            ],
        }

    def hold_imported_event(self, event: Any) -> None:
        """Keep an event imported from the worker alive until
        :meth:`release_imported_event`: the stream may still wait on it after the request
        that brought it has returned."""
        with self._event_lock:
            self._held_events.append(event)

    def release_imported_event(self, event: Any = None) -> None:
        """Release one held event (or all when ``event`` is None)."""
        with self._event_lock:
            if event is None:
                self._held_events.clear()
            else:
                for i, held in enumerate(self._held_events):
                    if held is event:
                        del self._held_events[i]
                        break


class TorchCacheContext(BaseCacheContext):
    """The torch-tensor implementation shared by core's contexts (CPU SHM, CUDA/HIP).

    Opens the worker's IPC wrappers, groups the layers, and keeps the block-id buffer,
    the layer-pointer tables and the per-batch temporary chunk buffers on the KV device,
    allocated once. Subclasses say which device the layers must be on
    (``_kv_device``) and provide ``stream``.
    """

    MAX_BATCH: ClassVar[int] = 4

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
        import torch

        from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper

        if not kv_caches:
            raise ValueError(f"{type(self).__name__} requires a non-empty kv_caches list")
        self._wrappers: list[DeviceIPCWrapper] = []
        tensors: list[Any] = []
        for layer in kv_caches:
            if isinstance(layer, DeviceIPCWrapper):
                self._wrappers.append(layer)
                tensors.append(layer.to_tensor())
            else:
                tensors.append(layer)
        device = self._kv_device([t[0] if isinstance(t, (tuple, list)) else t for t in tensors])
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
        self._temp: dict[tuple[int, int], Any] = {}
        self._pointers: dict[int, Any] = {}

    @abc.abstractmethod
    def _kv_device(self, first_tensors: list[Any]) -> Any:
        """The one device of every layer (first tensor of each); ValueError otherwise."""

    @property
    def cupy_stream(self) -> Any:
        return None  # no cupy dependency; kernels take stream handles directly

    @property
    def max_batch_size(self) -> int:
        return self.MAX_BATCH

    def close(self) -> None:
        self._temp.clear()
        self._pointers.clear()
        self._kv_caches = []
        for w in self._wrappers:
            w.close()
        self._wrappers = []

    def get_kernel_group_kv_pointers(self, kg: KernelGroup) -> Any:
        ptrs = self._pointers.get(kg.group_id)
        if ptrs is None:
            import torch

            values = []
            for layer in self.kernel_group_layers(kg):
                t = layer[0] if isinstance(layer, (tuple, list)) else layer
                values.append(t.data_ptr())
            ptrs = torch.tensor(values, dtype=torch.int64, device=self.device)
            self._pointers[kg.group_id] = ptrs
        return ptrs

    def get_temp_object_group_buffer(self, batch_idx: int, og: ObjectGroup) -> Any:
        if not 0 <= batch_idx < self.MAX_BATCH:
            raise ValueError(f"batch_idx={batch_idx} outside [0, {self.MAX_BATCH})")
        key = (batch_idx, og.group_id)
        buf = self._temp.get(key)
        if buf is None:
            import torch

            nbytes = og.bytes_per_token() * self.lmcache_tokens_per_chunk
            buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
            self._temp[key] = buf
        return buf

    def get_temp_kernel_group_buffer(self, batch_idx: int, kg: KernelGroup) -> Any:
        og = self.object_groups[kg.object_group]
        flat = self.get_temp_object_group_buffer(batch_idx, og)
        tokens = self.lmcache_tokens_per_chunk
        off = og.kernel_group_offset(kg, tokens)
        shape, dtype = self.get_kernel_group_shape_dtype(tokens, kg)
        n = kg.bytes_per_token() * tokens
        return flat[off : off + n].view(dtype).view(shape)

    def get_kernel_group_shape_dtype(self, num_tokens: int, kg: KernelGroup) -> tuple[Any, Any]:
        import torch

        return torch.Size([kg.kv_size, kg.num_layers, int(num_tokens), kg.hidden_dim]), kg.dtype

    def cache_size_per_token(self) -> int:
        return sum(kg.bytes_per_token() for kg in self.kernel_groups)
