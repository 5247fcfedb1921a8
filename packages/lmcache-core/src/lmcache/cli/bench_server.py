"""``lmcache bench server``: an engine simulator that checks and measures a running server.

As LMCache 0.5.6's does, it registers ``--tp-size`` workers with paged KV caches shaped by
``--kvcache-shape-spec`` and runs request sequence numbers ``--start`` up to ``--end``
(exclusive; without ``--end`` it runs until Ctrl-C), sleeping ``--interval`` seconds after
each request. Sequence ``s`` sends the prompt ``s, 9906, 9906, ...`` (``--num-tokens`` + 1
tokens, cut to whole chunks) twice:

* **cold**: lookup, then store what missed, from the sequence's own blocks;
* **warm**: lookup, zero the blocks of what hit, retrieve into them.

The bytes the cold request stored and those the warm one retrieved are compared per chunk
(MD5), and the report (``--format terminal|json``, ``--output``) gives 0.5.6's sections:
``config``, ``results`` (``total_requests``, ``checksum_ok``, ``checksum_fail``,
``pass_rate``), and ``cold_lookup``/``cold_store``/``warm_lookup``/``warm_retrieve`` with
``<op>_count/_mean/_min/_max/_p50/_p99`` in ms. Ours beside them: ``<op>_gbps``,
``cached_lookup`` (``--lookup-repeats`` lookups of a stored prompt, each a new request),
``baselines`` (``--baselines``: the RPC round trip, bare ZeroMQ and a 64 MiB memcpy), and
``sweep`` (``--sweep-tokens``: the whole run once per request size). ``--fresh-prompts``
sends random prompts instead, so a warm server does not turn cold stores into hits.
Exit status 1 when a checksum or a transfer failed.

A clean checksum says nothing about L2: the chunks a server could not write to L2 stay in L1
and are served from there. So the run also asks the server's ``/status`` (``--url``) for its
L2 store counts, before and after (waiting, up to ``L2_SETTLE_S``, for its write-behind to
finish), and ``results`` gives ``l2_store_submitted_chunks``, ``l2_store_failed_chunks`` and
``l2_store_failed_tasks`` of the run, and ``l2_errors`` (the unhealthy adapters' last errors).
Failed L2 stores also make the run unverified and the exit status 1. Without ``/status``
(an HTTP API elsewhere, 0.5.6's server) those keys are left out and a note says why.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lmcache.cli.bench_baselines import measure_baselines
from lmcache.cli.errors import CLIError
from lmcache.cli.http_client import base_url, call
from lmcache.cli.report import Report, add_output_args

HELLO_TOKEN = 9906  # 0.5.6's filler token: its prompts and ours hash to the same keys
DEFAULT_SHAPE_SPEC = "(2,1024,16,8,128):float16:32"
DTYPES = ("float16", "float32", "bfloat16", "uint8", "int8")
OPS = (
    ("cold_lookup", "Cold Lookup (ms)"),
    ("cold_store", "Cold Store (ms)"),
    ("warm_lookup", "Warm Lookup (ms)"),
    ("warm_retrieve", "Warm Retrieve (ms)"),
)
INSTANCE_ID_BASE = 1000  # rank r registers instance 1000 + r, as 0.5.6's bench does


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rpc-url", default="tcp://localhost:5555", help="server RPC URL")
    p.add_argument(
        "--mode",
        choices=("cpu", "gpu"),
        default=None,
        help="where the KV caches live (default: gpu where CUDA is available, else cpu; "
        "0.5.6: gpu)",
    )
    p.add_argument(
        "--transfer-mode",
        choices=("auto", "engine_driven", "lmcache_driven"),
        default="auto",
        help="auto = lmcache_driven for gpu, engine_driven for cpu (default auto)",
    )
    p.add_argument("--tp-size", type=int, default=1, help="simulated TP workers (default 1)")
    p.add_argument(
        "--use-mla",
        action="store_true",
        help="MLA: rank 0 stores, every rank retrieves (implied by kv_size 1 in the spec)",
    )
    p.add_argument("--num-tokens", type=int, default=512, help="tokens per request (default 512)")
    kv = p.add_argument_group("KV cache shape")
    kv.add_argument(
        "--kvcache-shape-spec",
        default=DEFAULT_SHAPE_SPEC,
        help="'(KV,NB,BS,NH,HS):dtype:layers' per layer, vLLM NHD; KV = 2 (K and V) or 1 "
        f"(MLA); dtype one of {', '.join(DTYPES)} (default {DEFAULT_SHAPE_SPEC})",
    )
    kv.add_argument(
        "--num-blocks", type=int, default=1024, help="blocks when the spec's NB is 0 (default 1024)"
    )
    kv.add_argument(
        "--block-size", type=int, default=16, help="tokens per block when the spec's BS is 0"
    )
    p.add_argument("--start", type=int, default=0, help="first sequence number (default 0)")
    p.add_argument(
        "--end", type=int, default=None, help="last sequence number, exclusive (default: forever)"
    )
    p.add_argument(
        "--interval", type=float, default=0.5, help="seconds between requests (default 0.5)"
    )
    p.add_argument(
        "--url",
        default="http://localhost:8080",
        help="server HTTP URL: its /status gives the run's L2 store failures "
        "(default http://localhost:8080)",
    )
    prof = p.add_argument_group("server profiling (0.5.6; not provided)")
    prof.add_argument("--flamegraph", choices=("on", "off"), default="off")
    prof.add_argument("--profile-server-pid", type=int, default=0, metavar="PID")
    prof.add_argument("--flamegraph-mode", default="gil", metavar="MODE[,MODE...]")
    prof.add_argument("--flamegraph-output", default="", metavar="PATH")
    prof.add_argument("--flamegraph-scripts-dir", default="", metavar="DIR")
    add_output_args(p)
    ours = p.add_argument_group("ours")
    ours.add_argument(
        "--fresh-prompts",
        action="store_true",
        help="random prompts instead of 0.5.6's fixed ones (cold stays cold on a warm server)",
    )
    ours.add_argument(
        "--sweep-tokens",
        default=None,
        metavar="N,N,...",
        help="run the whole sequence range once per request size (needs --end)",
    )
    ours.add_argument(
        "--lookup-repeats",
        type=int,
        default=100,
        help="back-to-back lookups of the last stored prompt, each a new request "
        "(cached_lookup; 0 skips; default 100)",
    )
    ours.add_argument(
        "--baselines", action="store_true", help="also measure noop RTT, bare zmq and memcpy"
    )
    ours.add_argument("--model-name", default="test-model", help="model name (default test-model)")
    ours.add_argument("--no-progress", action="store_true", help="no per-request lines on stderr")
    p.set_defaults(func=run)


def prepare_process(argv: Sequence[str]) -> None:
    """Process settings that must precede torch (``lmcache.cli.main`` calls this before it
    builds the flags, which loads torch; libgomp reads its settings once, when it loads).

    With ``--transfer-mode lmcache_driven`` the server copies this process's KV while it
    waits for the reply. After each parallel region (the simulator's ``zero_`` and hashes)
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


# -- plan ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    kv_size: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    dtype: str
    layers: int


_GROUP = re.compile(r"^\(([^)]*)\):(\w+):(\d+)$")


def parse_shape_spec(spec: str, num_blocks: int = 1024, block_size: int = 16) -> list[Group]:
    """``'(KV,NB,BS,NH,HS):dtype:layers[;...]'``; NB or BS of 0 take ``--num-blocks`` /
    ``--block-size``."""

    def bad(why: str) -> CLIError:
        return CLIError(
            f"--kvcache-shape-spec {spec!r}: {why}; use '(2,NB,BS,NH,HS):float16:NUM_LAYERS'"
        )

    groups = []
    for part in (s.strip() for s in spec.split(";")):
        m = _GROUP.match(part.replace(" ", ""))
        if not m:
            raise bad(f"{part!r} is not '(KV,NB,BS,NH,HS):dtype:layers'")
        try:
            dims = [int(x) for x in m.group(1).split(",")]
        except ValueError:
            raise bad(f"{m.group(1)!r} is not 5 integers") from None
        if len(dims) != 5:
            raise bad(f"{m.group(1)!r} has {len(dims)} dimensions, not 5")
        kv, nb, bs, nh, hs = dims
        if kv not in (1, 2) or min(nh, hs) < 1 or nb < 0 or bs < 0:
            raise bad("KV must be 1 or 2, NH and HS positive")
        if m.group(2) not in DTYPES:
            raise bad(f"dtype {m.group(2)!r} is not one of {', '.join(DTYPES)}")
        layers = int(m.group(3))
        if layers < 1:
            raise bad("layers must be >= 1")
        groups.append(Group(kv, nb or num_blocks, bs or block_size, nh, hs, m.group(2), layers))
    if len(groups) > 1:
        raise CLIError(
            f"--kvcache-shape-spec {spec!r} has {len(groups)} groups; this server registers "
            "one KV geometry per model, so give one group"
        )
    return groups


def _sizes(args: argparse.Namespace) -> list[int]:
    if args.sweep_tokens is None:
        return [args.num_tokens]
    try:
        sizes = [int(x) for x in args.sweep_tokens.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise CLIError(
            f"--sweep-tokens {args.sweep_tokens!r}: give positive token counts, e.g. 256,512,1024"
        )
    if args.end is None:
        raise CLIError("--sweep-tokens runs the range once per size, so it needs --end")
    return sizes


def _validate(args: argparse.Namespace) -> None:
    if args.flamegraph == "on":
        raise CLIError(
            "--flamegraph on is not provided by this version; profile the server with "
            "`py-spy record --pid <server pid>` while the bench runs"
        )
    for flag, value, low in (
        ("--tp-size", args.tp_size, 1),
        ("--num-tokens", args.num_tokens, 1),
        ("--num-blocks", args.num_blocks, 1),
        ("--block-size", args.block_size, 1),
        ("--lookup-repeats", args.lookup_repeats, 0),
    ):
        if value < low:
            raise CLIError(f"{flag} must be >= {low} (got {value})")
    if args.interval < 0:
        raise CLIError(f"--interval must be >= 0 seconds (got {args.interval})")
    if args.end is not None and args.end < args.start:
        raise CLIError(f"--end {args.end} is before --start {args.start}")


# -- workers ---------------------------------------------------------------------------


@dataclass
class Worker:
    rank: int
    kv_worker_id: int
    stores: bool
    kv: list[Any]
    ctx: Any


def _allocate(group: Group, device: str) -> list[Any]:
    import torch

    dtype = getattr(torch, group.dtype)
    if group.kv_size == 1:  # MLA: one latent vector per token
        shape: tuple[int, ...] = (
            group.num_blocks,
            group.block_size,
            group.num_heads * group.head_size,
        )
    else:
        shape = (2, group.num_blocks, group.block_size, group.num_heads, group.head_size)
    if dtype.is_floating_point:
        return [torch.randn(shape, device=device).to(dtype) for _ in range(group.layers)]
    info = torch.iinfo(dtype)
    return [
        torch.randint(info.min, info.max + 1, shape, dtype=dtype, device=device)
        for _ in range(group.layers)
    ]


def _block_dim(t: Any) -> int:
    return 0 if t.dim() == 3 else 1


def _blocks(kv: list[Any], first: int, count: int) -> list[Any]:
    return [t.narrow(_block_dim(t), first, count) for t in kv]


def chunk_checksums(
    workers: list[Worker], first_block: int, chunks: range, bpc: int
) -> dict[tuple[int, int], str]:
    """MD5 of each (storing worker, chunk of the request) over the worker's layers."""
    import torch

    sums = {}
    for w in (w for w in workers if w.stores):
        for c in chunks:
            h = hashlib.md5()
            for view in _blocks(w.kv, first_block + c * bpc, bpc):
                h.update(view.contiguous().view(torch.uint8).cpu().numpy().tobytes())
            sums[(w.rank, c)] = h.hexdigest()
    return sums


# -- the run ---------------------------------------------------------------------------


@dataclass
class SizeResult:
    num_tokens: int
    bytes_per_request: int
    completed: int = 0
    checksum_ok: int = 0
    checksum_fail: int = 0
    checksum_unavailable: int = 0
    transfer_failures: int = 0
    latencies: dict[str, list[float]] = field(default_factory=dict)  # ms
    interrupted: bool = False

    def record(self, op: str, ms: float) -> None:
        self.latencies.setdefault(op, []).append(ms)


class Bench:
    def __init__(self, args: argparse.Namespace, client: Any, chunk: int) -> None:
        self.args = args
        self.client = client
        self.chunk = chunk
        self.nonce = f"{random.getrandbits(32):08x}"
        self.rng = random.Random()
        self.workers: list[Worker] = []
        self.mla = False
        self.world_size = 1
        self.block_size = 16
        self.num_blocks = 0
        self.bytes_per_token = 0
        self.context_mode = ""

    def open(self, groups: list[Group], device: str, mode: str) -> None:
        from lmcache.v1.multiprocess.transfer_context import create_transfer_context

        g = groups[0]
        self.mla = self.args.use_mla or g.kv_size == 1
        if self.args.use_mla and g.kv_size != 1:
            raise CLIError(f"--use-mla needs kv_size 1 in --kvcache-shape-spec (got {g.kv_size})")
        if self.chunk % g.block_size:
            raise CLIError(
                f"the server's chunk size {self.chunk} is not a multiple of the block size "
                f"{g.block_size} of --kvcache-shape-spec"
            )
        self.block_size, self.num_blocks = g.block_size, g.num_blocks
        self.world_size = 1 if self.mla else self.args.tp_size
        for rank in range(self.args.tp_size):
            kv = _allocate(g, device)
            # vLLM's layout, said explicitly: a 0.5.6 server assumes another one without it
            ctx = create_transfer_context(
                kv,
                instance_id=INSTANCE_ID_BASE + rank,
                req_client=self.client,
                mode=mode,
                layout_hints={"kv_layout": "NHD"},
            )
            stores = rank == 0 or not self.mla
            self.workers.append(Worker(rank, 0 if self.mla else rank, stores, ctx.kv_caches, ctx))
            ctx.register(self.args.model_name, self.world_size)
            self.context_mode = str(getattr(ctx, "mode", mode))
        t = self.workers[0].kv[0]
        per_block = t.numel() * t.element_size() // self.num_blocks
        self.bytes_per_token = per_block * len(self.workers[0].kv) // self.block_size

    def close(self) -> None:
        for w in self.workers:
            try:
                w.ctx.unregister()
            finally:
                w.ctx.close()

    def _key(self, tokens: list[int], rid: str, start: int, end: int, worker_id: int | None) -> Any:
        from lmcache.v1.multiprocess import protocol as P

        return P.IPCCacheServerKey(
            model_name=self.args.model_name,
            world_size=self.world_size,
            worker_id=worker_id,
            token_ids=tokens,
            start=start,
            end=end,
            request_id=rid,
            num_kv_readers=self.args.tp_size if self.mla else 1,
        )

    def prompt(self, seq: int, n_tok: int) -> list[int]:
        if self.args.fresh_prompts:
            return [self.rng.randrange(1, 1 << 31) for _ in range(n_tok + 1)]
        return [seq] + [HELLO_TOKEN] * n_tok

    def lookup(self, tokens: list[int], rid: str) -> tuple[int, float]:
        t0 = time.perf_counter()
        hit = self.client.lookup_hits(self._key(tokens, rid, 0, len(tokens), None), 30.0)
        return int(hit or 0), (time.perf_counter() - t0) * 1000

    def _transfer(
        self, op: str, tokens: list[int], rid: str, start: int, end: int, first_block: int
    ) -> tuple[bool, float]:
        ids = list(
            range(first_block + start // self.block_size, first_block + end // self.block_size)
        )
        t0 = time.perf_counter()
        futures = []
        for w in self.workers:
            if op == "store" and not w.stores:
                continue
            key = self._key(tokens, rid, start, end, w.kv_worker_id)
            submit = w.ctx.submit_store if op == "store" else w.ctx.submit_retrieve
            futures.append(submit(key, ids))
        ok = all(bool(f.result(60)) for f in futures)
        return ok, (time.perf_counter() - t0) * 1000

    def request(
        self, res: SizeResult, seq: int, kind: str, tokens: list[int], first_block: int
    ) -> dict[tuple[int, int], str]:
        """One cold or warm request; the checksums of what it stored (cold) or retrieved (warm)."""
        full = len(tokens) // self.chunk * self.chunk
        rid = f"bench-{self.nonce}-{seq}-{kind}"
        hit_chunks, ms = self.lookup(tokens, rid)
        res.record(f"{kind}_lookup", ms)
        hit = min(hit_chunks * self.chunk, full)
        bpc = self.chunk // self.block_size
        sums = {}
        if kind == "cold" and full > hit:
            sums = chunk_checksums(
                self.workers, first_block, range(hit // self.chunk, full // self.chunk), bpc
            )
        if kind == "warm" and hit:
            for w in self.workers:
                for view in _blocks(w.kv, first_block, hit // self.block_size):
                    view.zero_()
        if hit:
            ok, ms = self._transfer("retrieve", tokens, rid, 0, hit, first_block)
            res.transfer_failures += not ok
            if kind == "warm":
                res.record("warm_retrieve", ms)
        if full > hit:
            ok, ms = self._transfer("store", tokens, rid, hit, full, first_block)
            res.transfer_failures += not ok
            if kind == "cold":
                res.record("cold_store", ms)
        if kind == "warm" and hit:
            sums = chunk_checksums(self.workers, first_block, range(hit // self.chunk), bpc)
        self.client.call("end_session", rid)
        return sums

    def check_size(self, n_tok: int, group: Group) -> None:
        full = (n_tok + 1) // self.chunk * self.chunk
        if full == 0:
            raise CLIError(
                f"--num-tokens {n_tok}: a request of {n_tok + 1} tokens holds no whole chunk of "
                f"{self.chunk} tokens (the server's --chunk-size); ask for at least {self.chunk - 1}"
            )
        if full // group.block_size > group.num_blocks:
            raise CLIError(
                f"a request of {full} tokens needs {full // group.block_size} blocks; the KV "
                f"cache has {group.num_blocks} (raise NB in --kvcache-shape-spec)"
            )

    def run_size(self, n_tok: int, seqs: Any, log: Any) -> SizeResult:
        full = (n_tok + 1) // self.chunk * self.chunk
        n_blocks = full // self.block_size
        usable = max(self.num_blocks - n_blocks, 1)
        res = SizeResult(n_tok, full * self.bytes_per_token)
        last = None
        try:
            for seq in seqs:
                tokens = self.prompt(seq, n_tok)
                first_block = (seq * n_blocks) % usable
                cold = self.request(res, seq, "cold", tokens, first_block)
                time.sleep(self.args.interval)
                warm = self.request(res, seq, "warm", tokens, first_block)
                res.completed += 1
                # The chunks the cold request stored and the warm one retrieved (0.5.6
                # compares whole lists, so a partial cold hit reads as a mismatch there).
                both = cold.keys() & warm.keys()
                if not both:
                    res.checksum_unavailable += 1
                    verdict = "checksum not available (nothing stored, or nothing came back)"
                elif all(cold[k] == warm[k] for k in both):
                    res.checksum_ok += 1
                    verdict = "checksum match"
                else:
                    res.checksum_fail += 1
                    verdict = "CHECKSUM MISMATCH"
                last = tokens
                log(f"[{n_tok} tokens] seq {seq}: {verdict}")
                time.sleep(self.args.interval)
        except KeyboardInterrupt:
            res.interrupted = True
        if last is not None and not res.interrupted:
            for i in range(self.args.lookup_repeats):
                hit, ms = self.lookup(last, f"bench-{self.nonce}-cached-{n_tok}-{i}")
                self.client.call("end_session", f"bench-{self.nonce}-cached-{n_tok}-{i}")
                res.record("cached_lookup", ms)
        return res


def _sections(res: SizeResult) -> dict[str, dict[str, Any]]:
    """0.5.6's summary sections of one size (plus our ``<op>_gbps``)."""
    total = res.completed
    out: dict[str, dict[str, Any]] = {
        "results": {
            "total_requests": total,
            "checksum_ok": res.checksum_ok,
            "checksum_fail": res.checksum_fail,
            **({"pass_rate": round(res.checksum_ok / total * 100, 2)} if total else {}),
            "checksum_unavailable": res.checksum_unavailable,
            "transfer_failures": res.transfer_failures,
            "verified": bool(total) and res.checksum_fail == 0 and res.transfer_failures == 0,
        }
    }
    for op in (*(o for o, _label in OPS), "cached_lookup"):
        samples = sorted(res.latencies.get(op) or [])
        if not samples:
            continue
        n = len(samples)
        sec = {
            f"{op}_count": n,
            f"{op}_mean": round(sum(samples) / n, 3),
            f"{op}_min": round(samples[0], 3),
            f"{op}_max": round(samples[-1], 3),
            f"{op}_p50": round(samples[max(0, math.ceil(n * 0.5) - 1)], 3),
            f"{op}_p99": round(samples[max(0, math.ceil(n * 0.99) - 1)], 3),
        }
        if op in ("cold_store", "warm_retrieve") and sec[f"{op}_p50"] > 0:
            sec[f"{op}_gbps"] = round(res.bytes_per_request / (sec[f"{op}_p50"] / 1e3) / 1e9, 3)
        out[op] = sec
    return out


L2_SETTLE_S = 60.0  # how long the report waits for the server's L2 write-behind to finish
_L2_COUNTS = ("submitted_keys", "failed_keys", "failed_tasks", "in_flight_tasks", "pending_keys")


def l2_store_counts(url: str) -> tuple[dict[str, int] | None, list[str], str]:
    """The server's L2 store counters summed over its store controllers, the last errors of
    its unhealthy L2 adapters, and why there are no counters (None, when /status lacks them)."""
    try:
        status = call("GET", f"{base_url(url)}/status", timeout=5.0)
    except CLIError as exc:
        return None, [], str(exc)
    sm = status.get("storage_manager") or {} if isinstance(status, dict) else {}
    rows = [r for r in (sm.get("store_controllers") or {}).values() if isinstance(r, dict)]
    errors = [
        f"{a.get('type', '?')}: {(a.get('health') or {}).get('last_error') or 'unhealthy'}"
        for a in sm.get("l2_adapters") or []
        if isinstance(a, dict) and not a.get("is_healthy", True)
    ]
    if not rows or not all("failed_keys" in r for r in rows):
        return None, errors, f"{base_url(url)}/status has no L2 store counts"
    return {k: sum(int(r.get(k, 0)) for r in rows) for k in _L2_COUNTS}, errors, ""


def l2_store_report(url: str, before: dict[str, int] | None) -> tuple[dict[str, Any], str]:
    """The run's L2 store results (counts since ``before``), once the server's write-behind is
    done; an empty dict and the reason when the server has no such counts."""
    if before is None:
        return {}, "no L2 store counts before the run"
    deadline = time.monotonic() + L2_SETTLE_S
    while True:
        after, errors, why = l2_store_counts(url)
        if after is None:
            return {}, why
        if after["in_flight_tasks"] + after["pending_keys"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    out: dict[str, Any] = {
        "l2_store_submitted_chunks": after["submitted_keys"] - before["submitted_keys"],
        "l2_store_failed_chunks": after["failed_keys"] - before["failed_keys"],
        "l2_store_failed_tasks": after["failed_tasks"] - before["failed_tasks"],
    }
    if after["in_flight_tasks"] + after["pending_keys"]:
        out["l2_store_unfinished_chunks"] = after["pending_keys"]
    if errors:
        out["l2_errors"] = errors
    return out, ""


_LABELS = {
    "total_requests": "Total requests",
    "checksum_ok": "Checksum OK",
    "checksum_fail": "Checksum FAIL",
    "pass_rate": "Pass rate (%)",
    "checksum_unavailable": "Checksum not available",
    "transfer_failures": "Failed transfers",
    "verified": "Verified",
    "l2_store_submitted_chunks": "L2 store: chunks submitted",
    "l2_store_failed_chunks": "L2 store: chunks failed",
    "l2_store_failed_tasks": "L2 store: tasks failed",
    "l2_store_unfinished_chunks": "L2 store: chunks unfinished",
    "l2_errors": "L2 errors",
}


def run(args: argparse.Namespace) -> int:
    import torch

    from lmcache.v1.multiprocess.client import LMCacheTimeoutError, MPClient

    _validate(args)
    sizes = _sizes(args)
    groups = parse_shape_spec(args.kvcache_shape_spec, args.num_blocks, args.block_size)
    mode = args.mode or ("gpu" if torch.cuda.is_available() else "cpu")
    if mode == "gpu" and not torch.cuda.is_available():
        raise CLIError("--mode gpu needs a CUDA device (torch sees none); use --mode cpu")
    device = "cuda" if mode == "gpu" else "cpu"
    transfer = args.transfer_mode
    if transfer == "auto":
        transfer = "lmcache_driven" if mode == "gpu" else "engine_driven"
    quiet = args.quiet or args.no_progress

    def log(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    l2_before, _errors, l2_why = l2_store_counts(args.url)
    client = MPClient(args.rpc_url, default_timeout=60)
    bench = Bench(args, client, 0)
    per_size: list[SizeResult] = []
    baselines = None
    try:
        try:
            bench.chunk = client.get_chunk_size(timeout=10)
        except LMCacheTimeoutError:
            raise CLIError(
                f"no lmcache server answers at {args.rpc_url}; start one with `lmcache server`", 1
            ) from None
        for n_tok in sizes:
            bench.check_size(n_tok, groups[0])
        bench.open(groups, device, transfer)
        try:
            for n_tok in sizes:
                seqs = range(args.start, args.end) if args.end is not None else _forever(args.start)
                res = bench.run_size(n_tok, seqs, log)
                per_size.append(res)
                if res.interrupted:
                    break
            if args.baselines and not (per_size and per_size[-1].interrupted):
                baselines = measure_baselines(client)
        finally:
            bench.close()
    finally:
        client.close()
    first = per_size[0] if per_size else None
    if first is None or first.completed == 0:
        log("no request completed; nothing to report")
        return 1 if first is None else 0
    report = Report("Server Bench Result", width=64)
    cfg = report.section("config", "Configuration")
    cfg.add("rpc_url", "RPC URL", args.rpc_url)
    cfg.add("mode", "Mode", mode)
    cfg.add("transfer_mode", "Transfer mode", args.transfer_mode)
    cfg.add("num_tokens", "Tokens / request", args.num_tokens)
    cfg.add("interval", "Interval (s)", args.interval)
    for key, label, value in (
        ("tp_size", "TP size", args.tp_size),
        ("use_mla", "MLA", bench.mla),
        ("kvcache_shape_spec", "KV cache shape", args.kvcache_shape_spec),
        ("chunk_size", "Server chunk size", bench.chunk),
        ("context_mode", "Transfer context", bench.context_mode),
        ("model_name", "Model", args.model_name),
        ("fresh_prompts", "Fresh prompts", args.fresh_prompts),
        ("bytes_per_request", "Bytes / request", first.bytes_per_request),
        ("omp_wait_policy", "OMP_WAIT_POLICY", os.environ.get("OMP_WAIT_POLICY", "default")),
        ("client_spin", "Client spin", client.spin.stats()),
    ):
        cfg.add(key, label, value)
    sections = _sections(first)
    l2, why = l2_store_report(args.url, l2_before)
    l2_failed = int(l2.get("l2_store_failed_chunks", 0)) > 0
    if l2_failed:
        sections["results"]["verified"] = False
        print(
            f"L2 store failed for {l2['l2_store_failed_chunks']} of "
            f"{l2['l2_store_submitted_chunks']} chunks (they are served from L1 only): "
            + "; ".join(l2.get("l2_errors") or ["see the server's /status"]),
            file=sys.stderr,
            flush=True,
        )
    elif not l2:
        log(f"L2 store results not available ({l2_why or why})")
    results = report.section("results", "Results")
    for key, value in {**sections["results"], **l2}.items():
        results.add(key, _LABELS[key], value)
    for op, title in (*OPS, ("cached_lookup", "Cached Lookup (ms)")):
        if op in sections:
            sec = report.section(op, title)
            for key, value in sections[op].items():
                sec.add(key, key.removeprefix(f"{op}_"), value)
    if args.sweep_tokens is not None:
        for i, res in enumerate(per_size):
            sec = report.section(f"sweep_{i}", f"Sweep: {res.num_tokens} tokens", group="sweep")
            sec.add("num_tokens", "Tokens / request", res.num_tokens)
            for name, body in _sections(res).items():
                sec.add(name, name, body)
    if baselines is not None:
        sec = report.section("baselines", "Baselines")
        for name, stats in baselines.items():
            sec.add(name, name, stats)
    report.emit(args)
    failed = any(r.checksum_fail or r.transfer_failures for r in per_size) or l2_failed
    return 1 if failed else 0


def _forever(start: int) -> Any:
    seq = start
    while True:
        yield seq
        seq += 1
