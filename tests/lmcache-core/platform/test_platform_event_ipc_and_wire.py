"""Event IPC backends and lookups (docs/design/platform.md#event-ipc); IPC wrappers and the wire tag
registry (docs/design/platform.md#ipc-wire)."""

from __future__ import annotations

import logging
import types
import uuid

import msgspec
import pytest
import torch

from lmcache.v1.platform.base import ipc_wire
from lmcache.v1.platform.base.device_spec import DeviceSpec
from lmcache.v1.platform.base.event_ipc import (
    DefaultEventIPCBackend,
    EventIPCBackend,
    get_event_ipc_backend,
)
from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper, TensorMetadata
from lmcache.v1.platform.devices.cpu.ipc_wrapper import (
    CpuShmTensorWrapper,
    create_shm_tensor,
)
from lmcache.v1.platform.testing import extra_device_specs, install_fake_device


class _Recorder:
    def __init__(self):
        self.calls = []


def test_default_backend_delegates_all_eight_operations():
    with install_fake_device("evdev", with_ipc_events=True) as fake:
        backend = DefaultEventIPCBackend(event_module=fake, device_type="evdev")
        assert isinstance(backend, EventIPCBackend)
        backend.check_event_support("evdev:0")
        ev = backend.create_event("evdev:0")
        assert ev.interprocess is True
        stream = fake.current_stream()
        backend.record_event(ev, stream)
        handle = backend.export_event(ev, "evdev:0")
        assert isinstance(handle, bytes) and ev in backend._exported
        imported = backend.import_event(handle, "evdev:0")
        assert ("from_ipc_handle", ("evdev:0", handle)) in imported.calls
        backend.wait_event(imported, stream)
        assert imported in stream.waited_events
        assert backend.query_event(imported) is True
        backend.synchronize_event(imported, "evdev:0")
        names = [c[0] for c in ev.calls]
        assert names[:3] == ["init", "record", "ipc_handle"]
        assert [c[0] for c in imported.calls][-3:] == ["wait", "query", "synchronize"]
        assert fake.synchronize_calls == 0  # no device-wide sync


def test_check_event_support_fails_closed_naming_the_device():
    with install_fake_device("noipc", with_ipc_events=False) as fake:
        backend = DefaultEventIPCBackend(event_module=fake, device_type="noipc")
        with pytest.raises(RuntimeError) as ei:
            backend.check_event_support("noipc:1")
        assert "noipc" in str(ei.value) and "interprocess" in str(ei.value)

    class NoFromHandle:
        def __init__(self, interprocess=False):
            pass

    mod = type("M", (), {"Event": NoFromHandle})
    with pytest.raises(RuntimeError, match="from_ipc_handle"):
        DefaultEventIPCBackend(mod, "xx").check_event_support("xx")
    with pytest.raises(RuntimeError, match="no Event"):
        DefaultEventIPCBackend(object(), "yy").check_event_support("yy")


class EvSpec(DeviceSpec):
    _event_backend_cache = None

    @property
    def device_type(self):
        return "musa"

    @property
    def torch_module_name(self):
        return "musa"

    def is_available(self):
        return True

    @property
    def event_ipc_backend(self):
        if self._event_backend_cache is None:
            self._event_backend_cache = DefaultEventIPCBackend(torch.musa, "musa")
        return self._event_backend_cache


class NoEvSpec(DeviceSpec):
    @property
    def device_type(self):
        return "noev"


def test_lookup_by_device_forms_and_errors():
    with (
        install_fake_device("musa", with_ipc_events=True),
        extra_device_specs(EvSpec(), NoEvSpec()),
    ):
        b1 = get_event_ipc_backend("musa:3")
        assert b1.device_type == "musa"
        # an object with .type (stock torch cannot build torch.device("musa"))
        assert get_event_ipc_backend(types.SimpleNamespace(type="musa", index=3)) is b1
        assert get_event_ipc_backend("musa") is b1
        assert get_event_ipc_backend(0) is b1  # int -> the active type (musa is detected)
        cpu_backend = get_event_ipc_backend("cpu")
        assert cpu_backend.device_type == "cpu"
        assert cpu_backend is get_event_ipc_backend(torch.device("cpu"))
        assert (
            cpu_backend.export_event(cpu_backend.create_event("cpu"), "cpu") == b"stub_ipc_handle"
        )
        cpu_backend.check_event_support("cpu")
        with pytest.raises(RuntimeError) as ei:
            get_event_ipc_backend("noev")
        assert str(ei.value) == "Device type 'noev' does not support event IPC."
        with pytest.raises(RuntimeError) as ei:
            get_event_ipc_backend("nonesuch:0")
        assert str(ei.value) == "No DeviceSpec registered for device type 'nonesuch'."


