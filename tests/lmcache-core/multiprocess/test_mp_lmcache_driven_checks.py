"""Checks 3 and 4 of docs/design/platform.md#lmcache-driven-checks: event IPC at the worker's
register, and the server's cache context + event re-check at REGISTER, against an in-process server
on real sockets (the in-process server sees this process's test device specs and overrides)."""

from __future__ import annotations

import argparse
import itertools
import logging
import threading
import types

import pytest
import torch
from testsupport.ports import free_port

from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.client import MPClient
from lmcache.v1.multiprocess.protocol import RemoteError
from lmcache.v1.multiprocess.transfer_context import create_transfer_context
from lmcache.v1.multiprocess.transfer_context.worker_transfer import LMCacheDrivenTransferContext
from lmcache.v1.platform import cache_context as cc
from lmcache.v1.platform.base.device_spec import DeviceSpec
from lmcache.v1.platform.base.event_ipc import DefaultEventIPCBackend
from lmcache.v1.platform.testing import extra_device_specs

_ids = itertools.count(91000)


@pytest.fixture(scope="module")
def server():
    from lmcache.cli.server import add_server_args, build_configs
    from lmcache.v1.multiprocess.runtime import ServerRuntime

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parser.parse_args(
        [
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--l1-size-gb",
            "0.25",
            "--worker-reap-timeout-seconds",
            "0",
            "--supported-transfer-mode",
            "lmcache_driven",
        ]
    )
    runtime = ServerRuntime.build(*build_configs(args))
    runtime.start()
    yield runtime
    runtime.stop()


@pytest.fixture
def client(server):
    c = MPClient(f"tcp://127.0.0.1:{server.config.port}", default_timeout=20)
    yield c
    c.close()


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def engine_log():
    handler = _Capture()
    log = logging.getLogger("lmcache.v1.multiprocess.engine")
    log.addHandler(handler)
    yield handler.records
    log.removeHandler(handler)


class _MetaAccel(DeviceSpec):
    """A device with an IPC wrapper and the lmcache_driven capability (tensors on 'meta')."""

    def __init__(self, backend=None) -> None:
        super().__init__()
        self._backend = backend

    @property
    def device_type(self):
        return "meta"

    @property
    def ipc_wrapper_cls(self):
        from lmcache.v1.platform.devices.cpu.ipc_wrapper import CpuShmTensorWrapper

        return CpuShmTensorWrapper

    def is_lmcache_driven_available(self):
        return True

    @property
    def event_ipc_backend(self):
        return self._backend


def _meta_kv():
    return [torch.zeros(2, 8, 16, 2, 8, dtype=torch.float16, device="meta") for _ in range(2)]


def _cpu_kv():
    return [torch.randn(2, 8, 16, 2, 8).half() for _ in range(2)]


@pytest.mark.parametrize(
    "backend, message",
    [
        (None, "Device type 'meta' does not support event IPC."),
        # a backend whose module has no interprocess Event fails its own support check
        (DefaultEventIPCBackend(types.SimpleNamespace(), "meta"), "meta"),
    ],
)
def test_register_without_event_ipc_fails_before_sending(backend, message):
    # Nobody listens on this port: any request would time out instead of this error.
    dead = MPClient(f"tcp://127.0.0.1:{free_port()}", default_timeout=2)
    try:
        with extra_device_specs(_MetaAccel(backend)):
            ctx = LMCacheDrivenTransferContext(
                _meta_kv(), wrapper_factory=lambda t: t, instance_id=next(_ids), req_client=dead
            )
            with pytest.raises(RuntimeError, match=message):
                ctx.register("m", 1)
            assert ctx.event_backend is None
            assert ctx.chunk_size == 0  # get_chunk_size was never asked
    finally:
        dead.close()


def test_cpu_worker_registers_with_the_stub_backend(server, client):
    iid = next(_ids)
    ctx = create_transfer_context(
        _cpu_kv(), instance_id=iid, req_client=client, mode="lmcache_driven"
    )
    try:
        ctx.register("checks-cpu", 1)
        ctx.event_backend.check_event_support("cpu")
        inst = server.engine.instances[iid]
        assert inst.cache_context is not None and inst.cache_context.device.type == "cpu"
    finally:
        ctx.unregister()
        ctx.close()
    assert iid not in server.engine.instances


