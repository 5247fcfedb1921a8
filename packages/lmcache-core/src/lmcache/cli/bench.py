"""``lmcache bench <target>``: benchmarks with JSON output.

Targets live in their own modules, each exposing ``register(subparsers)``:
``kernels`` (platform ops), ``l2`` (L2 adapters), ``server`` (the MP server), ``vllm``
(TTFT of a real vLLM with and without the cache).
"""

from __future__ import annotations

import argparse
import importlib

BENCH_TARGETS: tuple[tuple[str, str], ...] = (
    ("kernels", "lmcache.cli.bench_kernels"),
    ("l2", "lmcache.cli.bench_l2"),
    ("server", "lmcache.cli.bench_server"),
    ("vllm", "lmcache.cli.bench_vllm"),
)


def register(subparsers: argparse._SubParsersAction, with_flags: bool = True) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run a benchmark and print JSON results",
        description="Benchmarks: kernels (copy ops), l2 (storage adapters), server (MP server), "
        "vllm (TTFT of a real vLLM).",
    )
    if not with_flags:
        return
    targets = parser.add_subparsers(dest="bench_target", metavar="TARGET")
    for _name, module_name in BENCH_TARGETS:
        importlib.import_module(module_name).register(targets)
    parser.set_defaults(func=lambda _args: parser.print_help() or 2)
