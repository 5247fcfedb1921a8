"""`lmcache server` flag handling, `lmcache ping` and `lmcache bench server` as real commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch

from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.client import MPClient


def _lmcache(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    return subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--port", "abc"], "--port"),
        (["--supported-transfer-mode", "gpu_driven"], "--supported-transfer-mode"),
        (
            ["--enable-tracing"],
            "option --enable-tracing is not supported by this version of lmcache server",
        ),
        (["--transport", "grpc"], "option --transport is not supported"),
        (["--hash-algorithm", "sha256_cbor"], "option --hash-algorithm is not supported"),
        (["--run-script-api-enabled", "true"], "--run-script-api-enabled"),
        (["--chunk-size", "0"], "--chunk-size"),
        (["--l1-size-gb", "-1"], "--l1-size-gb"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args, needle, capsys):
    from lmcache.cli.main import main

    try:
        code = main(["server", *args, "--port", "0", "--http-port", "0"])
    except SystemExit as exc:  # argparse rejects the value before our code runs
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def bench_srv(lmcache_server_module):
    import os

    return lmcache_server_module("--shm-name", f"bench{os.getpid()}")


def test_ping_alive_and_dead(bench_srv, free_tcp_port, capsys):
    from lmcache.cli.main import main

    assert main(["ping", "--url", bench_srv.rpc_url, "--count", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["alive"] is True and out["chunk_size"] == 256 and out["count"] == 2
    assert out["connect_ms"] > 0  # the connection set-up is not one of the pings
    code = main(["ping", "--url", f"127.0.0.1:{free_tcp_port}", "--timeout", "0.5", "--count", "1"])
    err = capsys.readouterr().err
    assert code == 1 and "no reply" in err and "Traceback" not in err


@pytest.mark.parametrize("mode", ["engine_driven", "lmcache_driven"])
def test_bench_server_verifies_and_reports(bench_srv, tmp_path, mode):
    srv = bench_srv
    out = tmp_path / "bench.json"
    r = _lmcache(
        "bench",
        "server",
        "--rpc-url",
        srv.rpc_url,
        "--mode",
        "cpu",
        "--transfer-mode",
        mode,
        "--kvcache-shape-spec",
        "(2,96,16,2,16):float16:2",
        "--start",
        "256",
        "--end",
        "512",
        "--interval",
        "256",
        "--iterations",
        "2",
        "--lookup-repeats",
        "5",
        "--url",
        srv.http_url,
        "--format",
        "json",
        "--output",
        str(out),
        "--no-progress",
        *(["--baselines"] if mode == "engine_driven" else []),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    m = data["metrics"]
    assert [x["num_tokens"] for x in m["results"]] == [256, 512]
    assert all(x["verified"] for x in m["results"])
    for op in ("cold_store", "warm_retrieve", "cold_lookup", "warm_lookup", "cached_lookup"):
        assert f"{op}_p50_ms" in m and f"{op}_p99_ms" in m and op in m
    assert "gbps" in m["cold_store"] and "gbps" in m["warm_retrieve"]
    # while the server copies its KV, the simulated engine's OpenMP threads sleep
    assert data["config"]["omp_wait_policy"] == (
        "PASSIVE" if mode == "lmcache_driven" else "default"
    )
    # the bench's synchronous calls busy-poll for quick replies (client.SpinPolicy)
    spin = data["config"]["client_spin"]
    assert spin["spin_us"] == 500 and spin["polled"] > 0 and spin["caught"] <= spin["polled"]
    if mode == "engine_driven":
        assert set(m["baselines"]) == {
            "rpc_noop",
            "bare_zmq_req_rep",
            "bare_zmq_req_rep_two_processes",
            "memcpy_64MiB",
            "memcpy_64MiB_one_thread",
        }
        assert all(b["p50_ms"] > 0 for b in m["baselines"].values())


_SEE_PROCESS_BEFORE_FLAGS = """
import json, os, sys
import lmcache.cli.main as cli

def build_parser(*_):  # building the server's flags loads torch, and libgomp with it
    print(json.dumps({"policy": os.environ.get("OMP_WAIT_POLICY"), "torch": "torch" in sys.modules}))
    raise SystemExit(0)

