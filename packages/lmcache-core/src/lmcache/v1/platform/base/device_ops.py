"""``DeviceOps``: the ops strategy a backend hands out through ``DeviceSpec.get_ops()``.

A backend's ``DeviceOps`` subclass is where its copy kernels live. Every op is declared
on the class body and, by default, forwards to the same-named function of
``lmcache.v1.platform.torch_ops`` (the pure-PyTorch baseline, correct on any device with
standard tensor ops). A backend overrides the ops it can do better or must do
differently, and may bind a native module: ``ensure_native()`` (run once, when the
singleton is created) calls ``bind_native(module)``, which overlays the module's public
callables and types on that one instance. Anything neither declared nor bound raises
AttributeError, so callers probe optional native-only symbols with
``hasattr(device_ops, name)``.

One instance per backend per process, shared by every thread that copies KV: ops must be
reentrant and keep no per-call state on ``self``. Buffers passed in belong to the caller
for the whole call and, for asynchronous copies, until the caller synchronizes the
stream or device; an op never frees, keeps or resizes them. Operand shapes and the
canonical host chunk layout are described in ``docs/design/platform.md``.
"""

# The ops' bodies come from @_forwards_to_baseline: their declarations are docstring only.
# mypy: disable-error-code="empty-body"

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias, TypeVar, cast

from lmcache.utils import init_logger
from lmcache.v1.platform import ops_types
from lmcache.v1.platform.base.block_transfer import BlockTransferPlan, plan_block_transfer

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from lmcache.v1.platform.ops_types import EngineKVFormat, TransferDirection

    #: A native module's own ``EngineKVFormat`` or a plain int is accepted too.
    KVFormatLike: TypeAlias = EngineKVFormat | int
    #: Engine KV operand: per-layer tensors, kv lists, ``(K, V)``/plane tuples, one
    #: cross-layer tensor, or (pointer mode) a 1-D int64 tensor of device addresses.
    PagedKVOperand: TypeAlias = Tensor | Sequence[Any]
    #: LMCache chunks: host tensors (tensor mode) or host addresses (pointer mode).
    HostChunks: TypeAlias = Sequence[Tensor] | Sequence[int]
    BlockIds: TypeAlias = Tensor | Sequence[int]
    DeviceLike: TypeAlias = torch.device | str

logger = init_logger(__name__)

# The plugin API of this module (logger and the private helpers are not part of it).
__all__ = [
    "DEFAULT_MAX_OBJECTS_PER_CALL",
    "DEVICE_OP_NAMES",
    "DeviceOps",
    "StreamWaitRecorders",
    "resolve_kv_transfer_operands",
]

# Every op a DeviceOps declares (and torch_ops mirrors); docs/design/platform.md lists them.
DEVICE_OP_NAMES: tuple[str, ...] = (
    "multi_layer_block_kv_transfer",
    "multi_layer_kv_transfer",
    "lmcache_memcpy_async",
    "calculate_cdf",
    "alloc_pinned_ptr",
    "free_pinned_ptr",
    "alloc_pinned_numa_ptr",
    "free_pinned_numa_ptr",
    "alloc_numa_ptr",
    "free_numa_ptr",
    "alloc_hugepage_pinned_ptr",
    "free_hugepage_pinned_ptr",
    "alloc_hugepage_pinned_numa_ptr",
    "free_hugepage_pinned_numa_ptr",
    "alloc_shm_pinned_ptr",
    "free_shm_pinned_ptr",
    "batched_memcpy",
    "tensor_from_ptr",
    "record_completion_on_stream",
    "drain_recorded_completions",
    "record_event_on_stream",
    "drain_recorded_events",
    "multi_layer_kv_transfer_unilateral",
    "single_layer_kv_transfer",
    "single_layer_kv_transfer_sgl",
    "load_and_reshape_flash",
    "reshape_and_cache_back_flash",
    "encode_fast_new",
    "decode_fast_new",
    "decode_fast_prefsum",
    "rotary_embedding_k_fused",
    "rotary_embedding_k_fused_strided",
    "get_gpu_pci_bus_id",
)
"""Names of every op a ``DeviceOps`` declares and ``torch_ops`` mirrors, in doc order."""

