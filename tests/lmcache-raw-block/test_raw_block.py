"""``raw_block`` on a real pre-sized file through lmcache-rust-raw-block-io
(docs/design/storage-engine.md#backend-raw-block): round trip with both I/O engines, with and
without O_DIRECT; the index found again after a restart; 0.5.6's slot format on the file; stale
slots dropped at recovery; capacity (a full device fails the store, delete frees a slot, locked
keys stay); the errors a user gets for a missing dependency, a bad device_path and bad keys."""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import subprocess
import sys
import zlib

import pytest
import torch

from lmcache.v1.distributed.l2_adapters.config import (
    create_l2_adapter_from_registry,
    parse_l2_adapter_dict,
)

SLOT = 4096 + 64 * 1024  # header + 64 KiB
META = 1 << 20


def _spec(device, **over):
    return {
        "type": "raw_block",
        "device_path": str(device),
        "slot_bytes": SLOT,
        "meta_total_bytes": META,
        "use_odirect": False,
        "meta_enable_periodic": False,
        **over,
    }


def _build(spec, adapters):
    a = create_l2_adapter_from_registry(parse_l2_adapter_dict(1, spec))
    adapters.append(a)
    return a


@pytest.mark.parametrize(
    "engine,odirect", [("posix", False), ("posix", True), ("io_uring", False), ("io_uring", True)]
)
def test_round_trip(h, device, adapters, engine, odirect):
    a = _build(_spec(device, io_engine=engine, use_odirect=odirect), adapters)
    rec = h.Recorder()
    a.register_listener(rec)
    sizes = [4096, 5000, 64 * 1024 - 7]
    keys = [h.key(i, salt="s" if i == 2 else "") for i in range(3)]
    # aligned and unaligned buffers: the library bounces what O_DIRECT cannot take directly
    src = [h.make_obj(n, seed=i, align=4096, offset=i) for i, n in enumerate(sizes)]
    res = h.store(a, keys, src)
    assert res.is_successful() and res.bytes_transferred() == 3 * SLOT
    assert rec.stored == [(k, SLOT) for k in keys]
    assert a.get_usage().total_bytes_used == 3 * SLOT
    assert a.get_usage().total_capacity_bytes == ((16 << 20) - META) // SLOT * SLOT

    again = h.store(a, keys[:1], src[:1])  # a duplicate: success, 0 new bytes
    assert again.is_successful() and again.bytes_transferred() == 0

    bm = h.lookup(a, [keys[0], h.key(99), keys[2]])
    assert [bm.test(i) for i in range(3)] == [True, False, True]
    a.submit_unlock([keys[0], keys[2]])

    dst = [h.empty_like(o) for o in src]
    bm = h.load(a, keys + [h.key(99)], dst + [h.make_obj(10)])
    assert [bm.test(i) for i in range(4)] == [True, True, True, False]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(s.tensor, d.tensor)
    assert rec.accessed == keys
    status = a.report_status()
    assert status["is_healthy"] is True and status["indexed_key_count"] == 3


def test_a_destination_of_another_size_is_a_miss(h, device, adapters):
    a = _build(_spec(device), adapters)
    src = h.make_obj(5000, seed=1)
    assert h.store(a, [h.key(1)], [src]).is_successful()
    small, big = h.make_obj(4999, seed=2), h.make_obj(5001, seed=3)
    before = (small.tensor.clone(), big.tensor.clone())
    bm = h.load(a, [h.key(1), h.key(1)], [small, big])
    assert not bm.test(0) and not bm.test(1)
    assert torch.equal(small.tensor, before[0]) and torch.equal(big.tensor, before[1])


