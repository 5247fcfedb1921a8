"""The ops commands (LMCache 0.5.6's describe, kvcache, quota, ping, query; ours: ping rpc,
kvcache objects, query kvcache) run as real commands against a real server and a fake
OpenAI engine. Their JSON is 0.5.6's report: ``{"title", "metrics"}``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from testsupport.fake_engine import ANSWER, MODEL, PROMPT_TOKENS, fake_engine

MOCK_L2 = '{"type":"mock","max_size_gb":1,"mock_bandwidth_gb":10}'


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )


def report(*args: str) -> dict:
    proc = cli(*args, "--format", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def srv(lmcache_server_module):
    return lmcache_server_module("--l2-adapter", MOCK_L2)


def test_describe_kvcache(srv, mp):
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model="described")
    try:
        assert ctx.submit_store(mp.key("d", model="described"), list(range(1, 33))).result(20)
        out = report("describe", "kvcache", "--url", srv.http_url)
    finally:
        ctx.close()
        c.close()
    assert out["title"] == "LMCache KV Cache Service"
    m = out["metrics"]
    assert m["health"] == "OK" and m["url"] == srv.http_url and m["chunk_size"] == 256
    assert m["eviction_policy"] == "LRU" and m["active_sessions"] >= 0
    assert m["l1_capacity_gb"] == 0.25 and m["cached_objects"] >= 2
    assert m["l1_used_gb"].endswith("%)")
    assert [a["type"] for a in m["l2_adapters"]] == ["mock"]
    assert "described" in [x["model"] for x in m["models"]]


def test_kvcache_clear_empties_l1(srv, mp):
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model="cleared")
    try:
        assert ctx.submit_store(mp.key("c", model="cleared"), list(range(1, 33))).result(20)
        assert mp.lookup_hits(c, model="cleared") == 2
        c.call("end_session", mp.key("c").request_id)
        out = report("kvcache", "clear", "--url", srv.http_url)
        assert out == {"title": "KV Cache Clear", "metrics": {"status": "OK"}}
        # 0.5.6 puts the report flags before the action; both places work here
        quiet = cli("kvcache", "-q", "clear", "--url", srv.http_url)
        assert quiet.returncode == 0 and quiet.stdout == ""
    finally:
        ctx.close()
        c.close()


def test_kvcache_objects_lists_the_l2_adapter(srv, mp):
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model="listed")
    try:
        assert ctx.submit_store(mp.key("o", model="listed"), list(range(1, 33))).result(20)
    finally:
        ctx.close()
        c.close()
    mp.wait_for(
        lambda: (
            report("kvcache", "objects", "--url", srv.http_url, "--model-name", "listed")[
                "metrics"
            ]["count"]
            == 2
        ),
        "both chunks listed in L2",
    )
    out = report("kvcache", "objects", "--url", srv.http_url, "--model-name", "listed", "--all")
    rows = out["metrics"]["objects"]
    assert {r["model_name"] for r in rows} == {"listed"} and all(r["size_bytes"] > 0 for r in rows)


def test_quota_lifecycle(srv):
    url = ["--url", srv.http_url]
    assert report("quota", "set", "alice", "--limit-gb", "1.5", *url)["metrics"] == {
        "cache_salt": "alice",
        "limit_gb": 1.5,
        "status": "ok",
    }
    got = report("quota", "get", "alice", *url)["metrics"]
    assert got["limit_gb"] == 1.5 and got["exists"] is True
    listed = report("quota", "list", *url)["metrics"]["quotas"]
    assert {k: v for k, v in listed[0].items() if k != "current_usage_gb"} == {
        "cache_salt": "alice",
        "limit_gb": 1.5,
    }
    assert report("quota", "delete", "alice", *url)["metrics"]["status"] == "removed"
    assert report("quota", "delete", "alice", *url)["metrics"]["status"] == "not_found"
    empty = cli("quota", "list", *url)
    assert empty.returncode == 0 and "No quotas configured" in empty.stdout


def test_query_kvcache_counts_the_cached_chunks(srv, mp):
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model="queried")
    try:
        assert ctx.submit_store(mp.key("q", model="queried"), list(range(1, 33))).result(20)
    finally:
        ctx.close()
        c.close()
    ids = ",".join(str(t) for t in mp.TOKENS)
    m = report("query", "kvcache", "--url", srv.http_url, "--model", "queried", "--token-ids", ids)
    assert m["title"] == "Query KV Cache"
    assert m["metrics"]["found_keys"] == m["metrics"]["total_keys"] == 2


def test_ping_describe_and_query_an_engine():
    with fake_engine() as (url, requests):
        assert report("ping", "engine", "--url", url)["metrics"]["status"] == "OK"
        assert report("describe", "engine", "--url", url)["metrics"] == {
            "model": MODEL,
            "max_context": 4096,
            "status": "OK",
            "running_requests": 2,
        }
        out = report("query", "engine", "--url", url, "--prompt", "Say hi", "--max-tokens", "9")
        m = out["metrics"]
        assert (m["model"], m["answer"]) == (MODEL, "".join(ANSWER))
        assert (m["prompt_tokens"], m["output_tokens"]) == (PROMPT_TOKENS, len(ANSWER))
        assert set(m["latency"]) == {
            "ttft_ms",
            "tpot_ms_per_token",
            "total_latency_ms",
            "throughput_tokens_per_s",
        }
        assert requests[-1]["path"] == "/v1/completions" and requests[-1]["max_tokens"] == 9


def test_query_engine_documents_and_fallbacks(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("LMCache keeps KV caches.")
    with fake_engine(chat=False) as (url, requests):
        # --chat-first falls back to completions when the engine has no chat template
        args = ["--url", url, "--prompt", "Summarize: {doc}", "--documents", f"doc={doc}"]
        assert report("query", "engine", *args, "--chat-first")["metrics"]["answer"]
        assert [r["path"] for r in requests] == ["/v1/chat/completions", "/v1/completions"]
        assert requests[-1]["prompt"] == "Summarize: LMCache keeps KV caches."
        missing = cli("query", "engine", "--url", url, "--prompt", "{nope}")
        assert missing.returncode == 2 and "--documents nope=PATH" in missing.stderr


def test_admin_commands_fail_in_one_line_when_nothing_answers(free_tcp_port):
    dead = f"http://127.0.0.1:{free_tcp_port}"
    for args in (
        ["describe", "kvcache", "--url", dead],
        ["kvcache", "clear", "--url", dead],
        ["quota", "get", "x", "--url", dead],
        ["query", "engine", "--url", dead, "--prompt", "x", "--model", "m"],
    ):
        proc = cli(*args)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 1 and len(lines) == 1, (args, proc.stderr)
        assert "Traceback" not in proc.stderr
    ping = cli("ping", "engine", "--url", dead, "--format", "json")
    assert ping.returncode == 1 and json.loads(ping.stdout)["metrics"]["status"] == "FAIL"
