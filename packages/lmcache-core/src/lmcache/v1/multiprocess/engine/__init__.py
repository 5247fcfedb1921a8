"""Op handlers of the MP server: registrations, sessions, lookups, transfers, liveness.

``CacheEngine`` holds every piece of server state; ``server.MPCacheServer`` owns the
sockets and calls ``engine.handlers[op_name](ctx, *params)`` on the thread the op's
kind selects. Handlers raise ``RequestError`` for requests 0.5.6 would leave unanswered
(the transport turns it into silence or a negotiated error reply) and return False-ish
values where 0.5.6 already replies with one (docs/design/protocol.md#errors).

The package follows the engine's areas, one module each: ``state`` (records and helpers
every area shares), ``instances`` (registration, liveness), ``lookup`` (lookups and
sessions), ``write_path``, ``read_path``, ``janitor`` (session cleaner and reaper), and
``cache_engine`` (``CacheEngine``: the state, the op table, lifecycle and status).
"""

from lmcache.v1.multiprocess.engine.cache_engine import CacheEngine
from lmcache.v1.multiprocess.engine.state import (
    ENGINE_DRIVEN,
    HOST_DEVICE,
    L1_TAG,
    LMCACHE_DRIVEN,
    MODE_FIX,
    Instance,
    Layout,
    PendingRead,
    RequestContext,
    Reservation,
    codec_feature,
    fan_out_keys,
    object_key_cache,
)

__all__ = [
    "ENGINE_DRIVEN",
    "HOST_DEVICE",
    "L1_TAG",
    "LMCACHE_DRIVEN",
    "MODE_FIX",
    "CacheEngine",
    "Instance",
    "Layout",
    "PendingRead",
    "RequestContext",
    "Reservation",
    "object_key_cache",
    "codec_feature",
    "fan_out_keys",
]
