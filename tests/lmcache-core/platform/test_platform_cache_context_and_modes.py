"""Cache-context factory and CPUCacheContext (docs/design/platform.md#cache-context), kv_wrap
(docs/design/platform.md#kv-wrap), transfer modes (docs/design/platform.md#transfer-modes), IPC
policy (docs/design/platform.md#ipc-policy), stream helpers
(docs/design/platform.md#event-notifiers) and the fake-device helper
(docs/design/platform.md#device-wheels)."""

from __future__ import annotations

from multiprocessing import shared_memory

import pytest
import torch

from lmcache.v1.platform import cache_context as cc
from lmcache.v1.platform.devices.cpu.ipc_wrapper import CpuShmTensorWrapper, create_shm_tensor
from lmcache.v1.platform.ops_types import EngineKVFormat, TransferDirection
from lmcache.v1.platform.transfer_mode import MPTransferMode, resolve_mp_transfer_mode


def _kv(nl=3, nb=6, bs=4, nh=2, hs=8, dtype=torch.float16, shm=False):
    make = (
        (lambda s: create_shm_tensor(s, dtype)) if shm else (lambda s: torch.zeros(s, dtype=dtype))
    )
    layers = [make((2, nb, bs, nh, hs)) for _ in range(nl)]
    g = torch.Generator().manual_seed(0)
    for t in layers:
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    return layers


def test_factory_forwards_seven_positional_values_and_overrides_win():
    seen = []
    state = cc.snapshot_backends()
    try:
        cc.register_cache_context_backend(
            "cpu", lambda *args, **kw: seen.append((args, kw)) or "ctx"
        )
        layers = _kv(nl=1)
        out = cc.create_cache_context(layers, 128, ["HND"], [[0]], "sglang", True, True)
        assert out == "ctx"
        ((args, kw),) = seen
        assert kw == {} and len(args) == 7
        assert args[0][0] is layers[0]
        assert args[1:] == (128, ["HND"], [[0]], "sglang", True, True)
    finally:
        cc.restore_backends(state)
    assert cc.snapshot_backends() == state


def test_factory_errors():
    with pytest.raises(ValueError) as ei:
        cc.create_cache_context([])
    assert str(ei.value) == "create_cache_context requires a non-empty kv_caches list"
    with pytest.raises(ValueError, match="share one"):
        cc.create_cache_context(
            [torch.zeros(2, 1, 1, 1, 1), torch.zeros(2, 1, 1, 1, 1, device="meta")]
        )
    with pytest.raises(
        ValueError, match="No cache-context class registered for device type 'meta'"
    ):
        cc.create_cache_context([torch.zeros(2, 1, 1, 1, 1, device="meta")])


