"""``lmcache ping {kvcache,engine,rpc}``: does a server answer, and how fast?

``kvcache`` GETs the MP server's ``/healthcheck``, ``engine`` an OpenAI server's
``/health`` (both as LMCache 0.5.6 does, default URLs ``http://localhost:8080`` and
``http://localhost:8000``). ``rpc`` is ours: it connects to the RPC port over ZeroMQ
(default ``localhost:5555``; the chunk-size request that opens the connection is timed
apart as ``connect_ms``) and sends ``ping`` (op 22). Exit status 1 when the server does not
answer within ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

from lmcache.cli.errors import CLIError
from lmcache.cli.report import Report, add_output_args

_HTTP_TARGETS = {
    "kvcache": ("/healthcheck", "Ping KV Cache"),
    "engine": ("/health", "Ping Engine"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target", choices=("kvcache", "engine", "rpc"), help="what to ping (rpc: ours, ZeroMQ)"
    )
    parser.add_argument(
        "--url",
        default=None,
        help="server URL (default: http://localhost:8080 for kvcache, http://localhost:8000 "
        "for engine, localhost:5555 for rpc)",
    )
    parser.add_argument("--count", type=int, default=1, help="pings to send (default 1)")
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait per ping (default 10)"
    )
    add_output_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.count < 1:
        raise CLIError(f"--count must be >= 1 (got {args.count})")
    if args.target == "rpc":
        return _ping_rpc(args)
    from lmcache.cli.http_client import DEFAULT_URLS, base_url, probe

    path, title = _HTTP_TARGETS[args.target]
    url = base_url(args.url or DEFAULT_URLS[args.target]) + path
    rtts, error = [], None
    for _ in range(args.count):
        ok, rtt, why = probe(url, args.timeout)
        rtts.append(rtt)
        if not ok:
            error = why
            break
    report = Report(title, width=30)
    report.add("status", "Status", "FAIL" if error else "OK")
    report.add("round_trip_time_ms", "Round trip time (ms)", round(statistics.median(rtts), 2))
    report.emit(args)
    if error:
        raise CLIError(error, 1)
    return 0


def _ping_rpc(args: argparse.Namespace) -> int:
    from lmcache.v1.multiprocess.client import LMCacheTimeoutError, MPClient, normalize_url

    try:
        url = normalize_url(args.url or "localhost:5555")
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    rtts: list[float] = []
    chunk_size = connect_ms = None
    error = None
    with MPClient(url, default_timeout=args.timeout) as client:
        try:
            t0 = time.perf_counter()
            chunk_size = client.get_chunk_size(timeout=args.timeout)
            connect_ms = (time.perf_counter() - t0) * 1000
            for _ in range(args.count):
                t0 = time.perf_counter()
                client.ping(None)
                rtts.append((time.perf_counter() - t0) * 1000)
        except LMCacheTimeoutError:
            error = (
                f"no reply from {url} within {args.timeout} s; is `lmcache server` running there?"
            )
    report = Report("Ping RPC", width=36)
    report.add("status", "Status", "FAIL" if error else "OK")
    report.add(
        "round_trip_time_ms",
        "Round trip time (ms)",
        round(statistics.median(rtts), 3) if rtts else None,
    )
    report.add("url", "URL", url)
    report.add("chunk_size", "Chunk size", chunk_size)
    report.add("connect_ms", "Connect (ms)", None if connect_ms is None else round(connect_ms, 3))
    report.add("count", "Pings answered", len(rtts))
    for name, fn in (("min", min), ("p50", statistics.median), ("max", max)):
        report.add(f"rtt_ms_{name}", f"RTT {name} (ms)", round(fn(rtts), 3) if rtts else None)
    report.emit(args)
    if error:
        raise CLIError(error, 1)
    return 0
