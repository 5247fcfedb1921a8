"""lmcache-musa (docs/design/platform.md#device-musa) through a fake ``torch.musa`` /
``torch_musa`` / ``musa_aiter``: identity, selection, the exact ops override set, musa_aiter
dispatch with torch fallback, pointer-mode memcpy on CPU memory, recorders and pinning."""

from __future__ import annotations

import importlib.metadata as md
import sys
import types

import pytest
import torch

from lmcache.v1.platform import torch_ops
from lmcache.v1.platform.base.device_ops import DEVICE_OP_NAMES, DeviceOps
from lmcache.v1.platform.base.device_spec import effective_default_mode
from lmcache.v1.platform.ops_types import EngineKVFormat, PageBufferShapeDesc, TransferDirection
from lmcache.v1.platform.testing import install_fake_device
from lmcache.v1.platform.transfer_mode import MPTransferMode

F = EngineKVFormat
D2H, H2D = TransferDirection.D2H, TransferDirection.H2D
NL, NB, BS, NH, HS = 2, 6, 4, 2, 8
T = 2 * BS


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in (
        "LMCACHE_DEVICE_BACKEND",
        "DEVICE_TYPE",
        "LMCACHE_MUSA_HANDLE_TRANSFER",
        "LMCACHE_MUSA_NATIVE_KV_TRANSFER",
    ):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def fake_musa():
    with install_fake_device("musa", vendor_module="torch_musa") as fake:
        yield fake


@pytest.fixture
def ops(fake_musa):
    from lmcache.v1.platform import resolve_device_ops

    return resolve_device_ops("musa")


def test_entry_point_identity_and_flags(fake_musa):
    eps = {ep.name: ep.value for ep in md.entry_points(group="lmcache.device_plugins")}
    assert eps["musa"] == "lmcache.devices.musa:MusaDeviceSpec"
    from lmcache.devices.musa import MusaDeviceSpec
    from lmcache.v1.platform import get_device_spec

    spec = get_device_spec("musa")
    assert type(spec) is MusaDeviceSpec
    assert (spec.device_type, spec.backend_name, spec.torch_module_name) == ("musa",) * 3
    assert spec.is_lmcache_driven_available() is False
    assert spec.is_handle_transfer_available() is False
    assert spec.default_mp_transfer_mode() is MPTransferMode.ENGINE_DRIVEN
    assert effective_default_mode(spec) is MPTransferMode.ENGINE_DRIVEN

    class S:
        musa_stream = 0x1234

    assert spec.get_stream_handle(S()) == 0x1234


@pytest.mark.parametrize(
    ("available", "expected"), [(True, True), (False, False), (OSError("no driver"), False)]
)
def test_availability(available, expected):
    from lmcache.devices.musa import MusaDeviceSpec

    with install_fake_device("musa", available=available, vendor_module="torch_musa"):
        assert MusaDeviceSpec().is_available() is expected
    assert MusaDeviceSpec().is_available() is False  # no torch.musa at all


@pytest.mark.parametrize("var", ["LMCACHE_DEVICE_BACKEND", "DEVICE_TYPE"])
def test_selected_by_env(monkeypatch, var):
    from lmcache.devices.musa.device_ops import MusaDeviceOps
    from lmcache.v1.platform import get_torch_device, resolve_device_ops

    monkeypatch.setenv(var, "musa")
    with install_fake_device("musa", vendor_module="torch_musa") as fake:
        assert get_torch_device() == (fake, "musa")
        assert isinstance(resolve_device_ops("musa"), MusaDeviceOps)
        assert resolve_device_ops("musa") is resolve_device_ops("musa")


def test_explicit_selection_without_runtime(monkeypatch):
    from lmcache.v1.platform import default_device_registry

    monkeypatch.setenv("LMCACHE_DEVICE_BACKEND", "musa")
    with (
        install_fake_device("musa", available=False, vendor_module="torch_musa"),
        pytest.raises(RuntimeError, match="'musa' is registered but not available"),
    ):
        default_device_registry().detect()


def test_exact_override_set():
    from lmcache.devices.musa.device_ops import MusaDeviceOps

    # The block transfer is overridden through its plan hook, ``transfer_blocks``; some
    # overrides come from core's shared bases (DeviceViewOps, StreamWaitRecorders).
    names = (*DEVICE_OP_NAMES, "transfer_blocks")
    overridden = {
        name for name in names if getattr(MusaDeviceOps, name) is not getattr(DeviceOps, name)
    }
    assert overridden == {
        "tensor_from_ptr",
        "lmcache_memcpy_async",
        "record_completion_on_stream",
        "record_event_on_stream",
        "transfer_blocks",
    }
    assert MusaDeviceOps.kv_transfer_operands == "tensor"


