"""The C++ connector framework: its C++ unit tests (built with CMake, run with ctest) and the
Python-facing behaviour of LMCACHE_BIND_CONNECTOR_METHODS through a compiled test connector."""

from __future__ import annotations

import array
import importlib.util
import select
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

NATIVE = Path(__file__).resolve().parents[2] / "native"


def _need_tools() -> None:
    for tool in ("cmake", "g++"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (needed to build native/)")
    if not (NATIVE / "CMakeLists.txt").is_file():
        pytest.skip(f"native/ sources not found at {NATIVE}")


def _cmake(build: Path, *extra: str) -> None:
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    subprocess.run(
        ["cmake", "-S", str(NATIVE), "-B", str(build), *gen, *extra],
        check=True,
        capture_output=True,
        text=True,
    )
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def native_build(tmp_path_factory) -> Path:
    """One CMake build of native/: the C++ unit tests, plus the pybind11 test module when
    pybind11 is importable."""
    _need_tools()
    build = tmp_path_factory.mktemp("native-build")
    extra = ["-DCMAKE_BUILD_TYPE=None"]  # no optimisation: the fastest build
    try:
        import pybind11

        extra += [
            "-DLMCACHE_BUILD_PYTHON_TEST_MODULE=ON",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPython_EXECUTABLE={sys.executable}",
        ]
    except ImportError:
        pass
    _cmake(build, *extra)
    return build


def test_cpp_framework_unit_tests(native_build):
    build = native_build
    run = subprocess.run(
        ["ctest", "--test-dir", str(build), "--output-on-failure"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    detail = subprocess.run([str(build / "test_connector_base")], capture_output=True, text=True)
    assert "0 failure(s)" in detail.stdout
    assert "FAIL" not in detail.stdout


@pytest.fixture(scope="module")
def testmod(native_build) -> Any:
    so = next(native_build.glob("_lmcache_test_connector*.so"), None)
    if so is None:
        pytest.skip("pybind11 not installed (needed for the Python test connector)")
    spec = importlib.util.spec_from_file_location("_lmcache_test_connector", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wait(conn: Any, fid: int, timeout: float = 10) -> tuple:
    deadline = time.monotonic() + timeout
    seen: dict[int, tuple] = {}
    while fid not in seen:
        assert time.monotonic() < deadline, f"no completion for future {fid}"
        select.select([conn.event_fd()], [], [], 0.1)
        for c in conn.drain_completions():
            seen[c[0]] = c
    return seen[fid]


def test_unequal_buffer_lengths_round_trip(testmod):
    c = testmod.TestConnector(3)
    vals = [bytearray(b"a"), bytearray(b"b" * 5000), bytearray(b"c" * 17)]
    keys = ["k1", "k2", "k3"]
    fid, ok, err, res = _wait(c, c.submit_batch_set(keys, [memoryview(v) for v in vals]))
    assert ok and err == "" and res is None  # set: no per-key results
    out = [bytearray(len(v)) for v in vals]
    _, ok, _, res = _wait(c, c.submit_batch_get(keys, [memoryview(o) for o in out]))
    assert ok and res == [True, True, True] and out == vals
    _, ok, _, res = _wait(c, c.submit_batch_exists(["k1", "zz"]))
    assert res == [True, False] and all(type(b) is bool for b in res)
    _, ok, _, res = _wait(c, c.submit_batch_delete(["k1", "zz"]))
    assert res == [True, False]
    c.close()
    c.close()


def test_typed_buffers_use_size_times_itemsize(testmod):
    c = testmod.TestConnector(1)
    src = array.array("f", [float(i) for i in range(10)])  # itemsize 4: 40 bytes
    _wait(c, c.submit_batch_set(["t"], [memoryview(src)]))
    dst = bytearray(40)
    _, ok, _, res = _wait(c, c.submit_batch_get(["t"], [memoryview(dst)]))
    assert res == [True] and bytes(dst) == src.tobytes()
    short = bytearray(39)  # a different length is a miss, never an overflow
    _, ok, _, res = _wait(c, c.submit_batch_get(["t"], [memoryview(short)]))
    assert res == [False]
    c.close()


def test_buffer_checks(testmod):
    c = testmod.TestConnector(1)
    buf = bytearray(64)
    strided = memoryview(buf)[::2]
    with pytest.raises(RuntimeError, match="buffer 1 is not C-contiguous"):
        c.submit_batch_set(["a", "b"], [memoryview(buf), strided])
    with pytest.raises(RuntimeError, match="keys and memviews size mismatch"):
        c.submit_batch_set(["a", "b"], [memoryview(buf)])
    with pytest.raises(RuntimeError, match="keys list is empty"):
        c.submit_batch_set([], [])
    with pytest.raises(RuntimeError, match="keys list is empty"):
        c.submit_batch_exists([])
    with pytest.raises(RuntimeError, match="buffer 0 is not a writable buffer"):
        c.submit_batch_get(["a"], [b"read-only"])
    c.close()


def _runs_python_during(conn: Any, call: Any) -> tuple[bool, Any]:
    """Calls `call()` (a native call that delays in C++) while a Python thread spins asking the
    connector whether the delay is in progress; the thread can only see it in progress if the
    calling thread released the GIL."""
    seen_in_call = threading.Event()
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            if conn.in_delay():
                seen_in_call.set()
                return

    t = threading.Thread(target=spin)
    t.start()
    try:
        result = call()
    finally:
        stop.set()
        t.join()
    return seen_in_call.is_set(), result


@pytest.mark.parametrize("kind", ["exists", "delete", "get", "set"])
def test_submits_release_the_gil(testmod, kind):
    c = testmod.TestConnector(1)
    buf = bytearray(b"v" * 64)
    out = bytearray(64)  # must outlive the get: the worker writes into it after submit returns
    _wait(c, c.submit_batch_set(["x"], [memoryview(buf)]))
    submit = {
        "exists": lambda: c.submit_batch_exists(["x"]),
        "delete": lambda: c.submit_batch_delete(["x"]),
        "get": lambda: c.submit_batch_get(["x"], [memoryview(out)]),
        "set": lambda: c.submit_batch_set(["x"], [memoryview(buf)]),
    }[kind]
    c.set_submit_delay_ms(300)
    released, fid = _runs_python_during(c, submit)
    assert released, f"submit_batch_{kind} held the GIL while blocked in C++"
    c.set_submit_delay_ms(0)
    assert _wait(c, fid)[1] is True
    assert out == (buf if kind == "get" else bytearray(64))
    c.close()


def test_drain_completions_releases_the_gil(testmod):
    c = testmod.TestConnector(1)
    fid = c.submit_batch_exists(["x"])
    c.set_drain_delay_ms(300)
    seen: list = []
    deadline = time.monotonic() + 10
    while not any(x[0] == fid for x in seen):
        assert time.monotonic() < deadline, "no completion"
        select.select([c.event_fd()], [], [], 0.1)
        released, got = _runs_python_during(c, c.drain_completions)
        assert released, "drain_completions held the GIL while blocked in C++"
        seen += got
    c.close()


def test_failure_completions_reach_python_and_recover(testmod):
    c = testmod.TestConnector(1, fail_connect=True)
    _, ok, err, _ = _wait(c, c.submit_batch_exists(["x"]))
    assert ok is False and "test backend down" in err
    saw_unavailable = False
    for _ in range(20):
        _, ok, err, _ = _wait(c, c.submit_batch_exists(["x"]))
        assert ok is False
        if "queue unavailable: test backend down" in err:
            saw_unavailable = True
            break
    assert saw_unavailable
    c.set_fail_connect(False)
    deadline = time.monotonic() + 15
    while not _wait(c, c.submit_batch_exists(["x"]))[1]:
        assert time.monotonic() < deadline, "the worker never reconnected"
        time.sleep(0.02)
    c.close()
