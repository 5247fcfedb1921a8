"""``lmcache bench vllm-serve`` for real, short: ``vllm serve`` under ``vllm bench serve``
(prefix_repetition) on a tiny model, vLLM's prefix cache alone and ours with the server
SIGKILLed and restarted on the same ports mid-load (``nox -s vllm``; skipped without vLLM).
The full-size scenario (issue 29) is the command's defaults; docs/vllm.md has it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (run `nox -s vllm`)")

# Long enough (about 30 s on 2 cores) for the load to outlast the kill 1 s into it, the
# restart 2 s later and the new server's start-up on a host busy with vLLM (up to 15 s).
PROMPTS = 1600


def test_bench_vllm_serve_with_a_server_killed_and_restarted(tmp_path):
    cache = Path(os.environ.get("LMCACHE_TEST_CACHE", Path.home() / ".cache" / "lmcache-tests"))
    out = tmp_path / "serve.json"
    cmd = [
        sys.executable,
        "-m",
        "lmcache.cli.main",
        "bench",
        "vllm-serve",
        "--layers",
        "2",
        "--hidden-size",
        "256",
        "--model-cache",
        str(cache),
        "--cases",
        "vllm_prefix,lmcache_sigkill",
        "--max-model-len",
        "1024",
        "--prefix-len",
        "512",
        "--suffix-len",
        "16",
        "--num-prefixes",
        "8",
        "--output-len",
        "4",
        "--num-prompts",
        str(PROMPTS),
        "--l1-size-gb",
        "0.5",
        "--chunk-size",
        "128",
        "--connector-extra",
        json.dumps(
            {
                "lmcache.mp.heartbeat_interval": "1",
                "lmcache.mp.lookup_timeout": "2",
                "lmcache.mp.retrieve_timeout": "2",
            }
        ),
        "--kill-at",
        "1",
        "--restart-after",
        "2",
        "--timeout",
        "400",
        "--keep-logs",
        str(tmp_path / "logs"),
        "--output",
        str(out),
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result  # the same JSON on stdout
    assert "| lmcache_sigkill |" in proc.stderr  # and the table
    cases = result["cases"]
    assert list(cases) == ["vllm_prefix", "lmcache_sigkill"]
    for name, row in cases.items():
        assert (row["completed"], row["failed"]) == (PROMPTS, 0), (name, row)
        assert row["median_ttft_ms"] > 0 and row["mean_tpot_ms"] is not None
    killed = cases["lmcache_sigkill"]
    assert [f["action"] for f in killed["faults"]] == ["kill", "restart"]
    restarted = killed["faults"][1]["done_s"]
    assert restarted < killed["duration"], f"the load ended before the restart: {killed}"
    # the restarted server (its counters start at 0) stored and handed back chunks again
    assert killed["server"]["chunks_stored"] > 0
    assert killed["server"]["lookup_hit_tokens"] > 0
    assert "lmcache_median_ttft_vs_vllm_prefix" not in result["goals"]  # no plain lmcache case
