"""``MluDeviceOps``: KV-block transfers for Cambricon MLU with torch_mlu tensor ops.

Supported: ``multi_layer_block_kv_transfer`` with real per-layer tensors in K/V-first
NHD ``[2, NB, BS, NH, HS]`` (#1), K/V-first HND ``[2, NB, NH, BS, HS]`` (#6) and MLA
``[NB, BS, HS]`` (#3), to and from canonical token-major host chunks
(docs/design/storage-formats.md#host-chunk, the skip and partial-chunk rules of
docs/design/platform.md#block-transfer), and tensor-mode ``lmcache_memcpy_async``. Everything that
would treat MLU addresses as host pointers raises instead.
"""

from __future__ import annotations

from typing import Any, ClassVar

from lmcache.v1.platform import torch_ops
from lmcache.v1.platform.base.block_transfer import BlockTransferPlan
from lmcache.v1.platform.base.device_ops import StreamWaitRecorders
from lmcache.v1.platform.ops_types import EngineKVFormat

F = EngineKVFormat
SUPPORTED_FORMATS = (F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_BS_HS)


def _unsupported(op: str) -> NotImplementedError:
    return NotImplementedError(
        f"{op} is not supported by the mlu backend (legacy in-process transfer); use the "
        "multiprocess engine-driven path (multi_layer_block_kv_transfer)"
    )


# The legacy in-process transfers, refused (they would need MLU kernels).
_REFUSED_OPS = (
    "multi_layer_kv_transfer",
    "multi_layer_kv_transfer_unilateral",
    "single_layer_kv_transfer",
    "single_layer_kv_transfer_sgl",
    "load_and_reshape_flash",
    "reshape_and_cache_back_flash",
)


def _refused(op: str) -> Any:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise _unsupported(op)

    refuse.__name__ = op
    refuse.__qualname__ = f"MluDeviceOps.{op}"
    return refuse


