"""Benchmarks: kernels (copy ops), l2 (storage adapters), server (MP server), vllm (TTFT
of a real vLLM), vllm-serve (vLLM's OpenAI server under load), connector-trace (where vLLM's
steps spend time in the connector).

``lmcache bench kernels|vllm|vllm-serve|connector-trace`` print JSON results; ``bench l2`` and ``bench server`` print
LMCache 0.5.6's reports (``--format terminal|json``, ``--output``, ``-q``).
``lmcache bench <target> --help`` lists the target's flags.
"""

from __future__ import annotations

import argparse

from lmcache.cli.subcommand import Subcommand, add_subcommands

# Each target has its own module (see lmcache.cli.subcommand).
BENCH_TARGETS: tuple[Subcommand, ...] = (
    Subcommand(
        "kernels",
        "lmcache.cli.bench_kernels",
        "time multi_layer_block_kv_transfer (CPU) against a plain copy; JSON output",
    ),
    Subcommand(
        "l2",
        "lmcache.cli.bench_l2",
        "benchmark L2 adapters (store/lookup/load throughput and latency; 0.5.6's report)",
    ),
    Subcommand(
        "server",
        "lmcache.cli.bench_server",
        "check and benchmark a running lmcache server (an engine simulator)",
    ),
    Subcommand(
        "vllm",
        "lmcache.cli.bench_vllm",
        "TTFT of a real vLLM: no cache, our hit, vLLM's prefix cache (JSON)",
    ),
    Subcommand(
        "vllm-serve",
        "lmcache.cli.bench_vllm_serve",
        "vllm serve under vllm bench serve: no cache, vLLM's prefix cache, ours, faults (JSON)",
    ),
    Subcommand(
        "connector-trace",
        "lmcache.cli.bench_connector_trace",
        "summarize the connector's step trace (LMCACHE_CONNECTOR_TRACE): hooks, RPCs, steps",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    targets = parser.add_subparsers(dest="bench_target", metavar="TARGET")
    add_subcommands(targets, BENCH_TARGETS)
    parser.set_defaults(func=lambda _args: parser.print_help() or 2)
