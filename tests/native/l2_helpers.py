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


def store(adapter: Any, keys: list[ObjectKey], objs: list[Any], timeout: float = 20) -> Any:
    tid = adapter.submit_store_task(keys, objs)
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
