"""docs/design/platform.md#fake-devices against a real server, and a client killed mid SHM store."""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import signal
import subprocess
import sys

import httpx
import pytest
import torch

from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.client import MPClient
from lmcache.v1.multiprocess.protocol import RemoteError
from lmcache.v1.multiprocess.transfer_context import create_transfer_context
from lmcache.v1.multiprocess.transfer_context.worker_transfer import EngineDrivenTransferContext

_ids = itertools.count(5000)


@pytest.fixture(scope="module")
def srv(lmcache_server_module):
    return lmcache_server_module()


def _register(client: MPClient, model: str, dtype: str, layers: int = 2, hidden: int = 8) -> int:
    iid = next(_ids)
    payload = P.RegisterEngineDrivenContextPayload(
        instance_id=iid,
        model_name=model,
        world_size=1,
        block_size=16,
        num_layers=layers,
        hidden_dim_size=hidden,
        dtype_str=dtype,
    )
    client.call("register_kv_cache_engine_driven_context", payload)
    return iid


def _key(model: str, rid: str, worker_id=0, readers=1):
    return P.IPCCacheServerKey(
        model_name=model,
        world_size=1,
        worker_id=worker_id,
        token_ids=list(range(1, 513)),
        start=0,
        end=512,
        request_id=rid,
        num_kv_readers=readers,
    )


@pytest.mark.parametrize("protocol", [4, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.uint8])
def test_pickle_payload_stores_the_same_bytes(srv, protocol, dtype):
    model = f"pk-{protocol}-{str(dtype)[6:]}-{next(_ids)}"
    name = str(dtype).removeprefix("torch.")
    old = MPClient(srv.rpc_url, default_timeout=20)  # a 0.5.6-style client: never negotiates
    new = MPClient(srv.rpc_url, default_timeout=20)
    try:
        iid = _register(old, model, name)
        chunks = [
            (torch.arange(2 * 2 * 256 * 8) % 251).to(dtype).reshape(2, 2, 256, 8) + i
            for i in range(2)
        ]
        k = _key(model, "s")
        assert old.call("prepare_store", k, iid) == {"context": {}}
        assert old.call("commit_store", k, iid, pickle.dumps(chunks, protocol=protocol)) is True
        new.negotiate_default_features()
        rid = f"r-{model}"
        new.call("lookup", _key(model, rid, worker_id=None), 1)
        assert new.call("wait_prefetch_status", rid, 10.0) == 2
        iid2 = _register(new, model, name)
        reply = new.call("prepare_retrieve", _key(model, rid), iid2)
        assert reply["success"] is True and reply["context"]["encoding"] == "raw_v1"
        from lmcache.v1.multiprocess.payload_codec import decode_raw_v1

        got = decode_raw_v1(reply["data"], 2)
        assert [bytes(g) for g in got] == [
            c.contiguous().view(torch.uint8).numpy().tobytes() for c in chunks
        ]
    finally:
        old.close()
        new.close()


@pytest.mark.parametrize(
    "payload",
    [
        pickle.dumps([torch.zeros(2, 2, 256, 8, dtype=torch.float16)] * 2, protocol=2),
        pickle.dumps([torch.zeros(2, 2, 256, 8, dtype=torch.float16)] * 3),
        pickle.dumps([torch.zeros(2, 2, 256, 8, dtype=torch.bfloat16)] * 2),
        pickle.dumps(
            [
                torch.zeros(2, 2, 256, 8, dtype=torch.float16),
                torch.zeros(9_000_000, dtype=torch.float16),
            ]
        ),
        b"\x80\x04garbage",
        b"NOTAPAYLOAD",
        b"",
    ],
    ids=["protocol2", "count", "dtype", "oversized", "truncated", "magic", "empty-copy"],
)
def test_bad_copy_payloads_are_rejected(srv, payload):
    model = f"bad-{next(_ids)}"
    with MPClient(srv.rpc_url, default_timeout=20) as c:
        iid = _register(c, model, "float16")
        k = _key(model, "s")
        c.call("prepare_store", k, iid)
        assert c.call("commit_store", k, iid, payload) is False
        assert c.noop() == "OK"
        rid = f"r-{model}"
        c.call("lookup", _key(model, rid, worker_id=None), 1)
        assert c.call("wait_prefetch_status", rid, 10.0) == 0


def test_raw_v1_length_mismatch_is_false(srv):
    from lmcache.v1.multiprocess.payload_codec import encode_raw_v1

    model = f"raw-{next(_ids)}"
    with MPClient(srv.rpc_url, default_timeout=20) as c:
        c.negotiate_default_features()
        iid = _register(c, model, "float16")
        k = _key(model, "s")
        ctx = c.call("prepare_store", k, iid)["context"]
        assert ctx == {"encoding": "raw_v1", "chunk_indices": [0, 1]}
        assert c.call("commit_store", k, iid, encode_raw_v1([b"\x00" * 10, b"\x00" * 10])) is False