def test_handle_transfer_opt_in_and_prerequisites(monkeypatch, fake_musa):
    from lmcache.devices.musa import MusaDeviceSpec

    spec = MusaDeviceSpec()
    assert spec.handle_transfer_prerequisites() is False  # env not set
    monkeypatch.setenv("LMCACHE_MUSA_HANDLE_TRANSFER", "yes")
    assert spec.handle_transfer_prerequisites() is False  # no memory IPC in torch.musa
    fake_musa.ipc = types.SimpleNamespace(export_tensor=lambda t: b"", open_tensor=lambda h: None)
    assert spec.handle_transfer_prerequisites() is False  # no interprocess events
    with install_fake_device("musa", vendor_module="torch_musa", with_ipc_events=True) as fake:
        fake.ipc = types.SimpleNamespace(export_tensor=lambda t: b"", open_tensor=lambda h: None)
        assert spec.handle_transfer_prerequisites() is True
        # Wrapper, event backend and cache context are LATER: the capability stays off.
        assert spec.is_lmcache_driven_available() is False
        assert spec.default_mp_transfer_mode() is MPTransferMode.ENGINE_DRIVEN


# ---- pinning ---------------------------------------------------------------------------
def test_pin_backend_registers_through_musart(fake_musa):
    from lmcache.devices.musa.pin_memory import MusaPinMemoryBackend
    from lmcache.v1.platform import get_device_spec

    spec = get_device_spec("musa")
    assert spec.pin_memory_backend is MusaPinMemoryBackend
    calls = []

    class Runtime:
        def musaHostRegister(self, ptr, size, flags):
            calls.append(("reg", ptr, size, flags))
            return 0 if size < 100 else 2

        def musaHostUnregister(self, ptr):
            calls.append(("unreg", ptr))
            return 0

    backend = spec._pin_backend()
    assert isinstance(backend, MusaPinMemoryBackend)
    backend._rt = Runtime()
    assert spec.pin_memory(4096, 64) is True
    assert spec.pin_memory(4096, 128) is False  # runtime error code -> False, no raise
    assert spec.unpin_memory(4096) is True
    assert calls == [("reg", 4096, 64, 0), ("reg", 4096, 128, 0), ("unreg", 4096)]


def test_pin_without_runtime_is_false():
    from lmcache.devices.musa.pin_memory import MusaPinMemoryBackend

    backend = MusaPinMemoryBackend()
    assert backend.pin_memory(4096, 64) is False  # libmusart absent here
    assert backend.is_pin_supported is False


# ---- raw pointers ----------------------------------------------------------------------
def test_tensor_from_ptr_is_a_non_owning_view(ops):
    base = torch.arange(16, dtype=torch.float32)
    view = ops.tensor_from_ptr(base.data_ptr(), (4, 4), torch.float32, "cpu")
    view[0, 0] = 42.0
    assert base[0] == 42.0 and view.shape == (4, 4)
    with pytest.raises(ValueError):
        ops.tensor_from_ptr(0, (1,), torch.float32, "cpu")


def test_pointer_mode_memcpy_roundtrip_split_at_alignment(ops, monkeypatch):
    monkeypatch.setattr(type(ops), "_current_device", lambda self: torch.device("cpu"))
    pieces = []
    real = type(ops).tensor_from_ptr

    def spy(self, ptr, shape, dtype, device=None):
        pieces.append((ptr, tuple(shape)))
        return real(self, ptr, shape, dtype, device)

    monkeypatch.setattr(type(ops), "tensor_from_ptr", spy)
    host = torch.arange(256, dtype=torch.uint8)
    dev = torch.zeros(256, dtype=torch.uint8)
    # Host range starts 60 bytes into its allocation: 100 bytes cross the 64 and 128 marks.
    ops.lmcache_memcpy_async(dev.data_ptr(), host.data_ptr() + 60, 100, H2D, 60, 64)
    assert torch.equal(dev[:100], host[60:160]) and not dev[100:].any()
    assert [n for _, (n,) in pieces] == [4, 64, 32]
    back = torch.zeros(256, dtype=torch.uint8)
    ops.lmcache_memcpy_async(back.data_ptr(), dev.data_ptr(), 100, D2H, 0, 64)
    assert torch.equal(back[:100], host[60:160])
    with pytest.raises(ValueError, match="power of two"):
        ops.lmcache_memcpy_async(back.data_ptr(), dev.data_ptr(), 10, D2H, 0, 48)
    with pytest.raises(TypeError):
        ops.lmcache_memcpy_async(back, dev.data_ptr(), 10, D2H, 0, 64)


