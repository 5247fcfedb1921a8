"""Settings of the MP server (the non-storage part of the ``lmcache server`` flags)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field


@dataclass
class MPServerConfig:
    host: str = "localhost"
    port: int = 5555
    chunk_size: int = 256
    hash_algorithm: str = "blake3"
    null_block_id: int = 0
    max_gpu_workers: int = 4
    max_cpu_workers: int = 4
    supported_transfer_mode: str = "auto"  # lmcache_driven | engine_driven | auto
    shm_name: str = ""
    worker_reap_timeout_seconds: float = 120.0
    worker_registration_grace_seconds: float = 3600.0
    session_ttl_seconds: float = 600.0
    # At most this many sessions; a new one beyond it ends the least recently used (0 = no cap).
    max_sessions: int = 10000
    l1_write_ttl_seconds: float = 600.0
    # A worker's SHM read stays locked this long after prepare_retrieve even if the worker is
    # dropped meanwhile, so a worker whose copy ends within it need not await commit_retrieve.
    retrieve_lease_seconds: float = 10.0
    separate_object_groups: bool = False
    instance_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    disable_metrics: bool = False
    # share of L1 chunks whose lifecycle the metrics follow (--metrics-sample-rate)
    metrics_sample_rate: float = 0.01
    # KV events (docs/server.md#kv-events): records kept (0 = off), and the JSON of the
    # vLLM-format ZeroMQ publisher (vLLM's --kv-events-config keys; "" = no publisher)
    kv_event_log_size: int = 32768
    kv_events_config: str = ""

    @property
    def lmcache_driven_enabled(self) -> bool:
        return self.supported_transfer_mode in ("auto", "lmcache_driven")

    @property
    def engine_driven_enabled(self) -> bool:
        return self.supported_transfer_mode in ("auto", "engine_driven")

    @property
    def transfer_modes(self) -> list[str]:
        modes = []
        if self.lmcache_driven_enabled:
            modes.append("lmcache_driven")
        if self.engine_driven_enabled:
            modes.append("engine_driven")
        return modes
