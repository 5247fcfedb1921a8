"""How the lmcache-cuda wheel decides whether to compile its kernels (docs/devices.md).

By default the build runs CMake, which compiles ``_C`` when check_language(CUDA) finds a
compiler and otherwise installs the Python package alone; NO_GPU_EXT=1 skips CMake (a
py3-none-any wheel); LMCACHE_BUILD_CUDA=1 makes a missing compiler an error. A CUDA
compiler is hidden by pointing CUDACXX at a path that does not exist.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "packages" / "lmcache-cuda"

pytestmark = [
    pytest.mark.skipif(
        not (PKG / "pyproject.toml").is_file(), reason=f"lmcache-cuda sources not at {PKG}"
    ),
    pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed"),
]


def _wheel(tmp_path, **env_overrides):
    pytest.importorskip("scikit_build_core", reason="scikit-build-core not installed")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NO_GPU_EXT", "LMCACHE_BUILD_CUDA", "CUDACXX", "CMAKE_ARGS")
    }
    env.update(env_overrides)
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
         "-w", str(tmp_path), str(PKG)],
        env=env, capture_output=True, text=True,
    )  # fmt: skip


def _only_wheel(tmp_path) -> Path:
    wheels = list(tmp_path.glob("lmcache_cuda-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_default_build_without_a_cuda_compiler_installs_python_only(tmp_path):
    proc = _wheel(tmp_path, CUDACXX=str(tmp_path / "no-such-nvcc"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no CUDA compiler found" in proc.stdout + proc.stderr  # CMake did run
    names = zipfile.ZipFile(_only_wheel(tmp_path)).namelist()
    assert "lmcache/devices/cuda/__init__.py" in names
    assert not any(n.endswith(".so") for n in names)


def test_forced_build_without_a_cuda_compiler_fails_naming_the_fix(tmp_path):
    proc = _wheel(tmp_path, LMCACHE_BUILD_CUDA="1", CUDACXX=str(tmp_path / "no-such-nvcc"))
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "LMCACHE_BUILD_CUDA=1 but no CUDA compiler was found" in out
    assert not list(tmp_path.glob("*.whl"))


def test_no_gpu_ext_skips_cmake_even_with_nvcc_on_path(tmp_path):
    proc = _wheel(tmp_path, NO_GPU_EXT="1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Looking for a CUDA compiler" not in proc.stdout + proc.stderr  # no CMake run
    wheel = _only_wheel(tmp_path)
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    assert not any(n.endswith(".so") for n in zipfile.ZipFile(wheel).namelist())
