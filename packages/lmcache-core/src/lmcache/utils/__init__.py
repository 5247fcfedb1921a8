"""Small shared helpers of lmcache-core (logging, profiling annotations)."""

from lmcache.utils.log import RateLimitedLog, init_logger
from lmcache.utils.nvtx import _lmcache_nvtx_annotate

__all__ = ["RateLimitedLog", "_lmcache_nvtx_annotate", "init_logger"]
