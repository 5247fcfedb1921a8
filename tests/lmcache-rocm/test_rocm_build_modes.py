"""How the lmcache-rocm wheel decides whether to compile its HIP kernels (docs/devices.md).

By default the build runs CMake, which compiles ``_C`` when check_language(HIP) finds hipcc
(or ROCm clang) and otherwise installs the Python package alone; NO_GPU_EXT=1 skips CMake;
LMCACHE_BUILD_HIP=1 makes a missing compiler an error. A HIP compiler is hidden by pointing
HIPCXX at a path that does not exist.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "packages" / "lmcache-rocm"

pytestmark = [
    pytest.mark.skipif(
        not (PKG / "pyproject.toml").is_file(), reason=f"lmcache-rocm sources not at {PKG}"
    ),
    pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed"),
]


def _wheel(tmp_path, **env_overrides):
    pytest.importorskip("scikit_build_core", reason="scikit-build-core not installed")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("NO_GPU_EXT", "LMCACHE_BUILD_HIP", "HIPCXX", "CMAKE_ARGS")
    }
    env.update(HIPCXX=str(tmp_path / "no-such-hipcc"), **env_overrides)
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
         "-w", str(tmp_path), str(PKG)],
        env=env, capture_output=True, text=True,
    )  # fmt: skip


def test_default_build_without_a_hip_compiler_installs_python_only(tmp_path):
    proc = _wheel(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no HIP compiler was found" in proc.stdout + proc.stderr  # CMake did run
    wheels = list(tmp_path.glob("lmcache_rocm-*.whl"))
    assert len(wheels) == 1, wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert "lmcache/devices/rocm/__init__.py" in names
    assert not any(n.endswith(".so") for n in names)


def test_forced_build_without_a_hip_compiler_fails_naming_the_fix(tmp_path):
    proc = _wheel(tmp_path, LMCACHE_BUILD_HIP="1")
    assert proc.returncode != 0
    assert "LMCACHE_BUILD_HIP=1 but no HIP compiler was found" in proc.stdout + proc.stderr
    assert not list(tmp_path.glob("*.whl"))
