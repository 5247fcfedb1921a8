"""``lmcache bench server``: an engine simulator that measures a running ``lmcache server``.

It registers one worker with a paged KV cache shaped by ``--kvcache-shape-spec``
(``'(2,NB,BS,NH,HS):dtype:num_layers'``, vLLM NHD), then per request size runs, for
``--iterations`` fresh prompts: a cold lookup (miss), a cold store, a warm lookup (hit)
and a warm retrieve into blocks that were cleared first; every retrieved byte is
compared with what was stored. Each warm lookup follows a store of the whole request, so
it runs with caches the copy just flushed. ``cached_lookup`` then looks the last stored
prompt up ``--lookup-repeats`` times back to back, each as a new request (fresh session:
the server hashes the tokens), as a scheduler does for a batch of arriving requests.
Reports p50/p99 latency and GB/s per op as JSON (``metrics.results`` per size, plus
``cold_store``, ``warm_retrieve``, ``cold_lookup``, ``warm_lookup``, ``cached_lookup``
summaries of the first size with ``_p50_ms``/``_p99_ms``/``_gbps``).

``--baselines`` adds, for comparison, the RPC ``noop`` round trip; two bare pyzmq REQ/REP
round trips (``bare_zmq_req_rep``: both ends in this process, sharing one ZeroMQ I/O thread;
``bare_zmq_req_rep_two_processes``: the echo in a process of its own, the topology of the
RPC); and a 64 MiB copy (``memcpy_64MiB``: torch ``copy_``, which may use several threads;
``memcpy_64MiB_one_thread``: one libc ``memcpy``). Accepts LMCache 0.5.6's flags (``--rpc-url --mode
--transfer-mode --kvcache-shape-spec --num-tokens --start --end --interval --url --format
--output``).
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from lmcache.cli.errors import CLIError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "server",
        help="benchmark a running lmcache server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--rpc-url", default="tcp://localhost:5555", help="server RPC URL")
    p.add_argument("--url", default=None, help="server HTTP URL (optional; used for /status)")
    p.add_argument("--mode", default="cpu", choices=("cpu",), help="KV cache device (cpu)")
    p.add_argument(
        "--transfer-mode",
        default="engine_driven",
        choices=("engine_driven", "lmcache_driven", "auto"),
    )
    p.add_argument(
        "--kvcache-shape-spec",
        default="(2,1024,16,8,128):float16:32",
        help="'(2,NB,BS,NH,HS):dtype:num_layers' per-layer NHD KV shape",
    )
    p.add_argument("--num-tokens", type=int, default=512, help="tokens per request")
    p.add_argument("--start", type=int, default=None, help="sweep: first request size (tokens)")
    p.add_argument("--end", type=int, default=None, help="sweep: last request size (tokens)")
    p.add_argument("--interval", type=int, default=None, help="sweep: step (tokens)")
    p.add_argument("--iterations", type=int, default=20, help="requests per size (default 20)")
    p.add_argument(
        "--lookup-repeats",
        type=int,
        default=100,
        help="back-to-back lookups of a cached prompt per size (cached_lookup; default 100)",
    )
    p.add_argument("--model-name", default="bench-model")
    p.add_argument(
        "--baselines", action="store_true", help="also measure noop RTT, bare zmq and memcpy"
    )
    p.add_argument("--format", default="json", choices=("json", "text"))
    p.add_argument("--output", default=None, help="write the JSON here (default stdout)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def parse_shape_spec(spec: str) -> tuple[tuple[int, ...], Any, int]:
    import torch

    try:
        shape_s, dtype_s, layers_s = spec.rsplit(":", 2)
        shape = tuple(int(x) for x in ast.literal_eval(shape_s))
        dtype = getattr(torch, dtype_s)
        layers = int(layers_s)
    except Exception:
        raise CLIError(
            f"--kvcache-shape-spec {spec!r} is malformed; use '(2,NB,BS,NH,HS):float16:NUM_LAYERS'"
        ) from None
    if len(shape) != 5 or shape[0] != 2 or not isinstance(dtype, torch.dtype) or layers < 1:
        raise CLIError(
            f"--kvcache-shape-spec {spec!r}: need a 5-dim (2,NB,BS,NH,HS) shape, a torch dtype and layers >= 1"
        )
    return shape, dtype, layers


def _stats(samples: list[float], nbytes: int) -> dict[str, float]:
    s = sorted(samples)
    p50 = statistics.median(s)
    p99 = s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]
    out = {"p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "mean_ms": statistics.fmean(s) * 1e3}
    if nbytes:
        out["gbps"] = nbytes / p50 / 1e9 if p50 > 0 else 0.0
    return out


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled and sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            n = int(30 * self.done / self.total)
            sys.stderr.write(f"\r[{'#' * n}{'.' * (30 - n)}] {self.done}/{self.total} {label:<24}")
            sys.stderr.flush()
            if self.done == self.total:
                sys.stderr.write("\n")


def prepare_process(argv: Sequence[str]) -> None:
    """Process settings that must precede torch (``lmcache.cli.main`` calls this before it
    builds the flags, which loads torch; libgomp reads its settings once, when it loads).

    With ``--transfer-mode lmcache_driven`` the server copies this process's KV while it
    waits for the reply. After each parallel region (the simulator's ``zero_`` and compares)
    libgomp keeps its threads spinning for a while, and on a small host they take the cores
    the server's copy needs: stores and retrieves came out 15-30% slower on 2 cores. An
    engine's threads compute or sleep meanwhile, so the simulator's threads sleep too
    (``OMP_WAIT_POLICY=PASSIVE``, unless set). In engine_driven mode the simulator copies
    itself, with OpenMP's defaults, as an engine would."""
    # argparse reads the flag as the full parser will (also "--transfer-mode=x", "--transfer x")
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--transfer-mode")
    mode = peek.parse_known_args(list(argv))[0].transfer_mode
    if mode == "lmcache_driven":
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def run(args: argparse.Namespace) -> int:
    import torch

    from lmcache.v1.multiprocess import protocol as P
    from lmcache.v1.multiprocess.client import LMCacheTimeoutError, MPClient
    from lmcache.v1.multiprocess.transfer_context import create_transfer_context

    shape, dtype, layers = parse_shape_spec(args.kvcache_shape_spec)
    _, nb, bs, nh, hs = shape
    if args.start is not None or args.end is not None:
        start = args.start or args.num_tokens
        end = args.end or start
        step = args.interval or start
        sizes = list(range(start, end + 1, step))
    else:
        sizes = [args.num_tokens]
    if args.iterations < 1:
        raise CLIError(f"--iterations must be >= 1 (got {args.iterations})")
    if args.lookup_repeats < 1:
        raise CLIError(f"--lookup-repeats must be >= 1 (got {args.lookup_repeats})")
    client = MPClient(args.rpc_url, default_timeout=60)
    try:
        try:
            chunk = client.get_chunk_size(timeout=10)
        except LMCacheTimeoutError:
            raise CLIError(
                f"no lmcache server answers at {args.rpc_url}; start one with `lmcache server`", 1
            ) from None
        sizes = [s - s % chunk for s in sizes if s >= chunk]
        if not sizes:
            raise CLIError(f"every request size is below the server chunk size {chunk}")
        blocks_needed = max(sizes) // bs
        if blocks_needed * 2 > nb:
            raise CLIError(
                f"the KV cache has {nb} blocks; {max(sizes)} tokens need {2 * blocks_needed} (source + destination)"
            )
        kv = [torch.randn(shape).to(dtype) for _ in range(layers)]
        instance_id = random.getrandbits(62)
        ctx = create_transfer_context(
            kv, instance_id=instance_id, req_client=client, mode=args.transfer_mode
        )
        ctx.register(args.model_name, 1)
        prog = _Progress(len(sizes) * args.iterations, not args.no_progress)
        results = []
        for n_tok in sizes:
            res = _bench_size(client, ctx, kv, n_tok, chunk, bs, args, P, prog)
            results.append(res)
        try:
            ctx.unregister()
        finally:
            ctx.close()
        summary: dict[str, Any] = {"results": results}
        first = results[0]
        for op in ("cold_store", "warm_retrieve", "cold_lookup", "warm_lookup", "cached_lookup"):
            for k, v in first[op].items():
                summary[f"{op}_{k}"] = v
            summary[op] = first[op]
        if args.baselines:
            summary["baselines"] = _baselines(client)
        out = {
            "benchmark": "lmcache bench server",
            "config": {
                "rpc_url": args.rpc_url,
                "mode": args.mode,
                "transfer_mode": args.transfer_mode,
                "context_mode": ctx.mode,
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
                "client_spin": client.spin.stats(),
                "kvcache_shape_spec": args.kvcache_shape_spec,
                "chunk_size": chunk,
                "iterations": args.iterations,
                "sizes": sizes,
            },
            "metrics": summary,
        }
    finally:
        client.close()
    text = json.dumps(out, indent=2) if args.format == "json" else _text(out)
    if args.output:
        with open(args.output, "w") as f:
            f.write(json.dumps(out, indent=2))
    print(text)
    ok = all(r["verified"] for r in results)
    return 0 if ok else 1


def _bench_size(client, ctx, kv, n_tok, chunk, bs, args, P, prog) -> dict[str, Any]:
    import torch

    bpt = n_tok // bs
    src_ids = list(range(1, 1 + bpt))
    dst_ids = list(range(1 + bpt, 1 + 2 * bpt))
    nbytes = sum(t[:, :bpt].numel() * t.element_size() for t in kv)
    t_cold_lookup, t_store, t_warm_lookup, t_retrieve = [], [], [], []
    verified = True
    rng = random.Random()  # fresh prompts every run: nothing may already be cached

    def lookup(tokens, rid) -> tuple[int, float]:
        k = P.IPCCacheServerKey(
            model_name=args.model_name,
            world_size=1,
            worker_id=None,
            token_ids=tokens,
            start=0,
            end=len(tokens),
            request_id=rid,
            num_kv_readers=1,
        )
        t0 = time.perf_counter()
        hit = client.lookup_hits(k, 30.0)
        return int(hit or 0), time.perf_counter() - t0

    for it in range(args.iterations):
        tokens = [rng.randrange(1, 1 << 31) for _ in range(n_tok)]
        rid = f"bench-{n_tok}-{it}-{random.getrandbits(32)}"
        hit, dt = lookup(tokens, rid + "-cold")
        t_cold_lookup.append(dt)
        client.call("end_session", rid + "-cold")
        key = P.IPCCacheServerKey(
            model_name=args.model_name,
            world_size=1,
            worker_id=0,
            token_ids=tokens,
            start=0,
            end=n_tok,
            request_id=rid,
            num_kv_readers=1,
        )
        t0 = time.perf_counter()
        stored = ctx.submit_store(key, src_ids).result(60)
        t_store.append(time.perf_counter() - t0)
        hit, dt = lookup(tokens, rid)
        t_warm_lookup.append(dt)
        for t in kv:
            t[:, dst_ids[0] : dst_ids[-1] + 1].zero_()
        t0 = time.perf_counter()
        ok = ctx.submit_retrieve(key, dst_ids).result(60)
        t_retrieve.append(time.perf_counter() - t0)
        same = all(
            torch.equal(t[:, src_ids[0] : src_ids[-1] + 1], t[:, dst_ids[0] : dst_ids[-1] + 1])
            for t in kv
        )
        verified = verified and bool(stored) and hit * chunk == n_tok and bool(ok) and same
        client.call("end_session", rid)
        prog.step(f"{n_tok} tokens")
    t_cached_lookup = []
    for i in range(args.lookup_repeats):
        rid = f"bench-{n_tok}-cached-{i}-{random.getrandbits(32)}"
        hit, dt = lookup(tokens, rid)
        t_cached_lookup.append(dt)
        client.call("end_session", rid)
        verified = verified and hit * chunk == n_tok
    return {
        "num_tokens": n_tok,
        "bytes_per_request": nbytes,
        "verified": verified,
        "cold_lookup": _stats(t_cold_lookup, 0),
        "cold_store": _stats(t_store, nbytes),
        "warm_lookup": _stats(t_warm_lookup, 0),
        "warm_retrieve": _stats(t_retrieve, nbytes),
        "cached_lookup": _stats(t_cached_lookup, 0),
    }


# A REP echo in a process of its own: the same topology as the RPC (client and server are
# separate processes, each with its own ZeroMQ I/O thread).
_ECHO_CHILD = """
import sys, zmq
rep = zmq.Context.instance().socket(zmq.REP)
print(rep.bind_to_random_port("tcp://127.0.0.1"), flush=True)
while True:
    msg = rep.recv()
    if msg == b"stop":
        rep.send(b"")
        break
    rep.send(msg)
"""


def _bare_round_trips(req: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        req.send(b"x")
        req.recv()
        out.append(time.perf_counter() - t0)
    return out


def _baselines(client) -> dict[str, Any]:
    import subprocess

    import torch
    import zmq

    ctx = zmq.Context.instance()
    rep = ctx.socket(zmq.REP)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def echo() -> None:
        while not stop.is_set():
            if rep.poll(100):
                rep.send(rep.recv())

    th = threading.Thread(target=echo, daemon=True)
    th.start()
    req = ctx.socket(zmq.REQ)
    req.connect(f"tcp://127.0.0.1:{port}")
    child = subprocess.Popen([sys.executable, "-c", _ECHO_CHILD], stdout=subprocess.PIPE, text=True)
    req_x = ctx.socket(zmq.REQ)
    req_x.setsockopt(zmq.RCVTIMEO, 10000)
    try:
        assert child.stdout is not None
        req_x.connect(f"tcp://127.0.0.1:{int(child.stdout.readline())}")
        rtts, zrtts, xrtts = [], [], []
        # Blocks of the three alternate, so a host whose speed drifts weighs on all alike.
        for _ in range(10):
            for _ in range(50):
                t0 = time.perf_counter()
                client.noop()
                rtts.append(time.perf_counter() - t0)
            zrtts += _bare_round_trips(req, 50)
            xrtts += _bare_round_trips(req_x, 50)
        req_x.send(b"stop")
        req_x.recv()
    finally:
        req_x.close(0)
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        stop.set()
        th.join()
        req.close(0)
        rep.close(0)
    a = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    b = torch.empty_like(a)
    mts, one_thread = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        b.copy_(a)  # torch may split it across its intra-op threads
        mts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ctypes.memmove(b.data_ptr(), a.data_ptr(), a.numel())  # one libc memcpy
        one_thread.append(time.perf_counter() - t0)
    return {
        "rpc_noop": _stats(rtts, 0),
        "bare_zmq_req_rep": _stats(zrtts, 0),
        "bare_zmq_req_rep_two_processes": _stats(xrtts, 0),
        "memcpy_64MiB": _stats(mts, 64 << 20),
        "memcpy_64MiB_one_thread": _stats(one_thread, 64 << 20),
    }


def _text(out: dict[str, Any]) -> str:
    lines = []
    for r in out["metrics"]["results"]:
        lines.append(
            f"{r['num_tokens']} tokens ({r['bytes_per_request'] / 2**20:.1f} MiB) verified={r['verified']}"
        )
        for op in ("cold_lookup", "cold_store", "warm_lookup", "warm_retrieve", "cached_lookup"):
            s = r[op]
            extra = f" {s['gbps']:.2f} GB/s" if "gbps" in s else ""
            lines.append(f"  {op:<14} p50 {s['p50_ms']:.3f} ms  p99 {s['p99_ms']:.3f} ms{extra}")
    return "\n".join(lines)