DEFAULT_MAX_OBJECTS_PER_CALL = 4
"""Chunks per pointer-mode transfer call when the ops do not set ``max_objects_per_call``."""


def _t() -> Any:
    # Lazy: importing DeviceOps must not import torch (device specs import this cheaply).
    from lmcache.v1.platform import torch_ops

    return torch_ops


_Op = TypeVar("_Op", bound=Callable[..., Any])


def _forwards_to_baseline(method: _Op) -> _Op:
    """The body of a declared op: call the same-named ``torch_ops`` function with the
    caller's arguments. The decorated method stays the op's declaration (signature and
    docstring, which ``inspect.signature`` and ``help`` show); ``torch_ops`` is looked up
    at call time because importing DeviceOps must not import torch."""
    name = method.__name__

    @functools.wraps(method)
    def forward(self: DeviceOps, *args: Any, **kwargs: Any) -> Any:
        return getattr(_t(), name)(*args, **kwargs)

    return cast(_Op, forward)


class DeviceOps:
    """Strategy base: every op delegates to the torch baseline.

    Subclass it, set ``device_type`` and ``kv_transfer_operands``, override what differs,
    and bind native code in ``ensure_native``. A vendor override that falls back calls the
    ``torch_ops`` function directly (not ``super()``), so the fallback keeps the baseline's
    semantics even under a bound native module.
    """

    #: Informational only (the registry keys on specs); shows up in messages.
    device_type: ClassVar[str] = ""
    #: Operands of ``multi_layer_block_kv_transfer``: ``"tensor"`` (tensors, all chunks in
    #: one call) or ``"pointer"`` (int addresses, at most ``max_objects_per_call`` chunks
    #: per call). None = inferred by ``resolve_kv_transfer_operands``; set it explicitly.
    kv_transfer_operands: ClassVar[str | None] = None
    #: Pointer-mode batch limit; None = 4 (0.5.6's CUDA kernel limit).
    max_objects_per_call: ClassVar[int | None] = None

    PageBufferShapeDesc = ops_types.PageBufferShapeDesc
    StagingCopy = ops_types.StagingCopy
    LaunchVar = ops_types.LaunchVar
    BatchStep = ops_types.BatchStep
    KernelGroupSpec = ops_types.KernelGroupSpec

    def __init__(self) -> None:
        """No arguments: ``DeviceSpec.get_ops()`` builds the one instance per backend."""
        self._native_bound = False

    def __getattr__(self, name: str) -> Any:
        # Only reached for names found nowhere else: optional native-only symbols.
        raise AttributeError(f"{type(self).__name__} has no device operation '{name}'")

    # ---- native binding ------------------------------------------------------------
    def ensure_native(self) -> None:
        """Bind the backend's native module, if any; the base is a no-op (pure baseline).

        Called exactly once per instance, by ``DeviceSpec.get_ops()`` under its singleton
        lock, before any op runs. Set ``self._native_bound = True`` before trying (one
        attempt per instance), import the module and call ``self.bind_native(module)``.
        Soft fail is the norm: on ``ImportError``/``OSError`` log a warning naming the
        module and stay on the baseline. Raise only when the baseline would be unsafe on
        this device (pointers in a foreign address space); ``get_ops()`` then propagates
        the error with the backend named and caches nothing.
        """
        return None

    def bind_native(self, module: Any) -> None:
        """Overlay ``module``'s public callables and types on this instance only.

        Names starting with ``_``, ``None`` values, sub-modules and constants are skipped.
        Bound functions are called without ``self`` and must take exactly the baseline's
        positional arguments. An exported ``EngineKVFormat`` also becomes
        ``self.GPUKVFormat``. Logs the counts at DEBUG.
        """
        n_ops = n_types = 0
        for name in dir(module):
            if name.startswith("_"):
                continue
            sym = getattr(module, name, None)
            if sym is None or inspect.ismodule(sym):
                continue
            if isinstance(sym, type):
                setattr(self, name, sym)
                n_types += 1
            elif callable(sym):
                setattr(self, name, sym)
                n_ops += 1
        exported = getattr(module, "EngineKVFormat", None)
        if isinstance(exported, type):
            self.GPUKVFormat = exported
        logger.debug(
            "bind_native: %s <- %s (%d ops, %d types)",
            type(self).__name__,
            getattr(module, "__name__", repr(module)),
            n_ops,
            n_types,
        )

    def set_shape_desc_dtype(
        self, shape_desc: ops_types.PageBufferShapeDesc, dtype: torch.dtype
    ) -> None:
        """Set the KV dtype on ``shape_desc`` (native shape descriptors need a setter)."""
        shape_desc.dtype = dtype

    # ---- required ops ------------------------------------------------------------------
    # Every op below is called on the thread that does the copy: the worker's own thread
    # in engine_driven mode, the server's per-worker transfer thread in lmcache_driven mode
    # (one thread per worker, so one backend instance sees concurrent calls from several
    # workers). A native override receives exactly these positional arguments, without
    # ``self``. Validation errors are ``ValueError`` naming the bad value; an operand kind
    # the backend cannot handle is ``ValueError``/``NotImplementedError`` naming the
    # backend, never a silent host-pointer fallback.
    def multi_layer_block_kv_transfer(
        self,
        paged_buffer_ptrs_tensor: PagedKVOperand,
        lmcache_objects_ptrs: HostChunks,
        block_ids: BlockIds,
        device: DeviceLike,
        direction: TransferDirection,
        shape_desc: ops_types.PageBufferShapeDesc,
        lmcache_chunk_size: int,
        engine_kv_format: KVFormatLike,
        skip_prefix_n_blocks: int,
    ) -> None:
        """Copy whole paged KV blocks between the engine's cache and LMCache chunks.

        The hot path of both transfer modes. ``block_ids`` is the flat list of engine
        block ids in token order; chunk ``i`` of ``lmcache_objects_ptrs`` covers blocks
        ``[i*bpo, (i+1)*bpo)`` with ``bpo = lmcache_chunk_size // shape_desc.bs`` (the last
        chunk may be partial). The first ``skip_prefix_n_blocks`` blocks of the *flat*
        list are neither read (H2D) nor written (D2H); a chunk with nothing left in range is
        not touched. Chunks use the canonical token-major host layout, byte-identical to
        L2 data.

        Operands: ``paged_buffer_ptrs_tensor`` is the per-layer tensors (or kv lists,
        ``(K, V)`` tuples, one cross-layer tensor) or, in pointer mode, a 1-D int64 tensor
        of device addresses; ``lmcache_objects_ptrs`` is host chunk tensors or host
        addresses (see ``kv_transfer_operands``). The caller owns every buffer and keeps
        it alive until the copy is complete: D2H may be asynchronous, so the caller
        synchronizes the device or stream before reading or freeing a chunk.
        """
        self.transfer_blocks(
            plan_block_transfer(
                paged_buffer_ptrs_tensor,
                lmcache_objects_ptrs,
                block_ids,
                device,
                direction,
                shape_desc,
                lmcache_chunk_size,
                engine_kv_format,
                skip_prefix_n_blocks,
            )
        )

    @_forwards_to_baseline
    def transfer_blocks(self, plan: BlockTransferPlan) -> None:
        """Run a checked ``multi_layer_block_kv_transfer`` (see ``base.block_transfer``).
        Backends override this rather than the nine-argument op; the default is the torch
        baseline."""

    @_forwards_to_baseline
    def multi_layer_kv_transfer(
        self,
        key_value: Tensor,
        key_value_ptrs: PagedKVOperand,
        slot_mapping: Tensor,
        paged_memory_device: DeviceLike,
        page_buffer_size: int,
        direction: TransferDirection,
        engine_kv_format: KVFormatLike,
        block_size: int = 0,
        head_size: int = 0,
        skip_prefix_n_tokens: int = 0,
        block_stride_elems: int = 0,
    ) -> None:
        """Legacy per-token copy: ``key_value`` (``[2, NL, T, hidden]``, MLA
        ``[1, NL, T, hidden]``) to/from the slots ``slot_mapping[t]`` of the paged cache;
        negative slots and the first ``skip_prefix_n_tokens`` tokens are skipped. D2H is
        synchronous. HND formats need ``block_size``/``head_size``; unsupported formats
        raise ``NotImplementedError`` naming the format."""

    @_forwards_to_baseline
    def lmcache_memcpy_async(
        self,
        dest: Tensor | int,
        src: Tensor | int,
        nbytes: int,
        direction: TransferDirection,
        host_buffer_offset: int,
        host_buffer_alignments: int,
    ) -> None:
        """Copy ``nbytes`` between a device buffer and host memory, stream-ordered.

        Both operands are tensors or both are raw addresses (mixed: ``TypeError``).
        ``host_buffer_offset`` is the host address's offset from its allocation base and
        ``host_buffer_alignments`` (a power of two) the pinning granularity a copy must not
        straddle. The baseline copies raw pointers only on a CPU-only process; a backend
        that can see device pointers overrides it. The caller synchronizes before using
        the destination."""

    @_forwards_to_baseline
    def calculate_cdf(self, input_tensor: Tensor, num_bins: int) -> Tensor:
        """Per (layer, channel) 16-bit CDF of symbol ids over tokens:
        ``[NL, T, C]`` in, ``[NL, C, num_bins + 1]`` int16 out (KV compression)."""

    # Host allocators: page-aligned, zero-filled; pinned when the device runtime allows
    # (falls back to unpinned with one warning). Each alloc_* returns an address that stays
    # valid until the matching free_* (an unknown address is logged and ignored).
    @_forwards_to_baseline
    def alloc_pinned_ptr(self, size: int, device_id: int = 0) -> int:
        """Allocate ``size`` bytes of (pinned when possible) host memory; the address."""

    @_forwards_to_baseline
    def free_pinned_ptr(self, ptr: int) -> None:
        """Free memory from ``alloc_pinned_ptr``."""

    @_forwards_to_baseline
    def alloc_pinned_numa_ptr(self, size: int, numa_id: int = 0) -> int:
        """Like ``alloc_pinned_ptr``, preferring NUMA node ``numa_id``."""

    @_forwards_to_baseline
    def free_pinned_numa_ptr(self, ptr: int, size: int | None = None) -> None:
        """Free memory from ``alloc_pinned_numa_ptr``."""

    @_forwards_to_baseline
    def alloc_numa_ptr(self, size: int, numa_id: int = 0) -> int:
        """Alias of ``alloc_pinned_numa_ptr`` (0.5.6 name)."""

    @_forwards_to_baseline
    def free_numa_ptr(self, ptr: int, size: int | None = None) -> None:
        """Free memory from ``alloc_numa_ptr``."""

    @_forwards_to_baseline
    def alloc_hugepage_pinned_ptr(self, size: int, device_id: int = 0) -> int:
        """Hugepage-backed pinned memory; the baseline warns and uses ``alloc_pinned_ptr``."""

    @_forwards_to_baseline
    def free_hugepage_pinned_ptr(self, ptr: int, size: int = 0) -> None:
        """Free memory from ``alloc_hugepage_pinned_ptr``."""

    @_forwards_to_baseline
    def alloc_hugepage_pinned_numa_ptr(self, size: int, numa_id: int = 0) -> int:
        """NUMA-local hugepage memory; the baseline warns and falls back."""

    @_forwards_to_baseline
    def free_hugepage_pinned_numa_ptr(self, ptr: int, size: int = 0) -> None:
        """Free memory from ``alloc_hugepage_pinned_numa_ptr``."""

    @_forwards_to_baseline
    def alloc_shm_pinned_ptr(self, size: int, shm_name: str = "") -> int:
        """POSIX shared memory named ``shm_name`` (a stale segment of that name is
        replaced), pinned through the current device spec when possible."""

    @_forwards_to_baseline
    def free_shm_pinned_ptr(self, ptr: int, size: int = 0, shm_name: str = "") -> None:
        """Unpin, close and unlink memory from ``alloc_shm_pinned_ptr``."""

    @_forwards_to_baseline
    def batched_memcpy(
        self, src_ptrs: Sequence[int], dst_ptrs: Sequence[int], sizes: Sequence[int]
    ) -> None:
        """Host-to-host ``memmove`` of ``sizes[i]`` bytes for each pair (lists of equal
        length, else ``ValueError``; non-positive sizes are skipped)."""

    def tensor_from_ptr(
        self, ptr: int, shape: Sequence[int], dtype: torch.dtype, device: DeviceLike | None = None
    ) -> Tensor:
        """A tensor viewing memory at ``ptr`` in this backend's address space, without
        copying or owning it: the caller keeps the memory alive while the tensor is used.
        Only the backend knows its address space, so the base raises ``ValueError``."""
        raise ValueError(
            f"Device backend {self.device_type or type(self).__name__!r} does not support tensor construction from raw pointers."
        )

    # Stream-ordered recorders: publish a record once the work queued on the stream so far
    # has finished (the baseline synchronizes first on an accelerator). Handle 0 = the
    # current device's default stream. Draining is atomic: each record is returned once.
    @_forwards_to_baseline
    def record_completion_on_stream(self, cuda_stream_ptr: int, kind: Any, payload: bytes) -> None:
        """Queue ``(kind, payload)`` for ``drain_recorded_completions``."""

    @_forwards_to_baseline
    def drain_recorded_completions(self) -> list[tuple[Any, bytes]]:
        """Return and clear every recorded ``(kind, payload)``, in record order."""

    @_forwards_to_baseline
    def record_event_on_stream(
        self,
        cuda_stream_ptr: int,
        event_type_name: str,
        session_id: Any,
        str_metadata: Any,
        int_metadata: Any,
    ) -> None:
        """Queue a timestamped event record for ``drain_recorded_events``."""

    @_forwards_to_baseline
    def drain_recorded_events(self) -> list[tuple[Any, Any, float, Any, Any]]:
        """Return and clear every ``(type, session, timestamp, str_md, int_md)`` record."""

    # ---- LATER ops: the baseline raises NotImplementedError naming the op; a native
    # module bound by ensure_native() may provide them with the same signature. --------
    @_forwards_to_baseline
    def multi_layer_kv_transfer_unilateral(
        self,
        key_value: Tensor,
        key_value_ptrs: PagedKVOperand,
        slot_mapping: Tensor,
        paged_memory_device: DeviceLike,
        page_buffer_size: int,
        direction: TransferDirection,
        engine_kv_format: KVFormatLike,
    ) -> None:
        """One-direction variant of ``multi_layer_kv_transfer`` (native only)."""

    @_forwards_to_baseline
    def single_layer_kv_transfer(
        self,
        lmc_key_value_cache: Tensor,
        vllm_key_value_cache: Tensor,
        slot_mapping: Tensor,
        direction: TransferDirection,
        engine_kv_format: KVFormatLike,
        token_major: bool = False,
    ) -> None:
        """Per-layer copy for layerwise pipelines (native only)."""

    @_forwards_to_baseline
    def single_layer_kv_transfer_sgl(
        self,
        lmc_key_value_cache: Tensor,
        sgl_key_cache: Tensor,
        sgl_value_cache: Tensor,
        slot_mapping: Tensor,
        direction: TransferDirection,
        token_major: bool = False,
    ) -> None:
        """Per-layer copy against SGLang's separate K and V caches (native only)."""

    @_forwards_to_baseline
    def load_and_reshape_flash(
        self,
        key_value: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        slot_mapping: Tensor,
        layer_idx: int,
    ) -> None:
        """Flash-attention layout load (native only)."""

    @_forwards_to_baseline
    def reshape_and_cache_back_flash(
        self,
        key_value: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        slot_mapping: Tensor,
        layer_idx: int,
    ) -> None:
        """Flash-attention layout store (native only)."""

    @_forwards_to_baseline
    def encode_fast_new(
        self, cdf: Tensor, input_sym: Tensor, output_buffer: Tensor, output_lengths: Tensor
    ) -> None:
        """Arithmetic-coding encoder for KV compression (native only)."""

    @_forwards_to_baseline
    def decode_fast_new(
        self, cdf: Tensor, bytestreams: Tensor, lengths: Tensor, output: Tensor
    ) -> None:
        """Arithmetic-coding decoder (native only)."""

    @_forwards_to_baseline
    def decode_fast_prefsum(
        self, cdf: Tensor, bytestreams: Tensor, lengths_prefsum: Tensor, output: Tensor
    ) -> None:
        """Arithmetic-coding decoder over prefix-summed lengths (native only)."""

    @_forwards_to_baseline
    def rotary_embedding_k_fused(
        self,
        old_positions: Tensor,
        new_positions: Tensor,
        key: Tensor,
        head_size: int,
        cos_sin_cache: Tensor,
        is_neox: bool,
    ) -> None:
        """Re-rotate cached keys to new positions (CacheBlend; native only)."""

    @_forwards_to_baseline
    def rotary_embedding_k_fused_strided(
        self,
        old_positions: Tensor,
        new_positions: Tensor,
        key: Tensor,
        head_size: int,
        head_stride: int,
        cos_sin_cache: Tensor,
        is_neox: bool,
    ) -> None:
        """Strided variant of ``rotary_embedding_k_fused`` (native only)."""

    @_forwards_to_baseline
    def get_gpu_pci_bus_id(self, device_id: int = 0) -> str | None:
        """PCI bus id of device ``device_id`` (native only)."""


