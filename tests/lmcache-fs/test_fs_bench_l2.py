"""``lmcache bench l2`` against a persistent file backend: every run stores fresh keys, and
``--baselines`` measures plain file writes beside the adapter without leaving files behind."""

from __future__ import annotations

import json

from lmcache.cli.main import main


def _bench(base, capsys, *extra: str) -> dict:
    spec = json.dumps({"type": "fs_native", "base_path": str(base), "fsync": False})
    argv = ["bench", "l2", "--format", "json", "--l2-adapter", spec, "--num-keys", "4"]
    argv += ["--data-size-kb", "8"]
    argv += ["--rounds", "2", "--warmup-rounds", "1", *extra]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["metrics"]["l2"]["adapters"][0]["results"]


def test_repeated_runs_store_fresh_keys_into_one_directory(tmp_path, capsys):
    first = _bench(tmp_path, capsys)
    assert first["store"]["successful_keys"] == 8
    assert len(list(tmp_path.glob("*.data"))) == 12  # warmup + 2 rounds of 4 keys
    _bench(tmp_path, capsys)
    # A run that reused the earlier keys would have skipped them and written nothing.
    assert len(list(tmp_path.glob("*.data"))) == 24


def test_baselines_write_the_same_bytes_in_a_scratch_directory(tmp_path, capsys):
    res = _bench(tmp_path, capsys, "--baselines", "--only", "store")
    base = res["baselines"]["page_cache_write"]
    assert base["rounds"] == 2 and base["threads"] == 4 and base["avg_mb_per_s"] > 0
    assert base["directory"].startswith(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".data")) == []
