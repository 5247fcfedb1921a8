"""The worker's ``TransferRunner`` on its own: built from a ``ServerLink``, KV caches and a
``TransferRunnerSpec``, with no worker adapter, against a real ``lmcache server``."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import os
from pathlib import Path

import httpx
import pytest
import torch
from testsupport.waiting import eventually

from lmcache.integration.vllm import transfer_runner
from lmcache.integration.vllm.mp_config import MPConnectorConfig
from lmcache.integration.vllm.server_link import ServerLink
from lmcache.integration.vllm.transfer_runner import TransferRunner, TransferRunnerSpec
from lmcache.v1.multiprocess.protocol import IPCCacheServerKey

BLOCK = 16  # tokens per vLLM block
HEADS, HEAD_DIM, LAYERS, NUM_BLOCKS = 2, 8, 2, 64
_ids = itertools.count(1)


@pytest.fixture(scope="module")
def servers(lmcache_server_module):
    """One server on the copy path and one that offers its SHM pool, started on first use."""
    started = {}

    def get(shm: bool):
        if shm not in started:
            args = ("--shm-name", f"trun{os.getpid()}") if shm else ()
            started[shm] = lmcache_server_module(*args)
        return started[shm]

    return get


def vllm_kv_caches() -> dict[str, torch.Tensor]:
    """vLLM's per-layer paged KV, NHD: ``[2, num_blocks, block_size, heads, head_dim]``."""
    g = torch.Generator().manual_seed(7)
    shape = (2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM)
    return {f"model.layers.{i}.attn": torch.randn(shape, generator=g).half() for i in range(LAYERS)}


def spec_for(model: str, instance_id: int, mode: str, *, groups: int = 1) -> TransferRunnerSpec:
    group = {
        "layer_indices": list(range(LAYERS)),
        "tokens_per_block": BLOCK,
        "sw_size_tokens": -1,
        "extra_object_group_tag": 0,
        "recurrent_state": False,
    }
    return TransferRunnerSpec(
        instance_id=instance_id,
        model_name=model,
        kv_world_size=1,
        engine_group_infos=tuple({"engine_group_id": i, **group} for i in range(groups)),
        layout_hints={
            "kv_layout": "NHD",
            "tokens_per_block": BLOCK,
            "num_kv_heads": HEADS,
            "head_dim": HEAD_DIM,
        },
        mode=mode,
        mq_timeout=20.0,
    )


def runner_on(srv, model: str, instance_id: int, mode: str, mq_timeout: float):
    """A worker's link, vLLM KV caches and runner on ``srv``."""
    link = ServerLink(
        MPConnectorConfig(host="tcp://127.0.0.1", port=srv.port, mq_timeout=mq_timeout),
        role="worker (test)",
        instance_id=instance_id,
    )
    kv = vllm_kv_caches()
    spec = dataclasses.replace(spec_for(model, instance_id, mode), mq_timeout=mq_timeout)
    return link, kv, TransferRunner(link, kv, spec)


def key(model: str, tokens: list[int], rid: str, worker_id: int | None = 0) -> IPCCacheServerKey:
    return IPCCacheServerKey(
        model_name=model,
        world_size=1,
        worker_id=worker_id,
        token_ids=tokens,
        start=0,
        end=len(tokens),
        request_id=rid,
        num_kv_readers=1,
    )


