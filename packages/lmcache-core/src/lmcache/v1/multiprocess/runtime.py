"""Builds and stops the whole server process: storage, engine, RPC server (and SHM state).

``ServerRuntime.build(mp_config, storage_config)`` follows the startup order of
docs/design/architecture.md#server-threads; ``stop()`` stops the RPC server, then the engine, then
the storage (which unlinks the SHM pool).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lmcache.utils import init_logger
from lmcache.v1.multiprocess.config import MPServerConfig
from lmcache.v1.multiprocess.engine import L1_TAG, CacheEngine
from lmcache.v1.multiprocess.l1_lifecycle import L1Lifecycle
from lmcache.v1.multiprocess.metrics import ServerMetrics
from lmcache.v1.multiprocess.server import MPCacheServer, max_message_bytes
from lmcache.v1.multiprocess.storage_bridge import StorageBridge

logger = init_logger(__name__)


@dataclass
class ShmDecision:
    name: str = ""
    pool_size: int = 0
    disabled_reason: str = ""


def shm_state(storage: StorageBridge, requested: str, engine_driven: bool) -> ShmDecision:
    """SHM state of the L1 pool (13.1): the storage layer creates it; it is never silently off."""
    name = str(getattr(storage.l1, "shm_name", "") or "")
    if name:
        return ShmDecision(name, int(getattr(storage.l1, "pool_size", 0) or 0))
    if not requested:
        if engine_driven:
            logger.info(
                "No --shm-name: engine-driven workers use the copy path; start with "
                "--shm-name <name> to let them write L1 through shared memory"
            )
        return ShmDecision(disabled_reason="--shm-name not given")
    reason = str(getattr(storage.l1, "shm_disabled_reason", "") or "the L1 pool is not shm-backed")
    return ShmDecision(disabled_reason=reason)


@dataclass
class ServerHealth:
    healthy: bool
    reasons: list[str]

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)


class ServerRuntime:
    def __init__(
        self,
        config: MPServerConfig,
        storage_manager: Any,
        storage_config: Any = None,
    ) -> None:
        self.config = config
        self.storage_config = storage_config
        self.metrics = ServerMetrics(config.instance_id, enabled=not config.disable_metrics)
        self.storage = StorageBridge(storage_manager)
        shm = shm_state(self.storage, config.shm_name, config.engine_driven_enabled)
        self.shm = shm
        self.engine = CacheEngine(
            config,
            self.storage,
            self.metrics,
            shm_name=shm.name,
            shm_pool_size=shm.pool_size,
            shm_disabled_reason=shm.disabled_reason,
        )
        self.server = MPCacheServer(self.engine, max_message_bytes(self.storage.memory_usage()[1]))
        self._fed: dict[tuple[str, Any], int] = {}  # storage totals already in the counters
        self.l1_lifecycle: L1Lifecycle | None = None
        if not config.disable_metrics and hasattr(self.storage.l1, "register_listener"):
            self.l1_lifecycle = L1Lifecycle(config.metrics_sample_rate)
            self.storage.l1.register_listener(self.l1_lifecycle)
        self.metrics.add_gauge_source(self._refresh_gauges)
        self._stopped = False

    @classmethod
    def build(cls, config: MPServerConfig, storage_config: Any) -> ServerRuntime:
        from lmcache.v1.distributed.storage_manager import StorageManager

        sm = StorageManager(storage_config)
        try:
            return cls(config, sm, storage_config)
        except Exception:
            sm.close()
            raise

    def start(self) -> str:
        self.engine.start()
        return self.server.start()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.server.stop()
        self.engine.stop()
        try:
            self.storage.close()  # also unlinks the SHM pool
        except Exception:
            logger.exception("closing the storage manager failed")
        if self.shm.name:
            _unlink_shm(self.shm.name)

    def health(self, storage_status: dict[str, Any] | None = None) -> ServerHealth:
        """Whether the server is healthy, and why not: the one place ``/healthcheck`` and
        ``/status`` get it from. Unhealthy while the RPC server is not serving, or while a
        part of the storage engine is (an L2 backend that fails, with its last error).
        ``storage_status`` reuses a ``StorageBridge.status()`` the caller already has;
        without it only the cheap health parts of the storage engine are asked (no L1
        memory check), so a frequent liveness probe costs the L1 nothing."""
        reasons = []
        if not (self.server.endpoint and self.server.accepting):
            reasons.append("the RPC server is not serving")
        sm = storage_status
        if sm is None:
            reasons.extend(self.storage.health_reasons())
        elif "error" in sm:
            reasons.append(f"the storage engine cannot report its status: {sm['error']}")
        elif not sm.get("is_healthy", True):
            reasons.extend(sm.get("unhealthy_reasons") or ["the storage engine is unhealthy"])
        return ServerHealth(not reasons, reasons)

    def _refresh_gauges(self, m: ServerMetrics) -> None:
        l1 = {"backend": "dram", "l1_tag": L1_TAG}
        used, total = self.storage.memory_usage()
        m.set("lmcache_mp_l1_memory_usage_bytes", used, **l1)
        m.set("lmcache_mp_l1_usage_ratio", used / total if total else 0.0, **l1)
        m.set("lmcache_mp_l1_staging_bytes", self.storage.staging_bytes(), **l1)
        m.set("lmcache_mp_shm_enabled", 1 if self.shm.name else 0)
        st = self.engine.status()
        m.set("lmcache_mp_active_prefetch_jobs", st["active_prefetch_jobs"])
        for name in (
            "lmcache_mp_active_p2p_lookup_jobs",
            "lmcache_mp_event_bus_queue_depth",
            "lmcache_mp_event_bus_drain_lag_seconds",
        ):
            m.set(name, 0)
        m.set("lmcache_mp_kv_events_log_depth", self.engine.kv_events_log_depth())
        status = self.storage.status()
        adapters = [a for a in status.get("l2_adapters") or [] if isinstance(a, dict)]
        draining = sum(1 for a in adapters if a.get("draining"))
        for state, n in (("active", len(adapters) - draining), ("draining", draining)):
            m.set("lmcache_mp_l2_store_adapters", n, l1_tag=L1_TAG, state=state)
            m.set("lmcache_mp_l2_prefetch_adapters", n, state=state)
        usage: dict[str, float] = {}
        for a in adapters:
            usage[a.get("type", "?")] = usage.get(a.get("type", "?"), 0) + a.get("usage_bytes", 0)
        for name, n in usage.items():
            m.set("lmcache_mp_l2_usage_bytes", n, l2_name=name)
        if self.l1_lifecycle is not None:
            for name, seconds in self.l1_lifecycle.drain():
                m.observe(f"lmcache_mp_l1_chunk_{name}_seconds", seconds, l1_tag=L1_TAG)
        for kind, name, gbps in self.storage.drain_l2_throughput():
            m.observe(f"lmcache_mp_l2_{kind}_throughput_GB_per_second", gbps, l2_name=name)
        self._feed_storage_counters(m, status)

    def _feed_storage_counters(self, m: ServerMetrics, status: dict[str, Any]) -> None:
        """The storage layer keeps cumulative counts (evictions, L2 tasks); add what is new
        since the last scrape (after ``/metrics/reset`` the counters restart from there)."""
        l1_ctls = _parts(status.get("l1_eviction_controllers"))
        l1 = _parts(status.get("l1_managers"))
        l2 = status.get("l2_eviction_controller") or {}
        stores = _parts(status.get("store_controllers"))
        prefetch = status.get("prefetch_controller") or {}

        def total(rows: list[dict[str, Any]], key: str) -> int:
            return sum(int(r.get(key, 0)) for r in rows)

        feeds: list[tuple[str, dict[str, str], int]] = [
            (
                "lmcache_mp_l1_evicted_chunks",
                {"l1_tag": L1_TAG},
                total(l1_ctls, "evicted_keys") + total(l1, "demand_evicted_keys"),
            ),
            (
                "lmcache_mp_l1_eviction_loop_ticks",
                {},
                sum(int((c.get("eviction") or {}).get("cycles", 0)) for c in l1_ctls),
            ),
            ("lmcache_mp_l1_eviction_loop_triggered", {}, total(l1_ctls, "triggered_cycles")),
            ("lmcache_mp_l2_evicted_objects_chunks", {}, int(l2.get("evicted_keys", 0))),
            ("lmcache_mp_l2_store_submitted_requests", {}, total(stores, "submitted_tasks")),
            ("lmcache_mp_l2_store_submitted_objects_chunks", {}, total(stores, "submitted_keys")),
            ("lmcache_mp_l2_store_completed_objects_chunks", {}, total(stores, "completed_keys")),
            ("lmcache_mp_l2_store_failed_requests", {}, total(stores, "failed_tasks")),
            ("lmcache_mp_l2_store_failed_objects_chunks", {}, total(stores, "failed_keys")),
            ("lmcache_mp_l2_prefetch_lookup_requests", {}, int(prefetch.get("lookup_requests", 0))),
            (
                "lmcache_mp_l2_prefetch_lookup_objects_chunks",
                {},
                int(prefetch.get("lookup_keys", 0)),
            ),
            (
                "lmcache_mp_l2_prefetch_load_submitted_requests",
                {},
                int(prefetch.get("load_tasks", 0)),
            ),
            (
                "lmcache_mp_l2_prefetch_load_submitted_objects_chunks",
                {},
                int(prefetch.get("load_keys", 0)),
            ),
            (
                "lmcache_mp_l2_prefetch_load_completed_chunks",
                {},
                int(prefetch.get("loaded_keys", 0)),
            ),
        ]
        by_adapter: dict[str, int] = {}
        for row in stores:
            for name, n in (row.get("completed_tasks_by_adapter") or {}).items():
                by_adapter[name] = by_adapter.get(name, 0) + int(n)
        feeds += [
            ("lmcache_mp_l2_store_completed_requests", {"l2_name": name}, n)
            for name, n in by_adapter.items()
        ]
        feeds += [
            ("lmcache_mp_l2_load_completed_requests", {"l2_name": name}, int(n))
            for name, n in (prefetch.get("load_tasks_completed_by_adapter") or {}).items()
        ]
        feeds += [
            ("lmcache_mp_l2_prefetch_failure_chunks", {"reason": r, "model_name": m}, int(n))
            for r, m, n in prefetch.get("failed_keys_by_reason_and_model") or []
        ]
        rejected: dict[tuple[str, str], int] = {}
        for a in _parts(status.get("l2_adapters")):
            st = a.get("status") or {}
            if "serde_rejected_chunks" in st:
                k = (str(a.get("type", "?")), str(st.get("serde", "?")))
                rejected[k] = rejected.get(k, 0) + int(st["serde_rejected_chunks"])
        feeds += [
            ("lmcache_mp_l2_serde_rejected_chunks", {"l2_name": t, "serde": sd}, n)
            for (t, sd), n in rejected.items()
        ]
        for name, labels, now in feeds:
            key = (name, tuple(sorted(labels.items())))
            delta = now - self._fed.get(key, 0)
            if delta > 0:
                m.inc(name, delta, **labels)
            self._fed[key] = now


def _parts(value: Any) -> list[dict[str, Any]]:
    """Per-L1 parts of the storage status: a list, or a dict keyed by L1 tag."""
    rows = value.values() if isinstance(value, dict) else (value or [])
    return [r for r in rows if isinstance(r, dict)]


def _unlink_shm(name: str) -> None:
    path = os.path.join("/dev/shm", name)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not unlink SHM segment %s: %s", name, exc)
