"""lmcache-neuron (docs/design/platform.md#device-neuron): fake ``torch_neuronx`` that installs
``torch.neuron``; the XLA-era package without it is unavailable; pure baseline ops, engine-driven
only."""

from __future__ import annotations

import importlib.metadata as md
import sys
import types

import pytest
import torch

from lmcache.v1.platform import torch_ops
from lmcache.v1.platform.base.device_ops import DeviceOps
from lmcache.v1.platform.base.device_spec import effective_default_mode
from lmcache.v1.platform.ops_types import PageBufferShapeDesc, TransferDirection
from lmcache.v1.platform.testing import check_canonical_block_transfer, install_fake_device
from lmcache.v1.platform.transfer_mode import MPTransferMode


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("LMCACHE_DEVICE_BACKEND", "DEVICE_TYPE"):
        monkeypatch.delenv(var, raising=False)


def test_entry_point_identity_and_capabilities():
    eps = {ep.name: ep.value for ep in md.entry_points(group="lmcache.device_plugins")}
    assert eps["neuron"] == "lmcache.devices.neuron:NeuronDeviceSpec"
    from lmcache.devices.neuron import NeuronDeviceSpec
    from lmcache.v1.platform import get_device_spec, resolve_device_ops

    with install_fake_device("neuron", vendor_module="torch_neuronx"):
        spec = get_device_spec("neuron")
        assert type(spec) is NeuronDeviceSpec
        assert (spec.device_type, spec.backend_name, spec.torch_module_name) == ("neuron",) * 3
        assert spec.ops_cls is DeviceOps and type(resolve_device_ops("neuron")) is DeviceOps
        assert spec.is_lmcache_driven_available() is False
        assert spec.is_handle_transfer_available() is False
        assert spec.default_mp_transfer_mode() is MPTransferMode.ENGINE_DRIVEN
        assert effective_default_mode(spec) is MPTransferMode.ENGINE_DRIVEN
        assert spec.ipc_wrapper_cls is None and spec.event_ipc_backend is None
        assert spec.pin_memory_backend is None
        with pytest.raises(
            NotImplementedError,
            match="DeviceSpec for device_type='neuron' does not provide a BaseCacheContext",
        ):
            spec.create_cache_context()


def test_availability_variants(monkeypatch):
    from lmcache.devices.neuron import NeuronDeviceSpec

    spec = NeuronDeviceSpec()
    assert spec.is_available() is False  # no torch_neuronx
    with install_fake_device("neuron", vendor_module="torch_neuronx"):
        assert spec.is_available() is True
    with install_fake_device("neuron", available=False, vendor_module="torch_neuronx"):
        assert spec.is_available() is False
    with install_fake_device("neuron", available=RuntimeError("x"), vendor_module="torch_neuronx"):
        assert spec.is_available() is False
    # XLA-era torch-neuronx: importable, but no torch.neuron (device type "xla").
    monkeypatch.setitem(sys.modules, "torch_neuronx", types.ModuleType("torch_neuronx"))
    assert not hasattr(torch, "neuron")
    assert spec.is_available() is False


def test_torch_neuronx_import_registers_the_module(monkeypatch):
    """is_available() imports torch_neuronx for its side effect (registering torch.neuron)."""
    from lmcache.devices.neuron import NeuronDeviceSpec
    from lmcache.v1.platform.testing import FakeDeviceModule

    class Finder:
        def find_spec(self, name, path=None, target=None):
            if name != "torch_neuronx":
                return None
            import importlib.machinery

            return importlib.machinery.ModuleSpec(name, self)

        def create_module(self, spec):
            return types.ModuleType("torch_neuronx")

        def exec_module(self, module):
            monkeypatch.setattr(torch, "neuron", FakeDeviceModule("neuron"), raising=False)

    monkeypatch.delitem(sys.modules, "torch_neuronx", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Finder(), *sys.meta_path])
    assert NeuronDeviceSpec().is_available() is True


@pytest.mark.parametrize("var", ["LMCACHE_DEVICE_BACKEND", "DEVICE_TYPE"])
def test_selected_by_env(monkeypatch, var):
    from lmcache.v1.platform import get_torch_device

    monkeypatch.setenv(var, "neuron")
    with install_fake_device("neuron", vendor_module="torch_neuronx") as fake:
        assert get_torch_device() == (fake, "neuron")


def test_explicit_selection_error_text(monkeypatch):
    from lmcache.v1.platform import default_device_registry

    monkeypatch.setenv("LMCACHE_DEVICE_BACKEND", "neuron")
    with (
        install_fake_device("neuron", available=False, vendor_module="torch_neuronx"),
        pytest.raises(
            RuntimeError,
            match=r"LMCACHE_DEVICE_BACKEND='neuron' is registered but not available on this host\.",
        ),
    ):
        default_device_registry().detect()


def test_hnd_transfer_through_the_baseline():
    from lmcache.v1.platform import resolve_device_ops

    with install_fake_device("neuron", vendor_module="torch_neuronx"):
        ops = resolve_device_ops("neuron")
        layers = [torch.randn(2, 5, 2, 4, 8).half() for _ in range(2)]  # #6 [2, NB, NH, BS, HS]
        originals = [t.clone() for t in layers]
        sd = PageBufferShapeDesc(kv_size=2, nl=2, nb=5, bs=4, nh=2, hs=8, element_size=2)
        chunks = [torch.zeros(2, 2, 8, 16, dtype=torch.float16) for _ in range(2)]
        want = [torch.zeros(2, 2, 8, 16, dtype=torch.float16) for _ in range(2)]
        d2h, h2d = TransferDirection.D2H, TransferDirection.H2D
        ops.multi_layer_block_kv_transfer(layers, chunks, [3, 1, 4], "cpu", d2h, sd, 8, 6, 0)
        torch_ops.multi_layer_block_kv_transfer(layers, want, [3, 1, 4], "cpu", d2h, sd, 8, 6, 0)
        assert all(torch.equal(a, b) for a, b in zip(chunks, want, strict=True))
        # canonical rows: token-major, head-major inside a row
        assert torch.equal(chunks[0][0, 1, 0, :8], originals[1][0, 3, 0, 0])
        assert torch.equal(chunks[0][0, 1, 0, 8:], originals[1][0, 3, 1, 0])
        for t in layers:
            t.zero_()
        ops.multi_layer_block_kv_transfer(layers, chunks, [3, 1, 4], "cpu", h2d, sd, 8, 6, 0)
        for a, b in zip(layers, originals, strict=True):
            assert torch.equal(a[:, [3, 1, 4]], b[:, [3, 1, 4]]) and not a[:, [0, 2]].any()


def test_wheel_metadata_and_explicit_capabilities():
    """Depends on lmcache-core and on torch only as a range; both flags and the default
    mode are overridden explicitly (no reliance on the base-class bridge)."""
    from lmcache.devices.neuron import NeuronDeviceSpec
    from lmcache.v1.platform.testing import check_device_wheel_contract

    check_device_wheel_contract("lmcache-neuron", NeuronDeviceSpec())


@pytest.mark.parametrize("fmt", [1, 2, 3, 6])
@pytest.mark.parametrize(
    ("ids", "skip"), [([4, 0, 2], 0), ([4, 0, 2], 1), ([1, 3, 0, 2], 3), ([1, 2], 5)]
)
def test_transfer_matrix_canonical(fmt, ids, skip):
    from lmcache.v1.platform import resolve_device_ops

    with install_fake_device("neuron", vendor_module="torch_neuronx"):
        check_canonical_block_transfer(resolve_device_ops("neuron"), fmt, ids, skip)
