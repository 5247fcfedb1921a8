"""``lmcache server`` flags: every flag of LMCache 0.5.6 (from its own ``--help``) parses on
ours, 0.5.6's defaults passed explicitly start ours, and any other valid value either
works or stops start-up with one line naming the flag -- never an argparse error.

Needs LMCACHE_COMPAT_VENV (see conftest.py). The sample command lines are parsed by
0.5.6's own parser first, so only valid 0.5.6 command lines are put to ours.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from typing import Any

import pytest

from lmcache.cli.errors import CLIError

# Builds 0.5.6's `lmcache server` parser (its CLI registers only the command it runs) and
# prints every option as JSON; with argv lists on stdin it parses each and prints the bad ones.
_PARSER_056 = r"""
import argparse, json, sys
from lmcache.cli.commands import register_commands
root = argparse.ArgumentParser(prog="lmcache")
register_commands(root.add_subparsers(dest="command"), ["server"])
server = root._subparsers._group_actions[0].choices["server"]
if sys.argv[1:] == ["dump"]:
    out = []
    for a in server._actions:
        if not a.option_strings or isinstance(a, argparse._HelpAction):
            continue
        default = a.default if isinstance(a.default, (str, int, float, bool, list, type(None))) else None
        out.append({"options": a.option_strings, "nargs": a.nargs, "default": default,
                    "choices": list(a.choices) if a.choices else None,
                    "type": getattr(a.type, "__name__", None), "kind": type(a).__name__})
    print(json.dumps(out))
else:
    server.error = lambda message: (_ for _ in ()).throw(ValueError(message))
    bad = []
    for argv in json.load(sys.stdin):
        try:
            server.parse_args(argv)
        except (ValueError, SystemExit) as exc:
            bad.append([argv, str(exc)])
    print(json.dumps(bad))
"""


def _run_056(venv, *args: str, stdin: str = "") -> str:
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _PARSER_056, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def help_flags(compat_venv, lmcache_cli) -> set[str]:
    """Every option string 0.5.6's ``lmcache server --help`` shows."""
    proc = lmcache_cli(compat_venv, "server", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    usage = proc.stdout.split("\n\n")[0]  # the usage block names every option once
    flags = set(re.findall(r"\[(-{1,2}[a-z0-9][a-z0-9-]*)", usage))
    flags |= set(re.findall(r"\| (--no-[a-z0-9-]+)\]", usage))
    flags.discard("-h")
    assert len(flags) > 90, usage  # 0.5.6 has ~100; a short list means the help changed shape
    return flags


@pytest.fixture(scope="module")
def options_056(compat_venv) -> list[dict[str, Any]]:
    return json.loads(_run_056(compat_venv, "dump"))


def _ours() -> argparse.ArgumentParser:
    from lmcache.cli.server import add_server_args
    from lmcache.cli.server_flags import one_line_parse_errors

    parser = argparse.ArgumentParser(prog="lmcache server")
    add_server_args(parser)
    one_line_parse_errors(parser)
    return parser


def _value(opt: dict[str, Any], changed: bool) -> list[str]:
    """A valid value for ``opt``: its 0.5.6 default ([] when it has none), or another one."""
    default = opt["default"]
    if opt["nargs"] == "*":
        return ["a", "b"] if changed else []
    if opt["kind"] == "_AppendAction":
        return ['{"type": "mock", "max_size_gb": 1}'] if changed else []
    if not changed:
        return [] if default is None else [str(default)]
    if opt["choices"]:
        others = [str(c) for c in opt["choices"] if c != default]
        return others[:1]
    if opt["type"] == "int":
        return [str((default or 0) + 1)]
    if opt["type"] == "float":
        return [str((default or 0.0) + 1.5)]
    return ["changed-value"]


def _samples(opt: dict[str, Any]) -> list[list[str]]:
    """0.5.6 command lines using ``opt``: with its default (first) and changed."""
    flag, *others = opt["options"]
    if opt["kind"] == "BooleanOptionalAction":  # --X / --no-X: the default form first
        return [[flag], [others[0]]] if opt["default"] else [[others[0]], [flag]]
    if opt["kind"] in ("_StoreTrueAction", "_StoreFalseAction"):
        return [[flag]]
    default = _value(opt, changed=False)
    lines = [[flag, *default]] if (default or opt["nargs"] == "*") else []
    return [*lines, [flag, *_value(opt, changed=True)]]


def test_every_0_5_6_flag_is_known_to_ours(help_flags, options_056):
    known = {s for a in options_056 for s in a["options"]}
    assert help_flags <= known, f"help names flags the parser lacks: {help_flags - known}"
    ours = {s for a in _ours()._actions for s in a.option_strings}
    assert not help_flags - ours, f"0.5.6 flags missing from ours: {sorted(help_flags - ours)}"


def test_every_valid_0_5_6_flag_value_parses_on_ours_and_starts_or_stops_in_one_line(
    compat_venv, help_flags, options_056, tmp_path
):
    from lmcache.cli.server import build_configs

    samples = [
        argv
        for opt in options_056
        if set(opt["options"]) & help_flags
        for argv in _samples(opt)
        if argv
    ]
    assert not json.loads(_run_056(compat_venv, stdin=json.dumps(samples))), "bad samples"
    parser = _ours()
    outcomes: dict[str, str] = {}
    for argv in samples:
        try:
            args = parser.parse_args([*argv, "--port", "0", "--http-port", "0"])
        except SystemExit:
            pytest.fail(f"ours rejects the valid 0.5.6 command line {argv} at parse time")
        try:
            build_configs(args)
            outcomes[" ".join(argv)] = "starts"
        except CLIError as exc:
            message = str(exc)
            assert "\n" not in message and argv[0] in message, (argv, message)
            outcomes[" ".join(argv)] = message
    # A feature we lack stops start-up only when asked for; its default never does.
    for opt in options_056:
        lines = _samples(opt)
        if opt["default"] not in (None, [], "") and lines and len(lines[0]) > 1:
            assert outcomes.get(" ".join(lines[0]), "starts") == "starts", (lines[0], outcomes)


def test_0_5_6_defaults_passed_explicitly_start_ours(options_056, help_flags):
    """The whole set of 0.5.6 defaults on one command line (what a generated launcher
    writes) builds our configuration without a word."""
    from lmcache.cli.server import build_configs

    argv: list[str] = []
    for opt in options_056:
        if not set(opt["options"]) & help_flags or opt["default"] in (None,):
            continue
        if opt["kind"] in ("_StoreTrueAction", "_StoreFalseAction"):
            continue  # their default is "absent"
        if opt["kind"] == "BooleanOptionalAction":
            argv.append(opt["options"][0] if opt["default"] else opt["options"][1])
            continue
        if opt["kind"] == "_AppendAction":
            continue
        values = _value(opt, changed=False)
        if opt["nargs"] == "*" or values:
            argv += [opt["options"][0], *values]
    assert "--p2p-transfer-engine nixl" in " ".join(argv)  # once a start-up stopper
    assert "--gds-l1-use-direct-io" in argv and "--lookup-hash-log-dir" in argv
    args = _ours().parse_args([*argv, "--port", "0", "--http-port", "0"])
    mp, storage = build_configs(args)
    assert mp.supported_transfer_mode == "lmcache_driven"  # 0.5.6's default, given explicitly
    assert mp.max_gpu_workers == 1 and storage is not None
