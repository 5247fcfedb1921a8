"""``lmcache bench l2`` runs against a registered type and reports JSON (no timing asserts)."""

from __future__ import annotations

import json

import pytest

from lmcache.cli.main import main

MOCK = '{"type":"mock","max_size_gb":0.1,"mock_bandwidth_gb":50}'


def test_bench_l2_mock_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(
        [
            "bench",
            "l2",
            "--l2-adapter",
            MOCK,
            "--num-keys",
            "4",
            "--data-size-kb",
            "4",
            "--in-flight",
            "2",
            "--rounds",
            "2",
            "--warmup-rounds",
            "0",
            "--lookup-max-hit-rate",
            "0.5",
            "--no-skip-verify",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text())
    res = report["adapters"][0]["results"]
    assert set(res) == {"store", "lookup", "load"}
    assert res["store"]["successful_keys"] == 16 and res["store"]["tasks"] == 4
    assert res["lookup"]["successful_keys"] == 8  # half of each lookup hits
    assert res["load"]["successful_keys"] == 16 and res["load"]["verify_mismatched_keys"] == 0
    for op in res.values():
        for field in (
            "p50_ms",
            "p99_ms",
            "avg_mb_per_s",
            "min_mb_per_s",
            "max_mb_per_s",
            "avg_latency_per_key_us",
        ):
            assert field in op


def test_bench_l2_env_fallback_and_only(monkeypatch, capsys):
    monkeypatch.setenv("L2_ADAPTER_JSON", MOCK)
    assert (
        main(
            [
                "bench",
                "l2",
                "--num-keys",
                "2",
                "--data-size-kb",
                "1",
                "--only",
                "load",
                "--warmup-rounds",
                "0",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)["adapters"][0]["results"]
    assert list(res) == ["load"]


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["--l2-adapter", "{bad"], "Invalid JSON for --l2-adapter #1"),
        (["--l2-adapter", '{"type":"nope"}'], "unknown adapter type 'nope'. Known: "),
        (["--l2-adapter", MOCK, "--num-keys", "0"], "--num-keys must be >= 1"),
    ],
)
def test_bench_l2_errors_are_one_line(argv, text, capsys, monkeypatch):
    monkeypatch.delenv("L2_ADAPTER_JSON", raising=False)
    assert main(["bench", "l2", *argv]) != 0
    err = capsys.readouterr().err
    assert text in err and "Traceback" not in err
