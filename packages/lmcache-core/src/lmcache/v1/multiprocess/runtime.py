"""Builds and stops the whole server process: storage, engine, RPC server (and SHM state).

``ServerRuntime.build(mp_config, storage_config)`` follows the startup order of
spec/protocol.md 1.1; ``stop()`` stops the RPC server, then the engine, then the storage
(which unlinks the SHM pool).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lmcache.utils import init_logger
from lmcache.v1.multiprocess.config import MPServerConfig
from lmcache.v1.multiprocess.engine import CacheEngine
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
        self.metrics.set("lmcache_mp_shm_enabled", 1 if shm.name else 0)
        self._fed: dict[str, int] = {}  # eviction totals already added to the counters
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
        used, total = self.storage.memory_usage()
        m.set("lmcache_mp_l1_memory_usage_bytes", used)
        m.set("lmcache_mp_l1_usage_ratio", used / total if total else 0.0)
        m.set("lmcache_mp_l1_staging_bytes", self.storage.staging_bytes())
        st = self.engine.status()
        m.set("lmcache_mp_active_prefetch_jobs", st["active_prefetch_jobs"])
        self._feed_eviction_counters(m)

    def _feed_eviction_counters(self, m: ServerMetrics) -> None:
        """The storage layer keeps cumulative eviction counts; add what is new since the
        last scrape (after ``/metrics/reset`` the counters restart from the new ones)."""
        status = self.storage.status()
        l1_ctls = status.get("l1_eviction_controllers") or []
        l1 = status.get("l1_managers") or []
        l2 = status.get("l2_eviction_controller") or {}
        totals = {
            "lmcache_mp_l1_evicted_chunks": sum(int(c.get("evicted_keys", 0)) for c in l1_ctls)
            + sum(int(x.get("demand_evicted_keys", 0)) for x in l1),
            "lmcache_mp_l1_eviction_loop_ticks": sum(
                int((c.get("eviction") or {}).get("cycles", 0)) for c in l1_ctls
            ),
            "lmcache_mp_l1_eviction_loop_triggered": sum(
                int(c.get("triggered_cycles", 0)) for c in l1_ctls
            ),
            "lmcache_mp_l2_evicted_objects_chunks": int(l2.get("evicted_keys", 0)),
        }
        for name, total in totals.items():
            delta = total - self._fed.get(name, 0)
            if delta > 0:
                m.inc(name, delta)
            self._fed[name] = total


def _unlink_shm(name: str) -> None:
    path = os.path.join("/dev/shm", name)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("could not unlink SHM segment %s: %s", name, exc)
