"""``nixl_native`` against real NIXL (docs/design/storage-engine.md#native-connectors,
docs/design/storage-engine.md#backend-nixl): FILE storage (POSIX) writes the file names of
docs/design/storage-formats.md#l2-names and raw bytes, published like ``fs`` (interchangeable with
it); OBJ storage (moto) writes one object per native key string and refuses eviction, having no
delete."""

from __future__ import annotations

import os

import pytest
import torch

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.config import (
    create_l2_adapter_from_registry,
    parse_l2_adapter_dict,
)
from lmcache.v1.distributed.l2_adapters.key_codec import object_key_to_string

pytestmark = pytest.mark.usefixtures("nixl")

PAGE = 4096


def _build(spec, alloc, adapters):
    a = create_l2_adapter_from_registry(parse_l2_adapter_dict(1, spec), alloc.memory_desc())
    adapters.append(a)
    return a


def _file_spec(path, direct="false", **extra):
    return {
        "type": "nixl_native",
        "backend": "POSIX",
        "num_workers": 2,
        "backend_params": {"file_path": str(path), "use_direct_io": direct},
        **extra,
    }


def test_file_storage_writes_the_fs_file_names_and_raw_bytes(nx, h, tmp_path, arena, adapters):
    a = _build(_file_spec(tmp_path), arena, adapters)
    key = ObjectKey(bytes.fromhex("deadbeef"), "meta-llama/Llama-3", 42)
    salted = ObjectKey(bytes.fromhex("deadbeef"), "meta-llama/Llama-3", 42, 0, "t1")
    src = [nx.arena_obj(arena, 5000, seed=1), nx.arena_obj(arena, 10, seed=2)]
    res = h.store(a, [key, salted], src)
    assert res.is_successful() and res.bytes_transferred() == 5010
    names = sorted(os.listdir(tmp_path))
    assert names == [
        "meta-llama-SEP-Llama-3@0x0000002a@0@deadbeef.data",
        "meta-llama-SEP-Llama-3@0x0000002a@0@deadbeef@t1.data",
    ]
    assert (tmp_path / names[0]).read_bytes() == bytes(src[0].byte_array)

    bm = h.lookup(a, [key, h.key(5), salted])
    assert bm.get_indices_list() == [0, 2]
    dst = [nx.arena_obj(arena, 5000, seed=3), nx.arena_obj(arena, 10, seed=4)]
    assert h.load(a, [key, salted], dst).get_indices_list() == [0, 1]
    assert all(torch.equal(s.tensor, d.tensor) for s, d in zip(src, dst, strict=True))
    status = a.report_status()
    assert status["healthy"] is True and status["last_error"] is None
    assert status["extra_status"]["storage_type"] == "FILE"


def test_direct_io_pads_to_the_slot_with_a_zero_tail(nx, h, tmp_path, arena, adapters):
    a = _build(_file_spec(tmp_path, direct="true"), arena, adapters)
    assert a.report_status()["padding"] is True
    src = nx.arena_obj(arena, 5000, seed=1)
    assert h.store(a, [h.key(1)], [src]).bytes_transferred() == 2 * PAGE
    (name,) = os.listdir(tmp_path)
    data = (tmp_path / name).read_bytes()
    assert len(data) == 2 * PAGE and data[:5000] == bytes(src.byte_array)
    assert data[5000:] == bytes(2 * PAGE - 5000)
    dst = nx.arena_obj(arena, 5000, seed=2)
    assert h.load(a, [h.key(1)], [dst]).test(0) is True and torch.equal(dst.tensor, src.tensor)


def test_an_existing_file_is_never_replaced(nx, h, tmp_path, arena, adapters):
    first = _build(_file_spec(tmp_path), arena, adapters)
    second = _build(_file_spec(tmp_path), arena, adapters)
    original = nx.arena_obj(arena, 3000, seed=1)
    assert h.store(first, [h.key(1)], [original]).is_successful()
    assert h.store(second, [h.key(1)], [nx.arena_obj(arena, 3000, seed=2)]).is_successful()
    (name,) = os.listdir(tmp_path)  # and no temp file is left behind
    assert (tmp_path / name).read_bytes() == bytes(original.byte_array)


def test_a_shorter_file_is_a_miss(nx, h, tmp_path, arena, adapters):
    a = _build(_file_spec(tmp_path), arena, adapters)
    assert h.store(a, [h.key(1)], [nx.arena_obj(arena, 100, seed=1)]).is_successful()
    assert h.load(a, [h.key(1)], [nx.arena_obj(arena, 200, seed=2)]).test(0) is False


def test_fs_and_nixl_native_directories_are_interchangeable(nx, h, tmp_path, arena, adapters):
    pytest.importorskip("lmcache.storage.fs", reason="lmcache-fs is not installed")
    native = _build(_file_spec(tmp_path), arena, adapters)
    fs = create_l2_adapter_from_registry(
        parse_l2_adapter_dict(1, {"type": "fs", "base_path": str(tmp_path)})
    )
    adapters.append(fs)
    by_native, by_fs = nx.arena_obj(arena, 7000, seed=1), nx.arena_obj(arena, 7000, seed=2)
    assert h.store(native, [h.key(1)], [by_native]).is_successful()
    assert h.store(fs, [h.key(2)], [by_fs]).is_successful()
    d1, d2 = nx.arena_obj(arena, 7000, seed=3), nx.arena_obj(arena, 7000, seed=4)
    assert h.load(fs, [h.key(1)], [d1]).test(0) is True and torch.equal(d1.tensor, by_native.tensor)
    assert h.load(native, [h.key(2)], [d2]).test(0) is True and torch.equal(d2.tensor, by_fs.tensor)


