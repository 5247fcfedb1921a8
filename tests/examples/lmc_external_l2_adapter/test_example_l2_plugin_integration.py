"""The example plugin package end to end: the steps of docs/l2-plugins.md, StorageManager,
native_plugin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from testsupport.waiting import eventually

pytest.importorskip("lmc_external_l2_adapter", reason="lmc-external-l2-adapter not installed")

from lmc_external_l2_adapter import InMemoryL2Adapter, PyMemoryConnector
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import (
    EvictionConfig,
    L1ManagerConfig,
    L1MemoryManagerConfig,
    StorageManagerConfig,
)
from lmcache.v1.distributed.l2_adapters.config import (
    L2AdaptersConfig,
    parse_l2_adapter_dict,
)
from lmcache.v1.distributed.l2_adapters.key_codec import object_key_to_string
from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
    NativeConnectorL2Adapter,
)
from lmcache.v1.distributed.storage_manager import StorageManager

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "lmc_external_l2_adapter"
LAYOUT = MemoryLayoutDesc([torch.Size([1024])], [torch.float32])
RAW = {
    "type": "plugin",
    "module_path": "lmc_external_l2_adapter",
    "class_name": "InMemoryL2Adapter",
    "adapter_params": {"max_size_gb": 1.0, "mock_bandwidth_gb": 20.0},
}
WITH_CLASS = {**RAW, "config_class_name": "InMemoryL2AdapterConfig"}
NATIVE = {
    "type": "native_plugin",
    "module_path": "lmc_external_l2_adapter",
    "class_name": "PyMemoryConnector",
    "adapter_params": {"num_workers": 2},
    "max_capacity_gb": 0.01,
}


def key(i: int) -> ObjectKey:
    return ObjectKey(ObjectKey.IntHash2Bytes(i), "org/model", ObjectKey.ComputeKVRank(1, 0, 1, 0))


def make_sm(spec: dict) -> StorageManager:
    mem = L1MemoryManagerConfig(64 * 4096, use_lazy=False, shm_name="")
    cfg = StorageManagerConfig(
        L1ManagerConfig(mem),
        EvictionConfig("LRU"),
        L2AdaptersConfig([parse_l2_adapter_dict(1, spec)]),
    )
    return StorageManager(cfg, eviction_interval_s=60)


def round_trip(sm: StorageManager, stored_count) -> None:
    keys = [key(i) for i in range(4)]
    objs = sm.reserve_write(keys, LAYOUT)
    for i, k in enumerate(keys):
        objs[k].tensor.copy_(torch.arange(1024, dtype=torch.float32) + i)
    sm.finish_write(keys)
    eventually(lambda: stored_count() == 4)
    assert sm.delete_l1_keys(keys) == (4, 0)
    h = sm.submit_prefetch_task(PrefetchTaskSpec([GroupedObjectKeys(keys, 0, LAYOUT)]))
    assert sm.wait_prefetch_status(h, 30)
    r = sm.query_prefetch_status(h)
    assert repr(r.hit_cells[0]) == "1111" and repr(r.l2_hit_cells[0]) == "1111"
    with sm.read_prefetched_results(keys, r.l1_owners[0]) as got:
        for i, o in enumerate(got):
            assert torch.equal(o.tensor, torch.arange(1024, dtype=torch.float32) + i)
    sm.finish_read_prefetched(keys, 1, r.l1_owners[0])
    assert sm.memcheck()


@pytest.mark.parametrize("spec", [RAW, WITH_CLASS], ids=["raw-dict", "config-class"])
def test_plugin_through_storage_manager(spec):
    sm = make_sm(spec)
    try:
        adapter = sm.get_l2_adapters()[0]
        assert isinstance(adapter, InMemoryL2Adapter)
        round_trip(sm, lambda: adapter.report_status()["num_keys"])
        assert sm.get_l2_usages()[0].total_bytes_used == 4 * 4096
    finally:
        sm.close()


def test_native_style_connector_through_native_plugin():
    sm = make_sm(NATIVE)
    try:
        bridge = sm.get_l2_adapters()[0]
        assert isinstance(bridge, NativeConnectorL2Adapter)
        status = bridge.report_status()
        assert status["type_name"] == PyMemoryConnector.__name__ and status["is_healthy"]
        round_trip(sm, lambda: len(bridge.known_key_sizes()))
        assert dict(bridge.known_key_sizes()) == {key(i): 4096 for i in range(4)}
        assert bridge.get_usage().usage_fraction == pytest.approx(4 * 4096 / (0.01 * (1 << 30)))
    finally:
        sm.close()


def test_bridge_sends_native_key_strings_to_the_connector():
    """The connector sees L2 name strings (docs/design/storage-formats.md#l2-names); built through
    the bridge's public constructor."""
    client = PyMemoryConnector(num_workers=2)
    bridge = NativeConnectorL2Adapter(client, max_capacity_gb=0.01)
    try:
        keys = [key(i) for i in range(3)]
        src = [torch.arange(1024, dtype=torch.float32) + i for i in range(3)]
        objs = [_tensor_obj(t) for t in src]
        tid = bridge.submit_store_task(keys, objs)
        done: dict = {}
        eventually(lambda: done.update(bridge.pop_completed_store_tasks()) or tid in done)
        assert done[tid].is_successful()
        assert sorted(client.keys()) == sorted(object_key_to_string(k) for k in keys)
    finally:
        bridge.close()


def _tensor_obj(t: torch.Tensor):
    from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

    meta = MemoryObjMetadata(torch.Size([1024]), torch.float32, 0, 4096, 1)
    return TensorMemoryObj(t, meta)


def test_config_file_example_parses():
    spec = json.loads((EXAMPLE / "configs" / "l2_adapter_example.json").read_text())
    cfg = parse_l2_adapter_dict(1, spec)
    assert cfg.class_name == "InMemoryL2Adapter"


def test_seed_steps_two_to_four():
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    step2 = subprocess.run(
        [
            sys.executable,
            "-c",
            "from lmc_external_l2_adapter import InMemoryL2Adapter; print(InMemoryL2Adapter)",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert "InMemoryL2Adapter" in step2.stdout
    step3 = subprocess.run(
        [
            sys.executable,
            "-c",
            "from lmcache.v1.distributed.l2_adapters.config import get_registered_l2_adapter_types\nprint(get_registered_l2_adapter_types())",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert "'plugin'" in step3.stdout
    step4 = subprocess.run(
        [sys.executable, "-m", "pytest", str(EXAMPLE / "tests"), "-q", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        env=env,
        cwd=EXAMPLE,
    )
    assert step4.returncode == 0, step4.stdout[-2000:]
    script = EXAMPLE / "scripts" / "install_and_test.sh"
    assert os.access(script, os.X_OK)
