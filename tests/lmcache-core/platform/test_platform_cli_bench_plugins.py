"""`lmcache bench kernels` and `lmcache plugins` (in-process; no timing assertions)."""

from __future__ import annotations

import json
import sys

from lmcache.cli.main import main


def test_bench_kernels_writes_json_with_both_directions(tmp_path, capsys):
    out = tmp_path / "nested" / "kernels.json"
    code = main(["bench", "kernels", "--iterations", "1", "--warmup", "0", "--output", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    assert report["roundtrip_ok"] is True
    cfg = report["config"]
    assert (cfg["tokens"], cfg["layers"], cfg["heads"], cfg["head_size"]) == (512, 32, 8, 128)
    assert (cfg["block_size"], cfg["chunk_size"], cfg["dtype"]) == (16, 256, "float16")
    assert cfg["bytes_per_direction"] == 2 * 32 * 512 * 8 * 128 * 2
    for direction in ("d2h", "h2d"):
        r = report["results"][direction]
        for case in ("multi_layer_block_kv_transfer", "plain_copy"):
            assert set(r[case]) >= {"p50_ms", "mean_ms", "gb_per_s"}
        assert "ratio_p50" in r and isinstance(r["within_2x"], bool)


def test_bench_kernels_rejects_bad_iterations(capsys):
    assert main(["bench", "kernels", "--iterations", "0"]) == 2
    assert "--iterations must be > 0" in capsys.readouterr().err


def test_plugins_json_lists_backends_and_degrades_without_l2(monkeypatch, capsys):
    assert main(["plugins", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    names = [b["name"] for b in report["device_backends"]]
    assert names[0] == "cpu"
    cpu = report["device_backends"][0]
    assert cpu["source"] == "built-in" and cpu["selected"] is True
    # CpuDeviceSpec.is_available() is False (docs/design/platform.md#cpu-device): reported as is,
    # the fallback role apart
    assert cpu["available"] is False and cpu["fallback"] is True
    assert all(b["fallback"] is False for b in report["device_backends"][1:])
    assert report["selected_device"]["backend"] == "cpu"
    # the L2 half degrades to a note when the storage layer cannot be imported
    from lmcache.cli import plugins

    monkeypatch.setitem(sys.modules, "lmcache.v1.distributed.l2_adapters.registry", None)
    report = plugins.collect()
    assert report["l2_adapter_types"] == []
    assert any("L2 adapter types unavailable" in n for n in report["notes"])
    assert [b["name"] for b in report["device_backends"]] == names


def test_plugins_text_marks_cpu_as_the_fallback(capsys):
    assert main(["plugins"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    cpu = next(r for r in rows if r and r[0] == "cpu")
    assert cpu[1:4] == ["cpu", "fallback", "*"]


def test_plugins_reports_detection_errors_instead_of_crashing(monkeypatch, capsys):
    monkeypatch.setenv("LMCACHE_DEVICE_BACKEND", "nosuchbackend")
    assert main(["plugins"]) == 0
    text = capsys.readouterr().out
    assert "Selected: <none> (detection failed: LMCACHE_DEVICE_BACKEND='nosuchbackend'" in text
