"""Two `lmcache server` processes sharing one directory (`fs` and `fs_native`): a prompt
stored through one is retrieved, byte-identical, through the other."""

from __future__ import annotations

import json
import os

from lmcache.v1.distributed.l2_adapters.key_codec import filename_to_object_key


def test_chunk_stored_by_one_server_is_served_by_another(h, tmp_path, lmcache_server, fs_type):
    adapter = json.dumps({"type": fs_type, "base_path": str(tmp_path), "num_workers": 2})

    def count() -> int:
        return sum(1 for n in os.listdir(tmp_path) if n.endswith(".data"))

    h.cross_server_round_trip(lmcache_server, adapter, count, model="xsrv/fs-native")
    names = [n for n in os.listdir(tmp_path) if n.endswith(".data")]
    assert all(n.startswith("xsrv-SEP-fs-native@0x") for n in names)
    assert all(filename_to_object_key(n) is not None for n in names)
