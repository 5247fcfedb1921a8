"""Small shared helpers of lmcache-core (logging, profiling annotations)."""

from lmcache.utils.log import RateLimitedLog, init_logger
from lmcache.utils.nvtx import lmcache_nvtx_annotate

#: The name vLLM's in-tree connector imports (LMCache 0.5.6's spelling).
_lmcache_nvtx_annotate = lmcache_nvtx_annotate

__all__ = ["RateLimitedLog", "_lmcache_nvtx_annotate", "init_logger", "lmcache_nvtx_annotate"]
