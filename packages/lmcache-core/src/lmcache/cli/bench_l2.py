"""``lmcache bench l2``: drive one or more L2 adapters directly and report the results.

    lmcache bench l2 --l2-adapter '{"type":"mock","max_size_gb":4,"mock_bandwidth_gb":10}' \\
        --num-keys 32 --data-size-kb 256 --in-flight 4 --rounds 3 [--format json]

Each round submits ``--in-flight`` tasks of ``--num-keys`` keys at once (fresh keys per round)
with buffers carved from one arena, waits on the adapter's event fds and records every task's
duration and the round's wall time. ``--l2-adapter`` is repeatable (each adapter is benchmarked
on its own) and falls back to the env var ``L2_ADAPTER_JSON``. A ``serde`` block in the
adapter JSON wraps the adapter in that serde, as the server's storage manager does; an
unknown serde type is an error naming the registered ones (exit 2). With a serde the objects
hold bfloat16 values (normal, std 1: KV-like, so ``fp8`` has something to quantize) shaped
``[2, layers, tokens <= 16, 128]`` (flat if the size is not a multiple of 512 bytes), the load
check compares with the serde's own round trip of each object (exact for lossless serdes),
and ``results.serde`` (in ``metrics.l2`` of ``--format json``; a ``Serde`` section in the
terminal report) has its cost measured on the same objects on one thread: encode and decode
GB/s of object bytes and the compression ratio (object bytes / stored bytes).

The report is LMCache 0.5.6's (``lmcache.cli.report``; ``--format terminal`` by default,
``--format json``, ``--output PATH``, ``-q``): title ``L2 Adapter Benchmark Result``, a
``config`` section and one ``op_<i>`` section per op run (store, lookup, load), with 0.5.6's
keys and per-round figures. Adapters after the first get ``adapter_<n>_config`` /
``adapter_<n>_op_<i>`` sections (0.5.6 benchmarks only the first). ``--format json`` also
carries ``metrics.l2``: our full result (``{"benchmark": "l2", "config", "adapters": [...]}``,
per adapter and op: per-task p50/p99, MB/s, latency per key, success counts, baselines,
verification), which was this command's whole output before it took 0.5.6's report.

``--baselines`` adds ``baselines.page_cache_write``: after every store round, the same bytes are
written into fresh files by plain threads (open, write, close; nothing else), in a scratch
directory beside the adapter's ``base_path`` (or a temp directory). It is the ceiling a file
backend can reach on this machine at that moment, measured interleaved with the adapter.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import select
import statistics
import sys
import time
from typing import Any

from lmcache.cli.errors import CLIError
from lmcache.cli.report import Report, add_output_args

OPS = ("store", "lookup", "load")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--l2-adapter",
        action="append",
        default=[],
        metavar="JSON",
        help="adapter spec as JSON (repeatable; default: $L2_ADAPTER_JSON)",
    )
    p.add_argument("--num-keys", type=int, default=32, help="keys per task (default 32)")
    p.add_argument("--in-flight", type=int, default=1, help="tasks submitted at once (default 1)")
    p.add_argument(
        "--data-size-kb", type=int, default=256, help="bytes per key in KiB (default 256)"
    )
    p.add_argument(
        "--l1-align-bytes",
        type=int,
        default=1,
        help="buffer alignment (4096 for O_DIRECT backends; default 1)",
    )
    p.add_argument(
        "--l1-use-hugepages",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="back the arena with hugepages (default: off)",
    )
    p.add_argument("--rounds", type=int, default=1, help="measured rounds (default 1)")
    p.add_argument("--warmup-rounds", type=int, default=1, help="unmeasured rounds (default 1)")
    p.add_argument(
        "--lookup-max-hit-rate",
        type=float,
        default=0.0,
        help="fraction of looked-up keys that exist (default 0.0: pure misses)",
    )
    p.add_argument(
        "--skip-verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="skip comparing loaded bytes with stored bytes (default: skip)",
    )
    p.add_argument(
        "--only",
        choices=OPS,
        default=None,
        help="run only this op (store runs first as setup when needed, unmeasured)",
    )
    p.add_argument(
        "--baselines",
        action="store_true",
        help="also measure plain threaded file writes of the same bytes (page-cache ceiling)",
    )
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for one task")
    p.add_argument(
        "--flamegraph",
        choices=("on", "off"),
        default="off",
        help="0.5.6's self-profiling; only 'off' is provided here (use py-spy/perf outside)",
    )
    for flag in ("--flamegraph-mode", "--flamegraph-output", "--flamegraph-scripts-dir"):
        p.add_argument(flag, default="", help=argparse.SUPPRESS)  # 0.5.6's; unused while off
    add_output_args(p)
    p.epilog = (
        "output: LMCache 0.5.6's report, in --format terminal (the default) or json;\n"
        "--output PATH writes the same form to PATH, -q prints nothing (exit code only).\n"
        "--format json has 0.5.6's keys (config, op_0, op_1, ...) and metrics.l2: this\n"
        "command's full result (per-task latencies, every adapter, baselines, verification),\n"
        "which it printed by default before it took 0.5.6's report."
    )
    p.set_defaults(func=run)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    idx = min(len(s) - 1, max(0, round(q * (len(s) - 1))))
    return s[idx]


class _Bench:
    def __init__(self, adapter: Any, args: argparse.Namespace, arena: Any) -> None:
        self.a = adapter
        self.args = args
        self.arena = arena
        self.nbytes = args.data_size_kb * 1024
        self.store_results: dict[int, Any] = {}
        # Keys differ between runs too: a persistent backend (fs, redis) would otherwise skip
        # the keys an earlier run stored and the store figures would count bytes never written.
        self.run_nonce = os.urandom(8).hex()

    def keys(self, tag: str, rnd: int, task: int):
        from lmcache.v1.distributed.api import ObjectKey

        return [
            ObjectKey(
                hashlib.blake2b(
                    f"{self.run_nonce}:{tag}:{rnd}:{task}:{i}".encode(), digest_size=16
                ).digest(),
                "lmcache-bench-l2",
                0,
            )
            for i in range(self.args.num_keys)
        ]

    def wait(self, fd: int, poll, deadline: float):
        from lmcache.v1.platform.event_notifier import consume_fd

        while True:
            res = poll()
            if res is not None:
                return res
            left = deadline - time.monotonic()
            if left <= 0:
                raise CLIError(f"an L2 task did not complete within {self.args.timeout} s")
            r, _, _ = select.select([fd], [], [], min(left, 0.5))
            if r:
                consume_fd(fd)

    def _poll_store(self, tid: int):
        def poll():
            self.store_results.update(self.a.pop_completed_store_tasks())
            return self.store_results.pop(tid, None)

        return poll

    def run_op(
        self, op: str, rnd: int, objs: list[list[Any]], stored: list[list[Any]]
    ) -> dict[str, Any]:
        n_tasks = self.args.in_flight
        deadline = time.monotonic() + self.args.timeout
        submitted = []
        t0 = time.perf_counter()
        for t in range(n_tasks):
            start = time.perf_counter()  # a task's duration includes its submit call
            if op == "store":
                keys = self.keys("k", rnd, t)
                tid = self.a.submit_store_task(keys, objs[t])
                poll, fd = self._poll_store(tid), self.a.get_store_event_fd()
            elif op == "lookup":
                hits = int(self.args.lookup_max_hit_rate * self.args.num_keys)
                keys = stored[t % len(stored)][:hits] + self.keys("miss", rnd, t)[hits:]
                tid = self.a.submit_lookup_and_lock_task(keys, None)
                fd = self.a.get_lookup_and_lock_event_fd()
                poll = functools.partial(self.a.query_lookup_and_lock_result, tid)
            else:
                keys = stored[t % len(stored)]
                tid = self.a.submit_load_task(keys, objs[t])
                fd = self.a.get_load_event_fd()
                poll = functools.partial(self.a.query_load_result, tid)
            submitted.append((t, keys, tid, fd, poll, start))
        durations, ok_keys, ok_tasks = [], 0, 0
        for _t, keys, _tid, fd, poll, start in submitted:
            res = self.wait(fd, poll, deadline)
            durations.append(time.perf_counter() - start)
            if op == "store":
                ok_tasks += int(res.is_successful())
                ok_keys += len(keys) if res.is_successful() else 0
                stored.append(keys)
            else:
                ok_keys += res.popcount()
                ok_tasks += int(res.popcount() == len(keys))
                if op == "lookup":
                    found = res.gather(keys)
                    if found:
                        self.a.submit_unlock(found)
        wall = time.perf_counter() - t0
        moved = self.nbytes * (ok_keys if op != "lookup" else 0)
        return {
            "durations": durations,
            "wall": wall,
            "bytes": moved,
            "ok_keys": ok_keys,
            "ok_tasks": ok_tasks,
            "tasks": n_tasks,
            "keys": n_tasks * self.args.num_keys,
        }


class _PageCacheBaseline:
    """Writes each round's buffers into fresh files with plain threads: what any file backend
    must at least do (create, copy into the page cache, close)."""

    def __init__(self, directory: str, threads: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.dir = directory
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bench-baseline")
        self.threads = threads
        self.count = 0

    def _write(self, name: str, view: memoryview) -> None:
        fd = os.open(os.path.join(self.dir, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        finally:
            os.close(fd)

    def run_round(self, groups: list[list[Any]]) -> dict[str, Any]:
        views = [o.byte_array for g in groups for o in g]
        names = [f"baseline-{self.count + i}" for i in range(len(views))]
        self.count += len(views)
        t0 = time.perf_counter()
        list(self.pool.map(self._write, names, views))
        wall = time.perf_counter() - t0
        return {"durations": [wall], "wall": wall, "bytes": sum(len(v) for v in views)}

    def summary(self, rounds: list[dict[str, Any]]) -> dict[str, Any]:
        mbps = [r["bytes"] / r["wall"] / 1e6 for r in rounds if r["wall"] > 0]
        return {
            "what": "plain threaded open/write/close of the same bytes into fresh files",
            "directory": self.dir,
            "threads": self.threads,
            "rounds": len(rounds),
            "avg_mb_per_s": round(statistics.fmean(mbps), 2) if mbps else 0.0,
            "min_mb_per_s": round(min(mbps), 2) if mbps else 0.0,
            "max_mb_per_s": round(max(mbps), 2) if mbps else 0.0,
        }

    def close(self) -> None:
        import shutil

        self.pool.shutdown(wait=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def _baseline_dir(spec: dict[str, Any]) -> str:
    import tempfile

    base = spec.get("base_path")
    if isinstance(base, str) and base:
        os.makedirs(base, exist_ok=True)
        return tempfile.mkdtemp(prefix=".lmcache-bench-baseline-", dir=base)
    return tempfile.mkdtemp(prefix="lmcache-bench-baseline-")


def _summary(op: str, rounds: list[dict[str, Any]], num_keys: int) -> dict[str, Any]:
    durs = [d for r in rounds for d in r["durations"]]
    mbps = [r["bytes"] / r["wall"] / 1e6 for r in rounds if r["wall"] > 0]
    return {
        "op": op,
        "rounds": len(rounds),
        "tasks": sum(r["tasks"] for r in rounds),
        "successful_tasks": sum(r["ok_tasks"] for r in rounds),
        "keys": sum(r["keys"] for r in rounds),
        "successful_keys": sum(r["ok_keys"] for r in rounds),
        "p50_ms": round(_percentile(durs, 0.5) * 1e3, 3),
        "p99_ms": round(_percentile(durs, 0.99) * 1e3, 3),
        "avg_mb_per_s": round(statistics.fmean(mbps), 2) if mbps else 0.0,
        "min_mb_per_s": round(min(mbps), 2) if mbps else 0.0,
        "max_mb_per_s": round(max(mbps), 2) if mbps else 0.0,
        "avg_latency_per_key_us": round(statistics.fmean(durs) / num_keys * 1e6, 2)
        if durs
        else 0.0,
    }


def _wrap_with_serde(adapter: Any, serde: Any, serde_type: str, alloc: Any) -> Any:
    """The storage manager's wrapping (``StorageManager._create_adapter``): the serde runs
    between the adapter and an L1 manager over the bench's arena, which lends it temporaries."""
    from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
    from lmcache.v1.distributed.l1_manager import L1Manager
    from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper

    mem = L1MemoryManagerConfig(
        size_in_bytes=alloc.size, use_lazy=False, align_bytes=alloc.align, shm_name=""
    )
    l1 = L1Manager(L1ManagerConfig(memory_config=mem), allocator=alloc)
    try:
        return SerdeL2AdapterWrapper(adapter, serde, l1, serde_name=serde_type)
    except BaseException:
        adapter.close()
        serde.close()
        raise


