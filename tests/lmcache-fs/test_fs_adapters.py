"""Behaviour of the `fs` and `fs_native` adapters (docs/design/storage-formats.md#l2-names,
docs/design/storage-engine.md#backend-fs)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from lmcache.storage.fs import FSL2AdapterConfig, FSNativeL2AdapterConfig
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.config import (
    get_registered_l2_adapter_types,
    get_type_name_for_config,
)
from lmcache.v1.distributed.l2_adapters.key_codec import object_key_to_filename


def _data_files(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".data"))


def _tmp_files(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".tmp"))


def test_types_registered_through_entry_point():
    types = get_registered_l2_adapter_types()
    assert "fs" in types and "fs_native" in types
    assert get_type_name_for_config(FSL2AdapterConfig(base_path="/x")) == "fs"
    assert get_type_name_for_config(FSNativeL2AdapterConfig(base_path="/x")) == "fs_native"


def test_start_up_scan_leaves_files_of_a_running_store_to_that_store(
    h, fs_type, adapters, tmp_path, monkeypatch
):
    # The scan runs while the first stores do; a file it finds for a store still in flight
    # is that store's to count (its result's bytes, and the size it charges).
    a = h.build(fs_type, base_path=str(tmp_path))
    adapters.append(a)
    scanned = threading.Event()
    if fs_type == "fs":  # hold every write until the scan has reported: always in flight
        from lmcache.storage.fs import fs_adapter

        real_write = fs_adapter.write_new_file
        monkeypatch.setattr(
            fs_adapter,
            "write_new_file",
            lambda *args, **kw: scanned.wait(10) and real_write(*args, **kw),
        )
        record_scanned = a._on_recovered
    else:  # the C++ writes take far longer than the call below (no hook to hold them)
        record_scanned = a.record_known_keys

    def scan_reports_them() -> None:  # with sizes a racing scan could not know yet
        record_scanned(keys, [1, 1, 1])
        scanned.set()

    keys = [h.key(i) for i in range(3)]
    objs = [h.make_obj(n, seed=i) for i, n in enumerate([10, 4096, 100_000])]
    res = h.store(a, keys, objs, while_running=scan_reports_them)
    assert res.is_successful() and res.bytes_transferred() == 10 + 4096 + 100_000
    assert a.get_usage().total_bytes_used == 10 + 4096 + 100_000


def test_round_trip_unequal_sizes(h, fs_type, adapters, tmp_path):
    a = h.build(fs_type, base_path=str(tmp_path))
    adapters.append(a)
    assert (
        len({a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()}) == 3
    )
    keys = [h.key(i) for i in range(3)]
    objs = [h.make_obj(n, seed=i) for i, n in enumerate([10, 4096, 100_000])]
    res = h.store(a, keys, objs)
    assert res.is_successful() and res.bytes_transferred() == 10 + 4096 + 100_000

    bm = h.lookup(a, [keys[0], h.key(99), keys[2]])
    assert bm.test(0) is True and bm.test(1) is False and bm.test(2) is True
    a.submit_unlock([keys[0], keys[2]])

    dst = [h.empty_like(o) for o in objs]
    bm = h.load(a, keys, dst)
    assert [bm.test(i) for i in range(3)] == [True, True, True]
    for o, d in zip(objs, dst, strict=False):
        assert torch.equal(o.raw_tensor[: o.get_size()], d.raw_tensor[: d.get_size()])

    miss = h.make_obj(10, seed=5)
    bm = h.load(a, [h.key(99)], [miss])
    assert bm.test(0) is False


def test_file_names_byte_identical_to_0_5_6(h, fs_type, adapters, tmp_path):
    a = h.build(fs_type, base_path=str(tmp_path))
    adapters.append(a)
    k1 = ObjectKey(bytes.fromhex("deadbeef"), "meta-llama/Llama-3", 42)
    k2 = ObjectKey(bytes.fromhex("deadbeef"), "meta-llama/Llama-3", 42, 0, "t1")
    k3 = ObjectKey(bytes([0, 1, 2, 3]), "llama", 255, 26)
    assert h.store(a, [k1, k2, k3], [h.make_obj(64, seed=i) for i in range(3)]).is_successful()
    assert _data_files(tmp_path) == sorted(
        [
            "meta-llama-SEP-Llama-3@0x0000002a@0@deadbeef.data",
            "meta-llama-SEP-Llama-3@0x0000002a@0@deadbeef@t1.data",
            "llama@0x000000ff@1a@00010203.data",
        ]
    )
    assert {object_key_to_filename(k) for k in (k1, k2, k3)} == set(_data_files(tmp_path))
    assert _tmp_files(tmp_path) == []


def test_golden_0_5_6_files_load(h, fs_type, adapters, tmp_path):
    """Files named and laid out by LMCache 0.5.6 (raw bytes, no header) load as-is."""
    payload = bytes(range(256)) * 16
    (tmp_path / "Qwen-SEP-Qwen3-8B@0x01010000@0@00000000000000000000000000000abc.data").write_bytes(
        payload
    )
    a = h.build(fs_type, base_path=str(tmp_path))
    adapters.append(a)
    k = ObjectKey(bytes.fromhex("00000000000000000000000000000abc"), "Qwen/Qwen3-8B", 0x01010000)
    assert h.lookup(a, [k]).test(0) is True
    dst = h.make_obj(len(payload), seed=-1)
    assert h.load(a, [k], [dst]).test(0) is True
    assert bytes(dst.byte_array) == payload


def test_duplicate_store_reports_zero_bytes_and_never_replaces(h, fs_type, adapters, tmp_path):
    a = h.build(fs_type, base_path=str(tmp_path))
    adapters.append(a)
    rec = h.Recorder()
    a.register_listener(rec)
    k = h.key(1)
    first, second = h.make_obj(4096, seed=1), h.make_obj(4096, seed=2)
    assert h.store(a, [k], [first]).bytes_transferred() == 4096
    res = h.store(a, [k], [second])
    assert res.is_successful() and res.bytes_transferred() == 0 and int(res) == 0
    assert (tmp_path / object_key_to_filename(k)).read_bytes() == bytes(first.byte_array)
    assert a.get_usage().total_bytes_used == 4096  # not double-counted
    assert sum(s for _, s in rec.stored) == 4096


def test_existing_file_from_another_writer_is_kept(h, fs_type, adapters, tmp_path):
    k = h.key(7)
    (tmp_path / object_key_to_filename(k)).write_bytes(b"A" * 128)
    a = h.build(fs_type, base_path=str(tmp_path))
    adapters.append(a)
    assert h.store(a, [k], [h.make_obj(128, seed=3)]).is_successful()
    assert (tmp_path / object_key_to_filename(k)).read_bytes() == b"A" * 128


def test_delete_removes_file_and_usage(h, fs_type, adapters, tmp_path):
    a = h.build(fs_type, base_path=str(tmp_path), max_capacity_gb=1)
    adapters.append(a)
    rec = h.Recorder()
    a.register_listener(rec)
    keys = [h.key(i) for i in range(3)]
    h.store(a, keys, [h.make_obj(1000, seed=i) for i in range(3)])
    assert a.get_usage().total_bytes_used == 3000
    assert a.get_usage().total_capacity_bytes == 1 << 30
    a.delete(keys[:2] + [h.key(42)])
    assert h.wait_until(lambda: a.get_usage().total_bytes_used == 1000)
    assert _data_files(tmp_path) == [object_key_to_filename(keys[2])]
    assert sorted(k.chunk_hash for k in rec.deleted) == sorted(k.chunk_hash for k in keys[:2])


def test_lookup_lock_holds_off_delete_until_unlock(h, fs_type, adapters, tmp_path):
    a = h.build(fs_type, base_path=str(tmp_path))
    adapters.append(a)
    rec = h.Recorder()
    a.register_listener(rec)
    k = h.key(1)
    h.store(a, [k], [h.make_obj(512)])
    assert h.lookup(a, [k]).test(0) is True  # locks it
    a.delete([k])
    assert (tmp_path / object_key_to_filename(k)).exists()
    assert rec.deleted == []
    a.submit_unlock([k])
    a.delete([k])  # the later delete goes through and still notifies
    assert h.wait_until(lambda: not (tmp_path / object_key_to_filename(k)).exists())
    assert h.wait_until(lambda: rec.deleted == [k])
    assert a.get_usage().total_bytes_used == 0


def test_load_fires_access_event(h, fs_type, adapters, tmp_path):
    a = h.build(fs_type, base_path=str(tmp_path))
    adapters.append(a)
    rec = h.Recorder()
    a.register_listener(rec)
    k = h.key(3)
    obj = h.make_obj(256)
    h.store(a, [k], [obj])
    h.load(a, [k, h.key(4)], [h.empty_like(obj), h.empty_like(obj)])
    assert h.wait_until(lambda: rec.accessed == [k])


def test_restart_recovers_usage_and_cleans_stale_temp_files(h, fs_type, adapters, tmp_path):
    a = h.build(fs_type, base_path=str(tmp_path))
    keys = [h.key(i) for i in range(4)]
    h.store(a, keys, [h.make_obj(1000 + i, seed=i) for i in range(4)])
    a.close()
    (tmp_path / "llama@0x00000000@0@000000ff.data").write_bytes(b"")  # empty: skipped
    (tmp_path / "not-a-key.data").write_bytes(b"xyz")  # unparseable: skipped
    stale = tmp_path / "llama@0x00000000@0@00000001.1-2-deadbeef.tmp"
    stale.write_bytes(b"partial")
    old = time.time() - 2 * 3600
    os.utime(stale, (old, old))
    fresh = tmp_path / "llama@0x00000000@0@00000002.tmp"  # a live 0.5.6 writer's temp file
    fresh.write_bytes(b"partial")

    b = h.build(fs_type, base_path=str(tmp_path), max_capacity_gb=1)
    adapters.append(b)
    rec = h.Recorder()
    b.register_listener(rec)
    scan = lambda: b.report_status().get("scan") or b.report_status()["extra_status"]["scan"]  # noqa: E731
    assert h.wait_until(lambda: scan()["done"])
    assert b.get_usage().total_bytes_used == sum(1000 + i for i in range(4))
    s = scan()
    assert s["keys_recovered"] == 4 and s["skipped_empty"] == 1 and s["skipped_unparseable"] == 1
    assert not stale.exists() and fresh.exists()
    # Recovered keys are tracked: deleting one reports its recovered size.
    b.delete([keys[0]])
    assert h.wait_until(lambda: b.get_usage().total_bytes_used == sum(1001 + i for i in range(3)))


def test_padded_longer_file_is_accepted_shorter_is_a_miss(h, fs_type, adapters, tmp_path):
    k_long, k_short = h.key(1), h.key(2)
    (tmp_path / object_key_to_filename(k_long)).write_bytes(b"\x07" * 4000 + b"\x00" * 96)
    (tmp_path / object_key_to_filename(k_short)).write_bytes(b"\x07" * 3999)
    a = h.build(fs_type, base_path=str(tmp_path))
    adapters.append(a)
    d1, d2 = h.make_obj(4000, seed=-1), h.make_obj(4000, seed=-1)
    bm = h.load(a, [k_long, k_short], [d1, d2])
    assert bm.test(0) is True and bm.test(1) is False
    assert bytes(d1.byte_array) == b"\x07" * 4000


@pytest.mark.parametrize("offset", [0, 1])
def test_odirect_aligned_and_unaligned_buffers(h, fs_type, adapters, tmp_path, offset):
    """O_DIRECT only when address and length are aligned; otherwise buffered I/O.
    0.5.6 checked only the length, so a misaligned address with an aligned length failed."""
    a = h.build(fs_type, base_path=str(tmp_path), use_odirect=True)
    adapters.append(a)
    src = h.make_obj(8192, seed=9, align=4096, offset=offset)
    assert (src.data_ptr % 4096 == 0) == (offset == 0)
    k = h.key(offset)
    assert h.store(a, [k], [src]).is_successful()
    dst = h.make_obj(8192, seed=-1, align=4096, offset=offset)
    assert h.load(a, [k], [dst]).test(0) is True
    assert torch.equal(src.raw_tensor[:8192], dst.raw_tensor[:8192])


def test_odirect_flag_only_for_aligned_buffers_and_one_warning(
    h, adapters, tmp_path, monkeypatch, caplog
):
    """The Python `fs` type opens data files with O_DIRECT exactly when the buffer is aligned,
    and warns once (not per buffer) about unaligned ones."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("os.O_DIRECT not available on this platform")
    from lmcache.storage.fs import _files

    opened: list[int] = []
    real_open = _files.os.open

    def recording_open(path, flags, *args, **kwargs):
        if str(path).startswith(str(tmp_path)) and not flags & os.O_DIRECTORY:
            opened.append(flags)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(_files.os, "open", recording_open)
    a = h.build("fs", base_path=str(tmp_path), use_odirect=True)
    adapters.append(a)

    def direct_flags(step) -> list[bool]:
        opened.clear()
        step()
        assert opened, "the adapter opened no data file"
        return [bool(f & os.O_DIRECT) for f in opened]

    caplog.set_level("WARNING")
    aligned = h.make_obj(8192, seed=1, align=4096, offset=0)
    assert all(direct_flags(lambda: h.store(a, [h.key(1)], [aligned])))
    dst = h.make_obj(8192, seed=-1, align=4096, offset=0)
    assert all(direct_flags(lambda: h.load(a, [h.key(1)], [dst])))
    assert not [r for r in caplog.records if "not aligned" in r.getMessage()]

    for i in (2, 3):  # two unaligned buffers: buffered I/O, a single warning
        odd = h.make_obj(8192, seed=i, align=4096, offset=1)
        assert not any(direct_flags(lambda o=odd, i=i: h.store(a, [h.key(i)], [o])))
        back = h.make_obj(8192, seed=-1, align=4096, offset=1)
        assert not any(direct_flags(lambda b=back, i=i: h.load(a, [h.key(i)], [b])))
        assert bytes(back.byte_array) == bytes(odd.byte_array)
    assert len([r for r in caplog.records if "not aligned" in r.getMessage()]) == 1
    assert bytes(dst.byte_array) == bytes(aligned.byte_array)


