"""The durable, race-free publish protocol of `fs` and `fs_native` (IMPROVE,
docs/design/storage-engine.md#backend-fs):
unique temp names, fsync, no-replace publish, and no torn file after a crash."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lmcache.storage.fs import _files
from lmcache.v1.distributed.l2_adapters.config import (
    get_l2_adapter_config_class,
    parse_l2_adapter_dict,
)
from lmcache.v1.distributed.l2_adapters.key_codec import object_key_to_filename

# A child process: stores keys with `type`, each value derived from (key index, writer id).
CHILD = textwrap.dedent(
    """
    import sys, torch, select
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.l2_adapters.config import (
        create_l2_adapter_from_registry, get_l2_adapter_config_class)
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    type_name, base, writer, first, count, size, fsync = sys.argv[1:8]
    writer, first, count, size = int(writer), int(first), int(count), int(size)
    cfg = get_l2_adapter_config_class(type_name).from_dict(
        {"type": type_name, "base_path": base, "fsync": fsync == "1"})
    a = create_l2_adapter_from_registry(cfg)

    def value(i):
        g = torch.Generator().manual_seed(i * 1000 + writer)
        t = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
        return TensorMemoryObj(t, MemoryObjMetadata(torch.Size([size]), torch.uint8, 0, size, 1))

    print("ready", flush=True)
    for i in range(first, first + count):
        tid = a.submit_store_task([ObjectKey(i.to_bytes(4, "big"), "m", 0)], [value(i)])
        done = {}
        while tid not in done:
            select.select([a.get_store_event_fd()], [], [], 0.2)
            done.update(a.pop_completed_store_tasks())
        print("stored", i, flush=True)
    a.close()
    """
)


def _expected(i: int, writer: int, size: int) -> bytes:
    import torch

    g = torch.Generator().manual_seed(i * 1000 + writer)
    return bytes(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).numpy().tobytes())


def _child(
    type_name: str,
    base,
    writer: int,
    first: int,
    count: int,
    size: int,
    fsync: bool,
    env: dict[str, str] | None = None,
):
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            type_name,
            str(base),
            str(writer),
            str(first),
            str(count),
            str(size),
            "1" if fsync else "0",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=None if env is None else {**os.environ, **env},
    )


def test_concurrent_process_publishers_leave_one_complete_file(tmp_path):
    """Python (fs) and native (fs_native) writers in three processes race on the same keys."""
    size = 256 * 1024
    procs = [_child(("fs", "fs_native")[w % 2], tmp_path, w, 0, 8, size, False) for w in range(3)]
    for p in procs:
        p.communicate(timeout=120)
        assert p.returncode == 0
    names = sorted(os.listdir(tmp_path))
    assert [n for n in names if not n.endswith(".data")] == []  # no temp files left
    assert len(names) == 8
    for i in range(8):
        data = (tmp_path / f"m@0x00000000@0@{i:08x}.data").read_bytes()
        # Exactly one writer's complete value, never a mix.
        assert data in {_expected(i, w, size) for w in range(3)}


def test_concurrent_thread_publishers_leave_one_complete_file(h, tmp_path, adapters, fs_type):
    a = h.build(fs_type, base_path=str(tmp_path), num_workers=8)
    adapters.append(a)
    k = h.key(5)
    objs = [h.make_obj(64 * 1024, seed=s) for s in range(8)]
    # Eight tasks for one key in flight at once on eight worker threads.
    tids = [a.submit_store_task([k], [o]) for o in objs]
    results: dict = {}
    assert h.wait_until(lambda: results.update(a.pop_completed_store_tasks()) or len(results) == 8)
    assert all(results[t].is_successful() for t in tids)
    assert sum(results[t].bytes_transferred() for t in tids) == 64 * 1024  # one winner
    assert os.listdir(tmp_path) == [object_key_to_filename(k)]
    data = (tmp_path / object_key_to_filename(k)).read_bytes()
    assert data in {bytes(o.byte_array) for o in objs}


@pytest.mark.parametrize("type_name", ["fs", "fs_native"])
def test_killed_writer_never_leaves_a_torn_file(tmp_path, type_name):
    size = 1 << 20
    for round_ in range(2):
        p = _child(type_name, tmp_path, 0, round_ * 1000, 1000, size, False)
        assert p.stdout.readline().strip() == "ready"
        # Let it publish a few values, then kill it in the middle of its next write.
        for _ in range(2 + round_):
            assert p.stdout.readline().startswith("stored")
        time.sleep(0.003 * round_)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    data_files = [n for n in os.listdir(tmp_path) if n.endswith(".data")]
    assert len(data_files) >= 5
    for name in data_files:
        i = int(name.split("@")[3].removesuffix(".data"), 16)
        assert (tmp_path / name).read_bytes() == _expected(i, 0, size), name


def test_fs_native_killed_writer_leaves_no_temp_files(h, tmp_path, adapters):
    """fs_native writes into an unnamed O_TMPFILE inode (ext4 and tmpfs have them): a writer
    killed mid-write leaves no temp file behind, not even one the start-up scan must clean."""
    probe = h.build("fs_native", base_path=str(tmp_path))
    adapters.append(probe)
    assert probe.report_status()["extra_status"]["publish_mode"] == "tmpfile"
    for round_ in range(3):
        p = _child("fs_native", tmp_path, 0, round_ * 1000, 1000, 1 << 20, False)
        assert p.stdout.readline().strip() == "ready"
        assert p.stdout.readline().startswith("stored")
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    names = os.listdir(tmp_path)
    assert [n for n in names if not n.endswith(".data")] == []
    for name in names:
        i = int(name.split("@")[3].removesuffix(".data"), 16)
        assert (tmp_path / name).read_bytes() == _expected(i, 0, 1 << 20), name


@pytest.fixture
def named_temp_fs_native(monkeypatch):
    """fs_native as it runs on filesystems without O_TMPFILE (NFS, many FUSE mounts)."""
    from lmcache.storage.fs.native_adapter import FSNativeL2Adapter

    monkeypatch.setattr(FSNativeL2Adapter, "allow_tmpfile", False)


@pytest.mark.usefixtures("named_temp_fs_native")
def test_fs_native_named_temp_publish_round_trips_without_leftovers(h, tmp_path, adapters):
    a = h.build("fs_native", base_path=str(tmp_path), relative_tmp_dir="staging", num_workers=8)
    adapters.append(a)
    assert a.report_status()["extra_status"]["publish_mode"] == "named_temp"
    k = h.key(7)
    objs = [h.make_obj(64 * 1024, seed=s) for s in range(8)]
    tids = [a.submit_store_task([k], [o]) for o in objs]  # eight writers race on one key
    results: dict = {}
    assert h.wait_until(lambda: results.update(a.pop_completed_store_tasks()) or len(results) == 8)
    assert all(results[t].is_successful() for t in tids)
    assert sum(results[t].bytes_transferred() for t in tids) == 64 * 1024  # one winner
    assert sorted(os.listdir(tmp_path)) == sorted([object_key_to_filename(k), "staging"])
    assert os.listdir(tmp_path / "staging") == []
    winner = (tmp_path / object_key_to_filename(k)).read_bytes()
    assert winner in {bytes(o.byte_array) for o in objs}
    dst = h.make_obj(64 * 1024, seed=-1)
    assert h.load(a, [k], [dst]).test(0) is True
    assert bytes(dst.byte_array) == winner


def test_publish_never_replaces_and_discards_loser_temp(tmp_path):
    final = tmp_path / "m@0x00000000@0@00000001.data"
    final.write_bytes(b"winner")
    tmp = tmp_path / _files.unique_tmp_name(final.name)
    tmp.write_bytes(b"loser")
    assert _files.publish_no_replace(str(tmp), str(final)) is False
    assert final.read_bytes() == b"winner" and not tmp.exists()


def test_temp_names_are_unique_per_writer_and_never_parse_as_keys():
    from lmcache.v1.distributed.l2_adapters.key_codec import filename_to_object_key

    name = "m@0x00000000@0@00000001.data"
    names = {_files.unique_tmp_name(name) for _ in range(100)}
    assert len(names) == 100
    for n in names:
        assert n.startswith(f"m@0x00000000@0@00000001.{os.getpid()}-") and n.endswith(".tmp")
        assert filename_to_object_key(n) is None


def test_short_writes_are_retried(h, tmp_path, adapters, monkeypatch):
    real_write = os.write
    calls = []

    def short_write(fd, data):
        calls.append(1)
        return real_write(fd, bytes(memoryview(data)[:1000]))

    monkeypatch.setattr(os, "write", short_write)
    a = h.build("fs", base_path=str(tmp_path))
    adapters.append(a)
    obj = h.make_obj(10_000, seed=3)
    assert h.store(a, [h.key(1)], [obj]).bytes_transferred() == 10_000
    assert (tmp_path / object_key_to_filename(h.key(1))).read_bytes() == bytes(obj.byte_array)
    assert len(calls) >= 10


def test_fs_native_retries_short_writes(tmp_path):
    """The C++ writer loops until every byte is written: an LD_PRELOAD shim makes each
    write() into the data directory move at most 1000 bytes."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the short-write shim (apt-get install gcc)")
    shim = tmp_path / "short_write.so"
    src = Path(__file__).parent / "shims" / "short_write.c"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(shim), str(src), "-ldl"], check=True)
    data = tmp_path / "data"
    data.mkdir()
    size = 10_000
    env = {
        "LD_PRELOAD": str(shim),
        "SHORT_WRITE_DIR": os.path.realpath(data),
        "SHORT_WRITE_MAX": "1000",
    }
    for fsync in (False, True):
        p = _child("fs_native", data, 0, 0 if not fsync else 10, 3, size, fsync, env=env)
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and out.count("stored") == 3
    names = sorted(os.listdir(data))
    assert len(names) == 6 and all(n.endswith(".data") for n in names)
    for name in names:
        i = int(name.split("@")[3].removesuffix(".data"), 16)
        assert (data / name).read_bytes() == _expected(i, 0, size), name
    # 6 values of 10 writes each: every value went out in 1000-byte pieces
    assert len((tmp_path / "short_writes").read_bytes()) >= 6 * 9


