"""DeviceSpec contract: base behaviour, the capability bridge table, get_ops, streams, pinning."""

from __future__ import annotations

import logging
import threading

import pytest

from lmcache.v1.platform.base.device_ops import DeviceOps
from lmcache.v1.platform.base.device_spec import (
    DeviceSpec,
    effective_default_mode,
    effective_lmcache_driven_available,
)
from lmcache.v1.platform.base.pin_memory import PinMemoryBackend
from lmcache.v1.platform.transfer_mode import MPTransferMode


def test_bare_device_spec_is_the_noop_fallback():
    spec = DeviceSpec()
    assert spec.device_type == ""
    assert spec.backend_name == ""
    assert spec.torch_module_name == ""
    assert spec.is_available() is False
    assert spec.is_handle_transfer_available() is True
    assert spec.is_lmcache_driven_available() is False
    assert spec.default_mp_transfer_mode() == MPTransferMode.ENGINE_DRIVEN
    assert spec.event_ipc_backend is None
    assert spec.ipc_wrapper_cls is None
    assert spec.ipc_wire_types == ()
    assert spec.pin_memory_backend is None
    assert spec.ops_cls is DeviceOps
    with pytest.raises(NotImplementedError) as ei:
        spec.create_cache_context()
    assert str(ei.value) == (
        "DeviceSpec for device_type='' does not provide a BaseCacheContext implementation."
    )


class _Wrapper:
    @classmethod
    def wrap(cls, t):
        return cls()


class NeitherWithWrapper(DeviceSpec):
    @property
    def device_type(self):
        return "cuda"

    @property
    def ipc_wrapper_cls(self):
        return _Wrapper


class NeitherBrokenWrapper(DeviceSpec):
    @property
    def device_type(self):
        return "zz"

    @property
    def ipc_wrapper_cls(self):
        raise ImportError("vendor module missing")


class SeedEraFalse(DeviceSpec):
    @property
    def device_type(self):
        return "cuda"

    @property
    def ipc_wrapper_cls(self):
        return _Wrapper

    def is_handle_transfer_available(self):
        return False


class SeedEraTrueNoWrapper(DeviceSpec):
    @property
    def device_type(self):
        return "seedy"

    def is_handle_transfer_available(self):
        return True


class Era056(DeviceSpec):
    answer = True

    @property
    def device_type(self):
        return "npu"

    def is_lmcache_driven_available(self):
        return self.answer


class BothDisagree(DeviceSpec):
    @property
    def device_type(self):
        return "dd"

    def is_lmcache_driven_available(self):
        return False

    def is_handle_transfer_available(self):
        return True


class ModeAuto(DeviceSpec):
    @property
    def device_type(self):
        return "autoish"

    def default_mp_transfer_mode(self):
        return MPTransferMode.AUTO


class ModeRaises(DeviceSpec):
    @property
    def device_type(self):
        return "raisy"

    def default_mp_transfer_mode(self):
        raise RuntimeError("probe failed")


class ModeOverride(DeviceSpec):
    @property
    def device_type(self):
        return "cuda"

    def default_mp_transfer_mode(self):
        return MPTransferMode.ENGINE_DRIVEN

    @property
    def ipc_wrapper_cls(self):
        return _Wrapper


def test_bridge_row_neither_gate_follows_wrapper_and_seed_mode_rule():
    spec = NeitherWithWrapper()
    assert spec.is_lmcache_driven_available() is True
    assert spec.is_handle_transfer_available() is True
    # first-generation rule (docs/design/platform.md#capability-flags): cuda + gate ->
    # lmcache_driven
    assert spec.default_mp_transfer_mode() == MPTransferMode.LMCACHE_DRIVEN


def test_bridge_row_neither_wrapper_error_counts_as_none(caplog):
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        assert NeitherBrokenWrapper().is_lmcache_driven_available() is False
    assert "vendor module missing" in caplog.text
    assert NeitherBrokenWrapper().default_mp_transfer_mode() == MPTransferMode.ENGINE_DRIVEN


def test_bridge_row_seed_era_override_is_the_gate():
    assert SeedEraFalse().is_lmcache_driven_available() is False
    assert SeedEraFalse().default_mp_transfer_mode() == MPTransferMode.ENGINE_DRIVEN
    spec = SeedEraTrueNoWrapper()
    assert spec.is_lmcache_driven_available() is True
    # first-generation rule (docs/design/platform.md#capability-flags): not cuda -> engine_driven
    # even with the gate open
    assert spec.default_mp_transfer_mode() == MPTransferMode.ENGINE_DRIVEN


@pytest.mark.parametrize("answer", [True, False])
def test_bridge_row_056_era_mirrors_and_uses_056_mode_rule(answer):
    spec = Era056()
    spec.answer = answer
    assert spec.is_handle_transfer_available() is answer
    expected = MPTransferMode.LMCACHE_DRIVEN if answer else MPTransferMode.ENGINE_DRIVEN
    assert spec.default_mp_transfer_mode() == expected


def test_bridge_both_overridden_disagree_router_uses_new_flag_and_warns_once(caplog):
    spec = BothDisagree()
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        assert effective_lmcache_driven_available(spec) is False
        assert effective_lmcache_driven_available(spec) is False
    hits = [r for r in caplog.records if "disagrees with" in r.getMessage()]
    assert len(hits) == 1
    assert hits[0].getMessage() == (
        "DeviceSpec BothDisagree: is_lmcache_driven_available()=False disagrees with "
        "is_handle_transfer_available()=True; using the former"
    )


