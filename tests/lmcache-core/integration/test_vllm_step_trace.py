"""The connector's step trace (``LMCACHE_CONNECTOR_TRACE``, docs/vllm.md) and its summary
(``lmcache bench connector-trace``): off by default with nothing wrapped, on it records each
engine step's hooks, RPCs and copies, driven in vLLM's call order against a real server."""

from __future__ import annotations

import json

import httpx
import pytest
from lmc_vllm_harness import Engine

from lmcache.cli.main import main as lmcache_main
from lmcache.integration.vllm.step_trace import (
    SCHEDULER_HOOKS,
    TRACE_ENV,
    WORKER_HOOKS,
    read_records,
    summarize,
)


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(n)]


@pytest.fixture
def server(shared_server):
    r = httpx.post(
        shared_server.http_url + "/cache/clear", json={"tier": "l1", "force": True}, timeout=10
    )
    assert r.status_code == 200
    return shared_server


def test_off_by_default_nothing_is_wrapped_or_written(server, tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    e = Engine(port=server.port)
    try:
        for conn, hooks in ((e.scheduler, SCHEDULER_HOOKS), (e.workers[0], WORKER_HOOKS)):
            assert conn._trace is None
            # the hooks are the class's own methods: no wrapper runs
            assert not set(hooks) & set(vars(conn))
            assert not hasattr(conn.worker_adapter or conn.scheduler_adapter, "_step_trace")
        e.add_request("off", tokens(600, seed=41))
        e.run()
        assert all(m.trace_step is None for m in e.metas)
    finally:
        e.close()
    assert list(tmp_path.iterdir()) == []


def test_on_records_every_step_hook_rpc_and_copy(server, tmp_path, monkeypatch):
    prefix = tmp_path / "trace" / "run"
    monkeypatch.setenv(TRACE_ENV, str(prefix))
    prompt = tokens(600, seed=42)
    # whole chunks only (the counts below); the partial_chunk tails have their own tests
    whole = {"lmcache.mp.partial_chunk": "false"}
    cold = Engine(port=server.port, extra=whole)
    try:
        cold.add_request("cold", prompt)
        cold.run()
    finally:
        cold.close()
    warm = Engine(port=server.port, extra=whole)
    try:
        warm.add_request("warm", prompt)
        warm.run()
        assert warm.loaded_ok.get("warm") == 512
    finally:
        warm.close()

    files = sorted(str(p) for p in prefix.parent.iterdir())
    roles = sorted(p.split("/")[-1].split(".")[1] for p in files)
    assert roles == ["scheduler", "scheduler", "worker", "worker"]
    records = read_records(files)
    sched = [r for r in records if r["role"] == "scheduler"]
    workers = [r for r in records if r["role"] == "worker"]
    # one scheduler record per build_connector_meta, one worker record per step, same numbers
    assert len(sched) == len(cold.metas) + len(warm.metas)
    assert sorted(r["step"] for r in workers) == sorted(r["step"] for r in sched)
    assert [m.trace_step for m in warm.metas] == list(range(len(warm.metas)))
    for r in sched:
        assert r["hooks"]["build_connector_meta"][0] == 1
        assert set(r["hooks"]) <= set(SCHEDULER_HOOKS)
    for r in workers:
        assert set(r["hooks"]) <= set(WORKER_HOOKS)
        assert r["hooks"]["clear_connector_metadata"][0] == 1
        assert r["hooks"]["wait_for_layer_load"][0] == 2  # once per layer (2 layers)

    scheduled = [r["sched"]["ops"] for r in sched if r["sched"]["ops"]]
    assert {"STORE": [1, 512]} in scheduled  # the cold prompt's two chunks
    assert {"RETRIEVE": [1, 512]} in scheduled  # the warm hit

    summary = summarize(records)
    assert summary["records"] == {"scheduler": len(sched), "worker": len(workers)}
    answers = summary["counts"]["scheduler"]
    assert (answers.get("miss"), answers.get("hit")) == (1, 1)
    assert sum(answers.values()) == len(cold.match_results["cold"]) + len(
        warm.match_results["warm"]
    )
    assert summary["rpc"]["scheduler"]["lookup"]["calls"] == 2
    assert summary["rpc"]["scheduler"]["lookup"]["bytes_sent"] > 600 * 4  # the token ids
    store, retrieve = summary["transfers"]["store"], summary["transfers"]["retrieve"]
    assert (store["n"], store["tokens"]) == (1, 512)
    assert (retrieve["n"], retrieve["tokens"]) == (1, 512)
    assert retrieve["in_step_path"] == 1  # a synchronous load runs in start_load_kv
    assert store["background"] == 1  # a store runs on the transfer thread
    # toy model: 2 layers x (K, V) x 1 head x 16 floats... as the context's geometry says
    assert store["bytes"] == retrieve["bytes"] > 0
    hooks = summary["hooks"]["worker"]
    assert hooks["start_load_kv"]["calls"] == len(workers)
    assert summary["worker_steps"]["all"]["n"] >= 1


def _rec(role, step, t, wall, hooks, **extra):
    return {"role": role, "pid": 1, "step": step, "t": t, "wall_ms": wall, "hooks": hooks,
            "rpc": {}, **extra}  # fmt: skip


def test_summary_joins_steps_and_background_copies(tmp_path, capsys):
    sched = [
        _rec("scheduler", i, 100.0 + i, 1.0, {"build_connector_meta": [1, 0.5]},
             sched={"tokens": t, "new": n, "running": r, "decode": d, "ops": {}})
        for i, (t, n, r, d) in enumerate([(2112, 1, 0, 0), (2, 0, 2, 2), (65, 1, 1, 1)])
    ]  # fmt: skip
    workers = [
        _rec("worker", 0, 10.0, 2000.0, {"start_load_kv": [1, 0.1]}),
        _rec("worker", 1, 10.05, 50.0, {"wait_for_save": [1, 1.0]},
             rpc={"prepare_store": [1, 0.4, 300]}),
        # the copy of the first step's store runs in the background during step 2
        _rec("worker", 2, 10.35, 300.0, {"start_load_kv": [1, 20.0], "wait_for_save": [1, 2.0]},
             xfer=[["store", "lmcache-transfer", 10.10, 100.0, 2048, 2048 * 8192],
                   ["retrieve", "MainThread", 10.06, 19.0, 2048, 2048 * 8192]]),
    ]  # fmt: skip
    summary = summarize(sched + workers, slowest=2)
    ws = summary["worker_steps"]
    assert ws["all"]["n"] == 2  # the first step of a process (start-up) is left out
    assert ws["with_decodes"]["n"] == 2 and ws["decode_only"]["n"] == 1
    assert ws["decode_only"]["max_ms"] == 50.0
    slow = summary["slowest_steps_with_decodes"]
    assert [v["step"] for v in slow] == [2, 1]
    assert slow[0]["ours_ms"] == 22.0
    assert slow[0]["background_copy_ms"] == pytest.approx(100.0)
    assert slow[0]["scheduled"]["tokens"] == 65
    assert slow[1]["background_copy_ms"] == 0.0
    assert summary["transfers"]["store"]["background"] == 1
    assert summary["transfers"]["retrieve"]["in_step_path"] == 1
    assert summary["hooks"]["worker"]["start_load_kv"]["total_ms"] == pytest.approx(20.1)
    assert summary["rpc"]["worker"]["prepare_store"]["bytes_sent"] == 300

    # the command line: text to stderr, the same summary as JSON
    path = tmp_path / "t.worker.1-0.jsonl"
    path.write_text(
        "".join(json.dumps(r) + "\n" for r in sched + workers) + '{"role": "worker", "cut'
    )
    out = tmp_path / "s.json"
    assert lmcache_main(["bench", "connector-trace", str(path), "--output", str(out)]) == 0
    captured = capsys.readouterr()
    assert "slowest steps with decodes" in captured.err
    assert json.loads(out.read_text())["worker_steps"] == ws


def test_summary_command_names_the_fix_for_no_records(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert lmcache_main(["bench", "connector-trace", str(empty)]) != 0
    assert TRACE_ENV in capsys.readouterr().err
