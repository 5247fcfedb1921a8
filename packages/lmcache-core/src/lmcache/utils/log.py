"""Process-wide logging setup for every ``lmcache.*`` logger.

``init_logger(__name__)`` is the one way modules get a logger. The level comes
from ``LMCACHE_LOG_LEVEL`` (default INFO); handlers are attached once to the
``lmcache`` root logger so records from every wheel share one format.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

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
