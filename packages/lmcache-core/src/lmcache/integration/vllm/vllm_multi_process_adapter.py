"""The adapters behind ``LMCacheMPConnector`` (imports nothing from vLLM).

vLLM's own copy of the connector imports these names from here, so they stay at
this path; the code lives in small modules next to it.
"""

from lmcache.integration.vllm.mp_ops import LMCacheMPRequestMetadata, LoadStoreOp
from lmcache.integration.vllm.parallel_strategy import ParallelStrategy
from lmcache.integration.vllm.scheduler_adapter import (
    LMCacheMPSchedulerAdapter,
    RequestState,
    RequestTracker,
)
from lmcache.integration.vllm.server_link import ServerLink
from lmcache.integration.vllm.worker_adapter import LMCacheMPWorkerAdapter, new_instance_id

__all__ = [
    "LMCacheMPRequestMetadata",
    "LMCacheMPSchedulerAdapter",
    "LMCacheMPWorkerAdapter",
    "LoadStoreOp",
    "ParallelStrategy",
    "RequestState",
    "RequestTracker",
    "ServerLink",
    "new_instance_id",
]