class StreamWaitRecorders(DeviceOps):
    """Stream-ordered recorders for a backend without stream callbacks (MLU, MUSA): wait
    until the work queued on the given stream of ``torch.<device_type>`` has finished, then
    publish through the baseline. A non-zero handle is the caller's stream (borrowed through
    ``ExternalStream``); handle 0 is the module's ``zero_handle_stream()``."""

    #: What handle 0 names: ``"default_stream"`` or ``"current_stream"`` of the module.
    zero_handle_stream: ClassVar[str] = "default_stream"

    def _wait_stream(self, handle: int) -> None:
        import torch

        module = getattr(torch, self.device_type)
        if handle:
            stream = module.ExternalStream(int(handle))
        else:
            stream = getattr(module, self.zero_handle_stream)()
        stream.synchronize()

    def record_completion_on_stream(self, cuda_stream_ptr: int, kind: Any, payload: bytes) -> None:
        self._wait_stream(cuda_stream_ptr)
        _t().record_completion_on_stream(0, kind, payload)

    def record_event_on_stream(
        self,
        cuda_stream_ptr: int,
        event_type_name: str,
        session_id: Any,
        str_metadata: Any,
        int_metadata: Any,
    ) -> None:
        self._wait_stream(cuda_stream_ptr)
        _t().record_event_on_stream(0, event_type_name, session_id, str_metadata, int_metadata)