def test_restart_finds_the_keys_and_the_file_has_0_5_6_s_slot_format(h, device, adapters):
    a = _build(_spec(device), adapters)
    keys = [h.key(i, model="org/model x", rank=0x102) for i in range(3)]
    src = [h.make_obj(3000 + i, seed=i) for i in range(3)]
    assert h.store(a, keys, src).is_successful()
    a.close()

    raw = device.read_bytes()
    # slot 0 (right after the metadata region): b"LMCBLK01", blake2b-8 of the key name, length
    name = "org%2Fmodel%20x@0x00000102@0@00000000"
    hdr = raw[META : META + 24]
    assert hdr[:8] == b"LMCBLK01"
    assert hdr[8:16] == hashlib.blake2b(name.encode(), digest_size=8).digest()
    assert int.from_bytes(hdr[16:24], "little") == 3000
    assert raw[META + 4096 : META + 4096 + 3000] == src[0].tensor.numpy().tobytes()
    # the checkpoint: seq 1 in container 0, its CRC, and the key names of 0.5.6
    magic, version, seq, length, crc = struct.unpack("<8sIQQI", raw[:32])
    assert (magic, version, seq) == (b"LMCIDX01", 1, 1)
    payload = raw[4096 : 4096 + length]
    assert zlib.crc32(payload) == crc
    state = json.loads(payload)
    assert state["entries"][name] == {
        "offset": META,
        "size": 3000,
        "shape": [3000],
        "dtype": "uint8",
        "fmt": "UNDEFINED",
        "cached_positions": None,
    }
    assert state["next_slot"] == 3 and state["data_base_offset"] == META

    b = _build(_spec(device), adapters)
    rec = h.Recorder()
    b.register_listener(rec)  # recovered keys are replayed to a listener attached later
    assert set(k for k, _ in rec.stored) == set(keys) and len(rec.stored) == 3
    assert b.get_usage().total_bytes_used == 3 * SLOT
    dst = [h.empty_like(o) for o in src]
    bm = h.load(b, keys, dst)
    assert all(bm.test(i) for i in range(3))
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(s.tensor, d.tensor)
    # new stores take fresh slots, never a recovered key's
    extra = h.make_obj(100, seed=9)
    assert h.store(b, [h.key(50)], [extra]).is_successful()
    b.close()
    assert json.loads(_latest_checkpoint(device))["next_slot"] == 4


