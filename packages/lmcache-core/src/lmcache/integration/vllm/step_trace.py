"""The connector's opt-in step trace: where an engine step's time goes inside our code.

``LMCACHE_CONNECTOR_TRACE=PREFIX`` (unset by default) makes every ``LMCacheMPConnector``
write one JSON line per engine step to ``PREFIX.<role>.<pid>-<n>.jsonl`` (role ``scheduler``
or ``worker``; ``n`` counts the connectors of that role in the process). Unset, :func:`from_env` returns None and nothing is wrapped: the connector's
hooks are its plain methods.

A record holds what one role did in one step:

* ``step``: the scheduler's step number (the worker reads it from the step's metadata),
  ``t``: wall clock (``time.time()``) at the record's end, ``wall_ms``: since the previous
  record of this connector (for a worker, the whole step: the forward included);
* ``hooks``: ``{hook: [calls, ms]}``, the wall time spent inside each connector hook;
* ``rpc``: ``{op: [calls, ms, bytes]}``, requests to the server: calls sent, summed round
  trips of the replies that came in this step, request bytes sent;
* ``xfer`` (worker): ``[[kind, thread, start, ms, tokens, bytes], ...]``, each store or
  retrieve copy that ended in this step, with its thread (``MainThread``: in the step's
  own path; otherwise a background thread) and ``start`` as ``time.time()``;
* ``sched`` (scheduler): ``tokens`` scheduled, ``new``/``running`` requests, ``decode``
  requests (one token), and ``ops``: ``{"RETRIEVE"|"STORE": [ops, tokens]}``;
* ``counts``: ``{event: n}``, e.g. the scheduler's answers to get_num_new_matched_tokens
  (``hit``, ``miss``, ``ask_again``: the request waits for a later step).

``lmcache bench connector-trace PREFIX.*.jsonl`` (:func:`summarize`) prints per-hook and
per-op totals and percentiles and the slowest steps.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

TRACE_ENV = "LMCACHE_CONNECTOR_TRACE"

SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "on_new_request",
    "take_events",
)
WORKER_HOOKS = (
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_kv_cache_events",
    "clear_connector_metadata",
)
# The hook that closes a step's record, per role.
STEP_END = {"scheduler": "build_connector_meta", "worker": "clear_connector_metadata"}
# Connectors of each role made in this process (their trace files' numbers).
_PER_PROCESS = {role: itertools.count() for role in STEP_END}


def from_env(role: str) -> StepTrace | None:
    """The trace for a connector of ``role``, or None when ``LMCACHE_CONNECTOR_TRACE`` is unset."""
    prefix = os.environ.get(TRACE_ENV, "").strip()
    if not prefix:
        return None
    n = next(_PER_PROCESS[role])
    return StepTrace(f"{prefix}.{role}.{os.getpid()}-{n}.jsonl", role)


class StepTrace:
    """Accumulates one step's figures and writes them as one JSON line when the step ends."""

    def __init__(self, path: str, role: str) -> None:
        if role not in STEP_END:
            raise ValueError(f"trace role {role!r}: expected one of {sorted(STEP_END)}")
        self.path = path
        self.role = role
        dirname = os.path.dirname(path)
        if dirname:
            os.makedirs(dirname, exist_ok=True)
        try:
            self._file = open(path, "a", buffering=1)  # noqa: SIM115 (closed in close())
        except OSError as exc:
            raise ValueError(
                f"{TRACE_ENV}: cannot write the step trace {path!r} ({exc}); give a prefix in a "
                "writable folder, or unset it"
            ) from None
        self._lock = threading.Lock()
        self._local = threading.local()
        self.step = 0
        self._step_of_record: int | None = None
        self._last_end = time.time()
        self._reset()

    def _reset(self) -> None:
        self._hooks: dict[str, list[float]] = {}
        self._rpc: dict[str, list[float]] = {}
        self._xfer: list[list[Any]] = []
        self._counts: dict[str, int] = {}
        self._extra: dict[str, Any] = {}

    # -- recording -------------------------------------------------------------------
    def add_hook(self, name: str, seconds: float) -> None:
        with self._lock:
            acc = self._hooks.setdefault(name, [0, 0.0])
            acc[0] += 1
            acc[1] += seconds * 1e3

    def add_rpc(self, op: str, calls: int = 0, seconds: float = 0.0, nbytes: int = 0) -> None:
        with self._lock:
            acc = self._rpc.setdefault(op, [0, 0.0, 0])
            acc[0] += calls
            acc[1] += seconds * 1e3
            acc[2] += nbytes

    def add_transfer(
        self, kind: str, start: float, seconds: float, tokens: int, nbytes: int
    ) -> None:
        thread = threading.current_thread().name
        with self._lock:
            self._xfer.append([kind, thread, start, round(seconds * 1e3, 3), tokens, nbytes])

    def count(self, event: str) -> None:
        with self._lock:
            self._counts[event] = self._counts.get(event, 0) + 1

    def set_step(self, step: int | None) -> None:
        """The step this record belongs to (a worker learns it from the metadata)."""
        if step is not None:
            self._step_of_record = int(step)

    def note(self, **fields: Any) -> None:
        with self._lock:
            self._extra.update(fields)

    def end_step(self) -> None:
        now = time.time()
        with self._lock:
            record: dict[str, Any] = {
                "role": self.role,
                "pid": os.getpid(),
                "step": self.step if self._step_of_record is None else self._step_of_record,
                "t": now,
                "wall_ms": round((now - self._last_end) * 1e3, 3),
                "hooks": {k: [int(n), round(ms, 3)] for k, (n, ms) in self._hooks.items()},
                "rpc": {k: [int(n), round(ms, 3), int(b)] for k, (n, ms, b) in self._rpc.items()},
                **self._extra,
            }
            if self._xfer:
                record["xfer"] = self._xfer
            if self._counts:
                record["counts"] = self._counts
            self._reset()
            self._step_of_record = None
            self._last_end = now
            self.step += 1
        try:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        except (OSError, ValueError):
            pass  # a full disk or a closed file must not stop the engine

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:
            pass

    # -- instrumentation -------------------------------------------------------------
    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` timed as hook ``name``; a hook called from inside another is not counted
        again (``request_finished_all_groups`` calls ``request_finished``)."""
        local = self._local
        ends_step = STEP_END[self.role] == name

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "depth", 0):
                return fn(*args, **kwargs)
            local.depth = 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add_hook(name, time.perf_counter() - t0)
                local.depth = 0
                if ends_step:
                    self.end_step()

        return wrapper

    def wrap_hooks(self, obj: Any, names: Iterable[str]) -> None:
        """Replace ``obj``'s bound methods ``names`` by timed ones (instance attributes)."""
        for name in names:
            method = getattr(obj, name, None)
            if method is not None:
                setattr(obj, name, self.timed(name, method))

    def wrap_client(self, client: Any) -> None:
        """Count ``client``'s requests (an ``MPClient``): op, request bytes, round trip."""
        if getattr(client, "_step_trace", None) is self:
            return
        client._step_trace = self
        frames_of = client._request_frames
        submit, call = client.submit, client.call
        local = threading.local()

        def request_frames(uid: int, op_bytes: bytes, payloads: tuple[Any, ...]) -> list[bytes]:
            frames = frames_of(uid, op_bytes, payloads)
            op = _op_name(op_bytes)
            self.add_rpc(op, calls=1, nbytes=sum(len(f) for f in frames))
            return frames

        def traced_submit(op: Any, *payloads: Any) -> Any:
            fut = submit(op, *payloads)
            if not getattr(local, "in_call", False):
                t0 = time.perf_counter()
                name = _op_name(op)
                fut.add_done_callback(
                    lambda _f: self.add_rpc(name, seconds=time.perf_counter() - t0)
                )
            return fut

        def traced_call(op: Any, *payloads: Any, **kwargs: Any) -> Any:
            local.in_call = True
            t0 = time.perf_counter()
            try:
                return call(op, *payloads, **kwargs)
            finally:
                local.in_call = False
                self.add_rpc(_op_name(op), seconds=time.perf_counter() - t0)

        client._request_frames = request_frames
        client.submit = traced_submit
        client.call = traced_call

    def wrap_transfers(self, context: Any, bytes_per_token: int) -> None:
        """Time a transfer context's store and retrieve copies (``submit_store`` /
        ``submit_retrieve``, run inline or on the transfer thread)."""
        for kind in ("store", "retrieve"):
            fn = getattr(context, f"submit_{kind}")

            def traced(key: Any, *args: Any, _fn: Any = fn, _kind: str = kind, **kw: Any) -> Any:
                start, t0 = time.time(), time.perf_counter()
                try:
                    return _fn(key, *args, **kw)
                finally:
                    tokens = int(getattr(key, "end", 0)) - int(getattr(key, "start", 0))
                    self.add_transfer(
                        _kind, start, time.perf_counter() - t0, tokens, tokens * bytes_per_token
                    )

            setattr(context, f"submit_{kind}", traced)


@functools.lru_cache(maxsize=256)
def _op_name(op: Any) -> str:
    """An op's name from its name, legacy id or op frame (bytes as sent)."""
    from lmcache.v1.multiprocess import protocol as P

    if isinstance(op, bytes):
        try:
            op = P.decode(op)
        except Exception:
            return op.hex()
    spec = P.lookup_op(op)
    return spec.name if spec is not None else str(op)


def scheduler_fields(scheduler_output: Any, ops: list[Any]) -> dict[str, Any]:
    """The ``sched`` field of a scheduler record: what vLLM scheduled and which ops we emit."""
    num = dict(getattr(scheduler_output, "num_scheduled_tokens", None) or {})
    new = getattr(scheduler_output, "scheduled_new_reqs", None) or []
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    running = len(getattr(cached, "req_ids", None) or [])
    per_op: dict[str, list[int]] = {}
    for meta in ops:
        acc = per_op.setdefault(meta.direction, [0, 0])
        acc[0] += 1
        acc[1] += int(meta.op.end - meta.op.start)
    return {
        "sched": {
            "tokens": int(sum(num.values())),
            "new": len(new),
            "running": running,
            "decode": sum(1 for n in num.values() if n == 1),
            "ops": per_op,
        }
    }


# -- reading and summarizing ------------------------------------------------------------
def read_records(paths: Iterable[str]) -> list[dict[str, Any]]:
    """The records of trace files (a line cut short by a killed process is skipped)."""
    records = []
    for path in paths:
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("role") in STEP_END:
                    records.append(rec)
    return records


def _pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``values`` (0.0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, int(round(q / 100.0 * len(ordered) + 0.5)) - 1))
    return round(ordered[rank], 3)


def _dist(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "total_ms": round(sum(values), 3),
        "p50_ms": _pct(values, 50),
        "p90_ms": _pct(values, 90),
        "p99_ms": _pct(values, 99),
        "max_ms": round(max(values), 3) if values else 0.0,
    }


def _ours_ms(rec: dict[str, Any]) -> float:
    return sum(ms for _n, ms in rec.get("hooks", {}).values())


def summarize(records: list[dict[str, Any]], slowest: int = 10) -> dict[str, Any]:
    """Per role: each hook's calls and its time per step (total and percentiles over the
    steps that called it), each RPC op's calls, round trips and bytes; the store/retrieve
    copies (in the step's path or in the background); the worker steps' wall time, with
    the steps that scheduled decodes apart; and the ``slowest`` worker steps, each with
    the scheduler's view of that step and the background copies that overlapped it."""
    out: dict[str, Any] = {"records": {}, "hooks": {}, "rpc": {}, "counts": {}}
    for role in STEP_END:
        recs = [r for r in records if r["role"] == role]
        if not recs:
            continue
        out["records"][role] = len(recs)
        per_hook: dict[str, list[float]] = {}
        calls: dict[str, int] = {}
        for r in recs:
            for hook, (n, ms) in r.get("hooks", {}).items():
                per_hook.setdefault(hook, []).append(ms)
                calls[hook] = calls.get(hook, 0) + n
        out["hooks"][role] = {
            h: {"calls": calls[h], **_dist(v)}
            for h, v in sorted(per_hook.items(), key=lambda kv: -sum(kv[1]))
        }
        rpc: dict[str, list[float]] = {}
        for r in recs:
            for op, (n, ms, b) in r.get("rpc", {}).items():
                acc = rpc.setdefault(op, [0, 0.0, 0])
                acc[0] += n
                acc[1] += ms
                acc[2] += b
        counts: dict[str, int] = {}
        for r in recs:
            for event, n in r.get("counts", {}).items():
                counts[event] = counts.get(event, 0) + n
        if counts:
            out["counts"][role] = dict(sorted(counts.items()))
        out["rpc"][role] = {
            op: {
                "calls": int(n),
                "round_trip_ms": round(ms, 3),
                "mean_round_trip_ms": round(ms / n, 3) if n else 0.0,
                "bytes_sent": int(b),
            }
            for op, (n, ms, b) in sorted(rpc.items(), key=lambda kv: -kv[1][1])
        }
    sched = {r["step"]: r for r in records if r["role"] == "scheduler"}
    workers = sorted((r for r in records if r["role"] == "worker"), key=lambda r: r["t"])
    xfers = [x for r in workers for x in r.get("xfer", [])]
    transfers: dict[str, Any] = {}
    for kind in ("store", "retrieve"):
        mine = [x for x in xfers if x[0] == kind]
        if mine:
            transfers[kind] = {
                **_dist([x[3] for x in mine]),
                "in_step_path": sum(1 for x in mine if x[1] == "MainThread"),
                "background": sum(1 for x in mine if x[1] != "MainThread"),
                "tokens": sum(x[4] for x in mine),
                "bytes": sum(x[5] for x in mine),
            }
    out["transfers"] = transfers
    if not workers:
        return out
    background = [(x[2], x[2] + x[3] / 1e3) for x in xfers if x[1] != "MainThread"]

    def view(r: dict[str, Any]) -> dict[str, Any]:
        begin, end = r["t"] - r["wall_ms"] / 1e3, r["t"]
        overlap = sum(max(0.0, min(end, b) - max(begin, a)) for a, b in background)
        s = sched.get(r["step"], {}).get("sched", {})
        hooks = {h: ms for h, (_n, ms) in r.get("hooks", {}).items() if ms >= 0.05}
        return {
            "step": r["step"],
            "wall_ms": r["wall_ms"],
            "ours_ms": round(_ours_ms(r), 3),
            "background_copy_ms": round(overlap * 1e3, 3),
            "hooks_ms": dict(sorted(hooks.items(), key=lambda kv: -kv[1])),
            "scheduled": s,
        }

    # the first step of a process includes its start-up: left out of the distributions
    steps = workers[1:] if len(workers) > 1 else workers
    decode = [r for r in steps if sched.get(r["step"], {}).get("sched", {}).get("decode")]
    decode_only = [
        r
        for r in decode
        if sched[r["step"]]["sched"]["decode"]
        == sched[r["step"]]["sched"]["new"] + sched[r["step"]]["sched"]["running"]
    ]
    out["worker_steps"] = {
        "all": {
            **_dist([r["wall_ms"] for r in steps]),
            "ours": _dist([_ours_ms(r) for r in steps]),
        },
        "with_decodes": {
            **_dist([r["wall_ms"] for r in decode]),
            "ours": _dist([_ours_ms(r) for r in decode]),
        },
        "decode_only": {
            **_dist([r["wall_ms"] for r in decode_only]),
            "ours": _dist([_ours_ms(r) for r in decode_only]),
        },
    }
    out["slowest_steps_with_decodes"] = [
        view(r) for r in sorted(decode, key=lambda r: -r["wall_ms"])[:slowest]
    ]
    out["slowest_ours"] = [view(r) for r in sorted(steps, key=lambda r: -_ours_ms(r))[:slowest]]
    return out


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as text: hooks, RPCs, copies, step times, slowest steps."""
    lines = [f"records: {summary.get('records')}"]
    for role, counts in summary.get("counts", {}).items():
        lines.append(f"{role} counts: {counts}")
    for role, hooks in summary.get("hooks", {}).items():
        lines.append(f"\n{role} hooks (ms per step):")
        lines.append(f"  {'hook':34} {'calls':>7} {'total':>9} {'p50':>7} {'p99':>7} {'max':>8}")
        for h, d in hooks.items():
            lines.append(
                f"  {h:34} {d['calls']:>7} {d['total_ms']:>9.1f} {d['p50_ms']:>7.2f} "
                f"{d['p99_ms']:>7.2f} {d['max_ms']:>8.2f}"
            )
    for role, ops in summary.get("rpc", {}).items():
        lines.append(f"\n{role} RPCs:")
        lines.append(f"  {'op':34} {'calls':>7} {'rtt total ms':>12} {'mean':>7} {'bytes':>11}")
        for op, d in ops.items():
            lines.append(
                f"  {op:34} {d['calls']:>7} {d['round_trip_ms']:>12.1f} "
                f"{d['mean_round_trip_ms']:>7.2f} {d['bytes_sent']:>11}"
            )
    for kind, d in summary.get("transfers", {}).items():
        lines.append(
            f"\n{kind} copies: {d['n']} ({d['in_step_path']} in the step, {d['background']} in "
            f"the background), {d['tokens']} tokens, {d['bytes'] / 2**20:.1f} MiB, "
            f"total {d['total_ms']:.1f} ms, p50 {d['p50_ms']:.2f}, max {d['max_ms']:.2f} ms"
        )
    for name, d in summary.get("worker_steps", {}).items():
        o = d["ours"]
        lines.append(
            f"\nworker steps ({name}): {d['n']}, wall p50 {d['p50_ms']:.1f} p90 {d['p90_ms']:.1f} "
            f"p99 {d['p99_ms']:.1f} max {d['max_ms']:.1f} ms; ours p50 {o['p50_ms']:.2f} "
            f"p99 {o['p99_ms']:.2f} max {o['max_ms']:.2f} total {o['total_ms']:.1f} ms"
        )
    for title, key in (
        ("slowest steps with decodes", "slowest_steps_with_decodes"),
        ("steps with the most time in our code", "slowest_ours"),
    ):
        if summary.get(key):
            lines.append(f"\n{title}:")
            for v in summary[key]:
                s = v["scheduled"]
                hooks = ", ".join(f"{h} {ms:.1f}" for h, ms in list(v["hooks_ms"].items())[:4])
                lines.append(
                    f"  step {v['step']}: wall {v['wall_ms']:.1f} ms, ours {v['ours_ms']:.1f}, "
                    f"bg copy {v['background_copy_ms']:.1f}; tokens {s.get('tokens')} "
                    f"(new {s.get('new')}, running {s.get('running')}, decode "
                    f"{s.get('decode')}), ops {s.get('ops')}; {hooks}"
                )
    return "\n".join(lines)