def test_shm_attach_failure_falls_back_with_warning(lmcache_server, monkeypatch, caplog):
    srv = lmcache_server("--shm-name", f"fb{os.getpid()}")

    def refuse(self, name, size):
        raise OSError("simulated: cannot open the segment")

    monkeypatch.setattr(EngineDrivenTransferContext, "_attach", refuse)
    kv = [torch.randn(2, 64, 16, 2, 8).half() for _ in range(2)]
    client = MPClient(srv.rpc_url, default_timeout=20)
    try:
        with caplog.at_level(logging.INFO, logger="lmcache"):
            ctx = create_transfer_context(
                kv, instance_id=next(_ids), req_client=client, mode="engine_driven"
            )
            ctx.register("fb-model", 1)
        assert ctx.mode == "raw_v1"
        text = caplog.text
        assert (
            f"Failed to initialize SHM context (shm_name=lmcache_l1_pool_fb{os.getpid()}), falling back to raw_v1 transport"
            in text
        )
        assert (
            f"Worker engine-driven context registered (instance_id={ctx.instance_id}, mode=raw_v1)"
            in text
        )
        k = _key("fb-model", "s")
        assert ctx.submit_store(k, list(range(1, 33))).result(20) is True
        assert "switching it to the copy path" in srv.log()
        rid = "fb-r"
        client.call("lookup", _key("fb-model", rid, worker_id=None), 1)
        assert client.call("wait_prefetch_status", rid, 10.0) == 2
        monkeypatch.undo()  # the reading engine maps the pool normally
        dest = [torch.zeros_like(t) for t in kv]
        c2 = MPClient(srv.rpc_url, default_timeout=20)
        ctx2 = create_transfer_context(
            dest, instance_id=next(_ids), req_client=c2, mode="engine_driven"
        )
        ctx2.register("fb-model", 1)
        assert ctx2.submit_retrieve(_key("fb-model", rid), list(range(1, 33))).result(20) is True
        assert all(torch.equal(a[:, 1:33], b[:, 1:33]) for a, b in zip(kv, dest, strict=True))
        ctx2.close()
        c2.close()
    finally:
        client.close()


def test_mode_not_enabled(lmcache_server):
    only_engine = lmcache_server("--supported-transfer-mode", "engine_driven")
    kv = [torch.randn(2, 64, 16, 2, 8).half() for _ in range(2)]
    client = MPClient(only_engine.rpc_url, default_timeout=20)
    try:
        ctx = create_transfer_context(
            kv, instance_id=next(_ids), req_client=client, mode="lmcache_driven"
        )
        with pytest.raises(RemoteError) as exc:
            ctx.register("m", 1)
        assert exc.value.code == "MODE_NOT_ENABLED"
        assert "--supported-transfer-mode auto" in exc.value.message
        ctx.close()
    finally:
        client.close()
    assert "--supported-transfer-mode auto" in only_engine.log()
    only_lmc = lmcache_server("--supported-transfer-mode", "lmcache_driven")
    client = MPClient(only_lmc.rpc_url, default_timeout=20)
    try:
        ctx = create_transfer_context(
            kv, instance_id=next(_ids), req_client=client, mode="engine_driven"
        )
        with pytest.raises(RemoteError) as exc:
            ctx.register("m", 1)
        assert exc.value.code == "MODE_NOT_ENABLED"
        assert "--supported-transfer-mode auto" in exc.value.message
    finally:
        client.close()
    assert "--supported-transfer-mode auto" in only_lmc.log()


_HALF_WRITER = r"""
import sys, time, torch
from lmcache.v1.multiprocess.client import MPClient
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.transfer_context import create_transfer_context
c = MPClient(sys.argv[1], default_timeout=20)
kv = [torch.randn(2, 64, 16, 2, 8).half() for _ in range(2)]
ctx = create_transfer_context(kv, instance_id=int(sys.argv[2]), req_client=c, mode="engine_driven")
ctx.register("killed-model", 1)
assert ctx.mode == "SHM", ctx.mode
k = P.IPCCacheServerKey(model_name="killed-model", world_size=1, worker_id=0,
    token_ids=list(range(1, 513)), start=0, end=512, request_id="k")
reply = c.call("prepare_store", k, ctx.instance_id)
views = ctx._slot_views(reply["context"]["slots"])
views[0].fill_(1.0)  # half of the request written, then the worker dies
c.ping(ctx.instance_id)
print("READY", flush=True)
time.sleep(600)
"""


def test_client_killed_mid_shm_store_leaves_nothing_readable(lmcache_server, mp):
    srv = lmcache_server(
        "--shm-name",
        f"kill{os.getpid()}",
        "--worker-reap-timeout-seconds",
        "1",
        "--worker-registration-grace-seconds",
        "1",
    )
    iid = next(_ids)
    proc = subprocess.Popen(
        [sys.executable, "-c", _HALF_WRITER, srv.rpc_url, str(iid)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "READY"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        with MPClient(srv.rpc_url, default_timeout=20) as c:
            mp.wait_for(
                lambda: f"Reaped instance {iid}" in srv.log(), "the killed worker reaped", 15
            )
            c.call("lookup", _key("killed-model", "after", worker_id=None), 1)
            assert c.call("wait_prefetch_status", "after", 10.0) == 0
            assert c.noop() == "OK"
            l1 = httpx.get(srv.http_url + "/status", timeout=5).json()["storage_manager"]["l1"]
            assert l1["total_object_count"] == 0 and l1["write_locked_count"] == 0, l1
    finally:
        if proc.poll() is None:
            proc.kill()
