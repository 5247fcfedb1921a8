"""Shared helpers of the native/fs/redis tests (loaded by path from their conftest files):
memory objects, adapters built through the registry, and waiting on an adapter's fds."""

from __future__ import annotations

import select
import time
from collections.abc import Callable
from typing import Any

import torch

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.config import (
    create_l2_adapter_from_registry,
    get_l2_adapter_config_class,
)
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj


def make_obj(
    nbytes: int, seed: int = 0, align: int = 0, offset: int = 0, phy: int = 0
) -> TensorMemoryObj:
    """A uint8 MemoryObj of ``nbytes`` logical bytes with deterministic content.

    ``align``/``offset`` place the buffer at ``address % align == offset``; ``phy`` > nbytes
    gives a padded physical slot.
    """
    slot = max(phy, nbytes)
    backing = torch.zeros(slot + align + 64, dtype=torch.uint8)
    start = 0
    if align:
        start = (-backing.data_ptr()) % align + offset
    raw = backing[start : start + slot]
    g = torch.Generator().manual_seed(seed)
    raw[:nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    meta = MemoryObjMetadata(
        shape=torch.Size([nbytes]), dtype=torch.uint8, address=0, phy_size=slot, ref_count=1
    )
    obj = TensorMemoryObj(raw_data=raw, metadata=meta)
    obj._backing = backing  # keep the allocation alive
    return obj


def empty_like(obj: TensorMemoryObj) -> TensorMemoryObj:
    return make_obj(obj.get_size(), seed=-1)


def key(i: int, model: str = "llama", rank: int = 0, salt: str = "") -> ObjectKey:
    return ObjectKey(i.to_bytes(4, "big"), model, rank, 0, salt)


def build(type_name: str, **fields: Any) -> Any:
    cfg = get_l2_adapter_config_class(type_name).from_dict({"type": type_name, **fields})
    return create_l2_adapter_from_registry(cfg)


def _wait(fd: int, poll: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = poll()
        if got is not None:
            return got
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("adapter task did not complete")
        select.select([fd], [], [], min(left, 0.2))


def store(
    adapter: Any,
    keys: list[ObjectKey],
    objs: list[Any],
    timeout: float = 20,
    while_running: Callable[[], Any] | None = None,
) -> Any:
    """Store and wait for the result; ``while_running`` is called right after submitting
    (the store is usually still in flight then)."""
    tid = adapter.submit_store_task(keys, objs)
    if while_running is not None:
        while_running()
    done: dict[int, Any] = {}

    def poll() -> Any:
        done.update(adapter.pop_completed_store_tasks())
        return done.get(tid)

    return _wait(adapter.get_store_event_fd(), poll, timeout)


def lookup(adapter: Any, keys: list[ObjectKey], timeout: float = 20) -> Any:
    tid = adapter.submit_lookup_and_lock_task(keys, {})
    return _wait(
        adapter.get_lookup_and_lock_event_fd(),
        lambda: adapter.query_lookup_and_lock_result(tid),
        timeout,
    )


def load(adapter: Any, keys: list[ObjectKey], objs: list[Any], timeout: float = 20) -> Any:
    tid = adapter.submit_load_task(keys, objs)
    return _wait(adapter.get_load_event_fd(), lambda: adapter.query_load_result(tid), timeout)


def wait_until(cond: Callable[[], bool], timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


class Recorder:
    """An L2AdapterListener that records every event."""

    def __init__(self) -> None:
        self.stored: list[tuple[ObjectKey, int]] = []
        self.accessed: list[ObjectKey] = []
        self.deleted: list[ObjectKey] = []

    def on_l2_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        self.stored += list(zip(keys, sizes, strict=False))

    def on_l2_keys_accessed(self, keys: list[ObjectKey]) -> None:
        self.accessed += keys

    def on_l2_keys_deleted(self, keys: list[ObjectKey]) -> None:
        self.deleted += keys


# --- two `lmcache server` processes sharing one L2 backend ----------------------------------

NUM_BLOCKS, BLOCK, LAYERS, HEADS, HEAD_SIZE, NUM_TOKENS = 160, 16, 3, 2, 16, 1024


def _kv_cache(seed: int, zeros: bool) -> list[torch.Tensor]:
    """A paged NHD KV cache per layer: (2, blocks, block_size, heads, head_size)."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE)
    if zeros:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return [torch.randn(shape, generator=g).bfloat16() for _ in range(LAYERS)]


class _Engine:
    """One engine worker (in this process) registered with one `lmcache server`."""

    def __init__(self, url: str, model: str, kv: list[torch.Tensor]) -> None:
        import random

        from lmcache.v1.multiprocess.client import MPClient
        from lmcache.v1.multiprocess.transfer_context import create_transfer_context

        self.model = model
        self.client = MPClient(url, default_timeout=30)
        self.ctx = create_transfer_context(
            kv, instance_id=random.getrandbits(60), req_client=self.client
        )
        self.ctx.register(model, 1)

    def key(
        self,
        request_id: str,
        worker_id: int | None = 0,
        first_token: int = 10,
        end: int = NUM_TOKENS,
    ) -> Any:
        """The key of a NUM_TOKENS prompt (``first_token`` picks which one), its first ``end``
        tokens."""
        from lmcache.v1.multiprocess import protocol as P

        return P.IPCCacheServerKey(
            model_name=self.model,
            world_size=1,
            worker_id=worker_id,
            token_ids=list(range(first_token, first_token + NUM_TOKENS)),
            start=0,
            end=end,
            request_id=request_id,
            num_kv_readers=1,
        )

    def close(self) -> None:
        self.ctx.unregister()
        self.ctx.close()
        self.client.close()


def store_prompt(server: Any, model: str, block_ids: list[int], seed: int = 7) -> None:
    """An engine registered with ``server`` stores one NUM_TOKENS prompt from ``block_ids``
    of a KV cache filled from ``seed``."""
    writer = _Engine(server.rpc_url, model, _kv_cache(seed, zeros=False))
    try:
        assert writer.ctx.submit_store(writer.key("store-a"), block_ids).result(60)
    finally:
        writer.close()


def retrieve_prompt(
    server: Any, model: str, src_ids: list[int], dst_ids: list[int], seed: int = 7
) -> None:
    """A fresh engine registered with ``server`` finds the prompt ``store_prompt`` stored (all
    4 chunks, from L2) and retrieves it into ``dst_ids``: byte-identical, nothing else written."""
    kv = _kv_cache(seed, zeros=True)
    reader = _Engine(server.rpc_url, model, kv)
    try:
        reader.client.call("lookup", reader.key("from-b", worker_id=None), 1)
        hits = reader.client.call("wait_prefetch_status", "from-b", 30.0)
        assert hits == 4, f"found {hits} of 4 chunks in L2:\n{server.log()[-4000:]}"
        assert reader.ctx.submit_retrieve(reader.key("from-b"), dst_ids).result(60)
    finally:
        reader.close()
    expected = _kv_cache(seed, zeros=False)
    for e, t in zip(expected, kv, strict=True):
        for src, dst in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(e[:, src], t[:, dst])
    assert all(int(t[:, 0].float().abs().sum()) == 0 for t in kv)  # nothing else written


def cross_server_round_trip(
    lmcache_server: Callable[..., Any],
    adapter_json: str,
    stored_count: Callable[[], int],
    model: str = "xsrv-model",
) -> None:
    """A prompt stored through server A is retrieved, byte-identical, through server B.

    Both servers get the same ``--l2-adapter``; ``stored_count()`` reports how many values the
    backend holds, so the test waits for A's write-behind before asking B.
    """
    flags = ("--l2-adapter", adapter_json, "--supported-transfer-mode", "auto")
    a = lmcache_server(*flags)
    b = lmcache_server(*flags)
    n_blocks = NUM_TOKENS // BLOCK
    src_ids = list(range(1, 1 + n_blocks))
    dst_ids = list(range(1 + n_blocks, 1 + 2 * n_blocks))[::-1]
    store_prompt(a, model, src_ids)
    assert wait_until(lambda: stored_count() >= 4, 60), "server A never wrote its chunks to L2"
    time.sleep(0.5)  # let the last write-behind task settle
    retrieve_prompt(b, model, src_ids, dst_ids)


class Helpers:
    make_obj = staticmethod(make_obj)
    empty_like = staticmethod(empty_like)
    key = staticmethod(key)
    build = staticmethod(build)
    store = staticmethod(store)
    lookup = staticmethod(lookup)
    load = staticmethod(load)
    wait_until = staticmethod(wait_until)
    Recorder = Recorder
    cross_server_round_trip = staticmethod(cross_server_round_trip)
    store_prompt = staticmethod(store_prompt)
    retrieve_prompt = staticmethod(retrieve_prompt)
    Engine = _Engine
    kv_cache = staticmethod(_kv_cache)
    BLOCK_IDS = list(range(1, 1 + NUM_TOKENS // BLOCK))  # the blocks of one prompt