class MluDeviceOps(StreamWaitRecorders):
    device_type: ClassVar[str] = "mlu"
    kv_transfer_operands: ClassVar[str | None] = "tensor"
    # Recorders (StreamWaitRecorders): handle 0 is the current device's default queue.
    zero_handle_stream: ClassVar[str] = "default_stream"

    # ensure_native: inherited no-op (no native kernels for MLU).

    # ---- refused entry points (and _REFUSED_OPS, set below the class) --------------------
    def tensor_from_ptr(self, ptr, shape, dtype, device=None):
        raise ValueError(
            "Device backend 'mlu' does not support tensor construction from raw pointers "
            f"(ptr={ptr!r}); pass real MLU tensors"
        )

    def lmcache_memcpy_async(
        self, dest, src, nbytes, direction, host_buffer_offset, host_buffer_alignments
    ):
        if isinstance(dest, int) or isinstance(src, int):
            raise ValueError(
                "lmcache_memcpy_async with raw pointers is not supported by the mlu backend "
                f"(dest={dest!r}, src={src!r}); pass tensors"
            )
        return torch_ops.lmcache_memcpy_async(
            dest, src, nbytes, direction, host_buffer_offset, host_buffer_alignments
        )

    # ---- block transfer --------------------------------------------------------------------
    def transfer_blocks(self, plan: BlockTransferPlan) -> None:
        import torch

        plan.require_format("mlu", SUPPORTED_FORMATS)
        fmt = plan.engine_kv_format
        layers = self._layers(plan.paged, fmt)
        objects = list(plan.objects)
        for i, obj in enumerate(objects):
            if not isinstance(obj, torch.Tensor):
                raise ValueError(
                    f"mlu multi_layer_block_kv_transfer needs host chunk tensors; lmcache "
                    f"object {i} is {type(obj).__name__} (raw pointers are not supported)"
                )
        bs = int(layers[0].shape[_BS_AXIS[fmt]])
        dev = layers[0].device
        if isinstance(plan.block_ids, torch.Tensor):
            ids = plan.block_ids.reshape(-1).to(device=dev, dtype=torch.long)
        else:
            ids = torch.as_tensor(list(plan.block_ids), dtype=torch.long, device=dev)
        for span in plan.chunk_spans(int(ids.numel()), bs):
            rows = self._host_rows(objects[span.index], fmt, layers, plan.chunk_size, span.index)
            host = rows[..., span.first_token : span.first_token + span.num_tokens, :]
            idx = ids[span.blocks]
            if plan.d2h:
                self._store(layers, fmt, idx, host, dev)
            else:
                self._load(layers, fmt, idx, host)
        return None

    @staticmethod
    def _layers(paged: Any, fmt: EngineKVFormat) -> list:
        import torch

        if torch_ops.is_pointer_tensor(paged):
            raise ValueError(
                "mlu multi_layer_block_kv_transfer does not accept pointer operands "
                "(a 1-D tensor of device addresses); pass the per-layer MLU tensors"
            )
        if isinstance(paged, torch.Tensor):
            raise ValueError(
                f"mlu multi_layer_block_kv_transfer needs a list of per-layer tensors for "
                f"{fmt.name}, got one tensor of shape {tuple(paged.shape)}"
            )
        layers = list(paged)
        want = 3 if fmt == F.NL_X_NB_BS_HS else 5
        for i, t in enumerate(layers):
            if not isinstance(t, torch.Tensor) or t.dim() != want:
                raise ValueError(
                    f"mlu {fmt.name}: layer {i} must be a {want}-D tensor, got "
                    f"{getattr(t, 'shape', type(t).__name__)}"
                )
        if not layers:
            raise ValueError("mlu multi_layer_block_kv_transfer: no KV layers given")
        return layers

    @staticmethod
    def _host_rows(obj: Any, fmt: EngineKVFormat, layers: list, chunk: int, index: int) -> Any:
        """The chunk viewed as [2, NL, T, W] (K/V formats) or [NL, T, W] (MLA)."""
        nl = len(layers)
        t = layers[0]
        width = _width(t, fmt)
        shape = (nl, chunk, width) if fmt == F.NL_X_NB_BS_HS else (2, nl, chunk, width)
        if obj.numel() != _numel(shape) or obj.dtype.itemsize != t.dtype.itemsize:
            raise ValueError(
                f"lmcache object {index} has shape {tuple(obj.shape)} ({obj.dtype}); "
                f"expected {shape} with {t.dtype.itemsize}-byte elements"
            )
        if obj.dtype != t.dtype:
            obj = obj.view(t.dtype)
        return obj.view(shape)

    @staticmethod
    def _gather_layer(t: Any, fmt: EngineKVFormat, idx: Any) -> Any:
        """Device rows of the selected blocks: [2, nblk*BS, W] or [nblk*BS, W]."""
        if fmt == F.NL_X_NB_BS_HS:
            return t.index_select(0, idx).reshape(-1, t.shape[2])
        g = t.index_select(1, idx)  # [2, nblk, ...]
        if fmt == F.NL_X_TWO_NB_NH_BS_HS:  # HND -> token-major, head-major rows
            g = g.permute(0, 1, 3, 2, 4)
        return g.reshape(2, -1, _width(t, fmt))

    def _store(self, layers: list, fmt: EngineKVFormat, idx: Any, host: Any, dev: Any) -> None:
        import torch

        rows = [self._gather_layer(t, fmt, idx) for t in layers]
        src = torch.stack(rows, dim=0 if fmt == F.NL_X_NB_BS_HS else 1)
        if host.is_contiguous():
            host.copy_(src, non_blocking=True)
            return
        # Some torch_mlu versions return wrong data from an asynchronous strided D2H copy
        # even after synchronization: copy blocking, then wait on the queue.
        host.copy_(src, non_blocking=False)
        self._wait_queue(dev)

    @staticmethod
    def _wait_queue(dev: Any) -> None:
        import torch

        mlu = getattr(torch, "mlu", None)
        if mlu is None:  # CPU-only transfer matrix without torch_mlu: nothing is queued
            return
        stream = mlu.current_stream(dev) if dev.type == "mlu" else mlu.current_stream()
        stream.synchronize()

    @staticmethod
    def _load(layers: list, fmt: EngineKVFormat, idx: Any, host: Any) -> None:
        nblk = int(idx.numel())
        for layer, t in enumerate(layers):
            if fmt == F.NL_X_NB_BS_HS:
                src = host[layer].to(t.device, non_blocking=True).view(nblk, t.shape[1], t.shape[2])
                t.index_copy_(0, idx, src)
                continue
            rows = host[:, layer].to(t.device, non_blocking=True)
            if fmt == F.NL_X_TWO_NB_NH_BS_HS:
                nh, bs, hs = t.shape[2], t.shape[3], t.shape[4]
                src = rows.reshape(2, nblk, bs, nh, hs).permute(0, 1, 3, 2, 4)
            else:
                src = rows.reshape(2, nblk, t.shape[2], t.shape[3], t.shape[4])
            t.index_copy_(1, idx, src)


for _op in _REFUSED_OPS:
    setattr(MluDeviceOps, _op, _refused(_op))

_BS_AXIS = {F.NL_X_TWO_NB_BS_NH_HS: 2, F.NL_X_TWO_NB_NH_BS_HS: 3, F.NL_X_NB_BS_HS: 1}


def _width(t: Any, fmt: EngineKVFormat) -> int:
    """Token-row width of the host chunk: NH*HS (HS for MLA)."""
    if fmt == F.NL_X_NB_BS_HS:
        return int(t.shape[2])
    if fmt == F.NL_X_TWO_NB_NH_BS_HS:
        return int(t.shape[2] * t.shape[4])
    return int(t.shape[3] * t.shape[4])


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
