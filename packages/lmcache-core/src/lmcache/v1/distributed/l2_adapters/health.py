"""Backend health of an L2 adapter, from the outcomes of its operations.

The ``report_status()`` health convention (shared by every adapter we ship): besides the
required ``is_healthy``, a status may carry

* ``healthy: bool`` - the backend answers (same value as ``is_healthy``);
* ``last_error: str | None`` and ``last_error_time: float | None`` (unix seconds);
* ``last_success_time: float | None`` (unix seconds).

``HealthTracker`` computes them: adapters call ``success(op)`` / ``failure(op, error)``
as their operations complete. An adapter is unhealthy while the latest outcome of some
operation kind (store, load, lookup, ...) is a failure younger than ``STALE_AFTER_S``: a
full disk fails stores while lookups still work, and an old failure that nothing has
retried since says nothing about the backend any more. The first failure of a healthy
adapter is logged as a WARNING naming the backend and the cause; the first success that
leaves nothing failing as INFO.
Nothing in between is logged here (the controllers log failed tasks, rate-limited).

``adapter_health(status)`` reads the convention back from any adapter's status dict, so
the storage manager treats adapters that do not follow it (0.5.6 plugins) alike;
``failure_cause(adapter)`` is what the controllers log for a failed task that carries no
error of its own.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from lmcache.utils import init_logger

logger = init_logger(__name__)

__all__ = ["STALE_AFTER_S", "HealthTracker", "adapter_health", "failure_cause"]

STALE_AFTER_S = 30.0


class HealthTracker:
    """Health of one adapter's backend from the outcomes of its operations (see the module
    docstring); ``name`` names the backend in logs (``"resp at redis.internal:6379"``).
    Thread-safe: I/O threads report, the status endpoint reads."""

    def __init__(self, name: str) -> None:
        self.name = name  # e.g. "resp at redis.internal:6379"
        self._lock = threading.Lock()
        # op -> (ok, monotonic time, error) of its latest outcome
        self._latest: dict[str, tuple[bool, float, str]] = {}
        self._last_error: str | None = None
        self._last_error_time: float | None = None
        self._last_success_time: float | None = None
        self._failures = 0
        self._warned = False  # a failure was logged and no recovery since

    def _failing(self, now: float) -> list[str]:
        return sorted(
            op for op, (ok, t, _e) in self._latest.items() if not ok and now - t < STALE_AFTER_S
        )

    def success(self, op: str) -> None:
        """Record that an ``op`` (``"store"``, ``"load"``, ...) reached the backend; logs once at
        INFO when this leaves no operation failing after a failure."""
        now = time.monotonic()
        with self._lock:
            self._latest[op] = (True, now, "")
            self._last_success_time = time.time()
            recovered = self._warned and not self._failing(now)
            if recovered:
                self._warned = False
        if recovered:
            logger.info("L2 backend %s recovered (%s succeeded)", self.name, op)

    def failure(self, op: str, error: str) -> None:
        """Record that ``op`` failed with ``error`` (the backend's text); the first failure of
        a healthy backend logs one WARNING naming it and the cause."""
        now = time.monotonic()
        error = str(error) or "no reason given"
        with self._lock:
            was_failing = bool(self._failing(now))
            self._latest[op] = (False, now, error)
            self._last_error = f"{op}: {error}"
            self._last_error_time = time.time()
            self._failures += 1
            warn = not was_failing
            self._warned = True
        if warn:
            logger.warning(
                "L2 backend %s is failing: %s failed: %s. The server keeps serving from L1 "
                "and retries; /status shows the backend's health",
                self.name,
                op,
                error,
            )

    @property
    def healthy(self) -> bool:
        """False while some operation's latest outcome is a failure younger than
        ``STALE_AFTER_S`` seconds."""
        with self._lock:
            return not self._failing(time.monotonic())

    def status(self) -> dict[str, Any]:
        """The convention's fields, plus ``failing_ops`` and the total ``failures``."""
        with self._lock:
            failing = self._failing(time.monotonic())
            return {
                "healthy": not failing,
                "last_error": self._last_error,
                "last_error_time": self._last_error_time,
                "last_success_time": self._last_success_time,
                "failing_ops": failing,
                "failures": self._failures,
            }


def adapter_health(status: dict[str, Any]) -> dict[str, Any]:
    """The health fields of an adapter's ``report_status()``; an adapter that reports
    neither ``healthy`` nor ``is_healthy`` counts as healthy (0.5.6's default)."""
    healthy = bool(status.get("is_healthy", True)) and bool(status.get("healthy", True))
    return {
        "healthy": healthy,
        "last_error": status.get("last_error") or status.get("error"),
        "last_error_time": status.get("last_error_time"),
        "last_success_time": status.get("last_success_time"),
    }


def failure_cause(adapter: Any) -> str:
    """Why a task of ``adapter`` failed when the task itself does not say: the adapter's
    last reported error."""
    if adapter is None:
        return "the adapter is gone"
    try:
        error = adapter_health(dict(adapter.report_status()))["last_error"]
    except Exception as exc:
        return f"the adapter gave no reason (its report_status raised {type(exc).__name__})"
    return str(error) if error else "the adapter gave no reason"
