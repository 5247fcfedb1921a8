"""``raw_block`` interchange with LMCache 0.5.6: a device file written by 0.5.6's adapter is read
by ours, every object byte-equal, and the reverse; each side also finds the keys the other
stored after its own restart. One driver script runs in either venv through the 0.5.6 API
both share (``get_l2_adapter_config_class``, ``l2_adapters.create_l2_adapter``,
``TensorMemoryObj``). Needs LMCACHE_COMPAT_VENV (see conftest.py) with
``lmcache-rust-raw-block-io`` installed in it (0.5.6's raw_block imports it; ``nox -s compat``
installs it), else it skips saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmcache.storage.raw_block", reason="lmcache-raw-block is not installed")
pytest.importorskip("lmcache_rust_raw_block_io", reason="pip install lmcache-rust-raw-block-io")

# Sizes: one block, unaligned, near a slot's payload capacity; keys: a model name that needs
# quoting, a kv_rank with high bits, a group, a cache salt.
OBJECTS = [
    {"seed": 1, "size": 4096, "model": "llama", "rank": 0, "group": 0, "salt": ""},
    {"seed": 2, "size": 5001, "model": "org/Model 7B", "rank": 0x10002, "group": 1, "salt": ""},
    {"seed": 3, "size": 65536, "model": "llama", "rank": 3, "group": 0, "salt": "tenant:a"},
    {"seed": 4, "size": 777, "model": "llama", "rank": 0, "group": 2, "salt": ""},
]

DRIVER = r"""
import json, os, random, select, sys, time, types
import torch
import lmcache.v1

# 0.5.6's lmcache/v1/storage_backend/__init__.py imports every legacy backend (aiofile,
# transformers, ...); its raw_block subpackage needs none of them, so the package is entered
# bare and raw_block's own modules run unchanged. Ours has no such package.
_legacy = os.path.join(os.path.dirname(lmcache.v1.__file__), "storage_backend")
if os.path.isfile(os.path.join(_legacy, "__init__.py")):
    _pkg = types.ModuleType("lmcache.v1.storage_backend")
    _pkg.__path__ = [_legacy]
    sys.modules["lmcache.v1.storage_backend"] = _pkg
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

steps = json.loads(sys.argv[1])  # [[mode, spec, objects], ...], each on a fresh adapter
results = []

def key(o):
    return ObjectKey(chunk_hash=o["seed"].to_bytes(8, "big"), model_name=o["model"],
                     kv_rank=o["rank"], object_group_id=o["group"], cache_salt=o["salt"])

def obj(o, fill):
    data = random.Random(o["seed"]).randbytes(o["size"]) if fill else bytes(o["size"])
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()
    meta = MemoryObjMetadata(shape=torch.Size([o["size"]]), dtype=torch.uint8, address=0,
                             phy_size=o["size"], ref_count=1)
    return TensorMemoryObj(raw, meta, None)

def wait(fd, poll):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = poll()
        if got is not None:
            return got
        select.select([fd], [], [], 0.2)
    raise TimeoutError("adapter task did not complete")

def step(mode, spec, objects):
    cfg = get_l2_adapter_config_class("raw_block").from_dict(spec)
    adapter = create_l2_adapter(cfg)
    keys = [key(o) for o in objects]
    out = {}
    if mode == "write":
        tid = adapter.submit_store_task(keys, [obj(o, True) for o in objects])
        done = {}
        def popped():
            done.update(adapter.pop_completed_store_tasks())
            return done.get(tid)
        res = wait(adapter.get_store_event_fd(), popped)
        out["stored"] = bool(res.is_successful()) if hasattr(res, "is_successful") else bool(res)
    else:
        tid = adapter.submit_lookup_and_lock_task(keys, {})
        bm = wait(adapter.get_lookup_and_lock_event_fd(),
                  lambda: adapter.query_lookup_and_lock_result(tid))
        out["found"] = [bool(bm.test(i)) for i in range(len(keys))]
        dst = [obj(o, False) for o in objects]
        tid = adapter.submit_load_task(keys, dst)
        bm = wait(adapter.get_load_event_fd(), lambda: adapter.query_load_result(tid))
        out["loaded"] = [bool(bm.test(i)) for i in range(len(keys))]
        out["equal"] = [bytes(d.byte_array) == random.Random(o["seed"]).randbytes(o["size"])
                        for d, o in zip(dst, objects)]
        adapter.submit_unlock(keys)
    adapter.close()
    return out

