"""The ops commands of LMCache 0.5.6 (describe, kvcache, quota, ping, query) run with the
same arguments by 0.5.6's CLI and ours against the same live 0.5.6 server (and a fake
OpenAI engine): same exit status, same report title and keys, same text where the values
are deterministic. Needs LMCACHE_COMPAT_VENV (see conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from testsupport.fake_engine import fake_engine

QUIET = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false"}


def ours(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **QUIET},
    )


def report(proc: subprocess.CompletedProcess) -> dict:
    """The JSON report of a ``--format json`` run (0.5.6 may log lines before it)."""
    return json.loads(proc.stdout[proc.stdout.index("{") :])


def paths(value, prefix: str = "") -> set[str]:
    if isinstance(value, dict):
        return {p for k, v in value.items() for p in paths(v, f"{prefix}.{k}")} | {prefix}
    if isinstance(value, list):
        return {p for v in value for p in paths(v, f"{prefix}[]")} | {prefix}
    return {prefix}


def terminal(proc: subprocess.CompletedProcess) -> str:
    """The report lines of a terminal run (0.5.6 may print log lines around it)."""
    lines = proc.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("="))
    return "\n".join(lines[first:])


@pytest.fixture(scope="module")
def both(server_pair, compat_venv, lmcache_cli):
    """run(*args) -> {"theirs": proc, "ours": proc}, 0.5.6's CLI first."""

    def run(*args: str) -> dict[str, subprocess.CompletedProcess]:
        return {"theirs": lmcache_cli(compat_venv, *args), "ours": ours(*args)}

    return run


@pytest.fixture(scope="module")
def url(server_pair) -> str:
    return server_pair["theirs"].http_url


def _same_shape(out: dict[str, subprocess.CompletedProcess], *equal: str) -> dict:
    """Both exit alike; ours has 0.5.6's title and every key path; ``equal`` keys match."""
    theirs, mine = out["theirs"], out["ours"]
    assert theirs.returncode == mine.returncode, (theirs.stderr[-1500:], mine.stderr[-1500:])
    t, o = report(theirs), report(mine)
    assert o["title"] == t["title"]
    assert paths(t) <= paths(o), f"key paths ours lacks: {sorted(paths(t) - paths(o))}"
    for key in equal:
        assert o["metrics"][key] == t["metrics"][key], key
    return o


def test_ping_kvcache(both, url):
    out = _same_shape(both("ping", "kvcache", "--url", url, "--format", "json"), "status")
    assert out["metrics"]["status"] == "OK"


def test_describe_kvcache(both, url):
    out = _same_shape(
        both("describe", "kvcache", "--url", url, "--format", "json"),
        "health",
        "url",
        "engine_type",
        "chunk_size",
        "l1_capacity_gb",
        "active_sessions",
    )
    # 0.5.6 reads a /status path its own server no longer fills (N/A); ours shows the policy
    assert out["metrics"]["eviction_policy"] == "LRU"


def test_kvcache_clear_before_and_after_the_action(both, url):
    for args in (["kvcache", "clear", "--url", url], ["kvcache", "-q", "clear", "--url", url]):
        out = both(*args)
        assert out["theirs"].returncode == out["ours"].returncode == 0
        if "-q" in args:
            assert out["ours"].stdout == ""
        else:
            assert terminal(out["ours"]) == terminal(out["theirs"])
    _same_shape(both("kvcache", "--format", "json", "clear", "--url", url), "status")


def test_quota_lifecycle_reads_the_same(both, url, compat_venv, lmcache_cli):
    steps = [
        ["quota", "set", "alice", "--limit-gb", "1.5", "--url", url],
        ["quota", "get", "alice", "--url", url],
        ["quota", "list", "--url", url],
        ["quota", "delete", "alice", "--url", url],
        ["quota", "delete", "alice", "--url", url],
        ["quota", "get", "nobody", "--url", url],
        ["quota", "list", "--url", url],
    ]
    # 0.5.6's whole sequence, then ours from the same state (it ends where it began)
    theirs = [lmcache_cli(compat_venv, *step) for step in steps]
    for step, their in zip(steps, theirs, strict=True):
        mine = ours(*step)
        assert their.returncode == mine.returncode == 0, step
        assert terminal(mine) == terminal(their), step
    both("quota", "set", "bob", "--limit-gb", "2", "--url", url)
    _same_shape(both("quota", "list", "--url", url, "--format", "json"))
    _same_shape(both("quota", "get", "bob", "--url", url, "--format", "json"), "limit_gb")
    _same_shape(both("quota", "delete", "bob", "--url", url, "--format", "json"), "cache_salt")


def test_unreachable_server_fails_alike(both, free_tcp_port):
    dead = f"http://127.0.0.1:{free_tcp_port}"
    for args in (
        ["describe", "kvcache", "--url", dead],
        ["kvcache", "clear", "--url", dead],
        ["quota", "list", "--url", dead],
    ):
        out = both(*args)
        assert out["theirs"].returncode == out["ours"].returncode == 1, args
        assert "Traceback" not in out["ours"].stderr
    out = both("ping", "kvcache", "--url", dead, "--format", "json")
    assert out["theirs"].returncode == out["ours"].returncode == 1
    assert report(out["ours"])["metrics"]["status"] == report(out["theirs"])["metrics"]["status"]


def test_engine_commands(both):
    with fake_engine() as (engine, _requests):
        _same_shape(
            both("describe", "engine", "--url", engine, "--format", "json"),
            "model",
            "max_context",
            "status",
            "running_requests",
        )
        _same_shape(both("ping", "engine", "--url", engine, "--format", "json"), "status")
        out = _same_shape(
            both("query", "engine", "--url", engine, "--prompt", "hi", "--format", "json"),
            "model",
            "answer",
            "prompt_tokens",
            "output_tokens",
        )
        assert out["metrics"]["answer"] == "Hello, world"


def test_query_kvcache_without_arguments_does_nothing_on_both(both):
    out = both("query", "kvcache")
    assert out["theirs"].returncode == out["ours"].returncode == 0
    assert out["ours"].stdout == ""
