"""The ``lmcache`` console script: dispatch and error reporting without tracebacks."""

from __future__ import annotations

import argparse
import subprocess
import sys

from lmcache.cli import main as cli_main
from lmcache.cli.errors import CLIError


def test_help_lists_every_subcommand():
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    for name, _module in cli_main.SUBCOMMANDS:
        assert name in proc.stdout


def _parser_with(func):
    parser = argparse.ArgumentParser(prog="lmcache")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("boom").set_defaults(func=func)
    return parser


def test_cli_error_is_one_line_without_traceback(monkeypatch, capsys):
    def fail(_args):
        raise CLIError("--l1-size-gb must be > 0 (got -1); pass a positive size", exit_code=2)

    monkeypatch.setattr(cli_main, "build_parser", lambda: _parser_with(fail))
    assert cli_main.main(["boom"]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip()
        == "lmcache boom: error: --l1-size-gb must be > 0 (got -1); pass a positive size"
    )
    assert "Traceback" not in err


def test_unexpected_exception_is_reported_without_traceback(monkeypatch, capsys):
    def fail(_args):
        raise RuntimeError("port 5555 is in use; pass --port")

    monkeypatch.setenv("LMCACHE_LOG_LEVEL", "INFO")
    monkeypatch.setattr(cli_main, "build_parser", lambda: _parser_with(fail))
    assert cli_main.main(["boom"]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: port 5555 is in use; pass --port" in err
    assert "Traceback" not in err


def test_no_subcommand_prints_help_and_fails(capsys):
    assert cli_main.main([]) == 2
    assert "usage: lmcache" in capsys.readouterr().out
