"""``lmcache`` console script: dispatches to one module per subcommand.

Each subcommand is a row of ``SUBCOMMANDS`` (see ``lmcache.cli.subcommand``); its module's
``add_arguments(parser)`` adds the flags and sets ``func`` (a callable taking the parsed
namespace and returning an exit code).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from lmcache_namespace_guard import EXIT_CODE as NAMESPACE_EXIT_CODE
from lmcache_namespace_guard import check_namespace

from lmcache.cli.errors import CLIError
from lmcache.cli.subcommand import Subcommand, add_subcommands
from lmcache.v1.errors import LMCacheError

# Order is the order shown by ``lmcache --help``.
SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("server", "lmcache.cli.server", "run the multiprocess KV-cache server"),
    Subcommand(
        "ping",
        "lmcache.cli.ping",
        "check that an lmcache server (or an engine) answers, and the round trip",
    ),
    Subcommand(
        "describe",
        "lmcache.cli.describe",
        "show the detailed status of a running lmcache server (or engine)",
    ),
    Subcommand(
        "kvcache",
        "lmcache.cli.kvcache",
        "manage the KV cache of a running lmcache server (clear, list objects)",
    ),
    Subcommand(
        "quota", "lmcache.cli.quota", "manage per-salt cache quotas of a running lmcache server"
    ),
    Subcommand(
        "query",
        "lmcache.cli.query",
        "run one request (an inference, a cache lookup) and report metrics",
    ),
    Subcommand("bench", "lmcache.cli.bench", "run a benchmark and print JSON results"),
    Subcommand(
        "plugins",
        "lmcache.cli.plugins",
        "list device backends and L2 adapter types, and plugins that failed to load",
    ),
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``lmcache`` parser. With ``command`` (the first word of the command line), only
    that subcommand gets its flags and the others are listed with their one-line help:
    the server's flags name the installed L2 adapter types, and loading those loads torch
    (~2 s), which ``lmcache ping`` or ``lmcache --help`` should not wait for."""
    parser = argparse.ArgumentParser(
        prog="lmcache",
        description="LMCache-compatible KV-cache layer for LLM serving engines.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_subcommands(subparsers, SUBCOMMANDS, lambda name: command is None or command == name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The console script checked already (cached); `python -m lmcache.cli.main` gets here first.
    namespace = check_namespace()
    if not namespace.ok and os.environ.get("LMCACHE_SKIP_NAMESPACE_GUARD") != "1":
        print(f"lmcache: error: {namespace.message()}", file=sys.stderr)
        return NAMESPACE_EXIT_CODE
    if argv[:2] == ["bench", "server"]:
        from lmcache.cli.bench_server import prepare_process

        prepare_process(argv)
    parser = build_parser(argv[0] if argv else "")
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        code = func(args)
    except LMCacheError as exc:  # its message names the bad value and the fix
        print(f"lmcache {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, CLIError) else 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the CLI never shows a raw traceback
        if os.environ.get("LMCACHE_LOG_LEVEL", "").upper() == "DEBUG":
            traceback.print_exc()
        print(f"lmcache {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
