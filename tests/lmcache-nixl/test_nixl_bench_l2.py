"""``lmcache bench l2`` drives nixl_store on POSIX end to end: every key stored, found and loaded
back byte for byte (results, not speed)."""

from __future__ import annotations

import json

import pytest

from lmcache.cli.main import main

pytestmark = pytest.mark.usefixtures("nixl")


def test_bench_l2_against_posix(tmp_path, capsys):
    spec = {
        "type": "nixl_store",
        "backend": "POSIX",
        "pool_size": 4,
        "backend_params": {
            "file_path": str(tmp_path),
            "use_direct_io": "false",
            "file_size": str(1 << 20),
        },
    }
    argv = ["bench", "l2", "--format", "json", "--l2-adapter", json.dumps(spec)]
    argv += ["--l1-align-bytes", "4096"]
    argv += ["--num-keys", "4", "--data-size-kb", "20", "--in-flight", "2", "--rounds", "2"]
    argv += ["--lookup-max-hit-rate", "1.0", "--no-skip-verify"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)  # stdout is pure JSON (0.5.6's report)
    res = report["metrics"]["l2"]["adapters"][0]["results"]
    assert res["store"]["successful_keys"] == res["store"]["keys"] == 16
    assert res["lookup"]["successful_keys"] == 16
    assert res["load"]["successful_keys"] == 16
    assert res["load"]["verify_mismatched_keys"] == 0


def test_bench_l2_default_alignment_is_refused_with_the_fix(tmp_path, capsys):
    spec = {
        "type": "nixl_store",
        "backend": "POSIX",
        "pool_size": 1,
        "backend_params": {"file_path": str(tmp_path), "use_direct_io": "false"},
    }
    assert main(["bench", "l2", "--l2-adapter", json.dumps(spec), "--num-keys", "1"]) != 0
    assert "--l1-align-bytes 4096" in capsys.readouterr().err