@pytest.mark.parametrize(
    "mode, shm, inline, transport",
    [
        ("engine_driven", False, False, "raw_v1"),
        ("engine_driven", True, True, "SHM"),
        ("lmcache_driven", False, False, "lmcache_driven"),
    ],
)
def test_a_runner_without_an_adapter_stores_then_retrieves(servers, mode, shm, inline, transport):
    srv = servers(shm)
    instance_id = next(_ids)
    model = f"runner-{mode}-{shm}-{instance_id}"
    link, kv, runner = runner_on(srv, model, instance_id, mode, mq_timeout=20.0)
    try:
        assert runner.mode == transport
        chunks = 2
        tokens = [(instance_id * 1000 + i) % 30000 for i in range(chunks * link.chunk_size)]
        block_ids = list(range(1, 1 + len(tokens) // BLOCK))  # block 0 is vLLM's null block
        assert runner.submit_store(key(model, tokens, "store"), [block_ids]).result(20)
        assert runner.flush(20)
        stored = {name: t[:, block_ids].clone() for name, t in kv.items()}
        for t in kv.values():
            t[:, block_ids] = 0

        hit = chunks * link.chunk_size if link.partial_chunk else chunks  # partial_chunk: tokens
        assert link.client.lookup_hits(key(model, tokens, "load", worker_id=None), 10.0) == hit
        load = runner.submit_retrieve(key(model, tokens, "load"), [block_ids], 0, inline=inline)
        assert load.result(20)
        for name, t in kv.items():
            assert torch.equal(t[:, block_ids], stored[name]), name
    finally:
        runner.close(timeout=5)
        link.close()


@pytest.mark.parametrize("busy", [False, True])
def test_an_inline_retrieve_from_a_stopped_server_fails_within_its_timeout(
    lmcache_server, sigstop, busy
):
    """A synchronous load waits on the server in the engine's forward: against a server that
    stopped answering it fails after its own timeout, not after mq_timeout (an RPC's), also
    when a store that holds the SHM views is stuck on the same server (``busy``)."""
    import signal
    import time

    srv = lmcache_server("--shm-name", f"trstop{os.getpid()}")
    instance_id = next(_ids)
    model = f"runner-stopped-{instance_id}"
    mq_timeout = 120.0  # far beyond the retrieve's timeout: a wait on it would show
    link, kv, runner = runner_on(srv, model, instance_id, "engine_driven", mq_timeout=mq_timeout)
    try:
        tokens, block_ids = store_and_look_up_one_chunk(runner, link, model, instance_id)
        sigstop(srv.proc.pid)
        if busy:  # a store on the runner's thread, stuck on the stopped server
            runner.submit_store(key(model, tokens, "store-2"), [block_ids])
        t0 = time.monotonic()
        load = runner.submit_retrieve(
            key(model, tokens, "load"), [block_ids], 0, inline=True, timeout=1.0
        )
        waited = time.monotonic() - t0
        assert load.result(0) is False
        assert waited < mq_timeout / 2  # its own timeout bounded it, not an RPC's
        os.kill(srv.proc.pid, signal.SIGCONT)
        # The resumed server prepares the abandoned retrieve (read-locking its slot for
        # this live worker); the commit the worker sent behind it releases the lock, long
        # before the L1 read TTL would.
        eventually(lambda: read_locked(srv) == 0, "no read lock left on the server", 20)
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
        runner.close(timeout=5)
        link.close()


def store_and_look_up_one_chunk(runner, link, model: str, instance_id: int):
    """Store one chunk, then the scheduler's lookup of it for request "load" (which
    read-locks it for that request's retrieve); returns its tokens and block ids."""
    tokens = [(instance_id * 1000 + i) % 30000 for i in range(link.chunk_size)]
    block_ids = list(range(1, 1 + len(tokens) // BLOCK))
    assert runner.submit_store(key(model, tokens, "store"), [block_ids]).result(20)
    assert runner.flush(20)
    hit = link.chunk_size if link.partial_chunk else 1  # partial_chunk: in tokens
    assert link.client.lookup_hits(key(model, tokens, "load", worker_id=None), 10.0) == hit
    return tokens, block_ids


def read_locked(srv) -> int:
    status = httpx.get(srv.http_url + "/status", timeout=5).json()
    return int(status["storage_manager"]["l1_manager"]["read_locked_count"])


def test_engine_driven_refuses_more_than_one_kv_group(servers):
    srv = servers(False)
    instance_id = next(_ids)
    link = ServerLink(
        MPConnectorConfig(host="tcp://127.0.0.1", port=srv.port, mq_timeout=20.0),
        role="worker (test)",
        instance_id=instance_id,
    )
    try:
        spec = spec_for("runner-groups", instance_id, "engine_driven", groups=2)
        with pytest.raises(ValueError) as err:
            TransferRunner(link, vllm_kv_caches(), spec)
        assert str(err.value) == (
            "engine_driven transfer supports one KV cache group, got 2; use lmcache_driven or "
            "start vLLM with --disable-hybrid-kv-cache-manager"
        )
    finally:
        link.close()


def test_the_runner_module_never_imports_the_adapter():
    """Built from explicit parts: no import of the adapter, not even for type checking."""
    tree = ast.parse(Path(transfer_runner.__file__).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "lmcache.integration.vllm.server_link" in imported  # the walk sees the imports
    assert not {m for m in imported if m and "adapter" in m}, imported


@pytest.mark.parametrize(
    "mode, shm",
    [("engine_driven", True), ("engine_driven", False), ("lmcache_driven", False)],
)
def test_a_retrieve_given_up_on_never_writes_into_the_blocks(lmcache_server, sigstop, mode, shm):
    """The worker stops waiting for a retrieve (its retrieve_timeout, or the server looked
    dead) and vLLM may give the blocks to another request. A server that answers after that
    must not get its chunk copied into them: engine_driven, the worker's own transfer thread
    would copy (the copy gate stops it); lmcache_driven, the server would (the deadline sent
    with the retrieve stops it)."""
    import signal

    args = ("--shm-name", f"trgone{os.getpid()}") if shm else ()
    srv = lmcache_server(*args)
    instance_id = next(_ids)
    model = f"runner-gone-{mode}-{instance_id}"
    link, kv, runner = runner_on(srv, model, instance_id, mode, mq_timeout=60.0)
    try:
        tokens, block_ids = store_and_look_up_one_chunk(runner, link, model, instance_id)

        sigstop(srv.proc.pid)
        load = runner.submit_retrieve(key(model, tokens, "load"), [block_ids], 0, timeout=1.0)
        if mode == "lmcache_driven":
            assert not load.abandon()  # before the deadline the server got, it may still copy
        assert not load.wait(1.5)  # the stopped server cannot have answered
        assert load.abandon()  # nothing copies now: the blocks are vLLM's again
        for t in kv.values():
            t[:, block_ids] = 7.0  # vLLM gave them to another request
        os.kill(srv.proc.pid, signal.SIGCONT)
        assert load.wait(30)  # the resumed server answered
        assert load.result(0) is False
        runner.flush(20)
        for name, t in kv.items():
            assert bool((t[:, block_ids] == 7.0).all()), f"{name}: a late retrieve wrote into it"
        if mode == "lmcache_driven":
            metrics = httpx.get(srv.http_url + "/metrics", timeout=5).text
            assert 'lmcache_mp_num_late_retrieves_skipped_total{device="cpu"} 1.0' in metrics
        eventually(lambda: read_locked(srv) == 0, "no read lock left on the server", 20)
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
        runner.close(timeout=5)
        link.close()
