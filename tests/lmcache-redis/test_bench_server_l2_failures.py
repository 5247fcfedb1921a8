"""`lmcache bench server` reports the run's L2 store failures: against a server whose Redis
was killed the checksums still pass (the chunks stay in L1) but the report counts the failed
chunks, names the error, is not verified and exits 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _bench(srv, out) -> subprocess.CompletedProcess:
    args = ["bench", "server", "--rpc-url", srv.rpc_url, "--url", srv.http_url, "--mode", "cpu"]
    args += ["--kvcache-shape-spec", "(2,96,16,2,16):float16:2", "--interval", "0"]
    args += ["--start", "0", "--end", "3", "--num-tokens", "512", "--fresh-prompts"]
    args += ["--lookup-repeats", "0", "--format", "json", "--output", str(out), "--no-progress"]
    return subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )


def test_bench_server_counts_l2_store_failures(redis_server, lmcache_server, tmp_path):
    adapter = {"type": "resp", "host": "127.0.0.1", "port": redis_server.port}
    adapter["health_check_interval_s"] = 0.2
    srv = lmcache_server("--l2-adapter", json.dumps(adapter))

    proc = _bench(srv, tmp_path / "ok.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((tmp_path / "ok.json").read_text())["metrics"]["results"]
    assert res["verified"] is True and res["l2_store_failed_chunks"] == 0
    assert res["l2_store_submitted_chunks"] > 0

    redis_server.kill()
    proc = _bench(srv, tmp_path / "down.json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    res = json.loads((tmp_path / "down.json").read_text())["metrics"]["results"]
    assert res["pass_rate"] == 100.0  # L1 still serves every chunk
    assert res["l2_store_failed_chunks"] == res["l2_store_submitted_chunks"] > 0
    assert res["l2_store_failed_tasks"] > 0 and res["verified"] is False
    assert res["l2_errors"] and res["l2_errors"][0].startswith("resp: ")
    assert "L2 store failed for" in proc.stderr