@pytest.mark.parametrize("fsync", [True, False])
def test_fsync_option(h, tmp_path, adapters, monkeypatch, fsync):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    a = h.build("fs", base_path=str(tmp_path), fsync=fsync)
    adapters.append(a)
    h.store(a, [h.key(1)], [h.make_obj(100)])
    # file + directory when on; nothing when off
    assert (len(synced) >= 2) if fsync else (synced == [])


@pytest.mark.parametrize("fsync", [True, False])
def test_fs_native_fsync_option(h, tmp_path, adapters, fsync):
    """The C++ client counts its successful fsyncs: one per file and one directory fsync per
    tile that published, when on; none when off."""
    a = h.build("fs_native", base_path=str(tmp_path), fsync=fsync, num_workers=1)
    adapters.append(a)
    assert a.report_status()["extra_status"]["fsync_count"] == 0
    keys = [h.key(i) for i in range(3)]
    assert h.store(a, keys, [h.make_obj(100, seed=i) for i in range(3)]).is_successful()
    count = a.report_status()["extra_status"]["fsync_count"]
    assert (count >= 4) if fsync else (count == 0)  # 3 files + at least 1 directory
    h.store(a, keys, [h.make_obj(100, seed=i) for i in range(3)])  # duplicates: no new file
    assert a.report_status()["extra_status"]["fsync_count"] == count


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "base_path must be a non-empty string"),
        ({"base_path": ""}, "base_path must be a non-empty string"),
        ({"base_path": "/x", "relative_tmp_dir": 3}, "relative_tmp_dir must be a string"),
        ({"base_path": "/x", "read_ahead_size": 0}, "read_ahead_size must be a positive integer"),
        ({"base_path": "/x", "use_odirect": "yes"}, "use_odirect must be a boolean"),
        ({"base_path": "/x", "num_workers": 0}, "num_workers must be a positive integer"),
        (
            {"base_path": "/x", "max_capacity_gb": -1},
            "max_capacity_gb must be a non-negative number",
        ),
    ],
)
@pytest.mark.parametrize("type_name", ["fs", "fs_native"])
def test_config_errors(type_name, fields, message):
    with pytest.raises(ValueError, match="^" + message):
        get_l2_adapter_config_class(type_name).from_dict({"type": type_name, **fields})


def test_cli_error_names_the_adapter_index():
    with pytest.raises(ValueError) as e:
        parse_l2_adapter_dict(2, {"type": "fs"})
    assert str(e.value).startswith("--l2-adapter #2 ('fs'): base_path must be a non-empty string")


@pytest.mark.parametrize("type_name", ["fs", "fs_native"])
def test_relative_tmp_dir_escape_rejected_at_creation(h, tmp_path, type_name):
    with pytest.raises(ValueError, match="Invalid relative_tmp_dir: ../elsewhere"):
        h.build(type_name, base_path=str(tmp_path), relative_tmp_dir="../elsewhere")


def test_defaults():
    fs = get_l2_adapter_config_class("fs").from_dict({"type": "fs", "base_path": "/d"})
    assert (fs.num_workers, fs.fsync, fs.use_odirect, fs.max_capacity_gb) == (8, True, False, 0)
    nat = get_l2_adapter_config_class("fs_native").from_dict(
        {"type": "fs_native", "base_path": "/d"}
    )
    assert (nat.num_workers, nat.relative_tmp_dir, nat.read_ahead_size) == (4, "", None)