def test_cpu_spec_event_backend_is_cached_and_stub_based():
    from lmcache.v1.platform.devices.cpu import CpuDeviceSpec

    spec = CpuDeviceSpec()
    assert spec.event_ipc_backend is spec.event_ipc_backend
    assert repr(spec.event_ipc_backend.event_module) == "StubCPUDevice(device_type=cpu)"
    ev = spec.event_ipc_backend.import_event(b"stub_ipc_handle", "cpu")
    assert spec.event_ipc_backend.query_event(ev) is True


# ---- wrappers and the wire ------------------------------------------------------------


def test_cpu_shm_wrapper_round_trips_through_the_wire():
    kv = create_shm_tensor((2, 3, 4, 2, 8), torch.bfloat16)
    kv.copy_(torch.randn(kv.shape).to(torch.bfloat16))
    view = kv[1]  # non-zero storage offset
    w = CpuShmTensorWrapper.wrap(view)
    try:
        assert w.shm_name.startswith("/lmcache_kv_") and w.nbytes == kv.numel() * 2
        ext = ipc_wire.encode_wrapper(w)
        assert isinstance(ext, msgspec.msgpack.Ext) and ext.code == 1
        body = msgspec.msgpack.decode(ext.data)
        assert body["type"] == "cpu_shm" and body["version"] == 1
        assert body["metadata"] == {
            "dtype": "bfloat16",
            "shape": [3, 4, 2, 8],
            "stride": [64, 16, 8, 1],
            "storage_offset": 192,
            "device_uuid": "",
        }
        assert body["shm_name"] == w.shm_name and body["nbytes"] == w.nbytes
        # full message round trip with the msgspec hooks
        packed = msgspec.msgpack.encode({"kv": [w]}, enc_hook=ipc_wire.enc_hook)
        decoded = msgspec.msgpack.decode(packed, ext_hook=ipc_wire.ext_hook)
        back = decoded["kv"][0]
        assert back == w and type(back) is CpuShmTensorWrapper
        opened = back.to_tensor()
        assert torch.equal(opened.view(torch.int16), view.view(torch.int16))
        opened[0, 0, 0, 0] = 42.0  # shared memory: the owner sees the write
        assert view[0, 0, 0, 0].item() == 42.0
        del opened
        back.close()
    finally:
        w.unlink()


def test_wrap_moves_a_plain_cpu_tensor_into_shared_memory():
    t = torch.arange(24, dtype=torch.float32).view(4, 6)
    w = CpuShmTensorWrapper.wrap(t)
    try:
        assert torch.equal(t, torch.arange(24, dtype=torch.float32).view(4, 6))
        peer = CpuShmTensorWrapper.from_wire(w.to_wire())
        peer.restore_metadata(w.wire_metadata())
        other = peer.to_tensor()
        t[2, 3] = -5.0  # later engine writes through the same tensor object are shared
        assert other[2, 3].item() == -5.0
        del other
        peer.close()
    finally:
        w.unlink()


def _peer_views(wrappers):
    """What the server opens: each wrapper decoded from the wire and mapped anew."""
    peers = [CpuShmTensorWrapper.from_wire(w.to_wire()) for w in wrappers]
    for peer, w in zip(peers, wrappers, strict=True):
        peer.restore_metadata(w.wire_metadata())
    return peers, [p.to_tensor() for p in peers]


def _vllm_style_layers(nbytes: int, num_layers: int = 4):
    """vLLM >= 0.29: one int8 buffer, every layer a fused [NB, NH, BS, 2*HS] view of it."""
    buf = torch.zeros(nbytes, dtype=torch.int8)
    typed = buf.view(torch.float16)
    per = typed.numel() // num_layers
    return [typed[i * per : (i + 1) * per].view(-1, 2, 16, 32) for i in range(num_layers)]


