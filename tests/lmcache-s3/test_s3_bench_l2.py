"""``lmcache bench l2`` against an S3 server: every op runs and moves the bytes it reports."""

from __future__ import annotations

import json

from lmcache.cli.main import main


def test_bench_l2_runs_against_s3(moto, bucket, capsys):
    spec = json.dumps({"type": "s3", **moto.spec(bucket)})
    argv = ["bench", "l2", "--format", "json", "--l2-adapter", spec, "--num-keys", "4"]
    argv += ["--data-size-kb", "64"]
    argv += ["--rounds", "2", "--warmup-rounds", "1", "--in-flight", "2", "--no-skip-verify"]
    argv += ["--lookup-max-hit-rate", "0.5"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)["metrics"]["l2"]["adapters"][0]["results"]
    assert res["store"]["successful_keys"] == 16 and res["store"]["successful_tasks"] == 4
    assert res["lookup"]["successful_keys"] == 8  # half of each lookup exists
    assert res["load"]["successful_keys"] == 16 and res["load"]["verify_mismatched_keys"] == 0
    assert res["load"]["avg_mb_per_s"] > 0
    # warmup + 2 rounds of 2 tasks x 4 keys, all in the bucket
    assert moto.client().list_objects_v2(Bucket=bucket)["KeyCount"] == 24