def test_cpu_cache_context_over_shm_wrappers_supports_block_transfer():
    from lmcache.v1.platform.devices.cpu.cache_context import CPUCacheContext
    from lmcache.v1.platform.torch_ops import multi_layer_block_kv_transfer

    layers = _kv(shm=True)
    wrappers = [CpuShmTensorWrapper.wrap(t) for t in layers]
    try:
        ctx = cc.create_cache_context(wrappers, 8)  # server side: opens the wrappers
        assert isinstance(ctx, CPUCacheContext) and ctx.device_type == "cpu"
        assert ctx.num_layers == 3 and ctx.num_blocks == 6 and ctx.max_batch_size >= 1
        (kg,) = ctx.kernel_groups
        assert kg.engine_kv_format == EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
        assert ctx.get_engine_kv_format() == kg.engine_kv_format
        assert ctx.engine_kv_formats == [kg.engine_kv_format]
        desc = ctx.get_shape_desc(kg)
        assert (desc.kv_size, desc.nl, desc.nb, desc.bs, desc.nh, desc.hs) == (2, 3, 6, 4, 2, 8)
        assert ctx.cache_size_per_token() == 2 * 3 * 16 * 2
        shape, dtype = ctx.get_kernel_group_shape_dtype(8, kg)
        assert tuple(shape) == (2, 3, 8, 16) and dtype == torch.float16
        ptrs = ctx.get_kernel_group_kv_pointers(kg)
        assert ptrs.dtype == torch.int64 and ptrs.numel() == 3
        buf = ctx.get_temp_kernel_group_buffer(0, kg)
        flat = ctx.get_temp_object_group_buffer(0, ctx.object_groups[0])
        assert flat.dtype == torch.uint8 and flat.numel() == ctx.cache_size_per_token() * 8
        ids = ctx.stage_block_ids([5, 2])
        multi_layer_block_kv_transfer(
            ctx.kernel_group_layers(kg),
            [buf],
            ids,
            "cpu",
            TransferDirection.D2H,
            desc,
            8,
            kg.engine_kv_format,
            0,
        )
        for layer_idx, t in enumerate(layers):  # the worker's tensors, through SHM
            want = t[:, [5, 2]].reshape(2, 8, 16)
            assert torch.equal(buf[:, layer_idx], want)
        with pytest.raises(ValueError, match="exceed the staging buffer capacity"):
            ctx.stage_block_ids(list(range(7)))
        status = ctx.report_status()
        assert status["device_type"] == "cpu" and status["kernel_groups"][0]["layers"] == 3
        ev = object()
        ctx.hold_imported_event(ev)
        ctx.release_imported_event(ev)
        assert ctx._held_events == []
        ctx.close()
    finally:
        for w in wrappers:
            w.unlink()


def test_layers_with_different_geometry_form_separate_kernel_groups():
    from lmcache.v1.platform.base.cache_context import KVLayerGroupsManager

    layers = _kv(nl=2) + [torch.zeros(6, 4, 16, dtype=torch.float16)]  # + one MLA layer
    mgr = KVLayerGroupsManager.build(layers, ["NHD", "HND", None], [[0, 1], [2]], True)
    assert [kg.layer_indices for kg in mgr.kernel_groups] == [[0], [1], [2]]
    assert [kg.engine_kv_format for kg in mgr.kernel_groups] == [
        EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,
        EngineKVFormat.NL_X_TWO_NB_NH_BS_HS,
        EngineKVFormat.NL_X_NB_BS_HS,
    ]
    assert len(mgr.object_groups) == 2
    assert mgr.kernel_groups[2].kv_size == 1 and mgr.kernel_groups[2].hidden_dim == 16


def test_wrap_kv_caches_unlinks_earlier_segments_when_a_later_layer_fails(caplog):
    from lmcache.v1.platform.kv_wrap import wrap_kv_caches

    good = _kv(nl=2)
    created = []
    orig = CpuShmTensorWrapper.wrap.__func__

    def spy(cls, tensor):
        w = orig(cls, tensor)
        created.append(w.shm_name)
        return w

    CpuShmTensorWrapper.wrap = classmethod(spy)
    try:
        with (
            caplog.at_level("INFO", logger="lmcache"),
            pytest.raises(RuntimeError, match="No DeviceSpec registered for accelerator 'meta'"),
        ):
            wrap_kv_caches({"l0": good[0], "l1": good[1], "l2": torch.zeros(1, device="meta")})
    finally:
        CpuShmTensorWrapper.wrap = classmethod(orig)
    assert "Wrapping 3 KV cache tensors for IPC" in caplog.text
    assert len(created) == 2
    for name in created:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name.lstrip("/"), create=False)


def test_wrap_kv_caches_one_wrapper_per_layer():
    from lmcache.v1.platform.kv_wrap import wrap_kv_caches

    out = wrap_kv_caches({"a": _kv(nl=1)[0], "b": _kv(nl=1)[0]})
    try:
        assert list(out) == ["a", "b"]
        assert all(isinstance(w, CpuShmTensorWrapper) for w in out.values())
    finally:
        for w in out.values():
            w.unlink()


# ---- transfer modes ----------------------------------------------------------------------


