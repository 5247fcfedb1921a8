"""``lmcache ping``: is an ``lmcache server`` alive, and how long is a round trip?

Connects (asking the chunk size, timed apart as ``connect_ms``), then sends ``ping``
(op 22) ``--count`` times and prints each RTT; exits 1 when the server does not answer
within ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from lmcache.cli.errors import CLIError


def register(subparsers: argparse._SubParsersAction, with_flags: bool = True) -> None:
    parser = subparsers.add_parser(
        "ping", help="check that an lmcache server answers (RTT)", description=__doc__
    )
    if not with_flags:
        return
    parser.add_argument(
        "--url", default="localhost:5555", help="server RPC URL (default localhost:5555)"
    )
    parser.add_argument("--count", type=int, default=3, help="pings to send (default 3)")
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait per ping (default 5)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lmcache.v1.multiprocess.client import LMCacheTimeoutError, MPClient, normalize_url

    if args.count < 1:
        raise CLIError(f"--count must be >= 1 (got {args.count})")
    try:
        url = normalize_url(args.url)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    rtts: list[float] = []

    def no_reply() -> CLIError:
        return CLIError(
            f"no reply from {url} within {args.timeout} s; is `lmcache server` running there?", 1
        )

    with MPClient(url, default_timeout=args.timeout) as client:
        # The first request also sets up the connection: timed apart from the pings.
        t0 = time.perf_counter()
        try:
            chunk_size = client.get_chunk_size(timeout=args.timeout)
        except LMCacheTimeoutError:
            raise no_reply() from None
        connect_ms = (time.perf_counter() - t0) * 1000
        if not args.json:
            print(f"connected to {url} in {connect_ms:.3f} ms (chunk_size {chunk_size})")
        for _ in range(args.count):
            t0 = time.perf_counter()
            try:
                client.ping(None)
            except LMCacheTimeoutError:
                raise no_reply() from None
            rtts.append((time.perf_counter() - t0) * 1000)
            if not args.json:
                print(f"reply from {url}: time={rtts[-1]:.3f} ms")
    summary = {
        "url": url,
        "alive": True,
        "count": len(rtts),
        "chunk_size": chunk_size,
        "connect_ms": connect_ms,
        "rtt_ms_min": min(rtts),
        "rtt_ms_p50": statistics.median(rtts),
        "rtt_ms_max": max(rtts),
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"{url} is alive (chunk_size {chunk_size}): rtt min/p50/max = "
            f"{summary['rtt_ms_min']:.3f}/{summary['rtt_ms_p50']:.3f}/{summary['rtt_ms_max']:.3f} ms"
        )
    return 0
