"""The multiprocess (MP) cache server, its wire protocol and its clients.

Import-light on purpose: ``lmcache.v1.multiprocess.transfer_mode`` must be importable
without pulling zmq or server code, so this package imports nothing at load time.

Modules:
    protocol          ops, payload structs, msgpack encoding rules (docs/design/protocol.md#framing)
    token_hasher      blake3 prefix-chained chunk hashes (4.2)
    payload_codec     copy-path payloads: restricted unpickler and raw_v1 (8.4)
    client            ``MPClient``: the DEALER request client used by workers and schedulers
    server            ``MPCacheServer``: ROUTER loop thread, pools, handlers
    engine            ``CacheEngine`` and its collaborators: the op handlers and server state
    kv_copy           paged KV <-> host chunk copies, shared by the engine and the worker contexts
    http_api          FastAPI admin app (11), one module of routes per area
    transfer_context  worker-side transfer contexts and the mode router
    (docs/design/platform.md#transfer-modes)
"""
