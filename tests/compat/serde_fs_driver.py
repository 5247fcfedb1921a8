"""Stores or loads KV-shaped objects through an fs L2 adapter wrapped in a serde, with the
API both LMCache 0.5.6 and ours expose (``parse_args_to_l2_adapters_config``, ``L1Manager``,
``SerdeL2AdapterWrapper(inner, serde, l1_manager)``); run by tests/compat/test_serde_compat.py
with either venv's python.

    python serde_fs_driver.py '[{"op": "store"|"load", "spec": ADAPTER_JSON, "out": DIR}, ...]'

runs the steps in order and prints one JSON list of results: a store writes DIR/source.bin and
gives ``{"stored": bool}``, a load writes DIR/loaded.bin and gives ``{"hits": [bool, ...]}``.

The objects are deterministic (seeded bfloat16, KV-like values), so both sides build the same
source; ``*.bin`` hold each object's bytes in key order.

0.5.6's ``turboquant`` serde runs Triton kernels on CUDA only. With ``TRITON_INTERPRET=1``
(tests/compat/test_turboquant_compat.py sets it for 0.5.6's side) this driver runs them on
the CPU through Triton's interpreter: ``cpu_shim_for_056_turboquant`` makes 0.5.6's device
choice answer "cpu" and its fp8 format e4m3 (``float8e4nv``, what 0.5.6 uses on SM89+ GPUs).
A test-harness shim only; nothing of it is in our package.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
from lmcache.v1.distributed.l1_manager import L1Manager
from lmcache.v1.distributed.l2_adapters import config as l2_config
from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper
from lmcache.v1.distributed.serde import create_serde_processor

try:
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter as create_adapter
except ImportError:  # ours: the registry call
    from lmcache.v1.distributed.l2_adapters.config import (  # type: ignore[no-redef]
        create_l2_adapter_from_registry as create_adapter,
    )

N = 4
LAYOUT = MemoryLayoutDesc([torch.Size([2, 4, 16, 64])], [torch.bfloat16])  # 16 KiB objects
SALTS = ["", "tenant-a", "tenant-b", ""]


def keys() -> list[ObjectKey]:
    return [
        ObjectKey(
            chunk_hash=bytes([i]) * 8 + b"serde-compat",
            model_name="compat-model",
            kv_rank=0,
            cache_salt=SALTS[i],
        )
        for i in range(N)
    ]


def source() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randn(LAYOUT.shapes[0], generator=gen).to(torch.bfloat16) for _ in range(N)]


def cpu_shim_for_056_turboquant() -> None:
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from lmcache.v1.distributed.serde.turboquant import decode_kernel, turboquant
    except ImportError:  # ours: a module, not 0.5.6's package of kernels
        return
    turboquant._select_cuda_device = lambda *args: torch.device("cpu")
    decode_kernel._FP8_E4B15[0] = 0


def build(spec: str):
    cfg = l2_config.parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[spec]))
    acfg = cfg.adapters[0]
    mem = L1MemoryManagerConfig(size_in_bytes=64 << 20, use_lazy=False, align_bytes=4096)
    try:
        l1 = L1Manager(L1ManagerConfig(memory_config=mem))
    except TypeError:
        mem.shm_name = ""
        l1 = L1Manager(L1ManagerConfig(memory_config=mem))
    inner = create_adapter(acfg, l1.get_l1_memory_desc())
    return l1, SerdeL2AdapterWrapper(inner, create_serde_processor(acfg.serde_config), l1)


def wait(poll):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = poll()
        if r is not None:
            return r
        time.sleep(0.01)
    raise TimeoutError("L2 task did not finish in 60 s")


def objects(l1, ks, tag: str):
    res = l1.reserve_write(ks, [False] * len(ks), LAYOUT, tag)
    return [res[k][1] for k in ks]


def step(op: str, spec: str, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    l1, w = build(spec)
    ks = keys()
    try:
        if op == "store":
            objs = objects(l1, ks, "store")
            for o, t in zip(objs, source(), strict=True):
                o.tensor.copy_(t)
            (out / "source.bin").write_bytes(b"".join(bytes(o.byte_array) for o in objs))
            tid = w.submit_store_task(ks, objs)
            result = wait(lambda: w.pop_completed_store_tasks().get(tid))
            ok = result.is_successful() if hasattr(result, "is_successful") else bool(result)
            return {"stored": bool(ok)}
        objs = objects(l1, ks, "load")
        for o in objs:
            o.tensor.fill_(0)
        tid = w.submit_load_task(ks, objs)
        bm = wait(lambda: w.query_load_result(tid))
        (out / "loaded.bin").write_bytes(b"".join(bytes(o.byte_array) for o in objs))
        return {"hits": [bool(bm.test(i)) for i in range(N)]}
    finally:
        w.close()
        if hasattr(l1, "close"):
            l1.close()


def main() -> int:
    steps = json.loads(sys.argv[1])
    cpu_shim_for_056_turboquant()
    results = [step(s["op"], json.dumps(s["spec"]), Path(s["out"])) for s in steps]
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
