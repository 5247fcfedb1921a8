"""Request and response bodies of the HTTP admin API, as pydantic models.

Every JSON route of ``http_api.build_app`` declares its response model here, so a handler
that drifts from the documented shape fails (a 500 and a failing test) instead of
silently changing what clients read. The names and types under LMCache 0.5.6's keys are
0.5.6's (docs/compat.md "HTTP API"); models marked ``extra="allow"`` also carry our own
extension fields, which 0.5.6 clients ignore.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Tier(str, Enum):
    L1 = "l1"
    L2 = "l2"
    ALL = "all"


class _Open(BaseModel):
    """A 0.5.6 shape that may carry extension fields of ours (and of later merges)."""

    model_config = ConfigDict(extra="allow")


# --------------------------------------------------------------------------- requests


class EncodedKey(BaseModel):
    """JSON form of an object key (``lmcache.v1.distributed.api.EncodedObjectKey``)."""

    chunk_hash_hex: str
    model_name: str
    kv_rank: int
    object_group_id: int = 0
    cache_salt: str = ""


class DeleteObjectsRequest(BaseModel):
    keys: list[EncodedKey]
    tier: Tier = Tier.L2
    force: bool = False
    adapter: str | None = None


class PrefetchRequest(BaseModel):
    model_name: str
    world_size: int
    token_ids: list[int]
    cache_salt: str = ""
    source_tier: Tier = Tier.L2
    target_tier: Tier = Tier.L1


class ClearRequest(BaseModel):
    tier: Tier = Tier.L1
    force: bool = False


class ChecksumRequest(BaseModel):
    block_ids: list[int] = Field(default_factory=list)
    chunk_size: int = 0  # blocks per chunk
    instance_id: int = 0
    layerwise: bool = False


# -------------------------------------------------------------------------- responses


class RootResponse(BaseModel):
    status: str
    service: str


class HealthResponse(_Open):
    status: str  # "healthy" / "unhealthy"
    reason: str | None = None


class L1ManagerStatus(_Open):
    is_healthy: bool
    total_object_count: int
    write_locked_count: int
    read_locked_count: int
    staging_object_count: int
    staging_bytes: int
    memory_used_bytes: int
    memory_total_bytes: int
    memory_configured_bytes: int
    capacity_bytes_by_backend: dict[str, int]
    memory_usage_ratio: float
    write_ttl_seconds: float
    read_ttl_seconds: float


class ControllerStatus(_Open):
    is_healthy: bool
    thread_alive: bool


class StorageManagerStatus(_Open):
    is_healthy: bool
    unhealthy_reasons: list[str]  # ours: one line per unhealthy part
    l1_managers: dict[str, L1ManagerStatus]  # keyed by the L1's tag
    store_controllers: dict[str, ControllerStatus]
    l1_eviction_controllers: dict[str, ControllerStatus]
    prefetch_controller: dict[str, Any]
    l2_eviction_controller: dict[str, Any]
    # One dict per adapter: 0.5.6's adapter report plus our index/type/usage fields and
    # whatever health keys the adapters report.
    l2_adapters: list[dict[str, Any]]
    num_l2_adapters: int
    l1_usage: tuple[int, int]  # (used, total) bytes over all L1s
    l1_capacity_bytes_by_backend: dict[str, int]
    # Present when the server has exactly one L1 (0.5.6 leaves them out with several).
    l1_manager: L1ManagerStatus | None = None
    store_controller: ControllerStatus | None = None
    l1_eviction_controller: ControllerStatus | None = None


class WorkerLiveness(_Open):
    enabled: bool
    reap_timeout_seconds: float
    registration_grace_seconds: float
    tracked_instances: int


class StatusResponse(_Open):
    is_healthy: bool
    unhealthy_reasons: list[str]  # ours: why is_healthy is false (empty when true)
    engine_type: str
    chunk_size: int
    hash_algorithm: str
    active_sessions: int
    storage_manager: StorageManagerStatus
    active_prefetch_jobs: int
    active_p2p_lookup_jobs: int = 0
    p2p_enabled: bool = False
    p2p_state: str = "unregistered"
    p2p_peer_count: int = 0
    p2p_peers: list[Any] = Field(default_factory=list)
    worker_liveness: WorkerLiveness
    registered_gpu_ids: list[int]
    cache_context_meta: dict[str, dict[str, Any]]
    registered_non_cuda_instance_ids: list[int]
    non_cuda_context_meta: dict[str, dict[str, Any]]
    kv_events: dict[str, Any]  # 0.5.6's fields: enabled, incarnation, log_depth, ...


class HTTPFrontendConfig(BaseModel):
    http_host: str
    http_port: int


class ConfigResponse(_Open):
    mp: dict[str, Any]
    storage_manager: dict[str, Any]
    observability: dict[str, Any]
    http: HTTPFrontendConfig
    coordinator: dict[str, Any]


class AdapterInfo(_Open):
    index: int
    type_name: str
    tier: str
    primary: bool
    reconfigurable: bool


class AdaptersResponse(BaseModel):
    adapters: list[AdapterInfo]


class KeyEntry(BaseModel):
    key: EncodedKey
    size_bytes: int


class ObjectsPage(BaseModel):
    adapter: str  # the adapter's type name
    shared: bool
    entries: list[KeyEntry]
    next_page_token: str | None


class DeleteObjectsResponse(BaseModel):
    deleted: int
    skipped: int
    ok: bool
    error: str | None = None  # only when an L2 adapter failed


class PrefetchSubmitted(BaseModel):
    request_id: str | None = None  # absent for a sub-chunk ("noop") request
    chunks: int
    status: str  # "submitted" / "noop"


class PrefetchStatus(BaseModel):
    request_id: str
    status: str  # "pending" / "completed"
    found_keys: int | None = None
    total_keys: int | None = None


class ClearedTier(BaseModel):
    tier: str


class ClearResponse(BaseModel):
    status: str
    cleared: ClearedTier


class ChecksumResponse(BaseModel):
    status: str
    chunk_size: int
    num_chunks: int
    # one digest per chunk, or per layer ("layer_<i>") when layerwise
    chunk_checksums: list[str] | dict[str, list[str]]
    layerwise: bool
    block_id_ranges: list[int | list[int]]


class LevelCounts(BaseModel):
    total: int
    running: int
    active: int


class ThreadsSummary(BaseModel):
    total_count: int
    running_count: int
    active_count: int
    by_level: dict[str, LevelCounts]


class PeriodicThreadStatus(_Open):
    name: str
    level: str
    interval: float
    init_wait: float
    is_running: bool
    is_active: bool
    last_run_time: float | None
    last_run_ago: float | None
    total_runs: int
    failed_runs: int
    success_rate: float
    last_summary: dict[str, Any] | None


class PeriodicThreadsResponse(BaseModel):
    summary: ThreadsSummary
    threads: list[PeriodicThreadStatus]


class UnhealthyThread(BaseModel):
    name: str
    level: str
    last_run_ago: float | None
    interval: float


class PeriodicThreadsHealth(BaseModel):
    healthy: bool
    unhealthy_count: int
    unhealthy_threads: list[UnhealthyThread]


class QuotaSet(BaseModel):
    cache_salt: str
    limit_gb: float
    status: str


class QuotaInfo(BaseModel):
    cache_salt: str
    limit_gb: float
    current_usage_gb: float
    exists: bool


class QuotaDeleted(BaseModel):
    cache_salt: str
    status: str  # "removed" / "not_found"


class QuotaUsage(BaseModel):
    limit_gb: float
    current_usage_gb: float


class QuotaList(BaseModel):
    users: dict[str, QuotaUsage]


class ReconfigureStatus(BaseModel):
    enabled: bool
    backend: str
    num_adapters: int
    adapters: list[dict[str, Any]]


class ErrorResponse(BaseModel):
    """The ``{"error": ...}`` body of the routes 0.5.6 answers that way."""

    error: str
