"""Two `lmcache server` processes sharing one Redis: a prompt stored through one is
retrieved, byte-identical, through the other."""

from __future__ import annotations

import json

from lmcache.v1.distributed.l2_adapters.key_codec import string_to_object_key


def test_chunk_stored_by_one_server_is_served_by_another(h, redis_server, lmcache_server):
    adapter = json.dumps({"type": "resp", "host": "127.0.0.1", "port": redis_server.port})
    raw = redis_server.client()
    h.cross_server_round_trip(lmcache_server, adapter, lambda: raw.cmd("DBSIZE"), model="xsrv-resp")
    keys = raw.cmd("KEYS", "*")
    assert keys and all(string_to_object_key(k.decode()) is not None for k in keys)
