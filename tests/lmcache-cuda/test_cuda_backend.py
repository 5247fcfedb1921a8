"""lmcache-cuda (docs/design/platform.md#device-cuda) and core's cuda_family with a fake-patched
``torch.cuda`` + ``torch.version.cuda``: discovery, flags, AUTO = lmcache_driven, the
``cuda`` wire descriptor, IPC policy, pinning, native binding and its fallback."""

from __future__ import annotations

import importlib.metadata as md
import sys
import types

import pytest
import torch

from lmcache.v1.platform.base.device_spec import effective_default_mode
from lmcache.v1.platform.ops_types import TransferDirection
from lmcache.v1.platform.testing import install_fake_device
from lmcache.v1.platform.transfer_mode import MPTransferMode

CUDA_TORCH = {"cuda": "12.4", "hip": None}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("LMCACHE_DEVICE_BACKEND", "DEVICE_TYPE", "LMCACHE_MP_TRANSFER_MODE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def fake_cuda():
    with install_fake_device("cuda", version_attrs=CUDA_TORCH, with_ipc_events=True) as fake:
        yield fake


def test_entry_point_and_identity(fake_cuda):
    eps = {ep.name: ep.value for ep in md.entry_points(group="lmcache.device_plugins")}
    assert eps["cuda"] == "lmcache.devices.cuda:CudaDeviceSpec"
    from lmcache.devices.cuda import CudaDeviceSpec
    from lmcache.v1.platform import get_device_spec, get_torch_device
    from lmcache.v1.platform.cuda_family import CudaFamilyDeviceSpec

    spec = get_device_spec("cuda")
    assert type(spec) is CudaDeviceSpec and isinstance(spec, CudaFamilyDeviceSpec)
    assert (spec.device_type, spec.backend_name, spec.torch_module_name) == ("cuda",) * 3
    assert get_torch_device()[1] == "cuda"  # auto-detected without any env var


@pytest.mark.parametrize(
    ("available", "versions", "expected"),
    [
        (True, CUDA_TORCH, True),
        (False, CUDA_TORCH, False),
        (RuntimeError("driver"), CUDA_TORCH, False),
        (True, {"cuda": None, "hip": "6.2"}, False),  # a HIP build belongs to rocm
    ],
)
def test_availability(available, versions, expected):
    from lmcache.devices.cuda import CudaDeviceSpec

    with install_fake_device("cuda", available=available, version_attrs=versions):
        assert CudaDeviceSpec().is_available() is expected


@pytest.mark.parametrize("var", ["LMCACHE_DEVICE_BACKEND", "DEVICE_TYPE"])
def test_selected_by_env(monkeypatch, var, fake_cuda):
    from lmcache.devices.cuda.device_ops import CudaDeviceOps
    from lmcache.v1.platform import get_torch_device, reset_platform_caches, resolve_device_ops

    monkeypatch.setenv(var, "cuda")
    reset_platform_caches()
    assert get_torch_device()[1] == "cuda"
    ops = resolve_device_ops("cuda")
    assert isinstance(ops, CudaDeviceOps) and resolve_device_ops("cuda") is ops


def test_flags_auto_mode_and_event_backend(fake_cuda):
    from lmcache.v1.platform import get_device_spec
    from lmcache.v1.platform.base.event_ipc import DefaultEventIPCBackend, get_event_ipc_backend

    spec = get_device_spec("cuda")
    assert spec.is_lmcache_driven_available() is True
    assert spec.is_handle_transfer_available() is True
    assert spec.default_mp_transfer_mode() is MPTransferMode.LMCACHE_DRIVEN
    assert effective_default_mode(spec) is MPTransferMode.LMCACHE_DRIVEN
    backend = spec.event_ipc_backend
    assert isinstance(backend, DefaultEventIPCBackend) and backend.device_type == "cuda"
    assert spec.event_ipc_backend is backend and get_event_ipc_backend("cuda:0") is backend
    backend.check_event_support("cuda:0")  # interprocess events on the fake: no raise

    class S:
        cuda_stream = 0xBEEF

    assert spec.get_stream_handle(S()) == 0xBEEF


def test_wrapper_factory_follows_ipc_policy(fake_cuda):
    from lmcache.v1.platform import get_device_spec, resolve_kv_wrapper_factory
    from lmcache.v1.platform.cuda_family.ipc_wrapper import (
        CudaIPCWrapper,
        RawCudaIPCWrapper,
        VmmCudaIPCWrapper,
    )
    from lmcache.v1.platform.ipc_policy import IPCPolicy, get_ipc_policy, set_ipc_policy

    spec = get_device_spec("cuda")
    assert spec.ipc_wrapper_cls is CudaIPCWrapper
    assert resolve_kv_wrapper_factory("cuda") == CudaIPCWrapper.wrap
    assert spec.ipc_wire_types == (CudaIPCWrapper,)
    saved = get_ipc_policy()
    try:
        set_ipc_policy(IPCPolicy(isolated_ipc=True))
        assert spec.ipc_wrapper_cls is RawCudaIPCWrapper
        with pytest.raises(NotImplementedError, match="--isolated-ipc"):
            RawCudaIPCWrapper.wrap(torch.zeros(1))
        set_ipc_policy(IPCPolicy(use_vmm_api=True, isolated_ipc=True))
        assert spec.ipc_wrapper_cls is VmmCudaIPCWrapper
    finally:
        set_ipc_policy(saved)


def _descriptor():
    from lmcache.v1.platform.cuda_family.ipc_wrapper import CudaIPCWrapper

    w = CudaIPCWrapper()
    w.handle = (0, b"\x01" * 64, 4096, 512, b"ref", 8, b"\x02" * 64, True)
    w.dtype = torch.bfloat16
    w.shape = (2, 4, 16, 8, 64)
    w.stride = (32768, 8192, 512, 64, 1)
    w.storage_offset = 0
    w.device_uuid = "GPU-1234"
    return w


def test_cuda_descriptor_wire_roundtrip(fake_cuda):
    from lmcache.v1.platform.base.ipc_wire import (
        decode_wrapper,
        encode_wrapper,
        registered_wire_tags,
        wrapper_to_dict,
    )
    from lmcache.v1.platform.cuda_family.ipc_wrapper import CudaIPCWrapper

    assert registered_wire_tags()["cuda"] is CudaIPCWrapper
    w = _descriptor()
    body = wrapper_to_dict(w)
    assert body["type"] == "cuda" and body["version"] == 1
    assert body["metadata"]["dtype"] == "bfloat16" and body["metadata"]["device_uuid"] == "GPU-1234"
    assert body["handle"][1] == b"\x01" * 64 and len(body["handle"]) == 8
    ext = encode_wrapper(w)
    back = decode_wrapper(ext.data)
    assert type(back) is CudaIPCWrapper and back == w


def test_cuda_descriptor_rejects_malformed_handle(fake_cuda):
    from lmcache.v1.platform.base.ipc_wire import wrapper_from_dict, wrapper_to_dict

    body = wrapper_to_dict(_descriptor())
    body["handle"] = body["handle"][:5]
    with pytest.raises(ValueError, match="8-tuple"):
        wrapper_from_dict(body)
    body = wrapper_to_dict(_descriptor())
    body["handle"][2] = "4096"
    with pytest.raises(ValueError, match=r"handle\[2\]"):
        wrapper_from_dict(body)


def test_cache_context_routes_to_gpu_context(fake_cuda):
    from lmcache.v1.platform import get_device_spec

    spec = get_device_spec("cuda")
    with pytest.raises(ValueError, match="GPUCacheContext got a KV tensor on cpu"):
        spec.create_cache_context(
            [torch.zeros(2, 4, 16, 2, 8)], 256, None, (), "vllm", False, False
        )


def test_pin_backend_through_cudart(fake_cuda, monkeypatch):
    from lmcache.devices.cuda.pin_memory import CudaPinMemoryBackend
    from lmcache.v1.platform import get_device_spec

    spec = get_device_spec("cuda")
    assert spec.pin_memory_backend is CudaPinMemoryBackend
    calls = []

    class Rt:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("reg", ptr, size, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unreg", ptr))
            return 1  # an error code

    backend = spec._pin_backend()
    backend._rt = Rt()
    assert spec.pin_memory(8192, 4096) is True
    assert spec.unpin_memory(8192) is False
    assert calls == [("reg", 8192, 4096, 0), ("unreg", 8192)]


def test_ops_fall_back_to_baseline_with_one_warning(fake_cuda, caplog, monkeypatch):
    import lmcache.devices.cuda as pkg
    from lmcache.devices.cuda.device_ops import CudaDeviceOps

    monkeypatch.setitem(sys.modules, "lmcache.devices.cuda._C", None)  # extension not built
    monkeypatch.delattr(pkg, "_C", raising=False)
    monkeypatch.delitem(sys.modules, "lmcache.devices.cuda.cuda_ops", raising=False)
    ops = CudaDeviceOps()
    ops.ensure_native()
    ops.ensure_native()  # one attempt per instance
    warnings = [r for r in caplog.records if "lmcache.devices.cuda.cuda_ops" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"
    assert "LMCACHE_BUILD_CUDA=1" in warnings[0].getMessage()
    assert ops.kv_transfer_operands == "tensor"
    assert ops.multi_layer_block_kv_transfer.__func__ is CudaDeviceOps.multi_layer_block_kv_transfer


def test_successful_bind_switches_to_pointer_operands(fake_cuda, monkeypatch):
    from lmcache.devices.cuda.device_ops import CudaDeviceOps

    native = types.ModuleType("lmcache.devices.cuda.cuda_ops")

    def multi_layer_block_kv_transfer(*args):
        return "native"

    native.multi_layer_block_kv_transfer = multi_layer_block_kv_transfer
    native.MAX_OBJECTS_PER_CALL = 4
    monkeypatch.setitem(sys.modules, "lmcache.devices.cuda.cuda_ops", native)
    ops = CudaDeviceOps()
    ops.ensure_native()
    assert ops.kv_transfer_operands == "pointer" and ops.max_objects_per_call == 4
    assert ops.multi_layer_block_kv_transfer() == "native"
    assert CudaDeviceOps().kv_transfer_operands == "tensor"  # other instances keep the baseline


def test_tensor_from_ptr_on_host_and_memcpy_tensor_mode(fake_cuda):
    from lmcache.devices.cuda.device_ops import CudaDeviceOps

    ops = CudaDeviceOps()
    base = torch.arange(8, dtype=torch.bfloat16)
    view = ops.tensor_from_ptr(base.data_ptr(), (2, 4), torch.bfloat16, "cpu")
    view[1, 3] = 5
    assert base[7] == 5
    with pytest.raises(ValueError):
        ops.tensor_from_ptr(0, (1,), torch.float16, "cpu")
    dst = torch.zeros(8, dtype=torch.bfloat16)
    ops.lmcache_memcpy_async(dst, base, 8, TransferDirection.D2H, 0, 1 << 26)
    assert torch.equal(dst[:4], base[:4]) and not dst[4:].any()
    with pytest.raises(TypeError):
        ops.lmcache_memcpy_async(dst, base.data_ptr(), 8, TransferDirection.D2H, 0, 1 << 26)
    with pytest.raises(ValueError, match="power of two"):
        ops.lmcache_memcpy_async(1, 2, 8, TransferDirection.D2H, 0, 3)


def test_host_pieces():
    from lmcache.v1.platform.cuda_family.device_ops import host_pieces

    assert host_pieces(60, 100, 64) == [(0, 4), (4, 64), (68, 32)]
    assert host_pieces(0, 128, 64) == [(0, 64), (64, 64)]
    assert host_pieces(5, 0, 64) == []


def test_wheel_metadata_and_explicit_capabilities():
    """Depends on lmcache-core and on torch only as a range; both flags and the default
    mode are overridden explicitly (no reliance on the base-class bridge)."""
    from lmcache.devices.cuda import CudaDeviceSpec
    from lmcache.v1.platform.testing import check_device_wheel_contract

    check_device_wheel_contract("lmcache-cuda", CudaDeviceSpec())


def _gpu_ready() -> bool:
    try:
        import lmcache.devices.cuda._C  # noqa: F401
    except ImportError:
        return False
    return bool(torch.version.cuda) and torch.cuda.is_available()


GPU_CHECKS = (
    __import__("pathlib").Path(__file__).resolve().parents[2]
    / "packages" / "lmcache-cuda" / "tests_gpu" / "gpu_checks.py"
)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(
    not _gpu_ready(),
    reason="needs a CUDA GPU and lmcache.devices.cuda._C (built when nvcc is found); "
    "a skip here is not hardware validation",
)
@pytest.mark.parametrize("check", ["check_kernels", "check_two_process"])
def test_gpu_checks(check):
    import importlib.util

    spec = importlib.util.spec_from_file_location("lmcache_cuda_gpu_checks", GPU_CHECKS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = {}
    getattr(module, check)(results)
    assert results