def _latest_checkpoint(device) -> bytes:
    raw = device.read_bytes()
    best = None
    for base in (0, META // 2):
        magic, _v, seq, length, crc = struct.unpack("<8sIQQI", raw[base : base + 32])
        payload = raw[base + 4096 : base + 4096 + length]
        if magic == b"LMCIDX01" and zlib.crc32(payload) == crc and (not best or seq > best[0]):
            best = (seq, payload)
    assert best is not None
    return best[1]


def test_a_slot_overwritten_behind_the_checkpoint_is_dropped_not_served(h, device, adapters):
    a = _build(_spec(device), adapters)
    src = [h.make_obj(2000, seed=i) for i in range(2)]
    assert h.store(a, [h.key(0), h.key(1)], src).is_successful()
    a.close()
    with open(device, "r+b") as f:  # slot 1 now carries another identity
        f.seek(META + SLOT + 8)
        f.write(b"\xff" * 8)
    b = _build(_spec(device), adapters)
    bm = h.lookup(b, [h.key(0), h.key(1)])
    assert bm.test(0) and not bm.test(1)
    assert "1 stale keys dropped" in b.report_status()["recovery"]
    b.submit_unlock([h.key(0)])
    # the dropped slot is free again
    assert h.store(b, [h.key(7)], [h.make_obj(10, seed=3)]).is_successful()
    assert b.report_status()["max_slots"] - b.report_status()["free_slot_count"] == 2


def test_a_checkpoint_of_another_geometry_is_ignored(h, device, adapters):
    a = _build(_spec(device), adapters)
    assert h.store(a, [h.key(0)], [h.make_obj(100)]).is_successful()
    a.close()
    b = _build(_spec(device, slot_bytes=2 * SLOT), adapters)
    assert "slot_bytes=69632" in b.report_status()["recovery"]
    assert not h.lookup(b, [h.key(0)]).test(0)


def test_full_device_fails_the_store_and_delete_frees_a_slot(h, tmp_path, adapters):
    dev = tmp_path / "small.img"
    with open(dev, "wb") as f:
        f.truncate(META + 3 * SLOT + 100)
    a = _build(_spec(dev), adapters)
    rec = h.Recorder()
    a.register_listener(rec)
    objs = [h.make_obj(1000, seed=i) for i in range(4)]
    assert h.store(a, [h.key(i) for i in range(3)], objs[:3]).is_successful()
    assert a.get_usage().usage_fraction == 1.0
    res = h.store(a, [h.key(3)], objs[3:])
    assert not res.is_successful()
    assert "no free slot" in res.error and "eviction" in res.error

    assert h.lookup(a, [h.key(0)]).test(0)  # locked: delete skips it
    a.delete([h.key(0), h.key(1)])
    assert rec.deleted == [h.key(1)]
    assert a.get_usage().total_bytes_used == 2 * SLOT
    assert h.store(a, [h.key(3)], objs[3:]).is_successful()  # reuses key 1's slot
    dst = h.empty_like(objs[3])
    assert h.load(a, [h.key(3)], [dst]).test(0) and torch.equal(dst.tensor, objs[3].tensor)
    a.submit_unlock([h.key(0)])
    a.delete([h.key(0)])
    assert rec.deleted == [h.key(1), h.key(0)]


def test_an_object_larger_than_a_slot_fails_with_the_fix(h, device, adapters):
    a = _build(_spec(device), adapters)
    res = h.store(a, [h.key(0)], [h.make_obj(SLOT - 4096 + 1)])
    assert not res.is_successful() and "raise slot_bytes" in res.error


def test_missing_dependency_names_the_pip_package(device, monkeypatch):
    monkeypatch.setitem(sys.modules, "lmcache_rust_raw_block_io", None)
    with pytest.raises(ImportError, match="pip install lmcache-rust-raw-block-io"):
        create_l2_adapter_from_registry(parse_l2_adapter_dict(1, _spec(device)))


@pytest.mark.parametrize(
    "path,words",
    [
        ("{tmp}/missing/kv.img", "truncate -s 8G"),
        ("{tmp}", "cannot open device_path"),
        ("{tmp}/empty.img", "has 0 bytes"),
    ],
)
def test_bad_device_path_is_named(tmp_path, path, words):
    (tmp_path / "empty.img").touch()
    path = path.format(tmp=tmp_path)
    with pytest.raises(ValueError) as exc:
        create_l2_adapter_from_registry(parse_l2_adapter_dict(1, _spec(path)))
    assert repr(path) in str(exc.value) and words in str(exc.value)


@pytest.mark.parametrize(
    "over,words",
    [
        ({"slot_bytes": 5000}, "slot_bytes must be a multiple of block_align"),
        ({"slot_bytes": 4096}, "slot_bytes must be >= header_bytes + 1"),
        ({"block_align": 3000}, "block_align must be a power of 2"),
        ({"io_engine": "aio"}, "io_engine must be one of"),
        ({"use_uring_cmd": True}, "use_uring_cmd requires io_uring io_engine"),
        ({"fdp_enabled": True}, "fdp_enabled requires io_engine='io_uring'"),
        ({"persist_enabled": False}, "raw_block requires persist_enabled=true"),
        ({"num_load_workers": 0}, "num_load_workers must be > 0"),
        ({"capacity_bytes": META}, "capacity_bytes must leave space"),
        ({"device_path": ""}, "device_path must be a non-empty string"),
    ],
)
def test_0_5_6_s_config_checks(device, over, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        parse_l2_adapter_dict(1, _spec(device, **over))


def test_config_keys_and_legacy_engine_flag(device):
    cfg = parse_l2_adapter_dict(1, _spec(device, use_iouring=True, capacity_bytes=8 << 20))
    assert cfg.type_name == "raw_block" and cfg.io_engine == "io_uring"
    assert (cfg.header_bytes, cfg.meta_magic, cfg.num_store_workers) == (4096, "LMCIDX01", 2)


def test_nvme_passthrough_is_refused_with_the_alternative(device):
    cfg = parse_l2_adapter_dict(1, _spec(device, io_engine="io_uring", use_uring_cmd=True))
    with pytest.raises(ValueError, match="not provided by lmcache-raw-block yet"):
        create_l2_adapter_from_registry(cfg)


def test_capacity_bytes_limits_the_slots(h, device, adapters):
    a = _build(_spec(device, capacity_bytes=META + 2 * SLOT), adapters)
    assert a.report_status()["max_slots"] == 2


def test_bench_l2_round_trip(device):
    spec = json.dumps(_spec(device))
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", "bench", "l2", "--l2-adapter", spec]
        + ["--num-keys", "4", "--data-size-kb", "64", "--no-skip-verify", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout[proc.stdout.index("{") :])["metrics"]
    assert [report[f"op_{i}"]["total_success"] for i in (0, 2)] == [4, 4]


def test_tasks_submitted_after_close_fail_without_raising(h, device, adapters):
    a = _build(_spec(device), adapters)
    a.close()
    tid = a.submit_store_task([h.key(0)], [h.make_obj(10)])
    result = a.pop_completed_store_tasks()[tid]
    assert not result.is_successful() and "closed" in result.error
    lid = a.submit_load_task([h.key(0)], [h.make_obj(10)])
    assert not a.query_load_result(lid).test(0)


def test_a_partly_failed_store_says_which_keys_landed(h, tmp_path, adapters):
    dev = tmp_path / "two.img"
    with open(dev, "wb") as f:
        f.truncate(META + 2 * SLOT + 100)
    a = _build(_spec(dev), adapters)
    keys = [h.key(i) for i in range(4)]
    objs = [h.make_obj(1000, seed=0), h.make_obj(SLOT), h.make_obj(1000, seed=2)]
    objs.append(h.make_obj(1000, seed=3))
    res = h.store(a, keys, objs)  # key 1 is too big; key 3 finds no slot left
    assert not res.is_successful()
    assert res.landed_keys(keys) == [keys[0], keys[2]]
    assert [h.lookup(a, [k]).test(0) for k in keys] == [True, False, True, False]