# ---- recorders -------------------------------------------------------------------------
def test_recorders_wait_on_the_raw_stream_then_publish(ops, fake_musa):
    torch_ops.drain_recorded_completions()
    current = fake_musa.current_stream()
    before = current.synchronize_calls
    ops.record_completion_on_stream(0, "done", b"x")
    assert current.synchronize_calls == before + 1
    made = []
    base_cls = fake_musa.ExternalStream

    class Recording(base_cls):
        def __init__(self, stream_ptr, device=None, **kw):
            super().__init__(stream_ptr, device, **kw)
            made.append(self)

    fake_musa.ExternalStream = Recording
    ops.record_completion_on_stream(77, "done2", b"y")
    assert [(s.handle, s.synchronize_calls) for s in made] == [(77, 1)]
    assert torch_ops.drain_recorded_completions() == [("done", b"x"), ("done2", b"y")]
    torch_ops.drain_recorded_events()
    ops.record_event_on_stream(77, "ev", 3, [], [])
    assert made[-1].synchronize_calls == 1 and len(made) == 2
    assert torch_ops.drain_recorded_events()[0][:2] == ("ev", 3)


# ---- block transfer --------------------------------------------------------------------
def _operands(fmt, seed=0):
    g = torch.Generator().manual_seed(seed)
    if fmt == F.TWO_X_NL_X_NB_BS_NH_HS:
        flat = [torch.randn(NB, BS, NH, HS, generator=g).half() for _ in range(2 * NL)]
        return flat, flat, (2, NH)
    shape = (2, NB, BS, NH, HS) if fmt == F.NL_X_TWO_NB_BS_NH_HS else (NB, BS, HS)
    layers = [torch.randn(*shape, generator=g).half() for _ in range(NL)]
    return layers, layers, (1, 1) if fmt == F.NL_X_NB_BS_HS else (2, NH)


def _desc(fmt):
    kv, nh = (1, 1) if fmt == F.NL_X_NB_BS_HS else (2, NH)
    return PageBufferShapeDesc(
        kv_size=kv, nl=NL, nb=NB, bs=BS, nh=nh, hs=HS, element_size=2, dtype=torch.float16
    )


def _chunks(fmt, n):
    shape = (NL, T, HS) if fmt == F.NL_X_NB_BS_HS else (2, NL, T, NH * HS)
    return [torch.full(shape, 9.0, dtype=torch.float16) for _ in range(n)]


SUPPORTED = [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_NB_BS_HS, F.TWO_X_NL_X_NB_BS_NH_HS]


