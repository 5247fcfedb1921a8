"""lmcache-xpu (docs/design/platform.md#device-xpu) with a patched ``torch.xpu``: engine-driven
only, the optional SYCL module bound when importable, baseline tensor mode otherwise."""

from __future__ import annotations

import importlib.metadata as md
import sys
import types

import pytest
import torch

from lmcache.v1.platform import torch_ops
from lmcache.v1.platform.base.device_spec import effective_default_mode
from lmcache.v1.platform.ops_types import EngineKVFormat, PageBufferShapeDesc, TransferDirection
from lmcache.v1.platform.testing import check_canonical_block_transfer, install_fake_device
from lmcache.v1.platform.transfer_mode import MPTransferMode

F = EngineKVFormat


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in ("LMCACHE_DEVICE_BACKEND", "DEVICE_TYPE"):
        monkeypatch.delenv(var, raising=False)
    from lmcache.devices.xpu import device_ops

    monkeypatch.setattr(device_ops, "_native", {})  # re-probe the SYCL module per test


def test_entry_point_identity_and_capabilities():
    eps = {ep.name: ep.value for ep in md.entry_points(group="lmcache.device_plugins")}
    assert eps["xpu"] == "lmcache.devices.xpu:XpuDeviceSpec"
    from lmcache.devices.xpu import XpuDeviceSpec
    from lmcache.v1.platform import get_device_spec

    with install_fake_device("xpu"):
        spec = get_device_spec("xpu")
        assert type(spec) is XpuDeviceSpec
        assert (spec.device_type, spec.backend_name, spec.torch_module_name) == ("xpu",) * 3
        assert spec.is_lmcache_driven_available() is False
        assert spec.is_handle_transfer_available() is False
        assert spec.default_mp_transfer_mode() is MPTransferMode.ENGINE_DRIVEN
        assert effective_default_mode(spec) is MPTransferMode.ENGINE_DRIVEN
        assert spec.ipc_wrapper_cls is None and spec.event_ipc_backend is None
        assert spec.pin_memory_backend is None  # no SYCL module -> no host registration
        with pytest.raises(NotImplementedError, match="device_type='xpu'"):
            spec.create_cache_context()


@pytest.mark.parametrize(
    ("available", "expected"), [(True, True), (False, False), (RuntimeError("x"), False)]
)
def test_availability(available, expected):
    from lmcache.devices.xpu import XpuDeviceSpec

    with install_fake_device("xpu", available=available):
        assert XpuDeviceSpec().is_available() is expected


@pytest.mark.parametrize("var", ["LMCACHE_DEVICE_BACKEND", "DEVICE_TYPE"])
def test_selected_by_env(monkeypatch, var):
    from lmcache.devices.xpu.device_ops import XpuDeviceOps
    from lmcache.v1.platform import get_torch_device, resolve_device_ops

    monkeypatch.setenv(var, "xpu")
    with install_fake_device("xpu"):
        assert get_torch_device()[1] == "xpu"
        ops = resolve_device_ops("xpu")
        assert type(ops) is XpuDeviceOps and resolve_device_ops("xpu") is ops
        assert ops.kv_transfer_operands == "tensor"


def test_baseline_transfer_when_sycl_module_absent(caplog):
    from lmcache.v1.platform import resolve_device_ops

    with install_fake_device("xpu"):
        ops = resolve_device_ops("xpu")
        assert "lmcache.devices.xpu.xpu_ops" in caplog.text
        layers = [torch.randn(2, 5, 4, 2, 8).half() for _ in range(2)]
        sd = PageBufferShapeDesc(kv_size=2, nl=2, nb=5, bs=4, nh=2, hs=8, element_size=2)
        got = [torch.zeros(2, 2, 8, 16, dtype=torch.float16) for _ in range(2)]
        want = [torch.zeros(2, 2, 8, 16, dtype=torch.float16) for _ in range(2)]
        d2h = TransferDirection.D2H
        ops.multi_layer_block_kv_transfer(layers, got, [4, 0, 2], "cpu", d2h, sd, 8, 1, 1)
        torch_ops.multi_layer_block_kv_transfer(layers, want, [4, 0, 2], "cpu", d2h, sd, 8, 1, 1)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_sycl_module_bound_and_pinning(monkeypatch):
    from lmcache.devices.xpu.pin_memory import XpuPinMemoryBackend
    from lmcache.v1.platform import get_device_spec, resolve_device_ops

    native = types.ModuleType("lmcache.devices.xpu.xpu_ops")
    registered = []
    native.multi_layer_block_kv_transfer = lambda *a: "sycl"
    native.xpu_host_register = lambda ptr, size: registered.append((ptr, size)) or True
    monkeypatch.setitem(sys.modules, "lmcache.devices.xpu.xpu_ops", native)
    with install_fake_device("xpu"):
        ops = resolve_device_ops("xpu")
        assert ops.multi_layer_block_kv_transfer() == "sycl"
        assert ops.kv_transfer_operands == "pointer"
        spec = get_device_spec("xpu")
        assert spec.pin_memory_backend is XpuPinMemoryBackend
        assert spec.pin_memory(4096, 64) is True and registered == [(4096, 64)]
        assert spec.unpin_memory(4096) is False  # the module has no unregister


def test_wheel_metadata_and_explicit_capabilities():
    """Depends on lmcache-core and on torch only as a range; both flags and the default
    mode are overridden explicitly (no reliance on the base-class bridge)."""
    from lmcache.devices.xpu import XpuDeviceSpec
    from lmcache.v1.platform.testing import check_device_wheel_contract

    check_device_wheel_contract("lmcache-xpu", XpuDeviceSpec())


@pytest.mark.parametrize("fmt", [1, 2, 3, 6])
@pytest.mark.parametrize(
    ("ids", "skip"), [([4, 0, 2], 0), ([4, 0, 2], 1), ([1, 3, 0, 2], 3), ([1, 2], 5)]
)
def test_transfer_matrix_canonical(fmt, ids, skip):
    from lmcache.v1.platform import resolve_device_ops

    with install_fake_device("xpu"):
        check_canonical_block_transfer(resolve_device_ops("xpu"), fmt, ids, skip)