def resolve_kv_transfer_operands(ops: Any) -> tuple[str, int | None]:
    """Operand mode for ``multi_layer_block_kv_transfer``.

    Returns ``("tensor", None)`` (all objects in one call) or ``("pointer", n)`` (at most
    ``n`` objects per call). Order: the ops' ``kv_transfer_operands`` attribute; tensor
    when the bound op is the baseline; else 0.5.6's annotation rule.
    """
    declared = getattr(ops, "kv_transfer_operands", None)
    mode: str | None = None
    if declared is not None:
        if declared not in ("tensor", "pointer"):
            raise ValueError(
                f"{type(ops).__name__}.kv_transfer_operands={declared!r}: "
                "expected 'tensor' or 'pointer'"
            )
        mode = declared
    else:
        op = ops.multi_layer_block_kv_transfer
        func = getattr(op, "__func__", op)
        if func is DeviceOps.multi_layer_block_kv_transfer:  # also torch_ops' (a bound method)
            mode = "tensor"
        else:
            mode = "pointer"
            try:
                param = inspect.signature(op).parameters.get("lmcache_objects_ptrs")
            except (TypeError, ValueError):
                param = None
            if param is not None and param.annotation is not inspect.Parameter.empty:
                ann = param.annotation
                text = ann if isinstance(ann, str) else str(ann)
                if "Tensor" in text:
                    mode = "tensor"
    if mode == "tensor":
        return "tensor", None
    limit = getattr(ops, "max_objects_per_call", None)
    return "pointer", int(limit) if limit else DEFAULT_MAX_OBJECTS_PER_CALL