cli.build_parser = build_parser
cli.main(sys.argv[1:])
"""


@pytest.mark.parametrize(
    "mode,preset,policy",
    [
        (["--transfer-mode", "lmcache_driven"], None, "PASSIVE"),
        (["--transfer=lmcache_driven"], None, "PASSIVE"),  # spelled as argparse accepts it
        (["--transfer-mode", "lmcache_driven"], "ACTIVE", "ACTIVE"),  # the user's setting stands
        (["--transfer-mode", "engine_driven"], None, None),
    ],
)
def test_bench_server_sets_openmp_up_before_torch_loads(mode, preset, policy):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if preset:
        env["OMP_WAIT_POLICY"] = preset
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            _SEE_PROCESS_BEFORE_FLAGS,
            "bench",
            "server",
            *mode,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout) == {"policy": policy, "torch": False}


def test_http_prefetch_and_checksums(lmcache_server, mp):
    srv = lmcache_server()
    kv = mp.make_kv()
    c, ctx = mp.worker(srv.rpc_url, kv, mode="lmcache_driven", model="http-m")
    try:
        assert ctx.submit_store(mp.key("h", model="http-m"), list(range(1, 33))).result(20)
        r = httpx.post(
            srv.http_url + "/cache/prefetches",
            json={"model_name": "http-m", "world_size": 1, "token_ids": mp.TOKENS},
        )
        assert r.status_code == 202
        pid = r.json()["request_id"]
        for _ in range(100):
            st = httpx.get(srv.http_url + f"/cache/prefetches/{pid}").json()
            if st["status"] == "completed":
                break
        assert st == {"request_id": pid, "status": "completed", "found_keys": 2, "total_keys": 2}
        sums = httpx.post(
            srv.http_url + "/cache/checksums",
            json={
                "block_ids": list(range(1, 33)),
                "chunk_size": 16,
                "instance_id": ctx.instance_id,
            },
        ).json()["chunk_checksums"]
        assert len(sums) == 2 and sums[0] != sums[1]
        # the same blocks give the same checksum; changing one byte changes it
        again = httpx.post(
            srv.http_url + "/cache/checksums",
            json={
                "block_ids": list(range(1, 17)),
                "chunk_size": 16,
                "instance_id": ctx.instance_id,
            },
        ).json()["chunk_checksums"]
        assert again == sums[:1]
        with torch.no_grad():
            kv[0][0, 1, 0, 0, 0] += 1
        changed = httpx.post(
            srv.http_url + "/cache/checksums",
            json={
                "block_ids": list(range(1, 17)),
                "chunk_size": 16,
                "instance_id": ctx.instance_id,
            },
        ).json()["chunk_checksums"]
        assert changed != sums[:1]
    finally:
        ctx.close()
        c.close()


def test_report_block_allocation_and_status_counts(lmcache_server, mp):
    srv = lmcache_server()
    with MPClient(srv.rpc_url) as c:
        rec = [{"req_id": "a", "new_block_ids": [1, 2], "new_token_ids": [3]}]
        assert c.call("report_block_allocation", 1, "m", rec) is None
        assert mp.metric(srv, "lmcache_mp_report_block_allocation_total") == 1
        k = P.IPCCacheServerKey(
            model_name="m",
            world_size=1,
            worker_id=None,
            token_ids=[1, 2],
            start=0,
            end=2,
            request_id="st",
            num_kv_readers=1,
        )
        c.call("lookup", k, 1)
        assert mp.status(srv)["active_sessions"] == 1
        assert c.call("end_session", "st") is None
        assert mp.status(srv)["active_sessions"] == 0


def test_http_delete_l1_objects(bench_srv, mp):
    from lmcache.v1.multiprocess.token_hasher import chunk_hashes, compute_kv_rank

    model = "http-delete-m"
    c, ctx = mp.worker(bench_srv.rpc_url, mp.make_kv(), model=model)
    try:
        assert ctx.submit_store(mp.key("d", model=model), list(range(1, 33))).result(20)
        keys = [
            {"chunk_hash_hex": h.hex(), "model_name": model, "kv_rank": compute_kv_rank(1, 0)}
            for h in chunk_hashes(mp.TOKENS, 256)
        ]
        r = httpx.request(
            "DELETE", bench_srv.http_url + "/cache/objects", json={"keys": keys, "tier": "l1"}
        )
        assert r.status_code == 200 and r.json()["deleted"] == 2 and r.json()["ok"] is True
        assert mp.lookup_hits(c, model=model) == 0
        incomplete = httpx.request(  # a key without its fields: 0.5.6's 422
            "DELETE",
            bench_srv.http_url + "/cache/objects",
            json={"keys": [{"chunk_hash_hex": "zz"}], "tier": "l1"},
        )
        assert incomplete.status_code == 422
        not_hex = httpx.request(
            "DELETE",
            bench_srv.http_url + "/cache/objects",
            json={"keys": [{**keys[0], "chunk_hash_hex": "zz"}], "tier": "l1"},
        )
        assert not_hex.status_code == 400 and "keys[0]" in not_hex.json()["detail"]
    finally:
        ctx.close()
        c.close()
