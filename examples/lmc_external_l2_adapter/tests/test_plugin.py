"""Behaviour of the example plugin, as in the L2 plugin guide (docs/l2-plugins.md)."""

from __future__ import annotations

import argparse
import select

import pytest
import torch

from lmc_external_l2_adapter import InMemoryL2Adapter
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import (
    add_l2_adapters_args,
    create_l2_adapter_from_registry,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig
from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd

RAW = {
    "type": "plugin",
    "module_path": "lmc_external_l2_adapter",
    "class_name": "InMemoryL2Adapter",
    "adapter_params": {"max_size_gb": 1.0, "mock_bandwidth_gb": 20.0},
}
WITH_CLASS = {**RAW, "config_class_name": "InMemoryL2AdapterConfig"}


def make_key(i: int) -> ObjectKey:
    return ObjectKey(ObjectKey.IntHash2Bytes(i), "test-model", 0)


def make_obj(values: torch.Tensor | None = None) -> TensorMemoryObj:
    data = values if values is not None else torch.zeros(1024, dtype=torch.float32)
    meta = MemoryObjMetadata(
        shape=torch.Size([1024]), dtype=torch.float32, address=0, phy_size=4096, ref_count=1
    )
    return TensorMemoryObj(raw_data=data, metadata=meta, parent_allocator=None)


def wait(fd: int, timeout: float = 5.0) -> None:
    r, _, _ = select.select([fd], [], [], timeout)
    assert r, "adapter did not signal its event fd"
    consume_fd(fd)  # notifications coalesce: drain before the next wait


def wait_for(fd: int, poll):
    """Wait on ``fd`` until ``poll()`` returns a result (one wake may cover several tasks)."""
    for _ in range(100):
        result = poll()
        if result is not None:
            return result
        wait(fd)
    raise AssertionError("task never completed")


@pytest.fixture(params=[RAW, WITH_CLASS], ids=["raw-dict", "config-class"])
def adapter(request):
    cfg = PluginL2AdapterConfig.from_dict(request.param)
    a = create_l2_adapter_from_registry(cfg)
    yield a
    a.close()


def test_config_parsing_both_modes():
    raw = PluginL2AdapterConfig.from_dict(RAW)
    assert raw.config_class_name is None and raw.class_name == "InMemoryL2Adapter"
    cls = PluginL2AdapterConfig.from_dict(WITH_CLASS)
    assert cls.config_class_name == "InMemoryL2AdapterConfig"


def test_cli_argument_round_trip():
    import json

    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    args = parser.parse_args(["--l2-adapter", json.dumps(RAW)])
    cfg = parse_args_to_l2_adapters_config(args)
    assert len(cfg.adapters) == 1
    assert isinstance(cfg.adapters[0], PluginL2AdapterConfig)
    assert cfg.adapters[0].class_name == "InMemoryL2Adapter"


def test_subclass():
    assert issubclass(InMemoryL2Adapter, L2AdapterInterface)


def test_created_through_registry(adapter):
    assert isinstance(adapter, InMemoryL2Adapter)


def test_three_distinct_fds(adapter):
    fds = {
        adapter.get_store_event_fd(),
        adapter.get_lookup_and_lock_event_fd(),
        adapter.get_load_event_fd(),
    }
    assert len(fds) == 3


def _store(adapter, keys, objs):
    tid = adapter.submit_store_task(keys, objs)
    done = {}

    def poll():
        done.update(adapter.pop_completed_store_tasks())
        return done.get(tid)

    assert wait_for(adapter.get_store_event_fd(), poll).is_successful()


def _lookup(adapter, keys):
    tid = adapter.submit_lookup_and_lock_task(keys, {})
    return wait_for(
        adapter.get_lookup_and_lock_event_fd(), lambda: adapter.query_lookup_and_lock_result(tid)
    )


def test_store_then_lookup(adapter):
    k = make_key(1)
    _store(adapter, [k], [make_obj()])
    bm = _lookup(adapter, [k])
    assert bm.test(0) is True
    adapter.submit_unlock([k])


def test_store_then_load_equal_bytes(adapter):
    k = make_key(2)
    src = torch.arange(1024, dtype=torch.float32)
    _store(adapter, [k], [make_obj(src.clone())])
    dst = make_obj()
    tid = adapter.submit_load_task([k], [dst])
    bm = wait_for(adapter.get_load_event_fd(), lambda: adapter.query_load_result(tid))
    assert bm.test(0) is True
    assert torch.equal(dst.tensor, src)


def test_batch_store(adapter):
    keys = [make_key(3), make_key(4)]
    _store(adapter, keys, [make_obj(), make_obj()])
    bm = _lookup(adapter, keys)
    assert bm.test(0) is True and bm.test(1) is True


def test_mixed_lookup(adapter):
    _store(adapter, [make_key(5)], [make_obj()])
    bm = _lookup(adapter, [make_key(5), make_key(6)])
    assert bm.test(0) is True
    assert bm.test(1) is False


@pytest.mark.parametrize("spec", [RAW, WITH_CLASS], ids=["raw-dict", "config-class"])
def test_fifo_eviction_at_capacity(spec):
    params = {**spec["adapter_params"], "max_size_gb": 10240 / (1 << 30), "mock_bandwidth_gb": 10.0}
    a = create_l2_adapter_from_registry(
        PluginL2AdapterConfig.from_dict({**spec, "adapter_params": params})
    )
    try:
        assert isinstance(a, InMemoryL2Adapter)
        k1, k2, k3 = make_key(7), make_key(8), make_key(9)
        _store(a, [k1], [make_obj()])
        _store(a, [k2], [make_obj()])
        _store(a, [k3], [make_obj()])
        bm = _lookup(a, [k1, k2, k3])
        assert bm.test(0) is False
        assert bm.test(1) is True
        assert bm.test(2) is True
    finally:
        a.close()