def test_relative_tmp_dir_holds_temp_files(h, fs_type, adapters, tmp_path):
    a = h.build(fs_type, base_path=str(tmp_path), relative_tmp_dir="staging")
    adapters.append(a)
    h.store(a, [h.key(i) for i in range(5)], [h.make_obj(300, seed=i) for i in range(5)])
    assert len(_data_files(tmp_path)) == 5
    assert os.listdir(tmp_path / "staging") == []


def test_fs_and_fs_native_share_directories(h, adapters, tmp_path):
    py = h.build("fs", base_path=str(tmp_path))
    nat = h.build("fs_native", base_path=str(tmp_path))
    adapters += [py, nat]
    a_obj, b_obj = h.make_obj(5000, seed=1), h.make_obj(7000, seed=2)
    h.store(py, [h.key(1)], [a_obj])
    h.store(nat, [h.key(2)], [b_obj])
    for reader, k, obj in ((nat, h.key(1), a_obj), (py, h.key(2), b_obj)):
        dst = h.empty_like(obj)
        assert h.load(reader, [k], [dst]).test(0) is True
        assert bytes(dst.byte_array) == bytes(obj.byte_array)


def test_fs_native_padding_writes_slot_with_zero_tail(h, adapters, tmp_path):
    a = h.build("fs_native", base_path=str(tmp_path), use_odirect=True)
    adapters.append(a)
    obj = h.make_obj(4000, seed=4, align=4096, phy=4096)
    obj.raw_tensor[4000:4096] = 0xAB  # stale allocator bytes must not reach the file
    k = h.key(1)
    assert h.store(a, [k], [obj]).is_successful()
    data = (tmp_path / object_key_to_filename(k)).read_bytes()
    assert len(data) == 4096 and data[:4000] == bytes(obj.byte_array) and data[4000:] == bytes(96)
    dst = h.make_obj(4000, seed=-1, align=4096, phy=4096)
    assert h.load(a, [k], [dst]).test(0) is True
    assert bytes(dst.byte_array) == bytes(obj.byte_array)


