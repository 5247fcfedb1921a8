"""CUDA kernels: nvcc compile check, host-side C++ tests, and the kernel address math
(run on the CPU through a C entry point) bit-equal to the torch baseline for every
pointer-form format. No GPU needed; GPU bit-equality lives in tests_gpu/run_gpu_checks.sh.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from lmcache.v1.platform import torch_ops
from lmcache.v1.platform.ops_types import PageBufferShapeDesc, TransferDirection

NL, NB, BS, NH, HS = 3, 6, 4, 2, 8


def make_layers(fmt: int, dtype=torch.float16, seed: int = 0):
    """(operand for the torch baseline, flat list of plane tensors in pointer order,
    (nl, nb, bs, nh, hs, elem) as the kernel sees them)."""
    g = torch.Generator().manual_seed(seed + fmt)

    def rnd(*shape, dt=dtype):
        if dt == torch.uint8:
            return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        return torch.randn(*shape, generator=g).to(dt)

    elem = torch.empty((), dtype=dtype).element_size()
    if fmt == 0:
        t = rnd(NB, NL, 2, BS, NH, HS)
        return t, [t], (NL, NB, BS, NH, HS, elem)
    if fmt == 8:
        t = rnd(NB, NL, 2, NH, BS, HS)
        return t, [t], (NL, NB, BS, NH, HS, elem)
    if fmt in (4, 9):
        shape = (NB * BS, NH, HS) if fmt == 4 else (NB, BS, NH, HS)
        k = [rnd(*shape) for _ in range(NL)]
        v = [rnd(*shape) for _ in range(NL)]
        return [k, v], k + v, (NL, NB, BS, NH, HS, elem)
    per_layer = {
        1: ((2, NB, BS, NH, HS), NH, HS),
        2: ((NB, 2, BS, NH, HS), NH, HS),
        3: ((NB, BS, HS), 1, HS),
        5: ((NB * BS, 1, HS), 1, HS),
        6: ((2, NB, NH, BS, HS), NH, HS),
        7: ((NB, 2, NH, BS, HS), NH, HS),
        10: ((NB, NH, BS, 2, HS), NH, 2 * HS),
        11: ((NB, BS, NH, 2, HS), NH, 2 * HS),
        12: ((NB, NH, BS, 2 * HS), NH, 2 * HS),
        13: ((NB, BS, NH, 2 * HS), NH, 2 * HS),
        14: ((NB, BS, 132), 1, 132),
        15: ((2, NB, NH, 1, BS, HS), NH, HS),
        18: ((NB, BS, NH, HS), NH, HS),
    }
    shape, nh, hs = per_layer[fmt]
    dt = torch.uint8 if fmt == 14 else dtype
    layers = [rnd(*shape, dt=dt) for _ in range(NL)]
    return layers, layers, (NL, NB, BS, nh, hs, 1 if fmt == 14 else elem)


POINTER_FORMATS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 18)
KV1_FORMATS = {3, 5, 10, 11, 12, 13, 14, 18}


CSRC = Path(__file__).resolve().parents[2] / "packages" / "lmcache-cuda" / "csrc"
needs_sources = pytest.mark.skipif(
    not (CSRC / "kv_transfer.cu").is_file(),
    reason=f"CUDA kernel sources not found at {CSRC} (run from the repository checkout)",
)
CXX = shutil.which("g++") or shutil.which("c++")


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    if CXX is None:
        pytest.skip("C++ compiler (g++) not installed")
    if not (CSRC / "host_capi.cpp").is_file():
        pytest.skip(f"CUDA kernel sources not found at {CSRC}")
    out = tmp_path_factory.mktemp("kvhost") / "libkvhost.so"
    subprocess.run(
        [
            CXX,
            "-std=c++17",
            "-O1",
            "-shared",
            "-fPIC",
            "-o",
            str(out),
            str(CSRC / "host_capi.cpp"),
            str(CSRC / "kv_transfer_common.cpp"),
        ],
        check=True,
        capture_output=True,
    )
    lib = ctypes.CDLL(str(out))
    lib.lmc_block_kv_transfer_host.restype = ctypes.c_int
    return lib


def _host_transfer(lib, planes, objects, block_ids, direction, fmt, geo, chunk, skip):
    nl, nb, bs, nh, hs, elem = geo
    ptrs = torch.tensor([t.data_ptr() for t in planes], dtype=torch.int64)
    objs = (ctypes.c_int64 * len(objects))(*[o.data_ptr() for o in objects])
    ids = torch.tensor(block_ids, dtype=torch.int64)
    err = ctypes.create_string_buffer(512)
    rc = lib.lmc_block_kv_transfer_host(
        ctypes.c_int64(ptrs.data_ptr()),
        ctypes.c_int64(len(planes)),
        objs,
        ctypes.c_int64(len(objects)),
        ctypes.c_int64(ids.data_ptr()),
        ctypes.c_int64(ids.numel()),
        ctypes.c_int(0),
        ctypes.c_int(int(direction)),
        ctypes.c_int(fmt),
        ctypes.c_int(nl),
        ctypes.c_int64(nb),
        ctypes.c_int64(bs),
        ctypes.c_int64(nh),
        ctypes.c_int64(hs),
        ctypes.c_int64(elem),
        ctypes.c_int64(chunk),
        ctypes.c_int64(skip),
        err,
        ctypes.c_int64(512),
    )
    if rc != 0:
        raise ValueError(err.value.decode())


def _chunks(fmt, geo, n_objs, chunk, dtype):
    nl, _, _, nh, hs, _ = geo
    shape = (nl, chunk, nh * hs) if fmt in KV1_FORMATS else (2, nl, chunk, nh * hs)
    dt = torch.uint8 if fmt == 14 else dtype
    return [torch.full(shape, 7, dtype=dt) for _ in range(n_objs)]


def _shape_desc(fmt, geo, dtype):
    nl, nb, bs, nh, hs, elem = geo
    return PageBufferShapeDesc(
        kv_size=1 if fmt in KV1_FORMATS else 2,
        nl=nl,
        nb=nb,
        bs=bs,
        nh=nh,
        hs=hs,
        element_size=elem,
        dtype=torch.uint8 if fmt == 14 else dtype,
    )


@needs_sources
@pytest.mark.parametrize("fmt", POINTER_FORMATS)
@pytest.mark.parametrize(
    ("skip", "block_ids"),
    [(0, [5, 0, 3, 1, 4]), (1, [5, 0, 3, 1, 4]), (3, [2, 4, 1, 5]), (9, [1, 2])],
    ids=["partial-last", "skip-mid-chunk", "skip-into-2nd", "skip-past-end"],
)
def test_kernel_math_matches_torch_baseline(host_lib, fmt, skip, block_ids):
    dtype = torch.bfloat16
    chunk = 2 * BS
    operand, planes, geo = make_layers(fmt, dtype)
    n_objs = -(-len(block_ids) // 2)
    sd = _shape_desc(fmt, geo, dtype)
    base = _chunks(fmt, geo, n_objs, chunk, dtype)
    torch_ops.multi_layer_block_kv_transfer(
        operand, base, block_ids, "cpu", TransferDirection.D2H, sd, chunk, fmt, skip
    )
    native = _chunks(fmt, geo, n_objs, chunk, dtype)
    _host_transfer(
        host_lib, planes, native, block_ids, TransferDirection.D2H, fmt, geo, chunk, skip
    )
    for a, b in zip(base, native, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"format {fmt}: D2H differs"

    # H2D into zeroed engine tensors: both paths write exactly the same bytes.
    _, planes_native, _ = make_layers(fmt, dtype)
    operand_base, planes_base, _ = make_layers(fmt, dtype)
    for t in planes_native + planes_base:
        t.zero_()
    torch_ops.multi_layer_block_kv_transfer(
        operand_base, base, block_ids, "cpu", TransferDirection.H2D, sd, chunk, fmt, skip
    )
    _host_transfer(
        host_lib, planes_native, base, block_ids, TransferDirection.H2D, fmt, geo, chunk, skip
    )
    for a, b in zip(planes_base, planes_native, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"format {fmt}: H2D differs"
    if skip < len(block_ids):
        assert any(t.view(torch.uint8).any() for t in planes_native), "H2D wrote nothing"


@needs_sources
def test_kernel_math_rejects_bad_arguments(host_lib):
    operand, planes, geo = make_layers(1)
    objs = _chunks(1, geo, 1, 2 * BS, torch.float16)
    with pytest.raises(ValueError, match="lmcache_chunk_size=6"):
        _host_transfer(host_lib, planes, objs, [0], 1, 1, geo, 6, 0)
    with pytest.raises(ValueError, match="len\\(block_ids\\)=3"):
        _host_transfer(host_lib, planes, objs, [0, 1, 2], 1, 1, geo, 2 * BS, 0)
    with pytest.raises(ValueError, match="engine_kv_format=16"):
        _host_transfer(host_lib, planes, objs, [0], 1, 16, geo, 2 * BS, 0)
    with pytest.raises(ValueError, match="needs 3 paged pointers"):
        _host_transfer(host_lib, planes[:2], objs, [0], 1, 1, geo, 2 * BS, 0)


NVCC = shutil.which("nvcc")


@needs_sources
@pytest.mark.skipif(NVCC is None, reason="nvcc (CUDA toolkit) not installed")
def test_nvcc_compiles_kernels_and_host_tests_pass(tmp_path):
    """Compile-only check of the kernel translation unit (one arch keeps it short), then
    build and run the C++ host-side tests with nvcc."""
    arch = os.environ.get("LMCACHE_TEST_CUDA_ARCH", "sm_90")
    obj = tmp_path / "kv_transfer.o"
    subprocess.run(
        [NVCC, "-std=c++17", f"-arch={arch}", "-c", str(CSRC / "kv_transfer.cu"), "-o", str(obj)],
        check=True,
        capture_output=True,
    )
    exe = tmp_path / "test_kv_host"
    subprocess.run(
        [
            NVCC,
            "-std=c++17",
            "-O1",
            "-o",
            str(exe),
            str(CSRC / "tests" / "test_kv_host.cpp"),
            str(CSRC / "kv_transfer_common.cpp"),
            str(obj),
        ],
        check=True,
        capture_output=True,
    )
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "all host-side kernel checks passed" in run.stdout


class _FakeKernels:
    """Stands in for the compiled ``_C``: runs the kernel's address math on the host."""

    MAX_OBJECTS_PER_LAUNCH = 4

    def __init__(self, lib):
        self.lib = lib
        self.calls = []

    def block_kv_transfer(self, *args):
        self.calls.append(args)
        paged, n_paged, objs, ids, n_ids, is32, direction, fmt, nl, nb, bs, nh, hs, elem = args[:14]
        chunk, skip, stream = args[14:]
        arr = (ctypes.c_int64 * len(objs))(*objs)
        err = ctypes.create_string_buffer(512)
        rc = self.lib.lmc_block_kv_transfer_host(
            *[ctypes.c_int64(v) for v in (paged, n_paged)], arr, ctypes.c_int64(len(objs)),
            ctypes.c_int64(ids), ctypes.c_int64(n_ids), ctypes.c_int(int(is32)),
            ctypes.c_int(direction), ctypes.c_int(fmt), ctypes.c_int(nl),
            *[ctypes.c_int64(v) for v in (nb, bs, nh, hs, elem, chunk, skip)], err,
            ctypes.c_int64(512),
        )  # fmt: skip
        if rc:
            raise ValueError(err.value.decode())