def test_wrap_shares_a_large_engine_buffer_in_place_once_for_all_layers():
    """One segment for all layers of one buffer (not a copy per layer), mapped over the
    engine's own memory: views the engine made BEFORE wrapping (vLLM's attention layers
    hold such views) see the server's writes, and the server sees the engine's."""
    from lmcache.v1.platform.devices.cpu.ipc_wrapper import REMAP_MIN_BYTES

    layers = _vllm_style_layers(REMAP_MIN_BYTES + 3 * 8192)
    engine_views = [t.as_strided(t.shape, t.stride(), t.storage_offset()) for t in layers]
    engine_views[2][5, 1, 3, 7] = 7.0  # written before registration: must survive
    ptrs = [t.data_ptr() for t in layers]
    wrappers = [CpuShmTensorWrapper.wrap(t) for t in layers]
    try:
        assert len({w.shm_name for w in wrappers}) == 1
        assert [t.data_ptr() for t in layers] == ptrs  # same addresses: nothing rebound
        peers, server = _peer_views(wrappers)
        assert server[2][5, 1, 3, 7].item() == 7.0
        engine_views[1][9, 0, 1, 2] = 3.0
        assert server[1][9, 0, 1, 2].item() == 3.0
        server[3][0, 1, 2, 3] = 5.0
        assert engine_views[3][0, 1, 2, 3].item() == 5.0
        assert layers[3][0, 1, 2, 3].item() == 5.0
        # registering again (a server restart) finds the same segment
        assert CpuShmTensorWrapper.wrap(layers[0]).shm_name == wrappers[0].shm_name
        del server
        for p in peers:
            p.close()
    finally:
        wrappers[0].unlink()


def test_wrap_copies_a_small_buffer_once_and_moves_every_wrapped_layer_onto_it():
    layers = _vllm_style_layers(1 << 18)
    layers[1][2, 1, 0, 5] = 4.0
    wrappers = [CpuShmTensorWrapper.wrap(t) for t in layers]
    try:
        assert len({w.shm_name for w in wrappers}) == 1  # one segment, not one per layer
        assert wrappers[0].nbytes == 1 << 18
        peers, server = _peer_views(wrappers)
        assert server[1][2, 1, 0, 5].item() == 4.0
        layers[0][1, 1, 1, 1] = 6.0  # the wrapped tensor objects now live in the segment
        assert server[0][1, 1, 1, 1].item() == 6.0
        del server
        for p in peers:
            p.close()
    finally:
        wrappers[0].unlink()


def test_a_new_tensor_where_a_copied_one_was_gets_its_own_segment_and_data():
    """A small buffer copied into a segment frees its old memory; a new tensor the
    allocator places at that old address must not be taken for the copied one (it would be
    moved onto the old segment without its own data)."""
    first = torch.full((16, 1024), 1.0)
    w_first = CpuShmTensorWrapper.wrap(first)
    wrappers = [w_first]
    try:
        for value in range(2, 22):  # the allocator soon hands the freed chunk out again
            t = torch.full((16, 1024), float(value))
            w = CpuShmTensorWrapper.wrap(t)
            wrappers.append(w)
            assert w.shm_name != w_first.shm_name
            peers, server = _peer_views([w])
            assert torch.equal(server[0], torch.full((16, 1024), float(value)))
            del server
            peers[0].close()
    finally:
        for w in wrappers:
            w.unlink()


def test_cpu_shm_wire_rejects_foreign_names_and_oversized_views():
    with pytest.raises(ValueError, match="invalid shm_name"):
        CpuShmTensorWrapper.from_wire({"shm_name": "/etc_passwd", "nbytes": 10})
    with pytest.raises(ValueError, match="invalid nbytes"):
        CpuShmTensorWrapper.from_wire({"shm_name": "/lmcache_kv_x", "nbytes": -1})
    w = CpuShmTensorWrapper(None, "/lmcache_kv_nothere", 16)
    w.restore_metadata(TensorMetadata("float32", (8,), (1,), 0, ""))
    with pytest.raises(ValueError, match="exceeds"):
        w.to_tensor()


