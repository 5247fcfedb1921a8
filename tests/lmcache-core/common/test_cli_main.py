"""The ``lmcache`` console script: dispatch and error reporting without tracebacks."""

from __future__ import annotations

import argparse
import subprocess
import sys

from lmcache.cli import main as cli_main
from lmcache.cli.errors import CLIError

_LOADS_TORCH = """
import sys
from lmcache.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("torch loaded:", "torch" in sys.modules)
"""


def test_only_the_command_that_runs_builds_its_flags_and_ping_never_loads_torch():
    def run(*argv: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-c", _LOADS_TORCH, *argv], capture_output=True, text=True, timeout=120
        )
        return proc.stdout

    for argv in (
        ["--help"],
        ["ping", "--help"],
        ["ping", "kvcache", "--help"],
        ["describe", "--help"],
        ["kvcache", "clear", "--help"],
        ["quota", "list", "--help"],
        ["query", "engine", "--help"],
        ["plugins", "--help"],
        ["bench", "--help"],
    ):
        assert "torch loaded: False" in run(*argv), argv
    server_help = run("server", "--help")
    assert "--l2-adapter" in server_help and "fs" in server_help  # the installed L2 types
    assert "--count" in run("ping", "--help")


def test_the_whole_parser_still_knows_every_flag():
    parser = cli_main.build_parser()
    assert parser.parse_args(["server", "--port", "1234"]).port == 1234
    assert parser.parse_args(["ping", "rpc", "--count", "2"]).count == 2
    assert (
        parser.parse_args(["kvcache", "--format", "json", "clear", "--url", "u"]).format == "json"
    )
    assert parser.parse_args(["quota", "set", "s", "--limit-gb", "2"]).limit_gb == 2
    assert parser.parse_args(["plugins", "--json"]).json is True


def test_help_lists_every_subcommand():
    proc = subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    for command in cli_main.SUBCOMMANDS:
        assert command.name in proc.stdout


def _parser_with(func):
    parser = argparse.ArgumentParser(prog="lmcache")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("boom").set_defaults(func=func)
    return parser


def test_cli_error_is_one_line_without_traceback(monkeypatch, capsys):
    def fail(_args):
        raise CLIError("--l1-size-gb must be > 0 (got -1); pass a positive size", exit_code=2)

    monkeypatch.setattr(cli_main, "build_parser", lambda *_: _parser_with(fail))
    assert cli_main.main(["boom"]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip()
        == "lmcache boom: error: --l1-size-gb must be > 0 (got -1); pass a positive size"
    )
    assert "Traceback" not in err


def test_lmcache_errors_print_their_message_alone(monkeypatch, capsys):
    from lmcache.v1.errors import UnknownL2AdapterTypeError

    def fail(_args):
        raise UnknownL2AdapterTypeError("nope", ["mock"], where="--l2-adapter #1")

    monkeypatch.setattr(cli_main, "build_parser", lambda *_: _parser_with(fail))
    assert cli_main.main(["boom"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "lmcache boom: error: --l2-adapter #1: unknown adapter type 'nope'. Known: mock. Fix the"
    )
    assert "UnknownL2AdapterTypeError" not in err and "Traceback" not in err


def test_unexpected_exception_is_reported_without_traceback(monkeypatch, capsys):
    def fail(_args):
        raise RuntimeError("port 5555 is in use; pass --port")

    monkeypatch.setenv("LMCACHE_LOG_LEVEL", "INFO")
    monkeypatch.setattr(cli_main, "build_parser", lambda *_: _parser_with(fail))
    assert cli_main.main(["boom"]) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: port 5555 is in use; pass --port" in err
    assert "Traceback" not in err


def test_no_subcommand_prints_help_and_fails(capsys):
    assert cli_main.main([]) == 2
    assert "usage: lmcache" in capsys.readouterr().out
