"""How every ``lmcache`` sub-command adds its parser: help line, module docstring as the
description, shown as written (our docstrings carry examples and tables)."""

from __future__ import annotations

import argparse


def add_command_parser(
    subparsers: argparse._SubParsersAction, name: str, help: str, description: str | None
) -> argparse.ArgumentParser:
    return subparsers.add_parser(
        name,
        help=help,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
