"""``fault_inject`` L2 type (test-only, docs/design/storage-engine.md#backend-fault-inject): wraps
an inner adapter and drops load bits.

Everything delegates to the inner adapter; only load results change. Position i of an n-key
load is dropped when i is in ``gap_indices``, when ``i == round((1-r)(n-1))`` for some r in
``gap_tail_ratios``, or when the key's blake2b bucket falls under ``rate``.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.utils import init_logger
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.l2_adapters.base import L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.distributed.l2_adapters.hookspecs import L2AdapterTypeSpec, hookimpl
from lmcache.v1.distributed.l2_adapters.registry import default_l2_adapter_registry
from lmcache.v1.distributed.l2_adapters.wrapping import WrappingL2Adapter
from lmcache.v1.memory_management import MemoryObj

logger = init_logger(__name__)

_BUCKETS = 1_000_000


@dataclass
class FaultInjectL2AdapterConfig(L2AdapterConfigBase):
    type_name = "fault_inject"

    inner: L2AdapterConfigBase
    rate: float = 0.0
    seed: int = 0
    gap_indices: list[int] = field(default_factory=list)
    gap_tail_ratios: list[float] = field(default_factory=list)
    inner_type: str = ""

    known_fields = frozenset({"inner", "rate", "seed", "gap_indices", "gap_tail_ratios"})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FaultInjectL2AdapterConfig:
        inner = d.get("inner")
        if not isinstance(inner, dict) or "type" not in inner:
            raise ValueError("'inner' must be an adapter spec dict with a 'type' field")
        if not isinstance(inner["type"], str):
            raise ValueError("'inner' adapter spec must include a string 'type'")
        rate = d.get("rate", 0.0)
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
            raise ValueError("rate must be a number in [0, 1]")
        seed = d.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError("seed must be an integer")
        gaps = d.get("gap_indices", [])
        if not isinstance(gaps, list) or any(
            isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in gaps
        ):
            raise ValueError("gap_indices must be a list of non-negative integers")
        tails = d.get("gap_tail_ratios", [])
        if not isinstance(tails, list) or any(
            isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0
            for r in tails
        ):
            raise ValueError("gap_tail_ratios must be a list of floats in [0, 1]")
        inner_cfg = default_l2_adapter_registry().config_class(inner["type"]).from_options(inner)
        return cls(
            inner=inner_cfg,
            rate=float(rate),
            seed=seed,
            gap_indices=list(gaps),
            gap_tail_ratios=[float(r) for r in tails],
            inner_type=inner["type"],
        )

    @classmethod
    def help(cls) -> str:
        return (
            "fault_inject L2 adapter (testing only): drops load results of an inner adapter.\n"
            "  inner (dict, required): a full adapter spec with its own 'type'\n"
            "  rate (float in [0,1], default 0): fraction of keys whose loads fail\n"
            "  seed (int, default 0): seed of the per-key bucket hash\n"
            "  gap_indices (list[int], default []): load positions that always fail\n"
            "  gap_tail_ratios (list[float in [0,1]], default []): positions round((1-r)(n-1))\n"
            'Example: {"type":"fault_inject","inner":{"type":"mock","max_size_gb":1,'
            '"mock_bandwidth_gb":10},"gap_indices":[2]}'
        )


def key_bucket(seed: int, key: ObjectKey) -> int:
    text = (
        f"{seed}:{bytes(key.chunk_hash).hex()}:{key.model_name}:{key.kv_rank}:"
        f"{key.object_group_id}:{key.cache_salt}"
    )
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % _BUCKETS


def dropped_positions(cfg: FaultInjectL2AdapterConfig, keys: list[ObjectKey]) -> set[int]:
    n = len(keys)
    out = {i for i in cfg.gap_indices if i < n}
    if n:
        for r in cfg.gap_tail_ratios:
            out.add(round((1.0 - r) * (n - 1)))
    if cfg.rate > 0:
        threshold = int(cfg.rate * _BUCKETS)
        out.update(i for i, k in enumerate(keys) if key_bucket(cfg.seed, k) < threshold)
    return out


class FaultInjectL2Adapter(WrappingL2Adapter):
    def __init__(
        self, config: FaultInjectL2AdapterConfig, l1_memory_desc: L1MemoryDesc | None = None
    ) -> None:
        super().__init__()
        self._cfg = config
        self._inner = default_l2_adapter_registry().create(config.inner, l1_memory_desc)
        self._load_keys: dict[int, list[ObjectKey]] = {}
        self._mu = threading.Lock()
        logger.warning(
            "fault_inject L2 adapter active (inner %s, rate=%s, gap_indices=%s, gap_tail_ratios=%s):"
            " loads WILL fail on purpose; never use this in production",
            config.inner_type or type(config.inner).__name__,
            config.rate,
            config.gap_indices,
            config.gap_tail_ratios,
        )

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        tid = super().submit_load_task(keys, objects)
        with self._mu:
            self._load_keys[tid] = list(keys)
        return tid

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        bm = super().query_load_result(task_id)
        if bm is None:
            return None
        with self._mu:
            keys = self._load_keys.pop(task_id, [])
        for i in dropped_positions(self._cfg, keys):
            if i < bm.size():
                bm.clear(i)
        return bm

    def report_status(self) -> dict[str, Any]:
        status = dict(self._inner.report_status())
        status["fault_inject"] = {
            "rate": self._cfg.rate,
            "gap_indices": self._cfg.gap_indices,
            "gap_tail_ratios": self._cfg.gap_tail_ratios,
        }
        return status


@hookimpl
def lmcache_l2_adapter_types() -> list[L2AdapterTypeSpec]:
    """Core's built-in ``fault_inject`` type (loaded by the registry like a wheel's hooks)."""
    return [L2AdapterTypeSpec("fault_inject", FaultInjectL2AdapterConfig, FaultInjectL2Adapter)]
