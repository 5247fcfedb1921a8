"""``lmcache bench l2 --format json`` on a mock adapter: ours prints 0.5.6's report with the
same key structure (title, ``config``, ``op_<i>`` and each one's keys, in 0.5.6's order);
ours adds only ``metrics.l2`` (its full result). 0.5.6 prints progress lines around the JSON
on stdout; ours prints the report alone. Needs LMCACHE_COMPAT_VENV (see conftest.py).
"""

from __future__ import annotations

import json

import pytest

MOCK = '{"type":"mock","max_size_gb":1,"mock_bandwidth_gb":10}'


def key_structure(value):
    if isinstance(value, dict):
        return [(k, key_structure(v)) for k, v in value.items()]
    return type(value).__name__ if isinstance(value, str | bool) else "number"


def _json_report(stdout: str) -> dict:
    """The report in a stdout that may hold 0.5.6's progress lines around it."""
    start = stdout.index("{\n")
    end = stdout.rindex("\n}") + 2
    return json.loads(stdout[start:end])


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--lookup-max-hit-rate", "0.5", "--in-flight", "2", "--rounds", "2"],
        ["--only", "load"],
    ],
    ids=["all-ops", "hits", "only-load"],
)
def test_bench_l2_json_key_structure_matches_0_5_6(
    venvs, lmcache_cli, extra, monkeypatch, tmp_path
):
    argv = ["bench", "l2", "--l2-adapter", MOCK, "--num-keys", "4", "--data-size-kb", "16"]
    argv += [*extra, "--format", "json"]
    out = {}
    for side in ("theirs", "ours"):
        with monkeypatch.context() as m:
            if side == "theirs":  # a PYTHONPATH naming our sources would shadow 0.5.6's
                m.delenv("PYTHONPATH", raising=False)
            proc = lmcache_cli(venvs[side], *argv, "--output", str(tmp_path / f"{side}.json"))
        assert proc.returncode == 0, (side, proc.stderr[-2000:])
        out[side] = _json_report(proc.stdout)
        if side == "ours":
            assert json.loads(proc.stdout) == out[side]  # the report alone on stdout
        assert out[side] == json.loads((tmp_path / f"{side}.json").read_text()), side
    ours = dict(out["ours"])
    ours["metrics"] = {k: v for k, v in ours["metrics"].items() if k != "l2"}
    assert key_structure(ours) == key_structure(out["theirs"])
    assert set(out["ours"]["metrics"]) - set(out["theirs"]["metrics"]) == {"l2"}
    for key, section in out["theirs"]["metrics"].items():
        if key.startswith("op_"):
            mine = out["ours"]["metrics"][key]
            assert mine["operation"] == section["operation"]
            for k in ("rounds", "keys_per_round", "total_keys"):
                assert mine[k] == section[k], (key, k)
    assert out["ours"]["metrics"]["config"] == out["theirs"]["metrics"]["config"]


def test_bench_l2_quiet_prints_nothing_on_both(venvs, lmcache_cli, monkeypatch):
    argv = ["bench", "l2", "--l2-adapter", MOCK, "--num-keys", "2", "--data-size-kb", "4", "-q"]
    for side in ("theirs", "ours"):
        with monkeypatch.context() as m:
            if side == "theirs":
                m.delenv("PYTHONPATH", raising=False)
            proc = lmcache_cli(venvs[side], *argv)
        assert (proc.returncode, proc.stdout) == (0, ""), side
