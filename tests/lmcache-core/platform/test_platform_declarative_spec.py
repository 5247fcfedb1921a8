"""DeviceSpec written two ways: declared with class attributes, or with 0.5.6-style
property and method overrides. Both must select, report capabilities and build ops the
same way, and an override must always win over a declared attribute."""

from __future__ import annotations

import os
import sys
import types

import pytest

from lmcache.v1.platform.base.device_ops import DeviceOps
from lmcache.v1.platform.base.device_spec import DeviceSpec
from lmcache.v1.platform.testing import extra_device_specs, install_fake_device
from lmcache.v1.platform.transfer_mode import MPTransferMode

# A tiny ops module the declarative spec names by string, so nothing imports it early.
_OPS_MODULE = "lmcache_test_decl_ops"


class DeclaredOps(DeviceOps):
    device_type = "zdecl"
    kv_transfer_operands = "tensor"


@pytest.fixture
def ops_module():
    mod = types.ModuleType(_OPS_MODULE)
    mod.DeclaredOps = DeclaredOps  # type: ignore[attr-defined]
    sys.modules[_OPS_MODULE] = mod
    yield mod
    sys.modules.pop(_OPS_MODULE, None)


class DeclaredSpec(DeviceSpec):
    name = "zdecl"
    vendor_module = "torch_zdecl"
    ops_class = f"{_OPS_MODULE}:DeclaredOps"
    lmcache_driven = False
    stream_handle_attr = "raw_queue"


class OldStyleSpec(DeviceSpec):
    """What a 0.5.6 / first-generation plugin looks like: everything overridden."""

    @property
    def device_type(self) -> str:
        return "zold"

    @property
    def torch_module_name(self) -> str:
        return "zold"

    @property
    def ops_cls(self) -> type[DeviceOps]:
        return DeclaredOps

    def is_available(self) -> bool:
        import torch

        return bool(getattr(torch, "zold", None) and torch.zold.is_available())

    def is_lmcache_driven_available(self) -> bool:
        return False

    def get_stream_handle(self, stream) -> int:
        return int(stream.raw_queue)


def test_declared_identity_derives_every_name():
    spec = DeclaredSpec()
    assert (spec.device_type, spec.backend_name, spec.torch_module_name) == (
        "zdecl",
        "zdecl",
        "zdecl",
    )

    class SharedType(DeviceSpec):
        name = "zrocm"
        torch_device_type = "cuda"

    shared = SharedType()
    assert (shared.device_type, shared.backend_name, shared.torch_module_name) == (
        "cuda",
        "zrocm",
        "cuda",
    )


def test_bare_spec_keeps_the_fallback_answers():
    spec = DeviceSpec()
    assert (spec.device_type, spec.backend_name, spec.torch_module_name) == ("", "", "")
    assert spec.is_available() is False
    assert spec.is_handle_transfer_available() is True
    assert spec.is_lmcache_driven_available() is False
    assert spec.default_mp_transfer_mode() is MPTransferMode.ENGINE_DRIVEN
    assert spec.ops_cls is DeviceOps
    with pytest.raises(NotImplementedError, match="raw stream handles"):
        spec.get_stream_handle(object())


def test_declared_availability_needs_vendor_module_and_torch_module():
    with install_fake_device("zdecl", available=True):
        assert DeclaredSpec().is_available() is False  # torch_zdecl is not importable
    with install_fake_device("zdecl", available=True, vendor_module="torch_zdecl"):
        assert DeclaredSpec().is_available() is True
    with install_fake_device("zdecl", available=False, vendor_module="torch_zdecl"):
        assert DeclaredSpec().is_available() is False
    with install_fake_device(
        "zdecl", available=RuntimeError("driver gone"), vendor_module="torch_zdecl"
    ):
        assert DeclaredSpec().is_available() is False  # never raises
    assert DeclaredSpec().is_available() is False  # no torch.zdecl at all


def test_declared_capability_and_stream_handle():
    spec = DeclaredSpec()
    assert spec.is_lmcache_driven_available() is False
    assert spec.is_handle_transfer_available() is False
    assert spec.default_mp_transfer_mode() is MPTransferMode.ENGINE_DRIVEN
    assert spec.get_stream_handle(types.SimpleNamespace(raw_queue=1234)) == 1234

    class Driven(DeviceSpec):
        name = "zdriven"
        lmcache_driven = True

    assert Driven().is_lmcache_driven_available() is True
    assert Driven().is_handle_transfer_available() is True
    assert Driven().default_mp_transfer_mode() is MPTransferMode.LMCACHE_DRIVEN


def test_declared_ops_class_is_imported_lazily_and_cached(ops_module):
    spec = DeclaredSpec()
    assert spec.ops_cls is DeclaredOps
    ops = spec.get_ops()
    assert isinstance(ops, DeclaredOps)
    assert spec.get_ops() is ops


@pytest.mark.parametrize("bad", ["no_colon_here", ":Cls", "mod:"])
def test_malformed_ops_class_names_the_attribute(bad):
    class Bad(DeviceSpec):
        name = "zbad"
        ops_class = bad

    with pytest.raises(ValueError, match=r"ops_class=.*'package\.module:ClassName'.*zbad"):
        Bad().get_ops()


def test_old_style_overrides_behave_as_before(ops_module):
    spec = OldStyleSpec()
    assert (spec.device_type, spec.backend_name, spec.torch_module_name) == (
        "zold",
        "zold",
        "zold",
    )
    # 0.5.6 rule: only is_lmcache_driven_available overridden -> the other mirrors it.
    assert spec.is_handle_transfer_available() is False
    assert spec.default_mp_transfer_mode() is MPTransferMode.ENGINE_DRIVEN
    assert spec.get_stream_handle(types.SimpleNamespace(raw_queue=7)) == 7
    assert isinstance(spec.get_ops(), DeclaredOps)
    with install_fake_device("zold", available=True) as fake:
        assert spec.is_available() is True
        spec.synchronize_device()
        assert fake.synchronize_calls == 1


def test_override_wins_over_declared_attribute():
    class Mixed(DeviceSpec):
        name = "zmixed"
        lmcache_driven = False

        @property
        def device_type(self) -> str:
            return "zother"

        def is_lmcache_driven_available(self) -> bool:
            return True

        def is_available(self) -> bool:
            return True

    spec = Mixed()
    assert spec.device_type == "zother"
    assert spec.backend_name == "zmixed"
    assert spec.is_available() is True
    assert spec.is_lmcache_driven_available() is True
    assert spec.is_handle_transfer_available() is True  # mirrors the override
    assert spec.default_mp_transfer_mode() is MPTransferMode.LMCACHE_DRIVEN


@pytest.mark.parametrize("spec_cls", [DeclaredSpec, OldStyleSpec])
def test_both_styles_are_selected_by_the_registry(spec_cls, monkeypatch, ops_module):
    from lmcache.v1.platform import _device_detect, resolve_device_ops

    spec = spec_cls()
    name = spec.backend_name
    vendor = "torch_zdecl" if spec_cls is DeclaredSpec else None
    monkeypatch.setitem(os.environ, "LMCACHE_DEVICE_BACKEND", name)
    with (
        install_fake_device(name, available=True, vendor_module=vendor),
        extra_device_specs(spec),
    ):
        _module, device_type, backend = _device_detect.default_device_registry().detect()
        assert (device_type, backend) == (name, name)
        assert isinstance(resolve_device_ops(name), DeclaredOps)
