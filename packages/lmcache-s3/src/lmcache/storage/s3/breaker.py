"""A circuit breaker that re-arms (IMPROVE, docs/design/storage-engine.md#backend-s3).

0.5.6 disabled its S3 adapter for good after 3 connection errors. Here ``max_failures``
consecutive connection-class failures *open* the breaker: requests are refused without
touching the network. Once the open delay has passed the breaker becomes *half-open* and
lets exactly one probe through; a good probe closes it, a failed one reopens it with the
delay doubled (capped). Pure logic with an injectable clock, so it is tested on its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
MAX_OPEN_SECONDS = 300.0


class CircuitBreaker:
    def __init__(
        self,
        max_failures: int,
        reset_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._max_failures = max_failures
        self._base_delay = reset_seconds
        self._clock = clock
        self._mu = threading.Lock()
        self._state = CLOSED
        self._failures = 0
        self._delay = reset_seconds
        self._reopen_at = 0.0

    def allow(self) -> bool:
        """True when requests may go out (closed). Open and half-open refuse them."""
        with self._mu:
            return self._state == CLOSED

    def record_success(self) -> None:
        with self._mu:
            if self._state == CLOSED:
                self._failures = 0

    def record_failure(self) -> bool:
        """A connection-class failure of a regular request. True when this one opened it."""
        with self._mu:
            if self._state != CLOSED:
                return False
            self._failures += 1
            if self._failures < self._max_failures:
                return False
            self._open(self._base_delay)
            return True

    def take_probe(self) -> bool:
        """Open and due: become half-open and return True (the caller runs the one probe)."""
        with self._mu:
            if self._state != OPEN or self._clock() < self._reopen_at:
                return False
            self._state = HALF_OPEN
            return True

    def probe_succeeded(self) -> None:
        with self._mu:
            self._state = CLOSED
            self._failures = 0
            self._delay = self._base_delay

    def probe_failed(self) -> None:
        with self._mu:
            self._open(min(self._delay * 2, MAX_OPEN_SECONDS))

    def _open(self, delay: float) -> None:
        self._state = OPEN
        self._delay = delay
        self._reopen_at = self._clock() + delay

    @property
    def state(self) -> str:
        with self._mu:
            return self._state

    def snapshot(self) -> dict[str, object]:
        with self._mu:
            reopen = max(0.0, self._reopen_at - self._clock()) if self._state == OPEN else 0.0
            return {
                "state": self._state,
                "consecutive_failures": self._failures,
                "reopen_in_s": round(reopen, 3),
            }