if steps == "probe":  # can this venv run raw_block at all?
    import lmcache_rust_raw_block_io
    get_l2_adapter_config_class("raw_block")
    steps = []
print("RESULT " + json.dumps([step(*s) for s in steps]))
"""


def _run(python: Path, steps: list[list], ours: bool) -> list[dict]:
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}
    if not ours:
        env.pop("PYTHONPATH", None)  # our sources on PYTHONPATH would shadow 0.5.6's
    proc = subprocess.run(
        [str(python), "-c", DRIVER, json.dumps(steps)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (ours, proc.stdout[-2000:], proc.stderr[-4000:])
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def theirs_python(compat_venv: Path) -> Path:
    python = compat_venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = subprocess.run(
        [str(python), "-c", DRIVER, '"probe"'], capture_output=True, text=True, timeout=300, env=env
    )
    if probe.returncode != 0:
        pytest.skip(
            f"0.5.6's raw_block does not load in {compat_venv} (pip install "
            f"lmcache-rust-raw-block-io there): {probe.stderr.strip().splitlines()[-1:]}"
        )
    return python


OPTIONS = {
    "posix": {"use_odirect": False},
    "io_uring-odirect": {"use_odirect": True, "io_engine": "io_uring"},
}
FOUND = {"found": [True] * 3, "loaded": [True] * 3, "equal": [True] * 3}
FOUND_ALL = {"found": [True] * 4, "loaded": [True] * 4, "equal": [True] * 4}


def test_a_device_written_by_one_side_is_read_by_the_other(theirs_python, tmp_path):
    """For each I/O mode, one device written first by 0.5.6 and one written first by ours:
    the other side reads every object byte-equal and adds a key; the first side, restarted,
    finds all four. Two 0.5.6 processes in all (its import takes ~20 s)."""
    specs = {}
    for writer in ("theirs", "ours"):
        for name, options in OPTIONS.items():
            device = tmp_path / f"{writer}-{name}.img"
            with open(device, "wb") as f:
                f.truncate(8 << 20)
            specs[writer, name] = {
                "type": "raw_block",
                "device_path": str(device),
                "slot_bytes": 4096 + 65536,
                "meta_total_bytes": 1 << 20,
                "meta_enable_periodic": False,
                **options,
            }
    first, rest = OBJECTS[:3], OBJECTS[3:]
    ours = Path(sys.executable)
    theirs_first = [specs["theirs", n] for n in OPTIONS]
    ours_first = [specs["ours", n] for n in OPTIONS]

    got = _run(theirs_python, [["write", s, first] for s in theirs_first], ours=False)
    assert got == [{"stored": True}] * 2
    steps = [[m, s, o] for s in theirs_first for m, o in (("read", first), ("write", rest))]
    steps += [["write", s, first] for s in ours_first]
    got = _run(ours, steps, ours=True)
    assert got == [FOUND, {"stored": True}] * 2 + [{"stored": True}] * 2, "ours reads 0.5.6's"
    steps = [["read", s, OBJECTS] for s in theirs_first]
    steps += [[m, s, o] for s in ours_first for m, o in (("read", first), ("write", rest))]
    got = _run(theirs_python, steps, ours=False)
    assert got[:2] == [FOUND_ALL] * 2, "0.5.6 finds its keys and ours after a restart"
    assert got[2:] == [FOUND, {"stored": True}] * 2, "0.5.6 reads ours"
    got = _run(ours, [["read", s, OBJECTS] for s in ours_first], ours=True)
    assert got == [FOUND_ALL] * 2, "ours finds its keys and 0.5.6's after a restart"
