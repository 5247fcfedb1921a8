"""``Janitor``: the background upkeep of ``CacheEngine`` on two threads, the session
cleaner (expired sessions, stale reservations, ended read leases) and the reaper of silent
workers."""

from __future__ import annotations

import threading
import time

from lmcache.utils import init_logger
from lmcache.v1.multiprocess.config import MPServerConfig
from lmcache.v1.multiprocess.engine.instances import InstanceRegistry
from lmcache.v1.multiprocess.engine.session_keys import SessionKeys
from lmcache.v1.multiprocess.metrics import ServerMetrics

logger = init_logger(__name__)


class Janitor:
    def __init__(
        self,
        config: MPServerConfig,
        metrics: ServerMetrics,
        registry: InstanceRegistry,
        session_keys: SessionKeys,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.registry = registry
        self.session_keys = session_keys
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for name, fn in (("mp-session-cleaner", self._clean_loop), ("mp-reaper", self._reap_loop)):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)

    # ------------------------------------------------------------------ periods
    def clean_period(self) -> float:
        """Seconds between session-cleaner cycles."""
        return max(0.2, min(60.0, self.config.session_ttl_seconds / 4))

    def reap_period(self) -> float:
        """Seconds between reaper cycles; 0 when reaping is off."""
        timeouts = [
            t
            for t in (
                self.config.worker_reap_timeout_seconds,
                self.config.worker_registration_grace_seconds,
            )
            if t > 0
        ]
        if not timeouts or self.config.worker_reap_timeout_seconds <= 0:
            return 0.0
        return max(0.1, min(30.0, min(timeouts) / 4))

    # ------------------------------------------------------------------ session cleaner
    def _clean_loop(self) -> None:
        period = self.clean_period()
        while not self._stop.wait(period):
            try:
                self.clean_once()
            except Exception:
                logger.exception("session cleaner cycle failed")

    def clean_once(self) -> None:
        self.session_keys.release_expired_leases()
        self.session_keys.close_expired_sessions()
        self.registry.abort_stale_reservations(time.monotonic() - self.config.l1_write_ttl_seconds)

    # ------------------------------------------------------------------ reaper
    def _reap_loop(self) -> None:
        period = self.reap_period()
        if not period:
            return
        while not self._stop.wait(period):
            try:
                self.reap_once()
            except Exception:
                logger.exception("reaper cycle failed")

    def reap_once(self) -> list[int]:
        victims = self.registry.silent(
            time.monotonic(),
            self.config.worker_reap_timeout_seconds,
            self.config.worker_registration_grace_seconds,
        )
        for iid in victims:  # the registry's lock is not held while releasing
            inst = self.registry.drop(iid, reason="reaped (no liveness signal)")
            if inst is not None:
                logger.warning("Reaped instance %d (%s): silent for too long", iid, inst.mode)
                self.metrics.inc("lmcache_mp_reaped_instances", mode=inst.mode)
        self._reclaim_silent_workers()
        self.session_keys.release_expired_leases()
        return victims

    def _reclaim_silent_workers(self) -> None:
        """Release the staging (unfinished stores, pending SHM reads) of every worker silent
        (no request, no ping) for ``--worker-reap-timeout-seconds``, also of one that never
        pinged: such a worker stays registered for the whole registration grace (an hour by
        default, for 0.5.6 clients that never ping), but a dead one must not hold L1 that
        long. Nothing is reclaimed while reaping is off."""
        limit = self.config.worker_reap_timeout_seconds
        if limit <= 0:
            return
        cutoff = time.monotonic() - limit
        for inst in self.registry.all():
            if inst.last_seen >= cutoff:
                continue
            stores, reads = self.registry.release_staging(inst)
            if not stores and not reads:
                continue
            self.metrics.inc("lmcache_mp_reclaimed_staging", stores + reads)
            logger.warning(
                "Instance %d (%s) silent for more than %.0f s: released its %d unfinished "
                "store(s) and %d unfinished SHM read(s); it stays registered",
                inst.instance_id,
                inst.mode,
                limit,
                stores,
                reads,
            )