@pytest.mark.parametrize("fmt", SUPPORTED, ids=lambda f: f.name)
@pytest.mark.parametrize("operands", ["tensor", "pointer"])
@pytest.mark.parametrize(("ids", "skip"), [([4, 1, 3], 0), ([4, 1, 3], 1), ([4, 1, 3, 0], 2)])
def test_block_transfer_matches_baseline(ops, fmt, operands, ids, skip):
    paged, planes, _ = _operands(fmt)
    sd = _desc(fmt)
    n = -(-len(ids) // 2)
    want = _chunks(fmt, n)
    torch_ops.multi_layer_block_kv_transfer(paged, want, ids, "cpu", D2H, sd, T, fmt, skip)
    arg = paged
    if operands == "pointer":  # device addresses, rebuilt as device tensors by the backend
        arg = torch.tensor([t.data_ptr() for t in planes], dtype=torch.int64)
    got = _chunks(fmt, n)
    ops.multi_layer_block_kv_transfer(arg, got, ids, "cpu", D2H, sd, T, fmt, skip)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    # H2D through the same operands restores the original blocks.
    originals = [t.clone() for t in planes]
    for t in planes:
        t.zero_()
    ops.multi_layer_block_kv_transfer(arg, got, ids, "cpu", H2D, sd, T, fmt, skip)
    axis = 1 if fmt == F.NL_X_TWO_NB_BS_NH_HS else 0
    for t, o in zip(planes, originals, strict=True):
        for b in ids[skip:]:
            assert torch.equal(t.select(axis, b), o.select(axis, b))


@pytest.mark.parametrize(
    "fmt", [F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_TWO_BS_NH_HS, F.NB_NL_TWO_BS_NH_HS]
)
def test_unsupported_formats(ops, fmt):
    with pytest.raises(ValueError, match=fmt.name) as err:
        ops.multi_layer_block_kv_transfer([], [], [], "cpu", D2H, _desc(1), T, fmt, 0)
    assert "NL_X_TWO_NB_BS_NH_HS" in str(err.value) and "TWO_X_NL_X_NB_BS_NH_HS" in str(err.value)


def _fake_aiter(monkeypatch, fn, abi=1):
    mod = types.ModuleType("musa_aiter")
    mod.LMCACHE_KV_TRANSFER_ABI = abi
    mod.lmcache_multi_layer_block_kv_transfer = fn
    monkeypatch.setitem(sys.modules, "musa_aiter", mod)
    return mod


def test_musa_aiter_dispatched_first(ops, monkeypatch):
    monkeypatch.setenv("LMCACHE_MUSA_NATIVE_KV_TRANSFER", "1")
    calls = []
    _fake_aiter(monkeypatch, lambda *a: calls.append(a))
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    paged, _, _ = _operands(fmt)
    chunks = _chunks(fmt, 1)
    ops.multi_layer_block_kv_transfer(paged, chunks, [1, 2], "cpu", D2H, _desc(fmt), T, fmt, 0)
    assert len(calls) == 1
    p, objs, ids, direction, f, chunk, skip = calls[0]
    assert p is paged and objs == chunks and ids.tolist() == [1, 2]
    assert (direction, f, chunk, skip) == (int(D2H), int(fmt), T, 0)
    assert torch.all(chunks[0] == 9.0)  # the torch path did not run


@pytest.mark.parametrize("problem", ["raises", "absent", "wrong-abi", "env-off"])
def test_musa_aiter_falls_back_to_torch(ops, monkeypatch, caplog, problem):
    calls = []
    if problem != "env-off":
        monkeypatch.setenv("LMCACHE_MUSA_NATIVE_KV_TRANSFER", "1")
    if problem == "absent":
        monkeypatch.setitem(sys.modules, "musa_aiter", None)  # import raises ImportError
    else:

        def fn(*a):
            calls.append(a)
            raise RuntimeError("kernel failed")

        _fake_aiter(monkeypatch, fn, abi=2 if problem == "wrong-abi" else 1)
    fmt = F.NL_X_NB_BS_HS
    paged, _, _ = _operands(fmt)
    want, got = _chunks(fmt, 1), _chunks(fmt, 1)
    torch_ops.multi_layer_block_kv_transfer(paged, want, [3, 0], "cpu", D2H, _desc(fmt), T, fmt, 0)
    ops.multi_layer_block_kv_transfer(paged, got, [3, 0], "cpu", D2H, _desc(fmt), T, fmt, 0)
    assert torch.equal(got[0], want[0])
    assert len(calls) == (1 if problem == "raises" else 0)
    if problem != "env-off":
        assert "using the torch path" in caplog.text


def test_wheel_metadata_and_explicit_capabilities():
    """Depends on lmcache-core and on torch only as a range; both flags and the default
    mode are overridden explicitly (no reliance on the base-class bridge)."""
    from lmcache.devices.musa import MusaDeviceSpec
    from lmcache.v1.platform.testing import check_device_wheel_contract

    check_device_wheel_contract("lmcache-musa", MusaDeviceSpec())


def test_lmcache_driven_pieces_fail_clearly(fake_musa):
    from lmcache.devices.musa.lmcache_driven import (
        MUSACacheContext,
        MusaEventIPCBackend,
        MusaIPCWrapper,
    )
    from lmcache.v1.platform import get_device_spec

    with pytest.raises(NotImplementedError, match="engine_driven"):
        MusaIPCWrapper.wrap(torch.zeros(1))
    with pytest.raises(RuntimeError, match="engine_driven"):
        MusaEventIPCBackend().check_event_support("musa:0")
    with pytest.raises(NotImplementedError, match="engine_driven"):
        MUSACacheContext([])
    spec = get_device_spec("musa")
    assert spec.ipc_wrapper_cls is None and spec.event_ipc_backend is None
    with pytest.raises(NotImplementedError, match="device_type='musa'"):
        spec.create_cache_context()
