"""fs L2 with a ``serde`` block, end to end through real ``lmcache server`` processes and
through the storage engine (docs/storage-backends.md#serdes).

- ``checksum`` and ``aesgcm`` (master key from an environment variable): a prompt stored
  through server A is served byte-identical by server B, and the files hold the frame.
- ``checksum``: corrupt or truncated files are misses, never wrong KV; a corrupt one counts in
  ``lmcache_mp_l2_serde_rejected_chunks_total`` (a truncated file is already a miss at the fs
  adapter, which reads exactly the frame's size).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest
import torch

from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import (
    EvictionConfig,
    L1ManagerConfig,
    L1MemoryManagerConfig,
    StorageManagerConfig,
)
from lmcache.v1.distributed.l2_adapters.config import L2AdaptersConfig, parse_l2_adapter_dict
from lmcache.v1.distributed.l2_adapters.key_codec import object_key_to_filename
from lmcache.v1.distributed.storage_manager import StorageManager

KEY_ENV = "LMCACHE_TEST_SERDE_MASTER_KEY"


def data_files(base: Path) -> list[Path]:
    return sorted(p for p in base.iterdir() if p.name.endswith(".data"))


@pytest.mark.parametrize("serde", ["checksum", "aesgcm"])
def test_prompt_round_trips_across_servers_through_a_serde(
    h, tmp_path, lmcache_server, monkeypatch, serde
):
    block = {"type": serde}
    if serde == "aesgcm":
        monkeypatch.setenv(KEY_ENV, "a master key only the environment knows")
        block["master_key_env"] = KEY_ENV
    base = tmp_path / "fs"
    base.mkdir()
    adapter = json.dumps({"type": "fs", "base_path": str(base), "serde": block})
    h.cross_server_round_trip(lmcache_server, adapter, lambda: len(data_files(base)))
    blobs = [p.read_bytes() for p in data_files(base)]
    assert len(blobs) == 4
    if serde == "checksum":
        assert all(b[:4] == b"LMCK" for b in blobs)
    else:
        assert all(b[0] == 1 for b in blobs)  # 0.5.6's aesgcm frame version


def _rejected(server) -> float:
    text = httpx.get(server.http_url + "/metrics", timeout=10).text
    m = re.search(
        r'^lmcache_mp_l2_serde_rejected_chunks_total\{l2_name="fs",serde="checksum"\} (\S+)$',
        text,
        re.M,
    )
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_damaged_checksum_objects_are_misses_never_wrong_kv(h, tmp_path, lmcache_server, damage):
    base = tmp_path / "fs"
    base.mkdir()
    adapter = json.dumps({"type": "fs", "base_path": str(base), "serde": {"type": "checksum"}})
    flags = ("--l2-adapter", adapter, "--supported-transfer-mode", "auto")
    a = lmcache_server(*flags)
    writer = h.Engine(a.rpc_url, "serde-model", h.kv_cache(7, zeros=False))
    try:
        assert writer.ctx.submit_store(writer.key("store"), h.BLOCK_IDS).result(60)
    finally:
        writer.close()
    assert h.wait_until(lambda: len(data_files(base)) >= 4, 60)
    a.stop()
    for p in data_files(base):  # every chunk damaged: the whole prompt must miss
        blob = bytearray(p.read_bytes())
        if damage == "corrupt":
            blob[len(blob) // 2] ^= 0x40  # one bit of the payload
            p.write_bytes(bytes(blob))
        else:
            p.write_bytes(bytes(blob[: len(blob) - 100]))

    b = lmcache_server(*flags)
    kv = h.kv_cache(7, zeros=True)
    reader = h.Engine(b.rpc_url, "serde-model", kv)
    try:
        reader.client.call("lookup", reader.key("read", worker_id=None), 1)
        hits = reader.client.call("wait_prefetch_status", "read", 30.0)
    finally:
        reader.close()
    assert hits == 0, b.log()[-3000:]
    assert all(int(t.float().abs().sum()) == 0 for t in kv)  # nothing written into the engine
    if damage == "corrupt":
        assert h.wait_until(lambda: _rejected(b) >= 1, 30), "no rejected chunk counted"
    else:
        assert _rejected(b) == 0  # the fs adapter already refused the short files


# --- the storage engine: one damaged object among good ones ---------------------------------

LAYOUT = MemoryLayoutDesc([torch.Size([2048])], [torch.bfloat16])  # 4 KiB objects


def _key(i: int) -> ObjectKey:
    return ObjectKey(ObjectKey.IntHash2Bytes(i), "serde-model", 0)


def _storage_manager(base: Path) -> StorageManager:
    mem = L1MemoryManagerConfig(64 * 4096, use_lazy=False, align_bytes=4096, shm_name="")
    adapter = {"type": "fs", "base_path": str(base), "serde": {"type": "checksum"}}
    cfg = StorageManagerConfig(
        L1ManagerConfig(mem),
        EvictionConfig("LRU"),
        L2AdaptersConfig([parse_l2_adapter_dict(1, adapter)]),
    )
    return StorageManager(cfg, eviction_interval_s=60)


def _prefetch(sm: StorageManager, keys: list[ObjectKey]):
    handle = sm.submit_prefetch_task(PrefetchTaskSpec([GroupedObjectKeys(keys, 0, LAYOUT)]))
    assert sm.wait_prefetch_status(handle, 30)
    return sm.query_prefetch_status(handle)


def test_one_corrupt_object_misses_alone_and_is_counted(h, tmp_path):
    base = tmp_path / "fs"
    base.mkdir()
    keys = [_key(i) for i in range(4)]
    values = [torch.randn(2048, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    sm = _storage_manager(base)
    try:
        objs = sm.reserve_write(keys, LAYOUT)
        for k, v in zip(keys, values, strict=True):
            objs[k].tensor.copy_(v.to(torch.bfloat16))
        sm.finish_write(keys)
        assert h.wait_until(lambda: len(data_files(base)) == 4, 30)
    finally:
        sm.close()
    victim = base / object_key_to_filename(keys[2])
    blob = bytearray(victim.read_bytes())
    blob[-1] ^= 0x01
    victim.write_bytes(bytes(blob))

    sm = _storage_manager(base)  # a fresh engine: L1 empty, everything comes from fs
    try:
        # one load task: the corrupt object misses alone (the prefix before it is served;
        # a prefetch keeps only the prefix, so the object after it is not offered)
        r = _prefetch(sm, keys)
        assert repr(r.l2_hit_cells[0]) == "1100"
        st = sm.report_status()["l2_adapters"][0]["status"]
        assert st["serde"] == "checksum" and st["serde_rejected_chunks"] == 1
        hit = keys[:2]
        with sm.read_prefetched_results(hit, r.l1_owners[0]) as got:
            for o, v in zip(got, values[:2], strict=True):
                assert torch.equal(o.tensor, v.to(torch.bfloat16))  # byte-identical
        sm.finish_read_prefetched(hit, 1, r.l1_owners[0])
        r = _prefetch(sm, keys[2:3])  # asked again: still a miss, counted again
        assert repr(r.l2_hit_cells[0]) == "0"
        assert sm.report_status()["l2_adapters"][0]["status"]["serde_rejected_chunks"] == 2
    finally:
        sm.close()
    os.unlink(victim)
