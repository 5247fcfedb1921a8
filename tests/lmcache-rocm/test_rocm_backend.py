"""lmcache-rocm (docs/design/platform.md#device-rocm): CUDA vs ROCm choice with both wheels
installed, the ROCm overrides over core's cuda_family, and a compile-only hipcc check."""

from __future__ import annotations

import importlib.metadata as md
import shutil
import subprocess
from pathlib import Path

import pytest

from lmcache.v1.platform.testing import install_fake_device
from lmcache.v1.platform.transfer_mode import MPTransferMode

HIP_TORCH = {"cuda": None, "hip": "6.2.41133"}
CUDA_TORCH = {"cuda": "12.4", "hip": None}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("LMCACHE_DEVICE_BACKEND", "DEVICE_TYPE", "LMCACHE_MP_TRANSFER_MODE"):
        monkeypatch.delenv(var, raising=False)


def test_entry_points_of_both_wheels():
    eps = {ep.name: ep.value for ep in md.entry_points(group="lmcache.device_plugins")}
    assert eps["rocm"] == "lmcache.devices.rocm:RocmDeviceSpec"
    assert eps["cuda"] == "lmcache.devices.cuda:CudaDeviceSpec"


def test_fake_hip_torch_detects_rocm():
    from lmcache.devices.rocm import RocmDeviceSpec
    from lmcache.devices.rocm.device_ops import RocmDeviceOps
    from lmcache.v1.platform import (
        default_device_registry,
        get_device_spec,
        get_torch_device,
        resolve_device_ops,
    )

    with install_fake_device("cuda", version_attrs=HIP_TORCH):
        assert [s.backend_name for s in default_device_registry().device_types()["cuda"]] == [
            "cuda",
            "rocm",
        ]
        assert get_torch_device()[1] == "cuda"
        spec = default_device_registry().current_device_spec()
        assert type(spec) is RocmDeviceSpec
        assert get_device_spec("cuda") is spec  # lookups agree with detection
        assert type(resolve_device_ops("cuda")) is RocmDeviceOps


def test_fake_cuda_torch_detects_cuda():
    from lmcache.devices.cuda import CudaDeviceSpec
    from lmcache.v1.platform import default_device_registry

    with install_fake_device("cuda", version_attrs=CUDA_TORCH):
        assert type(default_device_registry().current_device_spec()) is CudaDeviceSpec


def test_without_hardware_cuda_lookup_is_cuda_spec():
    from lmcache.devices.cuda import CudaDeviceSpec
    from lmcache.v1.platform import get_device_spec, reset_platform_caches

    reset_platform_caches()
    assert type(get_device_spec("cuda")) is CudaDeviceSpec


@pytest.mark.parametrize("var", ["DEVICE_TYPE", "LMCACHE_DEVICE_BACKEND"])
def test_env_selection_on_hip(monkeypatch, var):
    from lmcache.devices.rocm import RocmDeviceSpec
    from lmcache.v1.platform import default_device_registry

    monkeypatch.setenv(var, "cuda" if var == "DEVICE_TYPE" else "rocm")
    with install_fake_device("cuda", version_attrs=HIP_TORCH):
        assert type(default_device_registry().current_device_spec()) is RocmDeviceSpec


def test_explicit_rocm_on_cuda_torch_fails(monkeypatch):
    from lmcache.v1.platform import default_device_registry

    monkeypatch.setenv("LMCACHE_DEVICE_BACKEND", "rocm")
    with (
        install_fake_device("cuda", version_attrs=CUDA_TORCH),
        pytest.raises(RuntimeError, match="'rocm' is registered but not available"),
    ):
        default_device_registry().detect()


@pytest.mark.parametrize(
    ("available", "versions", "expected"),
    [(True, HIP_TORCH, True), (False, HIP_TORCH, False), (OSError("x"), HIP_TORCH, False),
     (True, CUDA_TORCH, False)],
)  # fmt: skip
def test_availability(available, versions, expected):
    from lmcache.devices.rocm import RocmDeviceSpec

    with install_fake_device("cuda", available=available, version_attrs=versions):
        assert RocmDeviceSpec().is_available() is expected


def test_rocm_overrides_only_what_differs():
    from lmcache.devices.rocm import RocmDeviceSpec
    from lmcache.devices.rocm.device_ops import RocmDeviceOps
    from lmcache.devices.rocm.pin_memory import RocmPinMemoryBackend
    from lmcache.v1.platform.cuda_family import CudaFamilyDeviceSpec
    from lmcache.v1.platform.cuda_family.ipc_wrapper import CudaIPCWrapper

    spec = RocmDeviceSpec()
    assert isinstance(spec, CudaFamilyDeviceSpec)
    assert (spec.device_type, spec.backend_name, spec.torch_module_name) == ("cuda", "rocm", "cuda")
    assert {n for n in RocmDeviceSpec.__dict__ if not n.startswith("__")} <= {
        "name",
        "torch_version_attr",
        "pin_memory_class",
        "ops_class",
    }
    assert spec.pin_memory_backend is RocmPinMemoryBackend
    assert RocmDeviceOps.native_module_name == "lmcache.devices.rocm.cuda_ops"
    assert spec.ipc_wrapper_cls is CudaIPCWrapper
    assert spec.is_lmcache_driven_available() and spec.is_handle_transfer_available()
    assert spec.default_mp_transfer_mode() is MPTransferMode.LMCACHE_DRIVEN


def test_native_module_absent_falls_back(caplog):
    from lmcache.devices.rocm.device_ops import RocmDeviceOps

    ops = RocmDeviceOps()
    ops.ensure_native()
    assert ops.kv_transfer_operands == "tensor"
    assert "lmcache.devices.rocm.cuda_ops" in caplog.text
    # ROCm's own build variable, never CUDA's.
    assert "LMCACHE_BUILD_HIP=1" in caplog.text and "LMCACHE_BUILD_CUDA" not in caplog.text


def test_pin_without_hip_runtime_is_false():
    from lmcache.devices.rocm.pin_memory import RocmPinMemoryBackend

    assert RocmPinMemoryBackend().pin_memory(4096, 64) is False  # no libamdhip64 here


CSRC = Path(__file__).resolve().parents[2] / "packages" / "lmcache-cuda" / "csrc"
HIPCC = shutil.which("hipcc")


@pytest.mark.skipif(HIPCC is None, reason="hipcc (ROCm toolkit) not installed")
@pytest.mark.skipif(not (CSRC / "kv_transfer.cu").is_file(), reason=f"kernel sources not at {CSRC}")
def test_hipcc_compiles_the_shared_kernels(tmp_path):
    subprocess.run(
        [HIPCC, "-std=c++17", "-x", "hip", "-DUSE_ROCM=1", "-c", str(CSRC / "kv_transfer.cu"),
         "-o", str(tmp_path / "kv_transfer.o")],
        check=True,
        capture_output=True,
    )  # fmt: skip


def test_wheel_metadata_and_explicit_capabilities():
    """Depends on lmcache-core and on torch only as a range; both flags and the default
    mode are overridden explicitly (no reliance on the base-class bridge)."""
    from lmcache.devices.rocm import RocmDeviceSpec
    from lmcache.v1.platform.testing import check_device_wheel_contract

    check_device_wheel_contract("lmcache-rocm", RocmDeviceSpec())