def test_cpu_kv_copies_of_every_worker_run_on_one_host_copy_thread(server, monkeypatch):
    """Each worker's transfers run on its own affinity slot, but the server's copies of CPU
    KV all run on one thread: libgomp keeps a thread team per thread that ran a parallel
    copy, and more OpenMP threads than cores make every later copy wait for wake-ups."""
    from lmcache.v1.multiprocess import kv_copy

    copied_on: list[str] = []
    for name in ("gather_paged_kv_to_cpu", "scatter_cpu_to_paged_kv"):

        def recording(*args, _real=getattr(kv_copy, name), **kwargs):
            copied_on.append(threading.current_thread().name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(kv_copy, name, recording)
    for worker in range(2):  # two clients: two affinity slots
        c = MPClient(f"tcp://127.0.0.1:{server.config.port}", default_timeout=20)
        kv = [torch.randn(2, 40, 16, 2, 8).half() for _ in range(2)]
        ctx = create_transfer_context(
            kv, instance_id=next(_ids), req_client=c, mode="lmcache_driven"
        )
        try:
            ctx.register("checks-host-copy", 1)
            tokens = [worker * 1000 + t for t in range(1, 257)]

            def key(worker_id, rid=f"host-copy-{worker}", tokens=tokens):
                return P.IPCCacheServerKey(
                    model_name="checks-host-copy",
                    world_size=1,
                    worker_id=worker_id,
                    token_ids=tokens,
                    start=0,
                    end=256,
                    request_id=rid,
                    num_kv_readers=1,
                )

            assert ctx.submit_store(key(0), list(range(1, 17))).result(20)
            assert c.lookup_hits(key(None), 10.0) == 1
            assert ctx.submit_retrieve(key(0), list(range(17, 33))).result(20)
            for t in kv:
                assert torch.equal(t[:, 1:17], t[:, 17:33])
        finally:
            ctx.unregister()
            ctx.close()
            c.close()
    assert len(copied_on) == 4
    assert len(set(copied_on)) == 1 and copied_on[0].startswith("mp-host-copy"), copied_on


def _register_failing(server, client, factory, engine_log):
    saved = cc.snapshot_backends()
    cc.register_cache_context_backend("cpu", factory)
    iid = next(_ids)
    ctx = create_transfer_context(
        _cpu_kv(), instance_id=iid, req_client=client, mode="lmcache_driven"
    )
    try:
        with pytest.raises(RemoteError) as exc:
            ctx.register("checks-fail", 1)
    finally:
        cc.restore_backends(saved)
        ctx.close()
    assert iid not in server.engine.instances
    errors = [r.getMessage() for r in engine_log if r.levelno >= logging.ERROR]
    assert any(f"instance {iid} failed" in m for m in errors), errors
    return exc.value, errors


def test_base_hook_not_implemented_is_a_failed_registration(server, client, engine_log):
    # The base DeviceSpec hook itself, as a device wheel without a cache context would run it.
    base = DeviceSpec()
    err, errors = _register_failing(
        server, client, lambda *a: base.create_cache_context(*a), engine_log
    )
    assert err.code == "NOT_SUPPORTED"
    assert "does not provide a BaseCacheContext implementation" in err.message
    assert any("NotImplementedError" in m for m in errors)
    # the server keeps serving: the next worker registers normally
    test_cpu_worker_registers_with_the_stub_backend(server, client)


def test_cache_context_value_error_is_a_failed_registration(server, client, engine_log):
    def bad(*_a):
        raise ValueError("kv layout 'XYZ' is not supported")

    err, errors = _register_failing(server, client, bad, engine_log)
    assert err.code == "INVALID_ARGUMENT" and "kv layout 'XYZ'" in err.message
    assert any("ValueError" in m for m in errors)


def test_event_support_is_rechecked_on_the_cache_context_device(server, client, engine_log):
    closed = []

    class _AccelContext:  # what an accelerator's cache context exposes here
        device = torch.device("meta")

        def close(self):
            closed.append(True)

    with extra_device_specs(_MetaAccel(None)):
        err, _ = _register_failing(server, client, lambda *a: _AccelContext(), engine_log)
    assert err.code == "NOT_SUPPORTED"
    assert "Device type 'meta' does not support event IPC." in err.message
    assert closed == [True]
