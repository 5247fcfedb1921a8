"""Background upkeep of ``CacheEngine``: the session cleaner (expired sessions, stale
reservations, ended read leases) and the reaper of silent workers."""

from __future__ import annotations

import time

from lmcache.utils import init_logger

logger = init_logger(__name__)


class JanitorMixin:
    """Part of ``CacheEngine`` (its state is set in ``CacheEngine.__init__``)."""

    # ------------------------------------------------------------------ background
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

    def _clean_loop(self) -> None:
        period = self.clean_period()
        while not self._stop.wait(period):
            try:
                self.clean_once()
            except Exception:
                logger.exception("session cleaner cycle failed")

    def clean_once(self) -> None:
        self._release_expired_leases()
        for s in self.sessions.expired():
            self._close_session(s)
        ttl = self.config.l1_write_ttl_seconds
        cutoff = time.monotonic() - ttl
        for inst in list(self.instances.values()):
            with inst.lock:
                old = [k for k, r in inst.reservations.items() if r.created < cutoff]
                gone = [inst.reservations.pop(k) for k in old]
            for r in gone:
                self.storage.abort_write(list(r.objs))

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
        now = time.monotonic()
        reap, grace = (
            self.config.worker_reap_timeout_seconds,
            self.config.worker_registration_grace_seconds,
        )
        victims = []
        with self._lock:
            for inst in self.instances.values():
                limit = reap if inst.pinged else grace
                if limit > 0 and now - inst.last_seen > limit:
                    victims.append(inst.instance_id)
        for iid in victims:  # the liveness lock is not held while releasing
            inst = self._drop_instance(iid, reason="reaped (no liveness signal)")
            if inst is not None:
                logger.warning("Reaped instance %d (%s): silent for too long", iid, inst.mode)
                self.metrics.inc("lmcache_mp_reaped_instances", mode=inst.mode)
        self._reclaim_silent_workers()
        self._release_expired_leases()
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
        for inst in list(self.instances.values()):
            if inst.last_seen >= cutoff:
                continue
            with inst.lock:
                if not inst.reservations and not inst.pending_reads:
                    continue
                reservations, inst.reservations = inst.reservations, {}
                reads, inst.pending_reads = inst.pending_reads, {}
            for res in reservations.values():
                self.storage.abort_write(list(res.objs))  # never admit half-written data
            self._release_after_lease(list(reads.values()))
            self.metrics.inc("lmcache_mp_reclaimed_staging", len(reservations) + len(reads))
            logger.warning(
                "Instance %d (%s) silent for more than %.0f s: released its %d unfinished "
                "store(s) and %d unfinished SHM read(s); it stays registered",
                inst.instance_id,
                inst.mode,
                limit,
                len(reservations),
                len(reads),
            )