def test_close_is_idempotent(h, fs_type, tmp_path):
    a = h.build(fs_type, base_path=str(tmp_path))
    a.close()
    a.close()


def test_eviction_controller_deletes_fs_keys_including_recovered_ones(
    h, fs_type, adapters, tmp_path
):
    from lmcache.v1.distributed.config import EvictionConfig
    from lmcache.v1.distributed.eviction import L2EvictionController

    cap_gb = 10_000 / (1 << 30)  # 10 000 bytes
    first = h.build(fs_type, base_path=str(tmp_path), max_capacity_gb=cap_gb)
    old_keys = [h.key(i) for i in range(5)]
    h.store(first, old_keys, [h.make_obj(1000, seed=i) for i in range(5)])
    first.close()

    # Restart: the scan recovers 5 000 bytes; the controller attaches afterwards.
    a = h.build(fs_type, base_path=str(tmp_path), max_capacity_gb=cap_gb)
    adapters.append(a)
    assert h.wait_until(lambda: a.get_usage().total_bytes_used == 5000)
    ctl = L2EvictionController(interval_s=3600)
    assert ctl.add_adapter(0, a, EvictionConfig("LRU", trigger_watermark=0.8, eviction_ratio=0.5))
    new_keys = [h.key(100 + i) for i in range(5)]
    h.store(a, new_keys, [h.make_obj(1000, seed=i) for i in range(5)])
    assert a.get_usage().usage_fraction == 1.0

    ctl.run_once()
    assert h.wait_until(lambda: a.get_usage().total_bytes_used == 5000)
    left = {n for n in os.listdir(tmp_path) if n.endswith(".data")}
    # LRU: the recovered (older) keys went first; the new ones stay.
    assert left == {object_key_to_filename(k) for k in new_keys}


def test_keys_of_one_task_run_concurrently(h, adapters, tmp_path, monkeypatch):
    """fs processes the keys of a task on its worker pool (0.5.6: one after another): each
    read waits at a two-party barrier, which only a concurrent second read can release."""
    import threading

    from lmcache.storage.fs import fs_adapter

    a = h.build("fs", base_path=str(tmp_path), num_workers=2)
    adapters.append(a)
    keys = [h.key(1), h.key(2)]
    objs = [h.make_obj(100, seed=1), h.make_obj(100, seed=2)]
    h.store(a, keys, objs)
    barrier = threading.Barrier(2, timeout=10)
    real_read = fs_adapter.read_file_into

    def read_at_barrier(*args, **kwargs):
        barrier.wait()  # raises BrokenBarrierError (a miss) if the other key never comes
        return real_read(*args, **kwargs)

    monkeypatch.setattr(fs_adapter, "read_file_into", read_at_barrier)
    bm = h.load(a, keys, [h.empty_like(o) for o in objs], timeout=30)
    assert bm.popcount() == 2
