"""How every ``lmcache`` sub-command is declared and gets its parser.

A sub-command is a row of a table (``main.SUBCOMMANDS``, ``bench.BENCH_TARGETS``): its
name, its module and its one-line help. The module's docstring is the description, shown
as written (our docstrings carry examples and tables), and the module's
``add_arguments(parser)`` adds its flags and sets ``func`` (a callable taking the parsed
namespace and returning an exit code). A module may name its own ``HELP_FORMATTER``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Iterable
from typing import NamedTuple


class Subcommand(NamedTuple):
    name: str
    module: str
    help: str


def add_subcommands(
    subparsers: argparse._SubParsersAction,
    commands: Iterable[Subcommand],
    with_flags: Callable[[str], bool] = lambda _name: True,
) -> None:
    """One parser per command; only the commands ``with_flags`` selects import their flags
    (the others show their name and help line)."""
    for command in commands:
        module = importlib.import_module(command.module)
        parser = subparsers.add_parser(
            command.name,
            help=command.help,
            description=module.__doc__,
            formatter_class=getattr(module, "HELP_FORMATTER", argparse.RawDescriptionHelpFormatter),
        )
        if with_flags(command.name):
            module.add_arguments(parser)