def test_bridge_row_default_mode_override_wins():
    assert ModeOverride().default_mp_transfer_mode() == MPTransferMode.ENGINE_DRIVEN
    assert effective_default_mode(ModeOverride()) == MPTransferMode.ENGINE_DRIVEN


@pytest.mark.parametrize("cls", [ModeAuto, ModeRaises])
def test_default_mode_auto_or_raising_becomes_engine_driven_with_warning(cls, caplog):
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        assert effective_default_mode(cls()) == MPTransferMode.ENGINE_DRIVEN
    assert "engine_driven" in caplog.text
    assert cls().device_type in caplog.text or cls.__name__ in caplog.text


def test_effective_default_mode_without_spec_is_engine_driven():
    assert effective_default_mode(None) == MPTransferMode.ENGINE_DRIVEN


class CountingOps(DeviceOps):
    created = 0
    natives = 0

    def __init__(self):
        super().__init__()
        type(self).created += 1

    def ensure_native(self):
        type(self).natives += 1


class CountingSpec(DeviceSpec):
    @property
    def device_type(self):
        return "counting"

    @property
    def ops_cls(self):
        return CountingOps


def test_get_ops_is_a_locked_singleton_with_one_ensure_native():
    CountingOps.created = CountingOps.natives = 0
    spec = CountingSpec()
    results = []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        results.append(spec.get_ops())

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(r) for r in results}) == 1
    assert CountingOps.created == 1 and CountingOps.natives == 1


class FailingOps(DeviceOps):
    fail = True

    def ensure_native(self):
        if type(self).fail:
            raise OSError("libfoo.so: cannot open shared object file")


class FailingSpec(DeviceSpec):
    @property
    def device_type(self):
        return "failing"

    @property
    def ops_cls(self):
        return FailingOps


def test_get_ops_failure_caches_nothing_and_names_the_backend():
    spec = FailingSpec()
    FailingOps.fail = True
    with pytest.raises(OSError) as ei:
        spec.get_ops()
    assert "'failing'" in str(ei.value) and "libfoo.so" in str(ei.value)
    assert spec._ops_cache is None
    FailingOps.fail = False
    ops = spec.get_ops()
    assert isinstance(ops, FailingOps) and spec.get_ops() is ops


def test_cpu_spec_streams_use_the_stub_even_with_an_accelerator_active():
    from lmcache.v1.platform.devices.cpu import CpuDeviceSpec
    from lmcache.v1.platform.devices.cpu.stub_cpu_device import StubStream
    from lmcache.v1.platform.testing import install_fake_device

    with install_fake_device("zorb") as fake:
        import lmcache.v1.platform as plat

        class ZorbSpec(DeviceSpec):
            @property
            def device_type(self):
                return "zorb"

            @property
            def torch_module_name(self):
                return "zorb"

        spec = CpuDeviceSpec()
        stream = spec.current_stream(None)
        assert isinstance(stream, StubStream)
        spec.synchronize_device(None)
        ev = spec.create_stream_event(None)
        spec.record_stream_event(ev, stream)
        assert spec.is_stream_event_complete(ev) is True
        assert fake.synchronize_calls == 0

        zorb = ZorbSpec()
        zorb.synchronize_device("zorb:0")
        assert fake.synchronize_calls == 1
        assert zorb.current_stream(None) is fake.current_stream()
        assert zorb.is_stream_event_complete(zorb.create_stream_event(None)) is True
        del plat


def test_stream_helpers_missing_module_name_the_module_and_backend():
    class Ghost(DeviceSpec):
        @property
        def device_type(self):
            return "ghost"

        @property
        def torch_module_name(self):
            return "ghostmod"

    with pytest.raises(RuntimeError) as ei:
        Ghost().synchronize_device(None)
    assert "torch.ghostmod" in str(ei.value) and "'ghost'" in str(ei.value)
    with pytest.raises(NotImplementedError):
        Ghost().get_stream_handle(object())


class RecordingPin(PinMemoryBackend):
    instances = 0

    def __init__(self):
        type(self).instances += 1
        self.calls = []

    def pin_memory(self, ptr, size, flags=0):
        self.calls.append(("pin", ptr, size, flags))
        return True

    def unpin_memory(self, ptr):
        self.calls.append(("unpin", ptr))
        return True

    @property
    def is_pin_supported(self):
        return True


class PinSpec(DeviceSpec):
    @property
    def device_type(self):
        return "pinny"

    @property
    def pin_memory_backend(self):
        return RecordingPin


def test_pin_memory_delegates_to_one_backend_instance():
    RecordingPin.instances = 0
    spec = PinSpec()
    assert spec.pin_memory(4096, 100) is True
    assert spec.unpin_memory(4096) is True
    assert spec.is_pin_supported is True
    assert RecordingPin.instances == 1
    assert spec._pin_backend().calls == [("pin", 4096, 100, 0), ("unpin", 4096)]
    base = DeviceSpec()
    assert base.pin_memory(1, 1) is False and base.unpin_memory(1) is False
    assert base.is_pin_supported is False
