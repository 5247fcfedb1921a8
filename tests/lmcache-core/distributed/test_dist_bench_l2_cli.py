"""``lmcache bench l2`` runs against a registered type and prints LMCache 0.5.6's report
(``--format terminal|json``, ``--output``, ``-q``); ``metrics.l2`` carries our full result
(no timing asserts)."""

from __future__ import annotations

import json

import pytest

from lmcache.cli.main import main

MOCK = '{"type":"mock","max_size_gb":0.1,"mock_bandwidth_gb":50}'
SMALL = ["--num-keys", "4", "--data-size-kb", "4"]

# The key structure of 0.5.6's `lmcache bench l2 --format json --lookup-max-hit-rate 0.5`
# on a mock adapter (lmcache 0.5.6, run by hand; values dropped, key order kept).
_OP_KEYS = [
    "operation",
    "rounds",
    "rounds_timed_out",
    "keys_per_round",
    "total_keys",
    "total_success",
    "duration_avg_ms",
    "duration_min_ms",
    "duration_max_ms",
    "duration_p50_ms",
    "duration_p99_ms",
    "duration_std_ms",
    "throughput_avg_mbps",
    "throughput_min_mbps",
    "throughput_max_mbps",
    "ops_per_sec_avg",
    "latency_per_key_ms",
]
GOLDEN_0_5_6 = {
    "title": "L2 Adapter Benchmark Result",
    "metrics": {
        "config": [
            "l2_adapter_json",
            "num_keys",
            "in_flight",
            "keys_per_round",
            "data_size_kb",
            "data_per_round_mb",
            "measurement_rounds",
            "warmup_rounds",
            "lookup_max_hit_rate",
        ],
        "op_0": _OP_KEYS,
        "op_1": [*_OP_KEYS, "expected_max_hit_rate", "expected_hit_count", "actual_hit_rate"],
        "op_2": _OP_KEYS,
    },
}


def _bench(*argv: str) -> int:
    return main(["bench", "l2", "--l2-adapter", MOCK, *SMALL, *argv])


def test_json_has_0_5_6_keys_and_our_full_result_under_l2(tmp_path, capsys):
    out = tmp_path / "r.json"
    argv = ["--in-flight", "2", "--rounds", "2", "--warmup-rounds", "0"]
    argv += ["--lookup-max-hit-rate", "0.5", "--no-skip-verify", "--format", "json"]
    assert _bench(*argv, "--output", str(out)) == 0
    report = json.loads(capsys.readouterr().out)  # stdout is the report only
    assert report == json.loads(out.read_text())
    assert report["title"] == GOLDEN_0_5_6["title"]
    m = report["metrics"]
    assert list(m) == [*GOLDEN_0_5_6["metrics"], "l2"]
    for key, keys in GOLDEN_0_5_6["metrics"].items():
        assert list(m[key]) == keys, key
    assert [m[f"op_{i}"]["operation"] for i in range(3)] == ["Store", "Lookup", "Load"]
    assert m["config"]["l2_adapter_json"] == MOCK and m["config"]["keys_per_round"] == 8
    store, lookup, load = (m[f"op_{i}"] for i in range(3))
    assert (store["rounds"], store["total_keys"], store["total_success"]) == (2, 16, 16)
    assert lookup["total_success"] == 8 and lookup["expected_hit_count"] == 8
    assert lookup["actual_hit_rate"] == 0.5 and lookup["throughput_avg_mbps"] == 0.0
    assert load["total_success"] == 16 and load["throughput_avg_mbps"] > 0
    full = m["l2"]
    assert full["benchmark"] == "l2" and full["config"]["num_keys"] == 4
    res = full["adapters"][0]["results"]
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


def test_default_is_0_5_6_terminal_form(capsys):
    assert _bench() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == " L2 Adapter Benchmark Result ".center(64, "=")
    assert lines[1] == " Configuration ".center(64, "-")
    assert lines[2] == f"L2 adapter JSON: {MOCK}"
    assert lines[3] == "Keys / submit:" + " " * 49 + "4"
    assert " Store ".center(64, "-") in lines and " Load ".center(64, "-") in lines
    assert "Lookup max hit rate:" + " " * 40 + "0.00" in lines
    assert lines[-1] == "=" * 64 and all(len(x) == 64 for x in lines if ":" not in x)


