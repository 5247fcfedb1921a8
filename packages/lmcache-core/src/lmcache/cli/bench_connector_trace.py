"""``lmcache bench connector-trace``: summarize the connector's step trace.

Run vLLM with ``LMCACHE_CONNECTOR_TRACE=PREFIX`` (each connector writes
``PREFIX.<role>.<pid>-<n>.jsonl``, one line per engine step), then:

    lmcache bench connector-trace PREFIX.*.jsonl
    lmcache bench connector-trace /tmp/trace/run1.* --slowest 20 --output trace.json

Prints (stderr) per role and hook the calls and the time spent inside our code per step
(total, p50, p99, max), per RPC op the calls, round trips and request bytes, the store and
retrieve copies (in the step's own path or in the background), the worker steps' wall time
(all, with decodes, decode only; ``ours``: the part inside our hooks) and the slowest steps
with decodes next to what the scheduler put in them. The JSON (stdout, ``--output``) holds
the same figures (``lmcache.integration.vllm.step_trace.summarize``).
"""

from __future__ import annotations

import argparse
import sys

from lmcache.cli.errors import CLIError
from lmcache.cli.report import add_json_output_arg, print_json_result
from lmcache.integration.vllm.step_trace import format_summary, read_records, summarize


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", help="trace files (PREFIX.<role>.<pid>-<n>.jsonl)")
    p.add_argument(
        "--slowest", type=int, default=10, help="how many slowest steps to list (default 10)"
    )
    add_json_output_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.slowest < 0:
        raise CLIError(f"--slowest {args.slowest}: give a count >= 0")
    try:
        records = read_records(args.files)
    except OSError as exc:
        raise CLIError(f"cannot read the trace: {exc}") from None
    if not records:
        raise CLIError(
            f"no trace records in {', '.join(args.files)}: run vLLM with "
            "LMCACHE_CONNECTOR_TRACE=PREFIX and give the PREFIX.*.jsonl files it wrote"
        )
    summary = summarize(records, slowest=args.slowest)
    print(format_summary(summary), file=sys.stderr, flush=True)
    print_json_result(summary, args.output)
    return 0