def test_mode_resolution_env_explicit_and_invalid(monkeypatch):
    assert resolve_mp_transfer_mode() is MPTransferMode.AUTO
    monkeypatch.setenv("LMCACHE_MP_TRANSFER_MODE", "Engine_Driven")
    assert resolve_mp_transfer_mode() is MPTransferMode.ENGINE_DRIVEN
    assert resolve_mp_transfer_mode("lmcache_driven") is MPTransferMode.LMCACHE_DRIVEN
    assert resolve_mp_transfer_mode(MPTransferMode.AUTO) is MPTransferMode.AUTO
    with pytest.raises(ValueError) as ei:
        resolve_mp_transfer_mode("fastest")
    assert str(ei.value) == (
        "Invalid MP transfer mode 'fastest' (valid: auto, engine_driven, lmcache_driven)"
    )
    monkeypatch.setenv("LMCACHE_MP_TRANSFER_MODE", "nope")
    with pytest.raises(ValueError, match="Invalid MP transfer mode 'nope'"):
        resolve_mp_transfer_mode()


def test_multiprocess_reexport_is_the_same_enum():
    import subprocess
    import sys

    from lmcache.v1.multiprocess.transfer_mode import MPTransferMode as Reexported

    assert Reexported is MPTransferMode
    code = (
        "import sys\n"
        "import lmcache.v1.multiprocess.transfer_mode\n"
        "print(sorted(m for m in sys.modules if m == 'zmq' or m.startswith('zmq.'))[:1])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_router_checks():
    import lmcache.v1.multiprocess.transfer_context as tc  # core: always installed
    from lmcache.v1.platform.base.device_spec import DeviceSpec
    from lmcache.v1.platform.testing import extra_device_specs, install_fake_device

    with pytest.raises(ValueError, match="kv_caches is empty"):
        tc.create_transfer_context([], instance_id=0, req_client=None)
    with pytest.raises(ValueError, match="cpu.*meta|meta.*cpu"):
        tc.create_transfer_context(
            [torch.zeros(1), torch.zeros(1, device="meta")], instance_id=0, req_client=None
        )
    with pytest.raises(ValueError, match="Invalid MP transfer mode 'bogus'"):
        tc.create_transfer_context([torch.zeros(1)], instance_id=0, req_client=None, mode="bogus")

    class NoWrap(DeviceSpec):
        @property
        def device_type(self):
            return "nowrapdev"

    class WrapNoCap(DeviceSpec):
        @property
        def device_type(self):
            return "capdev"

        @property
        def ipc_wrapper_cls(self):
            return CpuShmTensorWrapper

        def is_handle_transfer_available(self):
            return False

    with install_fake_device("nowrapdev"), extra_device_specs(NoWrap(), WrapNoCap()):
        # route with a fake device type: a tiny tensor-like carrying .device.type
        fake = type("T", (), {"device": type("D", (), {"type": "nowrapdev"})()})()
        with pytest.raises(ValueError) as ei:
            tc.create_transfer_context(
                [fake], instance_id=0, req_client=None, mode="lmcache_driven"
            )
        assert str(ei.value) == (
            "MP transfer mode 'lmcache_driven' is not supported for device type 'nowrapdev': no "
            "KV-cache wrapper factory is registered. Use mode 'engine_driven' instead."
        )
        fake2 = type("T", (), {"device": type("D", (), {"type": "capdev"})()})()
        with pytest.raises(ValueError) as ei:
            tc.create_transfer_context(
                [fake2], instance_id=0, req_client=None, mode="lmcache_driven"
            )
        assert str(ei.value) == (
            "MP transfer mode 'lmcache_driven' is not available for device type 'capdev': "
            "required platform capability checks failed. Use mode 'engine_driven' instead."
        )


# ---- IPC policy, stream helpers, fake devices ---------------------------------------------


def test_ipc_policy_is_process_global():
    from lmcache.v1.platform import ipc_policy as ip

    saved = ip.get_ipc_policy()
    try:
        ip.set_isolated_ipc(True)
        assert ip.is_isolated_ipc() and not ip.is_use_vmm_api()
        ip.set_use_vmm_api(True)
        assert ip.get_ipc_policy() == ip.IPCPolicy(isolated_ipc=True, use_vmm_api=True)
        ip.set_ipc_policy(ip.IPCPolicy())
        assert not ip.is_isolated_ipc() and not ip.is_use_vmm_api()
    finally:
        ip.set_ipc_policy(saved)


def test_stream_helpers_dispatch_by_device_never_the_active_accelerator():
    from lmcache.v1.platform import stream
    from lmcache.v1.platform.base.device_spec import DeviceSpec
    from lmcache.v1.platform.devices.cpu.stub_cpu_device import StubStream
    from lmcache.v1.platform.testing import extra_device_specs, install_fake_device

    class Acc(DeviceSpec):
        @property
        def device_type(self):
            return "streamy"

        @property
        def torch_module_name(self):
            return "streamy"

        def is_available(self):
            return True

        def get_stream_handle(self, s):
            return 77

    with install_fake_device("streamy") as fake, extra_device_specs(Acc()):
        assert isinstance(stream.current_stream("cpu"), StubStream)
        assert stream.stream_handle(stream.current_stream("cpu"), "cpu") == 0
        stream.synchronize_device("cpu")
        assert fake.synchronize_calls == 0
        s = stream.current_stream("streamy")
        assert s is fake.current_stream()
        assert stream.stream_handle(s, "streamy") == 77
        ev = stream.record_completion_event(device="streamy")
        assert ev.query() is True and ("record", s) in ev.event.calls
        stream.synchronize_stream(s, "streamy")
        assert s.synchronize_calls == 1


def test_install_fake_device_restores_everything():
    import sys

    from lmcache.v1.platform.testing import install_fake_device

    orig_is_available = torch.cuda.is_available
    with install_fake_device("mlu", vendor_module="torch_mlu", device_count=2) as fake:
        assert torch.mlu is fake and "torch_mlu" in sys.modules
        assert fake.device_count() == 2 and fake.is_available()
        fake.set_device(1)
        assert fake.current_device() == 1
        ext = fake.ExternalStream(1234)
        assert ext.handle == 1234
    assert not hasattr(torch, "mlu") and "torch_mlu" not in sys.modules
    with install_fake_device("cuda", available=False, version_attrs={"hip": "6.0"}):
        assert torch.cuda.is_available() is False and torch.version.hip == "6.0"
    assert torch.cuda.is_available is orig_is_available
    assert torch.version.hip is None
    with (
        install_fake_device("xpu", available=RuntimeError("driver")) as fake,
        pytest.raises(RuntimeError),
    ):
        fake.is_available()


def test_wheel_checks_in_testing_module_pass_and_fail():
    from lmcache.v1.platform.base.device_ops import DeviceOps
    from lmcache.v1.platform.devices.cpu import CpuDeviceSpec
    from lmcache.v1.platform.testing import (
        check_canonical_block_transfer,
        check_device_wheel_contract,
    )

    for fmt in (1, 2, 3, 6):
        check_canonical_block_transfer(DeviceOps(), fmt, [4, 0, 2], 1)

    class SkipIgnored(DeviceOps):  # writes the skipped prefix too
        def multi_layer_block_kv_transfer(self, *args):
            return super().multi_layer_block_kv_transfer(*args[:-1], 0)

    with pytest.raises(AssertionError, match="before skip"):
        check_canonical_block_transfer(SkipIgnored(), 1, [4, 0, 2], 1)
    with pytest.raises(ValueError, match="fmt=9"):
        check_canonical_block_transfer(DeviceOps(), 9, [0], 0)
    # lmcache-core is not a device wheel: it does not depend on itself.
    with pytest.raises(AssertionError):
        check_device_wheel_contract("lmcache-core", CpuDeviceSpec())