def test_terminal_shows_a_baseline_section(capsys):
    assert _bench("--baselines", "--only", "store") == 0
    lines = capsys.readouterr().out.splitlines()
    i = lines.index(" Baseline: page-cache write ".center(64, "-"))
    assert lines[i + 1].startswith("Threads:") and lines[i + 2].startswith("Throughput avg (MB/s):")


def test_quiet_prints_nothing_and_output_gets_the_format(tmp_path, capsys):
    out = tmp_path / "r.txt"
    assert _bench("-q", "--output", str(out)) == 0
    assert capsys.readouterr().out == ""
    text = out.read_text()
    assert text.startswith("=") and text.endswith("=" * 64 + "\n")  # terminal, as 0.5.6
    assert _bench("--quiet", "--format", "json", "--output", str(out)) == 0
    assert capsys.readouterr().out == ""
    assert list(json.loads(out.read_text())["metrics"]) == ["config", "op_0", "op_1", "op_2", "l2"]


def test_env_fallback_and_only(monkeypatch, capsys):
    monkeypatch.setenv("L2_ADAPTER_JSON", MOCK)
    argv = ["bench", "l2", "--num-keys", "2", "--data-size-kb", "1", "--format", "json"]
    assert main([*argv, "--only", "load", "--warmup-rounds", "0"]) == 0
    m = json.loads(capsys.readouterr().out)["metrics"]
    assert list(m["l2"]["adapters"][0]["results"]) == ["load"]
    assert list(m) == ["config", "op_0", "l2"] and m["op_0"]["operation"] == "Load"
    assert "lookup_max_hit_rate" not in m["config"]  # as 0.5.6 when lookup does not run


def test_further_adapters_get_their_own_sections(capsys):
    other = '{"type":"mock","max_size_gb":0.2,"mock_bandwidth_gb":50}'
    assert _bench("--l2-adapter", other, "--only", "store", "--format", "json") == 0
    m = json.loads(capsys.readouterr().out)["metrics"]
    assert list(m) == ["config", "op_0", "adapter_2_config", "adapter_2_op_0", "l2"]
    assert m["adapter_2_config"]["l2_adapter_json"] == other
    assert len(m["l2"]["adapters"]) == 2


def _register_test_serde(monkeypatch, name, serializer, deserializer):
    from lmcache.v1.distributed.serde import AsyncSerdeProcessor, factory

    factory.get_registered_serde_types()  # the built-ins first
    monkeypatch.setitem(
        factory._REGISTRY, name, lambda kw: AsyncSerdeProcessor(serializer, deserializer)
    )


def test_serde_block_is_applied(monkeypatch, capsys):
    from lmcache.v1.distributed.serde.identity import IdentityDeserializer, IdentitySerializer

    calls = {"serialize": 0, "deserialize": 0}

    class CountingS(IdentitySerializer):
        def serialize(self, src, dst, key):
            calls["serialize"] += 1
            return super().serialize(src, dst, key)

    class CountingD(IdentityDeserializer):
        def deserialize(self, src, dst, key):
            calls["deserialize"] += 1
            return super().deserialize(src, dst, key)

    _register_test_serde(monkeypatch, "counting-test", CountingS(), CountingD())
    spec = json.dumps({**json.loads(MOCK), "serde": {"type": "counting-test"}})
    argv = ["bench", "l2", "--l2-adapter", spec, *SMALL, "--warmup-rounds", "0"]
    assert main([*argv, "--no-skip-verify", "--format", "json"]) == 0
    res = json.loads(capsys.readouterr().out)["metrics"]["l2"]["adapters"][0]["results"]
    assert res["load"]["successful_keys"] == 4 and res["load"]["verify_mismatched_keys"] == 0
    # the bench's 4 objects through the adapter, then the cost and verify round trips (8)
    assert calls == {"serialize": 4 + 8, "deserialize": 4 + 8}
    assert res["serde"]["type"] == "counting-test" and res["serde"]["compression_ratio"] == 1.0


@pytest.mark.parametrize(("serde", "ratio"), [("fp8", 2.0), ("checksum", None), ("identity", 1.0)])
def test_serde_cost_is_reported(serde, ratio, capsys):
    spec = json.dumps({**json.loads(MOCK), "serde": {"type": serde}})
    argv = ["bench", "l2", "--l2-adapter", spec, *SMALL, "--no-skip-verify", "--format", "json"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)["metrics"]["l2"]["adapters"][0]["results"]
    cost = res["serde"]
    assert cost["type"] == serde and cost["encode_gb_per_s"] > 0 and cost["decode_gb_per_s"] > 0
    if ratio is not None:
        assert cost["compression_ratio"] == ratio
    else:  # checksum: a 32-byte header
        assert cost["stored_bytes"] == cost["object_bytes"] + 32
    assert res["load"]["verify_mismatched_keys"] == 0  # fp8: equal to its own decode
    assert main(["bench", "l2", "--l2-adapter", spec, *SMALL]) == 0  # terminal: a Serde section
    assert "Compression ratio" in capsys.readouterr().out


