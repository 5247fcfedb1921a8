"""`lmcache bench kernels`: PLACEHOLDER until its issue lands (replace this whole module)."""

from __future__ import annotations

import argparse

from lmcache.cli.errors import CLIError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("kernels", help="(not implemented yet)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise CLIError("'kernels' is not implemented yet")
