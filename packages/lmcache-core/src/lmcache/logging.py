"""0.5.x import path for the logger factory (``from lmcache.logging import init_logger``)."""

from lmcache.utils.log import init_logger

__all__ = ["init_logger"]