def test_failed_verification_exits_1_after_the_report(monkeypatch, capsys):
    from lmcache.v1.distributed.serde.identity import IdentityDeserializer, IdentitySerializer

    class Corrupting(IdentityDeserializer):
        def __init__(self):
            self.loads = 0

        def deserialize(self, src, dst, key):
            super().deserialize(src, dst, key)
            self.loads += 1
            if self.loads <= 4:  # the loads through the adapter, not the bench's own check
                b = dst.byte_array
                b[0] = (b[0] + 1) % 256

    _register_test_serde(monkeypatch, "corrupting-test", IdentitySerializer(), Corrupting())
    spec = json.dumps({**json.loads(MOCK), "serde": {"type": "corrupting-test"}})
    argv = ["bench", "l2", "--l2-adapter", spec, *SMALL, "--no-skip-verify", "--format", "json"]
    argv += ["--warmup-rounds", "0"]
    assert main(argv) == 1  # as 0.5.6: the report first, then exit 1
    cap = capsys.readouterr()
    res = json.loads(cap.out)["metrics"]["l2"]["adapters"][0]["results"]
    assert res["load"]["verify_mismatched_keys"] == 4
    assert "verify: 4 loaded keys differ" in cap.err


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["--l2-adapter", "{bad"], "Invalid JSON for --l2-adapter #1"),
        (["--l2-adapter", '{"type":"nope"}'], "unknown adapter type 'nope'. Known: "),
        (["--l2-adapter", MOCK, "--num-keys", "0"], "--num-keys must be >= 1"),
        (
            ["--l2-adapter", MOCK[:-1] + ',"serde":{"type":"nope"}}'],
            "--l2-adapter #1: Unknown serde type 'nope'. Registered: ",
        ),
        (["--l2-adapter", MOCK, "--flamegraph", "on"], "--flamegraph on"),
    ],
)
def test_bench_l2_errors_are_one_line(argv, text, capsys, monkeypatch):
    monkeypatch.delenv("L2_ADAPTER_JSON", raising=False)
    assert main(["bench", "l2", *argv]) != 0
    cap = capsys.readouterr()
    assert text in cap.err and "Traceback" not in cap.err and cap.out == ""


def test_unknown_serde_names_every_registered_one(capsys):
    from lmcache.v1.distributed.serde import get_registered_serde_types

    spec = json.dumps({**json.loads(MOCK), "serde": {"type": "nope"}})
    assert main(["bench", "l2", "--l2-adapter", spec, *SMALL]) == 2
    err = capsys.readouterr().err
    known = get_registered_serde_types()
    assert {"aesgcm", "checksum", "fp8", "identity"} <= set(known)
    assert f"Registered: {', '.join(known)} " in err


def test_format_is_checked_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        _bench("--format", "xml")
    assert exc.value.code == 2 and "invalid choice: 'xml'" in capsys.readouterr().err


def test_turboquant_runs_on_kv_shaped_objects(capsys):
    """With a serde the objects are KV-shaped [2, layers, tokens, 128]: 32 KiB -> 4 layers of
    16 tokens; turboquant (one raw layer at each end) quantizes the middle two."""
    serde = {"type": "turboquant", "skip_first_layers": 1, "skip_last_layers": 1}
    spec = json.dumps({**json.loads(MOCK), "serde": serde})
    argv = ["bench", "l2", "--l2-adapter", spec, "--num-keys", "2", "--data-size-kb", "32"]
    assert main([*argv, "--no-skip-verify", "--format", "json"]) == 0
    res = json.loads(capsys.readouterr().out)["metrics"]["l2"]["adapters"][0]["results"]
    # k8v4, head_dim 128: 196 bytes per token and head instead of 512
    assert res["serde"]["stored_bytes"] == 2 * 16 * 512 + 2 * 16 * 196
    assert res["load"]["verify_mismatched_keys"] == 0  # equal to its own decode
