"""`lmcache ping`: PLACEHOLDER until its issue lands (replace this whole module)."""

from __future__ import annotations

import argparse

from lmcache.cli.errors import CLIError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("ping", help="(not implemented yet)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise CLIError("'ping' is not implemented yet")