@needs_sources
@pytest.mark.parametrize("fmt", [1, 2, 3, 6, 9])
def test_native_shim_passes_pointer_operands_to_the_kernel(host_lib, fmt):
    """The Python side of the native ops (shared by cuda and rocm) marshals pointer
    operands, block ids, element size and the current stream handle correctly."""
    from lmcache.v1.platform.cuda_family.native_shim import make_native_ops
    from lmcache.v1.platform.testing import install_fake_device

    fake_c = _FakeKernels(host_lib)
    transfer, _ = make_native_ops(fake_c)
    dtype = torch.float16
    operand, planes, geo = make_layers(fmt, dtype)
    sd = _shape_desc(fmt, geo, dtype)
    ids, skip, chunk = [5, 0, 3], 1, 2 * BS
    want = _chunks(fmt, geo, 2, chunk, dtype)
    torch_ops.multi_layer_block_kv_transfer(
        operand, want, ids, "cpu", TransferDirection.D2H, sd, chunk, fmt, skip
    )
    got = _chunks(fmt, geo, 2, chunk, dtype)
    ptrs = torch.tensor([t.data_ptr() for t in planes], dtype=torch.int64)
    with install_fake_device("cuda", version_attrs={"cuda": "12.4", "hip": None}) as fake:
        fake.current_stream().cuda_stream = 0x5151
        transfer(ptrs, [c.data_ptr() for c in got], ids, "cpu", 1, sd, chunk, fmt, skip)
        assert fake_c.calls and fake_c.calls[-1][-1] == 0x5151  # the current stream's handle
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        # CPU tensor operands cannot reach a GPU kernel: the torch baseline answers.
        n = len(fake_c.calls)
        again = _chunks(fmt, geo, 2, chunk, dtype)
        transfer(operand, again, ids, "cpu", 1, sd, chunk, fmt, skip)
        assert len(fake_c.calls) == n
        for a, b in zip(again, want, strict=True):
            assert torch.equal(a, b)


PKG = CSRC.parent


@pytest.mark.skipif(
    not (PKG / "pyproject.toml").is_file(), reason=f"lmcache-cuda sources not at {PKG}"
)
def test_no_gpu_ext_forces_the_pure_python_wheel(tmp_path):
    """NO_GPU_EXT=1 wins over LMCACHE_BUILD_CUDA=1: no CMake run, a py3-none-any wheel."""
    import sys

    pytest.importorskip("scikit_build_core", reason="scikit-build-core not installed")
    env = {**os.environ, "LMCACHE_BUILD_CUDA": "1", "NO_GPU_EXT": "1"}
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(PKG)],
        check=True, env=env, capture_output=True,
    )  # fmt: skip
    wheels = list(tmp_path.glob("lmcache_cuda-*.whl"))
    assert len(wheels) == 1 and wheels[0].name.endswith("-py3-none-any.whl"), wheels
    import zipfile

    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "lmcache/devices/cuda/__init__.py" in names
    assert not any(n.endswith(".so") for n in names)
    assert not any(n in ("lmcache/__init__.py", "lmcache/devices/__init__.py") for n in names)