def test_restart_recovers_usage_and_delete_respects_locks(nx, h, tmp_path, arena, adapters):
    a = _build(_file_spec(tmp_path), arena, adapters)
    assert h.store(a, [h.key(1), h.key(2)], [nx.arena_obj(arena, 1000, seed=i) for i in (1, 2)])
    (tmp_path / "stale.tmp").write_bytes(b"x")
    (tmp_path / "foreign.txt").write_bytes(b"x")
    a.close()

    b = _build(_file_spec(tmp_path, max_capacity_gb=1), arena, adapters)
    assert h.wait_until(lambda: b.report_status()["extra_status"]["scan"]["done"])
    assert b.get_usage().total_bytes_used == 2000
    rec = h.Recorder()
    b.register_listener(rec)  # a late listener gets the recovered keys replayed
    assert sorted(k.chunk_hash for k, _ in rec.stored) == [h.key(1).chunk_hash, h.key(2).chunk_hash]

    assert h.lookup(b, [h.key(1)]).test(0) is True
    b.delete([h.key(1), h.key(2)])
    assert rec.deleted == [h.key(2)]  # key 1 is locked by the lookup
    b.submit_unlock([h.key(1)])
    b.delete([h.key(1)])
    assert rec.deleted == [h.key(2), h.key(1)] and b.get_usage().total_bytes_used == 0
    assert sorted(os.listdir(tmp_path)) == ["foreign.txt", "stale.tmp"]  # a fresh .tmp stays


def test_buffers_outside_the_arena_fail_without_raising(nx, h, tmp_path, arena, adapters):
    a = _build(_file_spec(tmp_path), arena, adapters)
    res = h.store(a, [h.key(1)], [h.make_obj(3000, seed=1)])
    assert not res.is_successful() and os.listdir(tmp_path) == []
    status = a.report_status()
    assert "outside the registered L1 arena" in status["last_error"]
    assert status["is_healthy"] is True  # the caller's fault, not the backend's
    good = nx.arena_obj(arena, 3000, seed=2)
    assert h.store(a, [h.key(2)], [good]).is_successful()
    outside = h.make_obj(3000, seed=3)
    bm = h.load(a, [h.key(2), h.key(2)], [nx.arena_obj(arena, 3000, seed=4), outside])
    assert bm.get_indices_list() == [0]
    assert a.report_status()["is_healthy"] is True  # the caller's fault, not the backend's


def _obj_spec(nx, s3_bucket, **extra):
    endpoint, _, bucket = s3_bucket
    return {
        "type": "nixl_native",
        "backend": "OBJ",
        "num_workers": 2,
        "backend_params": nx.obj_backend_params(endpoint, bucket),
        **extra,
    }


def test_obj_storage_names_objects_by_the_native_key_string(nx, h, s3_bucket, arena, adapters):
    _, client, bucket = s3_bucket
    a = _build(_obj_spec(nx, s3_bucket), arena, adapters)
    assert a.report_status()["has_delete"] is False
    keys = [ObjectKey(bytes([0, 1, 2, 3]), "llama", 255), h.key(7, salt="alice")]
    src = [nx.arena_obj(arena, 5000, seed=1), nx.arena_obj(arena, 64, seed=2)]
    assert h.store(a, keys, src).bytes_transferred() == 5064
    objects = {o["Key"]: o["Size"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    assert objects == {"llama@000000ff@0@00010203": 5000, object_key_to_string(keys[1]): 64}
    assert h.lookup(a, [keys[0], h.key(99), keys[1]]).get_indices_list() == [0, 2]
    dst = [nx.arena_obj(arena, 5000, seed=3), nx.arena_obj(arena, 64, seed=4)]
    assert h.load(
        a, keys + [h.key(99)], dst + [nx.arena_obj(arena, 8, seed=5)]
    ).get_indices_list() == [0, 1]
    assert all(torch.equal(s.tensor, d.tensor) for s, d in zip(src, dst, strict=True))


def test_obj_storage_refuses_an_eviction_block(nx, s3_bucket, arena):
    spec = _obj_spec(nx, s3_bucket, max_capacity_gb=1, eviction={"eviction_policy": "LRU"})
    with pytest.raises(ValueError, match="^OBJ storage does not support eviction"):
        create_l2_adapter_from_registry(parse_l2_adapter_dict(1, spec), arena.memory_desc())


def test_file_storage_needs_a_file_path(arena):
    spec = {"type": "nixl_native", "backend": "POSIX", "backend_params": {}}
    with pytest.raises(ValueError, match="must include 'file_path' for FILE_SEG backend 'POSIX'"):
        create_l2_adapter_from_registry(parse_l2_adapter_dict(1, spec), arena.memory_desc())


def test_an_unknown_plugin_names_the_plugins_found(tmp_path, arena):
    spec = _file_spec(tmp_path)
    spec["backend"] = "NOPE"
    with pytest.raises(
        RuntimeError, match=r"could not create backend 'NOPE'.*plugins found: .*POSIX"
    ):
        create_l2_adapter_from_registry(parse_l2_adapter_dict(1, spec), arena.memory_desc())
