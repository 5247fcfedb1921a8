"""How vLLM's parallel layout maps onto LMCache's KV world (docs/vllm.md#parallelism).

Non-MLA models shard KV over every rank, so each rank is its own KV worker. MLA
models replicate the latent KV over tensor parallelism: only the first TP rank
of each pipeline stage (one per decode-context-parallel shard) writes, and every
TP rank reads, so each hit chunk carries ``num_kv_readers`` read-lock shares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lmcache.integration.vllm.utils import mla_enabled


@dataclass(frozen=True)
class ParallelStrategy:
    use_mla: bool
    kv_world_size: int
    kv_worker_id: int
    vllm_world_size: int
    vllm_rank: int
    tp_size: int
    pp_size: int = 1
    dcp_size: int = 1
    n_servers: int = 1

    @classmethod
    def build(
        cls,
        *,
        use_mla: bool,
        tp_size: int,
        pp_size: int = 1,
        dcp_size: int = 1,
        rank: int = 0,
        world_size: int | None = None,
        n_servers: int = 1,
    ) -> ParallelStrategy:
        """Derive the KV world from vLLM's sizes; ``rank`` is the global vLLM rank."""
        for name, value in (("tp_size", tp_size), ("pp_size", pp_size), ("dcp_size", dcp_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        world = world_size if world_size is not None else tp_size * pp_size
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside the vLLM world of size {world}")
        if tp_size % dcp_size:
            raise ValueError(
                f"decode context parallel size {dcp_size} must divide the TP size {tp_size}"
            )
        if use_mla:
            kv_world = pp_size * dcp_size
            tp_rank = rank % tp_size
            pp_rank = (rank // tp_size) % pp_size
            kv_id = pp_rank * dcp_size + tp_rank % dcp_size
        else:
            if n_servers < 1 or world % n_servers:
                raise ValueError(
                    f"the vLLM world size {world} must be a multiple of the server count {n_servers}"
                )
            kv_world = world // n_servers
            kv_id = rank % kv_world
        return cls(
            use_mla=use_mla,
            kv_world_size=kv_world,
            kv_worker_id=kv_id,
            vllm_world_size=world,
            vllm_rank=rank,
            tp_size=tp_size,
            pp_size=pp_size,
            dcp_size=dcp_size,
            n_servers=n_servers,
        )

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, *, rank: int | None = None) -> ParallelStrategy:
        pc = vllm_config.parallel_config
        tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
        pp = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
        dcp = int(getattr(pc, "decode_context_parallel_size", 1) or 1)
        world = int(getattr(pc, "world_size", tp * pp) or tp * pp)
        if rank is None:
            rank = int(getattr(pc, "rank", 0) or 0)
        return cls.build(
            use_mla=mla_enabled(getattr(vllm_config, "model_config", None)),
            tp_size=tp,
            pp_size=pp,
            dcp_size=dcp,
            rank=rank % world,
            world_size=world,
        )

    @property
    def tp_rank(self) -> int:
        return self.vllm_rank % self.tp_size

    @property
    def is_kv_writer(self) -> bool:
        """Only the first TP rank of each DCP shard stores MLA KV; every rank stores otherwise."""
        if not self.use_mla:
            return True
        return self.tp_rank < self.dcp_size

    @property
    def is_kv_event_subscriber(self) -> bool:
        """The one worker per server that reads the server's KV events for vLLM: the first
        KV worker of the server (for MLA, its first TP rank)."""
        return self.kv_worker_id == 0 and (not self.use_mla or self.tp_rank == 0)

    @property
    def num_kv_readers(self) -> int:
        """Read-lock shares a lookup takes per hit key: one per rank that retrieves it."""
        if not self.use_mla:
            return 1
        return math.ceil(self.tp_size / self.dcp_size)
