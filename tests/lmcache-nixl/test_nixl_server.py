"""A real ``lmcache server`` with the NIXL types: chunks written behind to nixl_store come back
from L2 once L1 is cleared, byte for byte; two servers share a nixl_native directory."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

pytestmark = pytest.mark.usefixtures("nixl")


def _nixl_status(srv) -> dict:
    (adapter,) = httpx.get(srv.http_url + "/status", timeout=10).json()["storage_manager"][
        "l2_adapters"
    ]
    assert adapter["type"] == "nixl_store"
    return adapter


def test_chunks_come_back_from_nixl_store_after_l1_is_cleared(nx, h, tmp_path, lmcache_server):
    lh = nx.l2_helpers
    spec = {
        "type": "nixl_store",
        "backend": "POSIX",
        "pool_size": 8,
        "backend_params": {
            "file_path": str(tmp_path),
            "use_direct_io": "false",
            "file_size": str(8 << 20),
        },
    }
    srv = lmcache_server("--l2-adapter", json.dumps(spec), "--supported-transfer-mode", "auto")
    status = _nixl_status(srv)
    assert status["is_healthy"] is True and status["status"]["slots_total"] == 8 * 2048

    n_blocks = lh.NUM_TOKENS // lh.BLOCK
    src_ids = list(range(1, 1 + n_blocks))
    dst_ids = list(range(1 + n_blocks, 1 + 2 * n_blocks))[::-1]
    writer = lh._Engine(srv.rpc_url, "nixl-model", lh._kv_cache(5, zeros=False))
    try:
        assert writer.ctx.submit_store(writer.key("store"), src_ids).result(60)
    finally:
        writer.close()
    assert h.wait_until(lambda: _nixl_status(srv)["status"]["stored_object_count"] >= 4, 60)
    r = httpx.post(srv.http_url + "/cache/clear", json={"tier": "l1", "force": True}, timeout=10)
    assert r.json() == {"status": "ok", "cleared": {"tier": "l1"}}

    kv = lh._kv_cache(5, zeros=True)
    reader = lh._Engine(srv.rpc_url, "nixl-model", kv)
    try:
        reader.client.call("lookup", reader.key("again", worker_id=None), 1)
        hits = reader.client.call("wait_prefetch_status", "again", 30.0)
        assert hits == 4, f"found {hits} of 4 chunks in L2:\n{srv.log()[-4000:]}"
        assert reader.ctx.submit_retrieve(reader.key("again"), dst_ids).result(60)
    finally:
        reader.close()
    expected = lh._kv_cache(5, zeros=False)
    for e, t in zip(expected, kv, strict=True):
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(e[:, s], t[:, d])
    status = _nixl_status(srv)["status"]
    assert status["healthy"] is True and status["last_error"] is None


def test_two_servers_share_a_nixl_native_directory(h, tmp_path, lmcache_server):
    spec = {
        "type": "nixl_native",
        "backend": "POSIX",
        "backend_params": {"file_path": str(tmp_path), "use_direct_io": "false"},
    }

    def count() -> int:
        return len(list(tmp_path.glob("*.data")))

    h.cross_server_round_trip(lmcache_server, json.dumps(spec), count, model="nixl-native-model")
