"""``mooncake_store``'s keys against LMCache 0.5.6's config class: the same JSON gives the same
worker settings and the same setup keys for Mooncake (0.5.6's config imports on CPU; its
adapter needs a C++ extension its wheel does not ship)."""

from __future__ import annotations

import json
import subprocess

import pytest

pytest.importorskip("lmcache.storage.mooncake", reason="lmcache-mooncake is not installed")

SPEC = {
    "type": "mooncake_store",
    "local_hostname": "10.0.0.5",
    "metadata_server": "P2PHANDSHAKE",
    "master_server_addr": "10.0.0.1:50051",
    "protocol": "tcp",
    "global_segment_size": 3221225472,
    "local_buffer_size": "1GB",
    "tenant_id": "team-a",
    "num_workers": 6,
    "per_op_workers": {"lookup": 2, "delete": 1},
    "eviction": {"eviction_policy": "LRU"},
}

THEIRS = """
import json, sys
from lmcache.v1.distributed.l2_adapters.mooncake_store_l2_adapter import (
    MooncakeStoreL2AdapterConfig as C,
)
c = C.from_dict(json.loads(sys.argv[1]))
print(json.dumps([c.setup_config, c.num_workers, c.per_op_workers]))
"""


def test_the_same_json_gives_the_same_setup_and_workers(compat_venv):
    from lmcache.storage.mooncake.config import MooncakeStoreL2AdapterConfig

    out = subprocess.run(
        [str(compat_venv / "bin" / "python"), "-c", THEIRS, json.dumps(SPEC)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"LMCACHE_TRACK_USAGE": "false", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    setup, workers, per_op = json.loads(out.stdout.strip().splitlines()[-1])
    ours = MooncakeStoreL2AdapterConfig.from_dict(dict(SPEC))
    assert ours.setup_config == setup
    assert ours.num_workers == workers and ours.per_op_workers == per_op
