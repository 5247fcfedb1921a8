"""Opt-in diagnostics of ``lmcache server`` (LMCache 0.5.6's flags, INFO log lines):

* ``--enable-gc-monitor``: every garbage collection is timed, and those that paused the
  process at least ``--gc-monitor-min-pause-ms`` are logged, with the most common object
  types of the collected generation when ``--gc-monitor-top-objects N`` > 0.
* ``--enable-extra-logging``: every ``--extra-logging-interval`` seconds, one line with
  the stores, retrieves and chunks moved since the last line, and L1 use.
"""

from __future__ import annotations

import collections
import gc
import threading
import time
from collections.abc import Callable
from typing import Any

from lmcache.utils import init_logger

logger = init_logger(__name__)


class GCMonitor:
    def __init__(self, min_pause_ms: float, top_objects: int = 0) -> None:
        self.min_pause_ms = min_pause_ms
        self.top_objects = top_objects
        self._t0 = 0.0
        self._top: list[tuple[str, int]] = []

    def install(self) -> None:
        gc.callbacks.append(self._on_gc)

    def remove(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            if self.top_objects:
                kinds = collections.Counter(
                    type(o).__name__ for o in gc.get_objects(info["generation"])
                )
                self._top = kinds.most_common(self.top_objects)
            self._t0 = time.perf_counter()
            return
        pause_ms = (time.perf_counter() - self._t0) * 1000
        if pause_ms < self.min_pause_ms:
            return
        top = ""
        if self._top:
            top = "; most common types: " + ", ".join(f"{k}={n}" for k, n in self._top)
        logger.info(
            "GC generation %d paused %.1f ms: collected %d, uncollectable %d%s",
            info.get("generation", -1),
            pause_ms,
            info.get("collected", 0),
            info.get("uncollectable", 0),
            top,
        )


class ExtraStatsLogger:
    """One INFO line per interval from the server's counters and L1 use."""

    COUNTERS = (
        ("stores", "lmcache_mp_num_finished_stores"),
        ("retrieves", "lmcache_mp_num_finished_retrieves"),
        ("chunks written", "lmcache_mp_l1_write_chunks"),
        ("chunks loaded", "lmcache_mp_num_chunks_loaded"),
        ("lookups", "lmcache_mp_lookups_requests"),
        ("hit tokens", "lmcache_mp_lookup_hit_tokens"),
    )

    def __init__(
        self,
        interval: float,
        value: Callable[[str], float],
        memory_usage: Callable[[], tuple[int, int]],
    ) -> None:
        self.interval = interval
        self._value = value
        self._memory_usage = memory_usage
        self._last = {name: 0.0 for _label, name in self.COUNTERS}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mp-extra-logging", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def line(self, elapsed: float) -> str:
        parts = []
        for label, name in self.COUNTERS:
            now = self._value(name)
            delta, self._last[name] = now - self._last[name], now
            parts.append(f"{label} {delta:.0f} ({delta / elapsed:.1f}/s)")
        used, total = self._memory_usage()
        share = used / total * 100 if total else 0.0
        return (
            f"last {elapsed:.1f} s: "
            + ", ".join(parts)
            + f"; L1 {used / 2**30:.2f} of {total / 2**30:.2f} GiB ({share:.1f}%)"
        )

    def _run(self) -> None:
        t = time.monotonic()
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                logger.info("extra stats: %s", self.line(now - t))
            except Exception as exc:  # diagnostics never take the server down
                logger.warning("extra stats failed: %s", exc)
            t = now
