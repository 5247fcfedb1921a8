"""An engine worker process for the end-to-end tests (run as a script, not collected).

store:    fill a paged KV cache deterministically from --seed, store the prompt's blocks.
retrieve: retrieve the prompt into a zeroed cache at other (shuffled) block ids and exit 0
          only when every retrieved byte equals what the storing engine had. With
          ``--lookup-readers N`` this process first plays the engine's scheduler: it looks the
          prompt up (taking N read shares per key), waits for the result and reports it as
          ``hit`` (chunks).
``--fake-device NAME`` runs the worker with a fake accelerator ``torch.NAME`` installed
(lmcache.v1.platform.testing); its KV tensors stay on CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch

from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.client import MPClient
from lmcache.v1.multiprocess.transfer_context import create_transfer_context

NUM_BLOCKS, BLOCK, LAYERS, HEADS, HEAD_SIZE = 160, 16, 3, 2, 16


def kv_cache(layout: str, seed: int, zeros: bool) -> list[torch.Tensor]:
    if layout == "MLA":
        shape = (NUM_BLOCKS, BLOCK, HEAD_SIZE)
    elif layout == "HND":
        shape = (2, NUM_BLOCKS, HEADS, BLOCK, HEAD_SIZE)
    else:
        shape = (2, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE)
    g = torch.Generator().manual_seed(seed)
    return [
        torch.zeros(shape, dtype=torch.bfloat16)
        if zeros
        else torch.randn(shape, generator=g).bfloat16()
        for _ in range(LAYERS)
    ]


def block_of(t: torch.Tensor, layout: str, b: int) -> torch.Tensor:
    return t[b] if layout == "MLA" else t[:, b]


def scheduler_lookup(client: MPClient, key: P.IPCCacheServerKey, readers: int) -> int:
    """The scheduler's part: lookup (locks the prefix), then wait for the hit count."""
    lookup_key = P.IPCCacheServerKey(
        model_name=key.model_name,
        world_size=key.world_size,
        worker_id=None,
        token_ids=key.token_ids,
        start=key.start,
        end=key.end,
        request_id=key.request_id,
        num_kv_readers=readers,
    )
    client.call("lookup", lookup_key, key.world_size)
    return client.call("wait_prefetch_status", key.request_id, 30.0)


def fake_device(name: str):
    """A fake accelerator ``torch.<name>`` and a minimal device spec for it."""
    import contextlib

    from lmcache.v1.platform.base.device_spec import DeviceSpec
    from lmcache.v1.platform.testing import extra_device_specs, install_fake_device

    class FakeAccelerator(DeviceSpec):
        @property
        def device_type(self) -> str:
            return name

        @property
        def torch_module_name(self) -> str:
            return name

        def is_available(self) -> bool:
            return True

    stack = contextlib.ExitStack()
    stack.enter_context(install_fake_device(name))
    stack.enter_context(extra_device_specs(FakeAccelerator()))
    return stack


def run_one(a: argparse.Namespace, layout: str) -> dict:
    tokens = list(range(10, 10 + a.num_tokens))
    n_blocks = a.num_tokens // BLOCK
    src_ids = list(range(1, 1 + n_blocks))
    dst_ids = list(range(1 + n_blocks, 1 + 2 * n_blocks))
    random.Random(a.seed).shuffle(dst_ids)
    hints = {"kv_layout": "HND"} if layout == "HND" else {}
    model = f"{a.model}-{layout}"
    client = MPClient(a.url, default_timeout=30)
    kv = kv_cache(layout, a.seed, zeros=a.role == "retrieve")
    ctx = create_transfer_context(
        kv, instance_id=random.getrandbits(60), req_client=client, mode=a.mode, layout_hints=hints
    )
    ctx.register(model, a.world_size)
    key = P.IPCCacheServerKey(
        model_name=model,
        world_size=a.world_size,
        worker_id=a.worker_id,
        token_ids=tokens,
        start=0,
        end=a.num_tokens,
        request_id=f"{a.request_id}-{layout}",
        num_kv_readers=1,
    )
    try:
        hit = None
        if a.role == "retrieve" and a.lookup_readers:
            hit = scheduler_lookup(client, key, a.lookup_readers)
        if a.role == "store":
            ok = ctx.submit_store(key, src_ids).result(60)
            return {"layout": layout, "stored": bool(ok), "mode": ctx.mode}
        ok = ctx.submit_retrieve(key, dst_ids).result(60)
        expected = kv_cache(layout, a.seed, zeros=False)
        same = all(
            torch.equal(block_of(e, layout, s), block_of(t, layout, d))
            for e, t in zip(expected, kv, strict=True)
            for s, d in zip(src_ids, dst_ids, strict=True)
        )
        untouched = all(int(block_of(t, layout, 0).float().abs().sum()) == 0 for t in kv)
        return {
            "layout": layout,
            "hit": hit,
            "retrieved": bool(ok),
            "identical": same,
            "untouched": untouched,
            "mode": ctx.mode,
        }
    finally:
        ctx.unregister()
        ctx.close()
        client.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=("store", "retrieve"))
    ap.add_argument("--url", required=True)
    ap.add_argument("--layouts", default="NHD", help="comma-separated: NHD,HND,MLA")
    ap.add_argument("--mode", default="engine_driven")
    ap.add_argument(
        "--model", default="e2e-model", help="model name prefix (the layout is appended)"
    )
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--worker-id", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-id", default="req", help="prefix (the layout is appended)")
    ap.add_argument("--num-tokens", type=int, default=1024)
    ap.add_argument(
        "--lookup-readers", type=int, default=0, help="retrieve: look up first (0: do not)"
    )
    ap.add_argument("--fake-device", default="", help="install a fake accelerator of this name")
    a = ap.parse_args()
    if a.fake_device:
        from lmcache.v1.platform import default_device_registry

        with fake_device(a.fake_device):
            device = default_device_registry().current_device_spec().device_type
            results = [dict(run_one(a, layout), device=device) for layout in a.layouts.split(",")]
    else:
        results = [run_one(a, layout) for layout in a.layouts.split(",")]
    print(json.dumps(results))
    ok = all(
        r.get("stored", True)
        and r.get("retrieved", True)
        and r.get("identical", True)
        and r.get("untouched", True)
        for r in results
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
