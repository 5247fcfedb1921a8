"""Op handlers of the MP server: registrations, sessions, lookups, transfers, liveness.

``CacheEngine`` builds the engine's collaborators and owns the op table; ``server.MPCacheServer``
owns the sockets and calls ``engine.handlers[op_name](ctx, *params)`` on the thread the op's
kind selects. Handlers raise ``RequestError`` for requests 0.5.6 would leave unanswered
(the transport turns it into silence or a negotiated error reply) and return False-ish
values where 0.5.6 already replies with one (docs/design/protocol.md#errors).

One module per collaborator, each with its own state, calling only the public methods of
the others: ``layouts`` (``LayoutTable``: the registered chunk layouts), ``session_keys``
(``SessionKeys``: sessions, their chunk keys, lookups and read shares), ``instances``
(``InstanceRegistry``: registered workers, liveness, their staging when they go),
``host_copy`` (``HostKVCopier``: the server's copies of worker KV, with the functions of
``lmcache.v1.multiprocess.kv_copy``), ``write_path`` (``WritePath``), ``read_path``
(``ReadPath``), ``janitor`` (``Janitor``: session cleaner and reaper threads) and
``cache_engine`` (``CacheEngine``: wiring, op table, lifecycle, status). ``records`` holds
the records they share (``Instance``, ``Layout``, ``Reservation``, ``PendingRead``,
``RequestContext``) and the ObjectKey fan-out; ``parker`` the timeouts of parked waits.
"""

from lmcache.v1.multiprocess.engine.cache_engine import CacheEngine
from lmcache.v1.multiprocess.engine.records import (
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
