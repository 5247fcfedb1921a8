"""``MusaDeviceOps``: method overrides over the torch baseline (no native module).

Overrides exactly ``tensor_from_ptr``, ``lmcache_memcpy_async`` (``DeviceViewOps``),
``record_completion_on_stream``, ``record_event_on_stream`` (``StreamWaitRecorders``) and
``transfer_blocks`` (the body of ``multi_layer_block_kv_transfer``;
docs/design/platform.md#device-musa). Fallbacks call
``lmcache.v1.platform.torch_ops`` directly.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, ClassVar

from lmcache.v1.platform import torch_ops
from lmcache.v1.platform.api import DeviceViewOps, init_logger
from lmcache.v1.platform.base.block_transfer import BlockTransferPlan
from lmcache.v1.platform.base.device_ops import StreamWaitRecorders
from lmcache.v1.platform.ops_types import EngineKVFormat

logger = init_logger(__name__)

NATIVE_KV_TRANSFER_ENV_VAR = "LMCACHE_MUSA_NATIVE_KV_TRANSFER"
# The optional vendor kernel module and the ABI version of its LMCache entry point:
#   musa_aiter.LMCACHE_KV_TRANSFER_ABI == 1
#   musa_aiter.lmcache_multi_layer_block_kv_transfer(paged_kv, objects, block_ids,
#       direction, engine_kv_format, lmcache_chunk_size, skip_prefix_n_blocks) -> None
# (paged_kv: list of MUSA tensors as the baseline takes them; block_ids: int64 tensor on
#  the device; direction/format as ints).
AITER_MODULE = "musa_aiter"
AITER_ABI = 1

SUPPORTED_FORMATS = (
    EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,  # 1
    EngineKVFormat.NL_X_NB_BS_HS,  # 3
    EngineKVFormat.TWO_X_NL_X_NB_BS_NH_HS,  # 9
)


class MusaDeviceOps(StreamWaitRecorders, DeviceViewOps):
    device_type: ClassVar[str] = "musa"
    kv_transfer_operands: ClassVar[str | None] = "tensor"
    # Recorders (StreamWaitRecorders): handle 0 is the current MUSA stream.
    zero_handle_stream: ClassVar[str] = "current_stream"

    def __init__(self) -> None:
        super().__init__()
        self._aiter_warned = False

    # ---- raw pointers ----------------------------------------------------------------
    def tensor_from_ptr(self, ptr, shape, dtype, device=None):
        """Non-owning view of ``ptr`` on ``device`` (default: the current MUSA device)."""
        import torch

        if not ptr:
            raise ValueError("tensor_from_ptr: ptr must be a non-zero device address")
        dev = torch.device(device) if device is not None else self._current_device()
        shape = tuple(int(s) for s in shape)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        storage = torch._C._construct_storage_from_data_pointer(int(ptr), dev, nbytes)
        return torch.empty(0, dtype=dtype, device=dev).set_(storage, 0, shape)

    def _current_device(self) -> Any:
        import torch

        return torch.device("musa", torch.musa.current_device())

    # ---- block transfer ------------------------------------------------------------------
    def transfer_blocks(self, plan: BlockTransferPlan) -> None:
        plan.require_format("MUSA", SUPPORTED_FORMATS)
        if torch_ops.is_pointer_tensor(plan.paged):
            plan = plan.replace(paged=self._rebuild_paged(plan))
        if os.environ.get(NATIVE_KV_TRANSFER_ENV_VAR, "").strip() == "1" and self._try_aiter(plan):
            return None
        return torch_ops.transfer_blocks(plan)

    def _rebuild_paged(self, plan: BlockTransferPlan) -> list:
        """Device addresses -> MUSA tensors of the format's per-pointer shape."""
        sd, fmt = plan.shape_desc, plan.engine_kv_format
        if int(getattr(sd, "block_stride_elems", 0) or 0):
            raise NotImplementedError(
                "MUSA pointer operands need tight blocks (shape_desc.block_stride_elems == 0)"
            )
        dtype = torch_ops.infer_pointer_dtype(sd, plan.objects)
        nb, bs, nh, hs = int(sd.nb), int(sd.bs), int(sd.nh), int(sd.hs)
        if fmt == EngineKVFormat.NL_X_TWO_NB_BS_NH_HS:
            shape: tuple[int, ...] = (2, nb, bs, nh, hs)
        elif fmt == EngineKVFormat.NL_X_NB_BS_HS:
            shape = (nb, bs, hs)
        else:  # kv_list #9: 2*NL pointers, K layers then V layers
            shape = (nb, bs, nh, hs)
        ptrs = plan.paged.tolist()
        return [self.tensor_from_ptr(int(p), shape, dtype, plan.device) for p in ptrs]

    def _try_aiter(self, plan: BlockTransferPlan) -> bool:
        """The optional musa_aiter kernel; False (after one WARNING) means use torch."""
        import torch

        try:
            module = importlib.import_module(AITER_MODULE)
        except ImportError as exc:
            self._warn_aiter(f"{AITER_MODULE} is not importable ({exc})")
            return False
        if getattr(module, "LMCACHE_KV_TRANSFER_ABI", None) != AITER_ABI:
            self._warn_aiter(
                f"{AITER_MODULE} offers LMCache KV-transfer ABI "
                f"{getattr(module, 'LMCACHE_KV_TRANSFER_ABI', None)!r}, need {AITER_ABI}"
            )
            return False
        fn = getattr(module, "lmcache_multi_layer_block_kv_transfer", None)
        if fn is None:
            self._warn_aiter(f"{AITER_MODULE} has no lmcache_multi_layer_block_kv_transfer")
            return False
        if isinstance(plan.block_ids, torch.Tensor):
            ids = plan.block_ids.reshape(-1).to(dtype=torch.int64)
        else:
            ids = torch.as_tensor(list(plan.block_ids), dtype=torch.int64)
        paged = plan.paged
        first = paged[0] if isinstance(paged, (list, tuple)) else paged
        if isinstance(first, (list, tuple)):
            first = first[0]
        ids = ids.to(first.device)
        try:
            fn(
                paged,
                list(plan.objects),
                ids,
                int(plan.direction),
                int(plan.engine_kv_format),
                plan.chunk_size,
                plan.skip_blocks,
            )
        except Exception as exc:
            self._warn_aiter(f"{AITER_MODULE} transfer failed ({exc!r})")
            return False
        return True

    def _warn_aiter(self, reason: str) -> None:
        if not self._aiter_warned:
            self._aiter_warned = True
            logger.warning(
                "%s=1 but the native MUSA KV transfer is unusable: %s; using the torch path",
                NATIVE_KV_TRANSFER_ENV_VAR,
                reason,
            )
