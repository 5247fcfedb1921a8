"""GPU checks of lmcache-cuda, run by run_gpu_checks.sh (needs a CUDA GPU).

1. kernels: native multi_layer_block_kv_transfer vs the torch baseline, bit for bit, on
   formats #1 #2 #3 #6 (D2H + H2D, skip and partial chunks, pinned-host and device chunks,
   bf16/fp16/fp8-as-uint8), pointer-mode lmcache_memcpy_async, tensor_from_ptr.
2. lmcache_driven: a second process (the "server") opens the worker's KV tensors through
   the ``cuda`` wire descriptor, waits on the worker's exported event, stores (D2H) and later
   retrieves (H2D) through GPUCacheContext and the native kernels; the worker checks bytes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
import traceback

import torch

from lmcache.v1.platform import torch_ops
from lmcache.v1.platform.ops_types import PageBufferShapeDesc, TransferDirection

D2H, H2D = TransferDirection.D2H, TransferDirection.H2D
NL, NB, BS, NH, HS = 4, 64, 16, 8, 128
T = 64  # 4 blocks per chunk


def _native_ops():
    from lmcache.devices.cuda.device_ops import CudaDeviceOps

    ops = CudaDeviceOps()
    ops.ensure_native()
    if ops.kv_transfer_operands != "pointer":
        raise RuntimeError("lmcache.devices.cuda.cuda_ops did not bind: the extension is missing")
    return ops


def _layers(fmt, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = {
        1: (2, NB, BS, NH, HS),
        2: (NB, 2, BS, NH, HS),
        3: (NB, BS, HS),
        6: (2, NB, NH, BS, HS),
    }[fmt]
    raw = torch.randint(0, 256, (NL, *shape), generator=g, device="cuda", dtype=torch.uint8)
    if dtype == torch.uint8:
        return list(raw.unbind(0))
    # random bit patterns of the right width (NaNs included: comparisons are bitwise)
    wide = torch.randint(
        -(2**15), 2**15, (NL, *shape), generator=g, device="cuda", dtype=torch.int16
    )
    return [t.view(dtype).clone() for t in wide.unbind(0)]


def _desc(fmt, dtype):
    mla = fmt == 3
    return PageBufferShapeDesc(
        kv_size=1 if mla else 2,
        nl=NL,
        nb=NB,
        bs=BS,
        nh=1 if mla else NH,
        hs=HS,
        element_size=dtype.itemsize,
        dtype=dtype,
    )


def _chunks(fmt, dtype, n, where):
    shape = (NL, T, HS) if fmt == 3 else (2, NL, T, NH * HS)
    if where == "pinned":
        out = [torch.empty(shape, dtype=dtype, pin_memory=True) for _ in range(n)]
    else:
        out = [torch.empty(shape, dtype=dtype, device="cuda") for _ in range(n)]
    for c in out:
        c.view(torch.uint8).fill_(0xA5)
    return out


def _bits(t):
    return t.contiguous().view(torch.uint8).cpu()


def check_kernels(results):
    ops = _native_ops()
    cases = 0
    for fmt in (1, 2, 3, 6):
        for dtype in (torch.bfloat16, torch.float16, torch.uint8):
            for ids_n, skip in ((NB // 2, 0), (NB // 2 - 3, 5), (10, 9), (8, 8)):
                for where in ("pinned", "device"):
                    layers = _layers(fmt, dtype, seed=fmt * 100 + ids_n)
                    sd = _desc(fmt, dtype)
                    perm = torch.randperm(NB, device="cuda")[:ids_n]
                    n_objs = -(-ids_n // (T // BS))
                    want = _chunks(fmt, dtype, n_objs, where)
                    torch_ops.multi_layer_block_kv_transfer(
                        layers, want, perm, "cuda:0", D2H, sd, T, fmt, skip
                    )
                    got = _chunks(fmt, dtype, n_objs, where)
                    ptrs = torch.tensor(
                        [t.data_ptr() for t in layers], dtype=torch.int64, device="cuda"
                    )
                    objs = [c.data_ptr() for c in got]
                    ops.multi_layer_block_kv_transfer(
                        ptrs, objs, perm, "cuda:0", D2H, sd, T, fmt, skip
                    )
                    torch.cuda.synchronize()
                    for a, b in zip(got, want, strict=True):
                        if not torch.equal(_bits(a), _bits(b)):
                            raise AssertionError(
                                f"D2H differs: fmt #{fmt} {dtype} skip={skip} {where}"
                            )
                    # H2D: both paths into zeroed copies, then compare engine bytes
                    base = [torch.zeros_like(t) for t in layers]
                    nat = [torch.zeros_like(t) for t in layers]
                    torch_ops.multi_layer_block_kv_transfer(
                        base, want, perm, "cuda:0", H2D, sd, T, fmt, skip
                    )
                    nptrs = torch.tensor(
                        [t.data_ptr() for t in nat], dtype=torch.int64, device="cuda"
                    )
                    ops.multi_layer_block_kv_transfer(
                        nptrs, [c.data_ptr() for c in want], perm, "cuda:0", H2D, sd, T, fmt, skip
                    )
                    torch.cuda.synchronize()
                    for a, b in zip(nat, base, strict=True):
                        if not torch.equal(_bits(a), _bits(b)):
                            raise AssertionError(
                                f"H2D differs: fmt #{fmt} {dtype} skip={skip} {where}"
                            )
                    cases += 1
    # tensor operands on the GPU take the same kernels
    layers = _layers(1, torch.bfloat16, 7)
    got, want = _chunks(1, torch.bfloat16, 2, "device"), _chunks(1, torch.bfloat16, 2, "device")
    ids = list(range(3, 11))
    ops.multi_layer_block_kv_transfer(
        layers, got, ids, "cuda:0", D2H, _desc(1, torch.bfloat16), T, 1, 2
    )
    torch_ops.multi_layer_block_kv_transfer(
        layers, want, ids, "cuda:0", D2H, _desc(1, torch.bfloat16), T, 1, 2
    )
    torch.cuda.synchronize()
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, want, strict=True)), (
        "tensor operands"
    )
    results["kernel_cases"] = cases + 1

    # pointer-mode memcpy, split at a small alignment so several pieces are issued
    host = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8).pin_memory()
    dev = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    ops.lmcache_memcpy_async(dev.data_ptr(), host.data_ptr() + 100, 300_000, H2D, 100, 1 << 16)
    back = torch.zeros(1 << 20, dtype=torch.uint8).pin_memory()
    ops.lmcache_memcpy_async(back.data_ptr(), dev.data_ptr(), 300_000, D2H, 0, 1 << 16)
    torch.cuda.synchronize()
    assert torch.equal(back[:300_000], host[100:300_100]), "lmcache_memcpy_async round trip"
    # tensor_from_ptr: a zero-copy view (bf16 through the int16 view)
    src = torch.randn(64, device="cuda").to(torch.bfloat16)
    view = ops.tensor_from_ptr(src.data_ptr(), (8, 8), torch.bfloat16, src.device)
    assert torch.equal(view.view(-1), src) and view.data_ptr() == src.data_ptr()
    results["memcpy_and_tensor_from_ptr"] = "ok"


# ---- two-process LMCache-driven round trip ---------------------------------------------------
def _server(conn):
    try:
        from lmcache.v1.platform.base.event_ipc import DefaultEventIPCBackend
        from lmcache.v1.platform.base.ipc_wire import decode_wrapper, register_wire_wrapper
        from lmcache.v1.platform.cuda_family.cache_context import GPUCacheContext
        from lmcache.v1.platform.cuda_family.ipc_wrapper import CudaIPCWrapper

        register_wire_wrapper(CudaIPCWrapper)
        bodies, event_handle, ids, skip = conn.recv()
        wrappers = [decode_wrapper(b) for b in bodies]
        ctx = GPUCacheContext(wrappers, T)
        kg = ctx.kernel_groups[0]
        ptrs, sd, fmt = (
            ctx.get_kernel_group_kv_pointers(kg),
            ctx.get_shape_desc(kg),
            ctx.get_engine_kv_format(kg),
        )
        ops = _native_ops()
        events = DefaultEventIPCBackend(event_module=torch.cuda, device_type="cuda")
        ev = events.import_event(event_handle, ctx.device)
        n_objs = -(-len(ids) // (T // BS))
        chunks = [
            torch.zeros(2, NL, T, NH * HS, dtype=torch.bfloat16, pin_memory=True)
            for _ in range(n_objs)
        ]
        with torch.cuda.stream(ctx.stream):
            events.wait_event(ev, ctx.stream)  # stream-side wait for the worker's writes
            ops.multi_layer_block_kv_transfer(
                ptrs, [c.data_ptr() for c in chunks], ids, ctx.device, D2H, sd, T, fmt, 0
            )
        ctx.stream.synchronize()
        conn.send([c.clone() for c in chunks])
        assert conn.recv() == "zeroed"
        with torch.cuda.stream(ctx.stream):
            ops.multi_layer_block_kv_transfer(
                ptrs, [c.data_ptr() for c in chunks], ids, ctx.device, H2D, sd, T, fmt, skip
            )
        ctx.stream.synchronize()
        conn.send("retrieved")
        ctx.close()
    except Exception:
        conn.send("ERROR " + traceback.format_exc())


def check_two_process(results):
    from lmcache.v1.platform.base.event_ipc import DefaultEventIPCBackend
    from lmcache.v1.platform.base.ipc_wire import encode_wrapper, register_wire_wrapper
    from lmcache.v1.platform.cuda_family.ipc_wrapper import CudaIPCWrapper

    register_wire_wrapper(CudaIPCWrapper)
    layers = _layers(1, torch.bfloat16, 11)
    original = [t.clone() for t in layers]
    bodies = [bytes(encode_wrapper(CudaIPCWrapper.wrap(t)).data) for t in layers]
    events = DefaultEventIPCBackend(event_module=torch.cuda, device_type="cuda")
    ev = events.create_event("cuda:0")
    events.record_event(ev, torch.cuda.current_stream())
    handle = events.export_event(ev, "cuda:0")
    ids, skip = [5, 9, 2, 40, 41, 7, 13], 2
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_server, args=(child,))
    proc.start()
    try:
        parent.send((bodies, handle, ids, skip))
        reply = parent.recv()
        if isinstance(reply, str):
            raise AssertionError(reply)
        want = [torch.zeros(2, NL, T, NH * HS, dtype=torch.bfloat16) for _ in reply]
        torch_ops.multi_layer_block_kv_transfer(
            [t.cpu() for t in original], want, ids, "cpu", D2H, _desc(1, torch.bfloat16), T, 1, 0
        )
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(reply, want, strict=True)), (
            "store bytes"
        )
        for t in layers:
            t.zero_()
        torch.cuda.synchronize()
        parent.send("zeroed")
        done = parent.recv()
        assert done == "retrieved", done
        torch.cuda.synchronize()
        restored, untouched = ids[skip:], set(range(NB)) - set(ids[skip:])
        for t, o in zip(layers, original, strict=True):
            assert torch.equal(_bits(t[:, restored]), _bits(o[:, restored])), "retrieve bytes"
            assert not t[:, sorted(untouched)].view(torch.uint8).any(), (
                "retrieve wrote skipped blocks"
            )
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    results["two_process_lmcache_driven"] = "ok"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    failed = False
    for name, fn in (("kernels", check_kernels), ("two_process", check_two_process)):
        start = time.time()
        try:
            fn(results)
            results[f"{name}_status"] = "passed"
        except Exception:
            failed = True
            results[f"{name}_status"] = "FAILED"
            results[f"{name}_error"] = traceback.format_exc()
        results[f"{name}_seconds"] = round(time.time() - start, 2)
        print(f"{name}: {results[f'{name}_status']} ({results[f'{name}_seconds']} s)", flush=True)
        if results.get(f"{name}_error"):
            print(results[f"{name}_error"], file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    print(json.dumps({k: v for k, v in results.items() if not k.endswith("_error")}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
