"""StubCPUDevice / StubEvent / StubStream: the torch-module stand-in of CPU-only processes
(docs/design/platform.md#cpu-device). Code written against ``torch.cuda`` calls these on
``lmcache.torch_dev`` without special cases, so each call must answer like a device module with
nothing pending."""

from __future__ import annotations

import contextlib

import pytest

from lmcache.v1.platform.base.event_ipc import DefaultEventIPCBackend
from lmcache.v1.platform.devices.cpu.stub_cpu_device import (
    StubCPUDevice,
    StubEvent,
    StubStream,
)


def test_device_queries_answer_one_unavailable_device():
    dev = StubCPUDevice("cpu")
    assert repr(dev) == "StubCPUDevice(device_type=cpu)"
    assert dev.device_type == "cpu"
    assert dev.is_available() is False
    assert dev.device_count() == 1
    assert dev.current_device() == 0
    props = dev.get_device_properties(0)
    assert props.uuid.startswith("stub-0000-") and props.uuid == dev.get_device_properties().uuid
    assert props.total_memory == 0 and props.name == "stub-cpu"
    for no_op in (dev.synchronize, dev.empty_cache, dev.init):
        assert no_op() is None
    assert dev.set_device(0) is None and dev.set_stream(dev.current_stream()) is None


def test_unknown_attributes_raise_attribute_error_naming_them():
    dev = StubCPUDevice("cpu")
    with pytest.raises(AttributeError, match="'memory_allocated'"):
        dev.memory_allocated  # noqa: B018 - the attribute access is the test
    assert not hasattr(dev, "ipc_collect")
    assert getattr(dev, "mem_get_info", None) is None  # callers probing with getattr get None


def test_device_and_stream_contexts_are_null_contexts():
    dev = StubCPUDevice("cpu")
    for ctx in (dev.device(0), dev.device(), dev.stream(dev.current_stream()), dev.stream()):
        assert isinstance(ctx, contextlib.nullcontext)
        with ctx as entered:
            assert entered is None


def test_streams_are_shared_and_always_complete():
    dev = StubCPUDevice("cpu")
    stream = dev.current_stream()
    assert isinstance(stream, StubStream)
    assert dev.default_stream() is stream and dev.current_stream(0) is stream
    assert stream.query() is True and stream.synchronize() is None
    event = StubEvent()
    assert stream.record_event(event) is event
    assert isinstance(stream.record_event(), StubEvent)
    assert stream.wait_event(event) is None and stream.wait_stream(dev.Stream()) is None
    with dev.Stream(device="cpu", priority=-1) as own:
        assert isinstance(own, StubStream) and own.device == "cpu"


def test_events_are_complete_at_once_and_round_trip_ipc_handles():
    dev = StubCPUDevice("cpu")
    assert dev.Event is StubEvent and dev.Stream is StubStream
    plain = dev.Event()
    assert plain.interprocess is False
    event = dev.Event(enable_timing=False, blocking=True, interprocess=True)
    assert event.interprocess is True
    assert event.ipc_handle() == b"stub_ipc_handle"
    assert event.record() is None and event.record(dev.current_stream()) is None
    assert event.wait() is None and event.wait(dev.current_stream()) is None
    assert event.synchronize() is None and event.query() is True
    peer = StubEvent.from_ipc_handle("cpu", event.ipc_handle())
    assert isinstance(peer, StubEvent) and peer.interprocess is True and peer.query() is True


def test_default_event_ipc_backend_runs_on_the_stub():
    """The CPU spec's event backend is DefaultEventIPCBackend over this stub: the whole
    create / export / import / record / wait / query / synchronize cycle must work."""
    backend = DefaultEventIPCBackend(StubCPUDevice("cpu"), "cpu")
    backend.check_event_support("cpu")  # Event takes interprocess=True, has from_ipc_handle
    event = backend.create_event("cpu")
    handle = backend.export_event(event, "cpu")
    assert handle == b"stub_ipc_handle"
    imported = backend.import_event(handle, "cpu")
    stream = StubCPUDevice("cpu").current_stream()
    backend.record_event(imported, stream)
    backend.wait_event(imported, stream)
    assert backend.query_event(imported) is True
    backend.synchronize_event(imported, "cpu")
