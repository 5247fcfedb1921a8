"""Small shared helpers of lmcache-core (logging, errors)."""

from lmcache.utils.log import init_logger

__all__ = ["init_logger"]
