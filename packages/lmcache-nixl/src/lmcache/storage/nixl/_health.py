"""Health bookkeeping of an adapter: the last error and success, and warnings that cannot
flood the log when a backend fails over and over."""

from __future__ import annotations

import threading
import time
from typing import Any

from lmcache.v1.distributed.l2_adapters.api import RateLimitedLog

WARN_INTERVAL_S = 10.0


class Health:
    """``failure()`` records an error and logs it, at most once per ``interval_s`` (the count of
    warnings held back meanwhile is appended to the next one). A backend failure makes the
    adapter unhealthy until the next success; a caller's error (a bad buffer) does not."""

    def __init__(self, logger: Any, prefix: str, interval_s: float = WARN_INTERVAL_S) -> None:
        self._warnings = RateLimitedLog(logger, interval=interval_s)
        self._prefix = prefix
        self._mu = threading.Lock()
        self._last_error: str | None = None
        self._last_error_time: float | None = None
        self._last_success_time: float | None = None
        self._backend_failing = False
        self._errors = 0

    def success(self) -> None:
        with self._mu:
            self._last_success_time = time.time()
            self._backend_failing = False

    def failure(self, message: str, *, backend: bool) -> None:
        with self._mu:
            self._last_error = message
            self._last_error_time = time.time()
            self._errors += 1
            if backend:
                self._backend_failing = True
        self._warnings.warning(self._prefix, "%s: %s", self._prefix, message)

    def snapshot(self, alive: bool) -> dict[str, Any]:
        with self._mu:
            healthy = alive and not self._backend_failing
            return {
                "is_healthy": healthy,
                "healthy": healthy,
                "last_error": self._last_error,
                "last_error_time": self._last_error_time,
                "last_success_time": self._last_success_time,
                "errors_total": self._errors,
            }