def _kv_shape(nbytes: int) -> Any:
    """A serde's objects: ``nbytes`` of bfloat16 shaped as KV ``[2, layers, tokens, 128]``
    (tokens: up to 16; what shape-aware serdes such as ``turboquant`` need), or flat when
    ``nbytes`` is not a multiple of 512 (one token of K and V)."""
    import math

    import torch

    if nbytes % 512:
        return torch.Size([nbytes // 2])
    token_layers = nbytes // 512
    tokens = math.gcd(token_layers, 16)
    return torch.Size([2, token_layers // tokens, tokens, 128])


def _serde_round_trip(serde: Any, obj: Any) -> tuple[Any, int, float, float]:
    """``obj`` through the serde's own serializer and deserializer on this thread, under
    one fixed key: (the decoded copy, stored bytes, encode seconds, decode seconds)."""
    import torch

    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.memory_management import BytesBufferMemoryObj

    key = ObjectKey(b"bench-l2-serde", "bench", 0)

    layout = _layout(obj)
    buf = BytesBufferMemoryObj(bytearray(serde.estimate_serialized_size(layout)))
    out = _object_like(obj)
    t0 = time.perf_counter()
    n = serde.serializer.serialize(obj, buf, key)
    t1 = time.perf_counter()
    serde.deserializer.deserialize(buf, out, key)
    t2 = time.perf_counter()
    assert isinstance(out.tensor, torch.Tensor)
    return out, int(n), t1 - t0, t2 - t1


def _layout(obj: Any) -> Any:
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    return MemoryLayoutDesc(list(obj.get_shapes()), list(obj.get_dtypes()))


def _object_like(obj: Any) -> Any:
    """A fresh memory object of ``obj``'s shape and dtype (not from the arena)."""
    import torch

    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    t = torch.empty(obj.tensor.shape, dtype=obj.tensor.dtype)
    raw = t.view(-1).view(torch.uint8)
    meta = MemoryObjMetadata(
        shape=t.shape,
        dtype=t.dtype,
        address=0,
        phy_size=raw.numel(),
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
    )
    return TensorMemoryObj(raw, meta)


def _serde_cost(serde: Any, serde_type: str, objs: list[Any]) -> dict[str, Any]:
    """``results.serde``: the serde's cost on ``objs``, one thread."""
    enc = dec = 0.0
    raw = stored = 0
    for obj in objs:
        _out, n, te, td = _serde_round_trip(serde, obj)
        enc, dec = enc + te, dec + td
        raw, stored = raw + obj.get_size(), stored + n
    return {
        "type": serde_type,
        "objects": len(objs),
        "object_bytes": raw // max(1, len(objs)),
        "stored_bytes": stored // max(1, len(objs)),
        "compression_ratio": round(raw / stored, 4) if stored else 0.0,
        "encode_gb_per_s": round(raw / enc / 1e9, 3) if enc > 0 else 0.0,
        "decode_gb_per_s": round(raw / dec / 1e9, 3) if dec > 0 else 0.0,
    }


def _bench_one(
    spec_json: str, index: int, args: argparse.Namespace
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """One adapter: (its full result, the measured rounds of each op run, in run order)."""
    import torch

    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.distributed.l1_memory import L1Allocator
    from lmcache.v1.distributed.l2_adapters.registry import default_l2_adapter_registry
    from lmcache.v1.distributed.serde.factory import create_serde_processor

    l2_types = default_l2_adapter_registry()
    serde_cfg = None
    try:
        d = json.loads(spec_json)
    except json.JSONDecodeError as exc:
        raise CLIError(f"Invalid JSON for --l2-adapter #{index}: {exc}") from exc
    try:
        cfg = l2_types.parse(d, where=f"--l2-adapter #{index}")
        serde_cfg = getattr(cfg, "serde_config", None)
        # as the storage manager: the serde is built (and an unknown type refused) first
        serde = create_serde_processor(serde_cfg) if serde_cfg is not None else None
    except ValueError as exc:
        raise CLIError(f"--l2-adapter #{index}: {exc}" if serde_cfg else str(exc)) from exc
    nbytes = args.data_size_kb * 1024
    align = args.l1_align_bytes
    slot = (nbytes + align - 1) // align * align
    n_bufs = 2 * args.in_flight * args.num_keys
    size = slot * n_bufs + align
    # with a serde: KV-like bfloat16 objects of the same byte size
    shape, dt = (
        ([torch.Size([nbytes])], [torch.uint8])
        if serde is None
        else ([_kv_shape(nbytes)], [torch.bfloat16])
    )
    if serde is not None:  # room for the wrapper's serialized temporaries of one wave
        tmp = serde.estimate_serialized_size(MemoryLayoutDesc(shape, dt))
        size += 2 * args.in_flight * args.num_keys * ((tmp + align - 1) // align * align + align)
    alloc = L1Allocator(size, align, shm_name="", use_hugepages=args.l1_use_hugepages)
    try:
        adapter = l2_types.create(cfg, alloc.memory_desc())
        if serde is not None:
            adapter = _wrap_with_serde(adapter, serde, serde_cfg.type, alloc)
    except BaseException:
        if serde is not None:
            serde.close()
        alloc.close()
        raise
    baseline = None
    if args.baselines:
        workers = d.get("num_workers")
        threads = workers if isinstance(workers, int) and workers > 0 else 4
        baseline = _PageCacheBaseline(_baseline_dir(d), threads)
    try:
        src = [alloc.batched_allocate(shape, dt, args.num_keys) for _ in range(args.in_flight)]
        dst = [alloc.batched_allocate(shape, dt, args.num_keys) for _ in range(args.in_flight)]
        gen = torch.Generator().manual_seed(0)
        for group in src:
            for o in group:
                if serde is None:
                    o.tensor.copy_(
                        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
                    )
                else:
                    o.tensor.copy_(torch.randn(o.tensor.shape, generator=gen).to(dt[0]))
        bench = _Bench(adapter, args, alloc)
        stored: list[list[Any]] = []
        results: dict[str, Any] = {}
        ops = [args.only] if args.only else list(OPS)
        store_rounds: list[dict[str, Any]] = []
        baseline_rounds: list[dict[str, Any]] = []
        for rnd in range(args.warmup_rounds + args.rounds):
            r = bench.run_op("store", rnd, src, stored)
            if rnd >= args.warmup_rounds:
                store_rounds.append(r)
                if baseline is not None:
                    baseline_rounds.append(baseline.run_round(src))
        if "store" in ops:
            results["store"] = _summary("store", store_rounds, args.num_keys)
        if baseline is not None:
            results["baselines"] = {"page_cache_write": baseline.summary(baseline_rounds)}
        stored_batches = stored[-args.in_flight :]
        raw: dict[str, list[dict[str, Any]]] = {}
        for op in ("lookup", "load"):
            if op not in ops:
                continue
            rounds = []
            for rnd in range(args.warmup_rounds + args.rounds):
                r = bench.run_op(op, 1000 + rnd, dst, stored_batches)
                if rnd >= args.warmup_rounds:
                    rounds.append(r)
            results[op] = _summary(op, rounds, args.num_keys)
            raw[op] = rounds
        # a serde built on AsyncSerdeProcessor exposes its codec: cost and expected decode
        codec = serde if hasattr(serde, "serializer") and hasattr(serde, "deserializer") else None
        if serde is not None:
            objs = [o for g in src for o in g]
            results["serde"] = (
                _serde_cost(codec, serde_cfg.type, objs)
                if codec is not None
                else {"type": serde_cfg.type, "cost": "not measured: not an AsyncSerdeProcessor"}
            )
        if "load" in ops and not args.skip_verify:
            mismatched = 0
            for sg, dg in zip(src, dst, strict=False):
                for s_, d_ in zip(sg, dg, strict=False):
                    want = s_ if codec is None else _serde_round_trip(codec, s_)[0]
                    mismatched += int(not torch.equal(want.tensor, d_.tensor))
            results["load"]["verify_mismatched_keys"] = mismatched
        measured = {"store": store_rounds, **raw}
        full = {"adapter": d, "type": d.get("type"), "results": results}
        return full, {op: measured[op] for op in ops}
    finally:
        adapter.close()
        if baseline is not None:
            baseline.close()
        del src, dst
        alloc.close()


def run(args: argparse.Namespace) -> int:
    specs = list(args.l2_adapter) or (
        [os.environ["L2_ADAPTER_JSON"]] if os.environ.get("L2_ADAPTER_JSON") else []
    )
    if not specs:
        raise CLIError(
            "give --l2-adapter JSON (or set L2_ADAPTER_JSON), e.g. "
            '--l2-adapter \'{"type":"mock","max_size_gb":4,"mock_bandwidth_gb":10}\''
        )
    for name in ("num_keys", "in_flight", "data_size_kb", "rounds", "l1_align_bytes"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.warmup_rounds < 0:
        raise CLIError(f"--warmup-rounds must be >= 0 (got {args.warmup_rounds})")
    if args.l1_align_bytes & (args.l1_align_bytes - 1):
        raise CLIError(f"--l1-align-bytes must be a power of two (got {args.l1_align_bytes})")
    if not 0.0 <= args.lookup_max_hit_rate <= 1.0:
        raise CLIError(f"--lookup-max-hit-rate must be in [0, 1] (got {args.lookup_max_hit_rate})")
    if args.flamegraph == "on":
        raise CLIError(
            "--flamegraph on (0.5.6's self-profiling) is not provided by this lmcache; "
            "profile the run from outside (py-spy record -- lmcache bench l2 ...)"
        )
    runs = [_bench_one(s, i, args) for i, s in enumerate(specs, start=1)]
    full = {
        "benchmark": "l2",
        "config": {
            k: getattr(args, k)
            for k in (
                "num_keys",
                "in_flight",
                "data_size_kb",
                "l1_align_bytes",
                "rounds",
                "warmup_rounds",
                "lookup_max_hit_rate",
                "skip_verify",
                "only",
                "baselines",
            )
        },
        "adapters": [r for r, _raw in runs],
    }
    report = Report(TITLE, width=64)
    for n, (spec, (_r, raw)) in enumerate(zip(specs, runs, strict=True), start=1):
        _add_report_sections(report, args, spec, raw, "" if n == 1 else f"adapter_{n}_", n)
    if (args.format or "terminal") == "json":
        sec = report.section("l2", "L2")  # ours, whole: what --format json adds to 0.5.6's
        for key, value in full.items():
            sec.add(key, key, value)
    else:
        for n, (r, _raw) in enumerate(runs, start=1):
            cost = r["results"].get("serde")
            if cost and "encode_gb_per_s" in cost:
                sec = report.section(f"serde_{n}", "Serde" + ("" if n == 1 else f" (adapter {n})"))
                sec.add("type", "Serde", cost["type"])
                sec.add("encode_gb_per_s", "Encode (GB/s, 1 thread)", cost["encode_gb_per_s"])
                sec.add("decode_gb_per_s", "Decode (GB/s, 1 thread)", cost["decode_gb_per_s"])
                sec.add("compression_ratio", "Compression ratio", cost["compression_ratio"])
            pcw = r["results"].get("baselines", {}).get("page_cache_write")
            if pcw:
                label = "Baseline: page-cache write" + ("" if n == 1 else f" (adapter {n})")
                sec = report.section(f"baseline_{n}", label)
                sec.add("threads", "Threads", pcw["threads"])
                for k in ("avg", "min", "max"):
                    sec.add(f"{k}_mb_per_s", f"Throughput {k} (MB/s)", pcw[f"{k}_mb_per_s"])
    report.emit(args)
    mismatched = sum(r["results"].get("load", {}).get("verify_mismatched_keys", 0) for r, _ in runs)
    if mismatched:  # 0.5.6: a failed round-trip check exits 1 after the report
        print(f"verify: {mismatched} loaded keys differ from what was stored", file=sys.stderr)
        return 1
    return 0


TITLE = "L2 Adapter Benchmark Result"
_MIB = 1024 * 1024


def _nearest_rank(values: list[float], pct: float) -> float:
    """0.5.6's percentile of round durations: nearest rank, ceil(pct/100 * N)."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s), max(1, math.ceil(pct / 100.0 * len(s)))) - 1]


def _add_report_sections(
    report: Report,
    args: argparse.Namespace,
    spec: str,
    raw: dict[str, list[dict[str, Any]]],
    prefix: str,
    n: int,
) -> None:
    """0.5.6's ``config`` and ``op_<i>`` sections (same keys, labels and rounding) for one
    adapter, computed from the measured rounds: a round's duration is its wall time (first
    submit to the last completion), throughput counts every key of the round."""
    nbytes = args.data_size_kb * 1024
    per_round = args.in_flight * args.num_keys
    tag = "" if n == 1 else f"Adapter {n}: "
    cfg = report.section(f"{prefix}config", f"{tag}Configuration")
    cfg.add("l2_adapter_json", "L2 adapter JSON", spec)
    cfg.add("num_keys", "Keys / submit", args.num_keys)
    cfg.add("in_flight", "In-flight / round", args.in_flight)
    cfg.add("keys_per_round", "Keys / round", per_round)
    cfg.add("data_size_kb", "Data size / key (KB)", args.data_size_kb)
    cfg.add("data_per_round_mb", "Data / round (MB)", round(per_round * nbytes / _MIB, 2))
    cfg.add("measurement_rounds", "Measurement rounds", args.rounds)
    cfg.add("warmup_rounds", "Warmup rounds", args.warmup_rounds)
    if args.only in (None, "lookup"):
        cfg.add("lookup_max_hit_rate", "Lookup max hit rate", round(args.lookup_max_hit_rate, 4))
    for i, (op, rounds) in enumerate(raw.items()):
        name = op.capitalize()
        durs = [r["wall"] for r in rounds]
        ok = sum(r["ok_keys"] for r in rounds)
        total = per_round * len(rounds)
        moved = 0 if op == "lookup" else per_round * nbytes
        mbps = [moved / _MIB / d for d in durs if d > 0] if moved else []
        ops_s = [per_round / d for d in durs if d > 0]
        avg = statistics.fmean(durs) if durs else 0.0
        sec = report.section(f"{prefix}op_{i}", f"{tag}{name}")
        sec.add("operation", "Operation", name)
        sec.add("rounds", "Rounds", len(rounds))
        sec.add("rounds_timed_out", "Rounds timed out", 0)  # a timeout fails the run here
        sec.add("keys_per_round", "Keys / round", per_round)
        sec.add("total_keys", "Total keys", total)
        sec.add("total_success", "Total success", ok)
        for key, label, value in (
            ("avg", "avg", avg),
            ("min", "min", min(durs, default=0.0)),
            ("max", "max", max(durs, default=0.0)),
            ("p50", "p50", _nearest_rank(durs, 50.0)),
            ("p99", "p99", _nearest_rank(durs, 99.0)),
            ("std", "std", statistics.stdev(durs) if len(durs) > 1 else 0.0),
        ):
            sec.add(f"duration_{key}_ms", f"Duration {label} (ms)", round(value * 1e3, 2))
        for key, value in (
            ("avg", statistics.fmean(mbps) if mbps else 0.0),
            ("min", min(mbps, default=0.0)),
            ("max", max(mbps, default=0.0)),
        ):
            sec.add(f"throughput_{key}_mbps", f"Throughput {key} (MB/s)", round(value, 2))
        sec.add("ops_per_sec_avg", "Avg ops/s", round(statistics.fmean(ops_s), 2) if ops_s else 0.0)
        sec.add("latency_per_key_ms", "Avg latency / key (ms)", round(avg / per_round * 1e3, 3))
        if op == "lookup" and args.lookup_max_hit_rate > 0:
            hits = int(args.lookup_max_hit_rate * args.num_keys) * args.in_flight * len(rounds)
            sec.add(
                "expected_max_hit_rate",
                "Expected max hit rate",
                round(args.lookup_max_hit_rate, 4),
            )
            sec.add("expected_hit_count", "Expected hit keys", hits)
            sec.add("actual_hit_rate", "Actual hit rate", round(ok / total, 4) if total else 0.0)
