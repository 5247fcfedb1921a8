"""Process-wide logging setup for every ``lmcache.*`` logger.

``init_logger(__name__)`` is the one way modules get a logger. The level comes
from ``LMCACHE_LOG_LEVEL`` (default INFO); handlers are attached once to the
``lmcache`` root logger so records from every wheel share one format.
``RateLimitedLog`` is the one way to log a condition that may repeat many times a
second (a failing backend, a full L1).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

_ROOT_NAME = "lmcache"
_FORMAT = "[%(asctime)s] LMCache %(levelname)s: %(message)s (%(filename)s:%(lineno)d:%(name)s)"
_configured = False
_lock = threading.Lock()


def _configure_root() -> None:
    global _configured
    with _lock:
        if _configured:
            return
        root = logging.getLogger(_ROOT_NAME)
        level_name = os.environ.get("LMCACHE_LOG_LEVEL", "INFO").strip().upper() or "INFO"
        level = logging.getLevelName(level_name)
        root.setLevel(level if isinstance(level, int) else logging.INFO)
        if not root.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
            root.addHandler(handler)
        # Records still propagate so pytest's caplog and host applications see them.
        _configured = True


def init_logger(name: str) -> logging.Logger:
    """Return the logger for ``name``, configuring the ``lmcache`` root once."""
    _configure_root()
    if name != _ROOT_NAME and not name.startswith(_ROOT_NAME + "."):
        name = f"{_ROOT_NAME}.{name}"
    return logging.getLogger(name)


class RateLimitedLog:
    """Logs the first occurrence of each condition at once; repeats within ``interval``
    seconds are only counted, and the next message logged after the interval says how many
    were left out. A failing backend thus costs a few lines a minute instead of one per
    task (a full disk once printed 5,742 warnings in 40 s).

    ``key`` names the condition (e.g. ``("store", adapter_index)``); messages with different
    keys never hide each other. Thread-safe; remembers at most ``max_keys`` keys."""

    def __init__(self, logger: logging.Logger, interval: float = 30.0, max_keys: int = 1024):
        self.logger = logger
        self.interval = float(interval)
        self.max_keys = max_keys
        self._seen: dict[object, list[float]] = {}  # key -> [last logged (monotonic), skipped]
        self._lock = threading.Lock()

    def log(self, level: int, key: object, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``key`` was logged less than ``interval`` s ago.
        Returns whether it was logged."""
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get(key)
            if seen is not None and now - seen[0] < self.interval:
                seen[1] += 1
                return False
            skipped = int(seen[1]) if seen is not None else 0
            since = now - seen[0] if seen is not None else 0.0
            self._seen.pop(key, None)
            if len(self._seen) >= self.max_keys:
                del self._seen[next(iter(self._seen))]  # the least recently logged
            self._seen[key] = [now, 0]
        if skipped:
            msg += " (%d more like this in the last %.0f s)"
            args = (*args, skipped, since)
        self.logger.log(level, msg, *args, stacklevel=2)
        return True

    def warning(self, key: object, msg: str, *args: object) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, key, msg, *args)

    def error(self, key: object, msg: str, *args: object) -> bool:
        """:meth:`log` at ERROR."""
        return self.log(logging.ERROR, key, msg, *args)