def test_tensor_metadata_validation():
    TensorMetadata("float16", (2, 3), (3, 1), 0, "")
    with pytest.raises(ValueError, match="invalid dtype name"):
        TensorMetadata("float99", (1,), (1,))
    with pytest.raises(ValueError, match="rank mismatch"):
        TensorMetadata("float16", (2, 3), (1,))
    with pytest.raises(ValueError, match="non-negative"):
        TensorMetadata("float16", (-1,), (1,))
    with pytest.raises(ValueError, match="storage_offset"):
        TensorMetadata("float16", (1,), (1,), -4)
    md = TensorMetadata("float16", (2, 3), (3, 1), 2)
    assert md.span_bytes() == (2 + 5 + 1) * 2
    md.check_fits(16)
    with pytest.raises(ValueError, match="exceeds"):
        md.check_fits(15)
    with pytest.raises(ValueError, match="lacks field"):
        TensorMetadata.from_dict({"dtype": "float16", "shape": [1]})


def test_unknown_tag_and_bad_bodies_are_rejected():
    body = msgspec.msgpack.encode({"type": "npu", "version": 1, "metadata": {}})
    with pytest.raises(ValueError) as ei:
        ipc_wire.decode_wrapper(body)
    assert str(ei.value) == (
        "Unknown IPC wrapper wire tag 'npu': no installed device backend registers it; install "
        "the device wheel that provides it on both worker and server"
    )
    with pytest.raises(ValueError, match="version"):
        ipc_wire.decode_wrapper(
            msgspec.msgpack.encode({"type": "cpu_shm", "version": 2, "metadata": {}})
        )
    with pytest.raises(ValueError, match="malformed"):
        ipc_wire.decode_wrapper(b"\xc1")
    with pytest.raises(ValueError, match="ext type"):
        ipc_wire.ext_hook(9, memoryview(b""))


class VendorWrapper(DeviceIPCWrapper):
    device_type = "vend"

    def __init__(self, tensor=None, token=""):
        super().__init__(tensor)
        self.token = token

    def to_wire(self):
        return {"token": self.token}

    @classmethod
    def from_wire(cls, data):
        return cls(None, data["token"])


class Impostor(DeviceIPCWrapper):
    device_type = "vend2"
    wire_tag = "vend"

    def to_wire(self):
        return {}

    @classmethod
    def from_wire(cls, data):
        return cls()


class VendSpec(DeviceSpec):
    @property
    def device_type(self):
        return "vend"

    @property
    def ipc_wire_types(self):
        return (VendorWrapper,)


class ImpostorSpec(DeviceSpec):
    @property
    def device_type(self):
        return "vend2"

    @property
    def ipc_wire_types(self):
        return (Impostor,)


def test_external_wrapper_registered_from_spec_duplicates_warn_and_types_checked(caplog):
    with extra_device_specs(VendSpec(), ImpostorSpec()):
        with caplog.at_level(logging.WARNING, logger="lmcache"):
            tags = ipc_wire.registered_wire_tags()
        assert tags["vend"] is VendorWrapper and tags["cpu_shm"] is CpuShmTensorWrapper
        assert "Ignoring IPC wrapper Impostor for wire tag 'vend'" in caplog.text
        w = VendorWrapper(torch.zeros(2, 3), token="abc")
        back = ipc_wire.decode_wrapper(ipc_wire.encode_wrapper(w).data)
        assert type(back) is VendorWrapper and back == w and back.shape == (2, 3)
        # explicit registration: a taken tag keeps its first class
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lmcache"):
            ipc_wire.register_wire_wrapper(Impostor, "cpu_shm")
        assert "already registered by CpuShmTensorWrapper" in caplog.text
        ipc_wire.register_wire_wrapper(Impostor, f"imp_{uuid.uuid4().hex[:6]}")
    with pytest.raises(TypeError):
        ipc_wire.register_wire_wrapper(dict)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ipc_wire.register_wire_wrapper(VendSpec)  # type: ignore[arg-type]


def test_unregistered_wrapper_class_cannot_be_encoded():
    class Loose(DeviceIPCWrapper):
        def to_wire(self):
            return {}

    with pytest.raises(ValueError, match="not registered for the wire"):
        ipc_wire.encode_wrapper(Loose(torch.zeros(1)))


def test_wrapper_equality_is_exact_type_and_fields():
    a = VendorWrapper(torch.zeros(2), "t")
    b = VendorWrapper(torch.zeros(2), "t")
    c = VendorWrapper(torch.zeros(2), "u")
    assert a == b and a != c

    class Sub(VendorWrapper):
        pass

    assert a != Sub(torch.zeros(2), "t")
