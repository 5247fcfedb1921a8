"""``Parker``: the timeouts of parked waits (``wait_prefetch_status``) on one thread, without
holding a pool thread per wait."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable

from lmcache.utils import init_logger

logger = init_logger(__name__)


class Parker:
    """Timeouts of parked waits without holding a pool thread per wait."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="mp-parked-waits", daemon=True)
        self._thread.start()

    def at(self, deadline: float, fn: Callable[[], None]) -> None:
        with self._cv:
            heapq.heappush(self._heap, (deadline, next(self._seq), fn))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (not self._heap or self._heap[0][0] > time.monotonic()):
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cv.wait(wait)
                if self._stop:
                    return
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:
                logger.exception("parked wait timeout callback failed")

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
