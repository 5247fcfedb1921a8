"""The example external native connector, loaded through `native_plugin` as docs/l2-plugins.md
shows."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
from pathlib import Path

import pytest

from lmc_external_native_connector import (
    ExampleFSConnector,
    ExampleMemoryConnector,
    ExampleNativeConnector,
)
from lmcache.v1.distributed.l2_adapters.config import (
    create_l2_adapter_from_registry,
    parse_l2_adapter_dict,
)

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "lmc_external_native_connector"


def _seed_config(params: dict) -> dict:
    return {
        "type": "native_plugin",
        "module_path": "lmc_external_native_connector",
        "class_name": "ExampleNativeConnector",
        "adapter_params": params,
    }


@pytest.mark.parametrize("backend", ["fs", "memory"])
def test_seed_json_round_trip(h, tmp_path, backend):
    params = {"backend": backend, "base_path": str(tmp_path / "ext"), "num_workers": 2}
    cfg = parse_l2_adapter_dict(1, _seed_config(params))
    adapter = create_l2_adapter_from_registry(cfg)
    try:
        keys = [h.key(i) for i in range(5)]
        objs = [h.make_obj(100 * (i + 1), seed=i) for i in range(5)]  # unequal sizes
        res = h.store(adapter, keys, objs)
        assert res.is_successful() and res.bytes_transferred() == sum(
            100 * (i + 1) for i in range(5)
        )
        bm = h.lookup(adapter, keys + [h.key(99)])
        assert bm.popcount() == 5 and bm.test(5) is False
        adapter.submit_unlock(keys)
        dst = [h.empty_like(o) for o in objs]
        assert h.load(adapter, keys, dst).popcount() == 5
        assert all(
            bytes(o.byte_array) == bytes(d.byte_array) for o, d in zip(objs, dst, strict=True)
        )
        adapter.delete(keys[:2])
        assert h.lookup(adapter, keys).get_indices_list() == [2, 3, 4]
        if backend == "fs":
            assert len(os.listdir(tmp_path / "ext")) == 3  # one file per key, no temp files
    finally:
        adapter.close()


def test_factory_returns_the_native_objects(tmp_path):
    fs = ExampleNativeConnector(backend="fs", base_path=str(tmp_path), num_workers=1)
    mem = ExampleNativeConnector(backend="memory", num_workers=1)
    assert isinstance(fs, ExampleFSConnector) and isinstance(mem, ExampleMemoryConnector)
    fs.close()
    mem.close()
    with pytest.raises(ValueError, match="backend must be one of"):
        ExampleNativeConnector(backend="s3")
    with pytest.raises(TypeError, match="unknown parameters"):
        ExampleNativeConnector(backend="memory", host="x")


def test_memory_get_is_size_checked():
    c = ExampleMemoryConnector(1)
    value = bytearray(b"abcd")  # buffers must outlive their completion
    fid = c.submit_batch_set(["k"], [memoryview(value)])
    small, right = bytearray(3), bytearray(4)
    gid = c.submit_batch_get(["k", "k"], [memoryview(small), memoryview(right)])
    done = {}
    while gid not in done or fid not in done:
        select.select([c.event_fd()], [], [], 1)
        done.update({f[0]: f for f in c.drain_completions()})
    assert done[gid][3] == [False, True] and right == bytearray(b"abcd") and small == bytearray(3)
    c.close()


def test_example_compiles_against_core_get_include(tmp_path):
    """The example's sources compile with only core's packaged headers on the include path."""
    native_include = pytest.importorskip(
        "lmcache.v1.distributed.l2_adapters.native_include",
        reason="lmcache-core does not ship native_include.get_include() yet",
    )
    pybind11 = pytest.importorskip("pybind11", reason="pybind11 not installed")
    if shutil.which("g++") is None:
        pytest.skip("g++ not installed")
    if not EXAMPLE.is_dir():
        pytest.skip(f"example sources not found at {EXAMPLE}")
    import sysconfig

    inc = native_include.get_include()
    assert (Path(inc) / "connector_base.h").is_file()
    for src in ("connector.cpp", "pybind.cpp"):
        subprocess.run(
            [
                "g++",
                "-std=c++17",
                "-fsyntax-only",
                f"-I{inc}",
                f"-I{pybind11.get_include()}",
                f"-I{sysconfig.get_paths()['include']}",
                f"-I{EXAMPLE / 'csrc'}",
                str(EXAMPLE / "csrc" / src),
            ],
            check=True,
        )
