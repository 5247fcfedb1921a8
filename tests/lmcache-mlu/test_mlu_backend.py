"""lmcache-mlu (docs/design/platform.md#device-mlu): identity, selection, capabilities, the
refused entry points and the transfer matrix of #1/#6/#3 on CPU through a fake
``torch.mlu``. MLU hardware cases skip without a runtime (that is not hardware validation).
"""

from __future__ import annotations

import importlib.metadata as md

import pytest
import torch

from lmcache.v1.platform import torch_ops
from lmcache.v1.platform.base.device_spec import effective_default_mode
from lmcache.v1.platform.ops_types import EngineKVFormat, PageBufferShapeDesc, TransferDirection
from lmcache.v1.platform.testing import install_fake_device
from lmcache.v1.platform.transfer_mode import MPTransferMode

F = EngineKVFormat
D2H, H2D = TransferDirection.D2H, TransferDirection.H2D
NL, NB, BS, NH, HS = 3, 7, 4, 2, 8
T = 2 * BS  # two blocks per chunk


def _real_mlu() -> bool:
    try:
        import torch_mlu  # noqa: F401

        return bool(torch.mlu.is_available())
    except Exception:
        return False


DEVICES = [
    "cpu",
    pytest.param(
        "mlu",
        marks=pytest.mark.skipif(
            not _real_mlu(),
            reason="torch_mlu runtime / MLU device not present; skipped MLU cases are not "
            "hardware validation",
        ),
    ),
]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("LMCACHE_DEVICE_BACKEND", "DEVICE_TYPE", "LMCACHE_MP_TRANSFER_MODE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def fake_mlu():
    with install_fake_device("mlu", vendor_module="torch_mlu") as fake:
        yield fake


@pytest.fixture
def ops(fake_mlu):
    from lmcache.v1.platform import resolve_device_ops

    return resolve_device_ops("mlu")


# ---- discovery, identity, selection ------------------------------------------------------
def test_entry_point_and_registry():
    eps = {ep.name: ep.value for ep in md.entry_points(group="lmcache.device_plugins")}
    assert eps["mlu"] == "lmcache.devices.mlu:MluDeviceSpec"
    from lmcache.devices.mlu import MluDeviceSpec
    from lmcache.v1.platform import default_device_registry, failed_device_plugins

    with install_fake_device("mlu", vendor_module="torch_mlu"):
        spec = default_device_registry().backends()["mlu"]
        assert type(spec) is MluDeviceSpec
        assert (spec.device_type, spec.backend_name, spec.torch_module_name) == ("mlu",) * 3
        assert not [f for f in failed_device_plugins() if f[0] == "mlu"]


@pytest.mark.parametrize(
    ("available", "vendor", "expected"),
    [
        (True, "torch_mlu", True),
        (False, "torch_mlu", False),
        (RuntimeError("driver gone"), "torch_mlu", False),
        (True, None, False),  # torch_mlu missing: the runtime is not installed
    ],
)
def test_availability_probe_never_raises(available, vendor, expected):
    from lmcache.devices.mlu import MluDeviceSpec

    if vendor is None:
        import sys

        assert "torch_mlu" not in sys.modules
    with install_fake_device("mlu", available=available, vendor_module=vendor):
        assert MluDeviceSpec().is_available() is expected


@pytest.mark.parametrize("var", ["LMCACHE_DEVICE_BACKEND", "DEVICE_TYPE"])
def test_selected_by_env(monkeypatch, var):
    from lmcache.devices.mlu.device_ops import MluDeviceOps
    from lmcache.v1.platform import default_device_registry, get_torch_device, resolve_device_ops

    monkeypatch.setenv(var, "MLU")
    with install_fake_device("mlu", vendor_module="torch_mlu") as fake:
        module, device_type = get_torch_device()
        assert module is fake and device_type == "mlu"
        assert default_device_registry().current_device_spec().backend_name == "mlu"
        assert isinstance(resolve_device_ops("mlu"), MluDeviceOps)
        assert resolve_device_ops("mlu") is resolve_device_ops("mlu")


@pytest.mark.parametrize(
    ("available", "vendor"), [(True, None), (False, "torch_mlu")], ids=["no-runtime", "no-mlu"]
)
def test_explicit_selection_fails_without_runtime_or_device(monkeypatch, available, vendor):
    from lmcache.v1.platform import default_device_registry

    monkeypatch.setenv("LMCACHE_DEVICE_BACKEND", "mlu")
    with (
        install_fake_device("mlu", available=available, vendor_module=vendor),
        pytest.raises(
            RuntimeError,
            match=r"LMCACHE_DEVICE_BACKEND='mlu' is registered but not available on this host\.",
        ),
    ):
        default_device_registry().detect()


def test_engine_driven_only(fake_mlu):
    from lmcache.v1.platform import get_device_spec, resolve_kv_wrapper_factory

    spec = get_device_spec("mlu")
    assert spec.is_lmcache_driven_available() is False
    assert spec.is_handle_transfer_available() is False
    assert spec.default_mp_transfer_mode() is MPTransferMode.ENGINE_DRIVEN
    assert effective_default_mode(spec) is MPTransferMode.ENGINE_DRIVEN  # AUTO -> engine_driven
    assert spec.ipc_wrapper_cls is None and spec.event_ipc_backend is None
    assert spec.pin_memory_backend is None and spec.pin_memory(1234, 64) is False
    with pytest.raises(NotImplementedError, match="device_type='mlu'"):
        spec.create_cache_context()
    with pytest.raises(
        ValueError, match="No KV-cache wrapper factory registered for device type 'mlu'"
    ):
        resolve_kv_wrapper_factory("mlu")


def test_ops_class_declares_tensor_operands(ops):
    from lmcache.devices.mlu.device_ops import MluDeviceOps

    assert type(ops) is MluDeviceOps
    assert MluDeviceOps.kv_transfer_operands == "tensor"
    ops.ensure_native()  # no native kernels: a no-op that binds nothing
    assert not hasattr(ops, "EngineKVFormat")


# ---- refused entry points ------------------------------------------------------------------
def test_pointer_operands_rejected(ops):
    layers, _ = _layers(F.NL_X_TWO_NB_BS_NH_HS)
    chunks = [torch.zeros(2, NL, T, NH * HS, dtype=torch.float16)]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    sd = _desc(F.NL_X_TWO_NB_BS_NH_HS)
    with pytest.raises(ValueError, match="pointer operands"):
        ops.multi_layer_block_kv_transfer(ptrs, chunks, [0, 1], "cpu", D2H, sd, T, 1, 0)
    with pytest.raises(ValueError, match="raw pointers"):
        ops.multi_layer_block_kv_transfer(
            layers, [chunks[0].data_ptr()], [0, 1], "cpu", D2H, sd, T, 1, 0
        )
    with pytest.raises(ValueError, match="raw pointers"):
        ops.lmcache_memcpy_async(chunks[0].data_ptr(), layers[0].data_ptr(), 64, D2H, 0, 1 << 26)
    with pytest.raises(ValueError, match="'mlu' does not support tensor construction"):
        ops.tensor_from_ptr(layers[0].data_ptr(), (4,), torch.float16, "cpu")


def test_tensor_mode_memcpy(ops):
    src = torch.arange(64, dtype=torch.float16)
    dst = torch.zeros(64, dtype=torch.float16)
    ops.lmcache_memcpy_async(dst, src, 32 * 2, D2H, 0, 1 << 26)
    assert torch.equal(dst[:32], src[:32]) and not dst[32:].any()


@pytest.mark.parametrize(
    "op",
    [
        "multi_layer_kv_transfer",
        "multi_layer_kv_transfer_unilateral",
        "single_layer_kv_transfer",
        "single_layer_kv_transfer_sgl",
        "load_and_reshape_flash",
        "reshape_and_cache_back_flash",
    ],
)
def test_legacy_entry_points_raise_naming_mlu(ops, op):
    with pytest.raises(NotImplementedError, match="mlu"):
        getattr(ops, op)(None, None, None, None, None, None)


@pytest.mark.parametrize(
    "fmt",
    [F.NL_X_NB_TWO_BS_NH_HS, F.NB_NL_TWO_BS_NH_HS, F.TWO_X_NL_X_NB_BS_NH_HS, F.NL_X_NB_BS_NH_HS],
)
def test_other_formats_rejected_naming_supported(ops, fmt):
    with pytest.raises(ValueError) as err:
        ops.multi_layer_block_kv_transfer([], [], [], "cpu", D2H, _desc(1), T, fmt, 0)
    text = str(err.value)
    assert fmt.name in text
    for ok in ("NL_X_TWO_NB_BS_NH_HS", "NL_X_TWO_NB_NH_BS_HS", "NL_X_NB_BS_HS"):
        assert ok in text


# ---- streams and recorders --------------------------------------------------------------
def test_completion_handle_zero_waits_on_default_stream(ops, fake_mlu):
    torch_ops.drain_recorded_completions()
    other = fake_mlu.Stream()
    fake_mlu.set_stream(other)  # the current stream is not the default one
    before = fake_mlu.default_stream().synchronize_calls
    ops.record_completion_on_stream(0, "store", b"payload")
    assert fake_mlu.default_stream().synchronize_calls == before + 1
    assert other.synchronize_calls == 0
    assert torch_ops.drain_recorded_completions() == [("store", b"payload")]


def test_nonzero_handle_borrows_callers_stream(ops, fake_mlu):
    made = []
    base_cls = fake_mlu.ExternalStream

    class Recording(base_cls):
        def __init__(self, stream_ptr, device=None, **kw):
            super().__init__(stream_ptr, device, **kw)
            made.append(self)

    fake_mlu.ExternalStream = Recording
    torch_ops.drain_recorded_events()
    default_before = fake_mlu.default_stream().synchronize_calls
    ops.record_event_on_stream(0xABC, "evt", 7, ["s"], [1])
    assert [s.handle for s in made] == [0xABC]
    assert made[0].synchronize_calls == 1
    assert fake_mlu.default_stream().synchronize_calls == default_before
    events = torch_ops.drain_recorded_events()
    assert len(events) == 1 and events[0][0] == "evt" and events[0][1] == 7


def test_stream_handle_helper(fake_mlu):
    from lmcache.devices.mlu import MluDeviceSpec

    class S:
        mlu_stream = 99

    assert MluDeviceSpec().get_stream_handle(S()) == 99


# ---- transfer matrix -----------------------------------------------------------------------
def _layers(fmt, device="cpu", dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = {
        F.NL_X_TWO_NB_BS_NH_HS: (2, NB, BS, NH, HS),
        F.NL_X_TWO_NB_NH_BS_HS: (2, NB, NH, BS, HS),
        F.NL_X_NB_BS_HS: (NB, BS, HS),
    }[fmt]
    layers = [torch.randn(*shape, generator=g).to(dtype).to(device) for _ in range(NL)]
    return layers, [t.clone() for t in layers]


def _desc(fmt, dtype=torch.bfloat16):
    mla = fmt == F.NL_X_NB_BS_HS
    return PageBufferShapeDesc(
        kv_size=1 if mla else 2, nl=NL, nb=NB, bs=BS, nh=1 if mla else NH, hs=HS,
        element_size=2, dtype=dtype,
    )  # fmt: skip


def _empty_chunks(fmt, n, fill=0.0):
    shape = (NL, T, HS) if fmt == F.NL_X_NB_BS_HS else (2, NL, T, NH * HS)
    return [torch.full(shape, fill, dtype=torch.bfloat16) for _ in range(n)]


def _canonical(fmt, layers, block_ids, n_objs, skip, fill):
    """Expected host chunks, written from the token-major host-chunk definition
    (docs/design/storage-formats.md#host-chunk)."""
    out = _empty_chunks(fmt, n_objs, fill)
    bpo = T // BS
    for p, bid in enumerate(block_ids):
        if p < skip:
            continue
        obj, t0 = p // bpo, (p % bpo) * BS
        for layer, t in enumerate(layers):
            t = t.cpu()
            if fmt == F.NL_X_NB_BS_HS:
                out[obj][layer, t0 : t0 + BS] = t[bid]
            elif fmt == F.NL_X_TWO_NB_BS_NH_HS:
                out[obj][:, layer, t0 : t0 + BS] = t[:, bid].reshape(2, BS, NH * HS)
            else:  # HND: heads before tokens in the engine, token-major in the chunk
                out[obj][:, layer, t0 : t0 + BS] = (
                    t[:, bid].permute(0, 2, 1, 3).reshape(2, BS, NH * HS)
                )
    return out


FORMATS = [F.NL_X_TWO_NB_BS_NH_HS, F.NL_X_TWO_NB_NH_BS_HS, F.NL_X_NB_BS_HS]
CASES = [
    ([3, 0, 6, 2, 5], 0),  # partial last chunk
    ([3, 0, 6, 2, 5], 1),  # skip in the middle of the first chunk
    ([3, 0, 6, 2], 3),  # skip into the second chunk
    ([3, 0, 6, 2], 4),  # skip >= len: no-op
    ([1, 4, 2, 6], 0),  # full chunks, contiguous targets
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize(("block_ids", "skip"), CASES)
def test_transfer_matrix(ops, device, fmt, block_ids, skip):
    layers, originals = _layers(fmt, device)
    n_objs = -(-len(block_ids) // (T // BS))
    sd = _desc(fmt)
    # D2H: canonical layout, untouched rows keep their content, and equal to the baseline.
    chunks = _empty_chunks(fmt, n_objs, fill=3.0)
    ops.multi_layer_block_kv_transfer(layers, chunks, block_ids, device, D2H, sd, T, fmt, skip)
    if device != "cpu":
        torch.mlu.synchronize()
    expected = _canonical(fmt, originals, block_ids, n_objs, skip, fill=3.0)
    for got, want in zip(chunks, expected, strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    baseline = _empty_chunks(fmt, n_objs, fill=3.0)
    torch_ops.multi_layer_block_kv_transfer(
        [t.cpu() for t in originals], baseline, block_ids, "cpu", D2H, sd, T, fmt, skip
    )
    for got, want in zip(chunks, baseline, strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    # H2D into zeroed engine memory restores exactly the covered blocks.
    for t in layers:
        t.zero_()
    full = _canonical(fmt, originals, block_ids, n_objs, 0, fill=0.0)
    ops.multi_layer_block_kv_transfer(layers, full, block_ids, device, H2D, sd, T, fmt, skip)
    axis = 0 if fmt == F.NL_X_NB_BS_HS else 1
    covered = set(block_ids[skip:])
    for got, orig in zip(layers, originals, strict=True):
        for b in range(NB):
            g, o = got.select(axis, b).cpu(), orig.select(axis, b).cpu()
            if b in covered:
                assert torch.equal(g, o), f"block {b} not restored"
            else:
                assert not g.any(), f"block {b} written although outside the valid range"


def test_d2h_then_h2d_roundtrip(ops):
    for fmt in FORMATS:
        layers, originals = _layers(fmt, seed=5)
        ids = list(range(NB))
        chunks = _empty_chunks(fmt, -(-NB // 2))
        sd = _desc(fmt)
        ops.multi_layer_block_kv_transfer(layers, chunks, ids, "cpu", D2H, sd, T, fmt, 0)
        for t in layers:
            t.zero_()
        ops.multi_layer_block_kv_transfer(layers, chunks, ids, "cpu", H2D, sd, T, fmt, 0)
        for a, b in zip(layers, originals, strict=True):
            assert torch.equal(a, b)


def test_strided_d2h_waits_on_queue(ops, fake_mlu):
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    layers, _ = _layers(fmt)
    sd = _desc(fmt)
    queue = fake_mlu.current_stream()
    before = queue.synchronize_calls
    # Full chunks: contiguous host targets stay asynchronous (no wait).
    ops.multi_layer_block_kv_transfer(
        layers, _empty_chunks(fmt, 2), [0, 1, 2, 3], "cpu", D2H, sd, T, fmt, 0
    )
    assert queue.synchronize_calls == before
    # Prefix skip -> non-contiguous slice of the chunk: blocking copy, then a queue wait.
    ops.multi_layer_block_kv_transfer(
        layers, _empty_chunks(fmt, 2), [0, 1, 2, 3], "cpu", D2H, sd, T, fmt, 1
    )
    assert queue.synchronize_calls == before + 1
    # Partial last chunk is strided too.
    ops.multi_layer_block_kv_transfer(
        layers, _empty_chunks(fmt, 2), [0, 1, 2], "cpu", D2H, sd, T, fmt, 0
    )
    assert queue.synchronize_calls == before + 2


def test_validation_errors(ops):
    fmt = F.NL_X_TWO_NB_BS_NH_HS
    layers, _ = _layers(fmt)
    sd = _desc(fmt)
    chunks = _empty_chunks(fmt, 1)
    with pytest.raises(ValueError, match="lmcache_chunk_size=6"):
        ops.multi_layer_block_kv_transfer(layers, chunks, [0], "cpu", D2H, sd, 6, fmt, 0)
    with pytest.raises(ValueError, match="skip_prefix_n_blocks=-1"):
        ops.multi_layer_block_kv_transfer(layers, chunks, [0], "cpu", D2H, sd, T, fmt, -1)
    with pytest.raises(ValueError, match="3 block ids"):
        ops.multi_layer_block_kv_transfer(layers, chunks, [0, 1, 2], "cpu", D2H, sd, T, fmt, 0)
    with pytest.raises(ValueError, match="invalid transfer direction 5"):
        ops.multi_layer_block_kv_transfer(layers, chunks, [0], "cpu", 5, sd, T, fmt, 0)


def test_wheel_metadata_and_explicit_capabilities():
    """Depends on lmcache-core and on torch only as a range; both flags and the default
    mode are overridden explicitly (no reliance on the base-class bridge)."""
    from lmcache.devices.mlu import MluDeviceSpec
    from lmcache.v1.platform.testing import check_device_wheel_contract

    check_device_wheel_contract("lmcache-mlu", MluDeviceSpec())


@pytest.mark.parametrize(
    ("fmt", "hint"),
    [(F.NL_X_TWO_NB_NH_BS_HS, "HND"), (F.NL_X_TWO_NB_BS_NH_HS, "NHD"), (F.NL_X_NB_BS_HS, None)],
    ids=["HND", "NHD", "MLA"],
)
def test_mp_gather_scatter_dispatch(ops, monkeypatch, fmt, hint):
    """The shared MP copy path (engine-driven worker) runs on MluDeviceOps with the
    arguments it really passes: per-layer tensors, flat ids, the layout from the hint."""
    from lmcache.v1.multiprocess import kv_copy  # core: always installed

    # CPU tensors stand in for MLU ones: route the KV tensors' ops to the MLU backend
    # (raising=True: a renamed hook fails here instead of silently skipping).
    monkeypatch.setattr(kv_copy, "_ops_for", lambda t: ops)
    layers, originals = _layers(fmt, seed=3)
    hints = {"kv_layout": hint} if hint else None
    ids = [6, 2, 0, 5]
    chunks = kv_copy.gather_paged_kv_to_cpu(layers, ids, T // BS, layout_hints=hints)
    want = _canonical(fmt, originals, ids, 2, 0, fill=0.0)
    for got, exp in zip(chunks, want, strict=True):
        assert torch.equal(got.view(torch.int16), exp.view(torch.int16))
    for t in layers:
        t.zero_()
    kv_copy.scatter_cpu_to_paged_kv(
        layers, ids, chunks, T // BS, skip_first_n_tokens=BS, layout_hints=hints
    )
    axis = 0 if fmt == F.NL_X_NB_BS_HS else 1
    for got, orig in zip(layers, originals, strict=True):
        assert not got.select(axis, 6).any()  # first block skipped (prefix-cache protection)
        for b in ids[1:]:
            assert torch.equal(got.select(axis, b), orig.select(axis, b))
