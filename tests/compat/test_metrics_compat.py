"""Prometheus metrics: after the same workload, every series name and label set that LMCache
0.5.6's ``/metrics`` shows, ours shows too, so a dashboard built on 0.5.6 keeps working.

The workload is 0.5.6's own ``lmcache bench server`` against each server (engine_driven
and lmcache_driven, on the copy path), an L1 clear, and the engine_driven prompts again,
which then come back from the mock L2 tier both servers run; both follow every L1 chunk's
lifecycle (``--metrics-sample-rate 1``). Needs LMCACHE_COMPAT_VENV.
"""

from __future__ import annotations

import re
import time

import pytest

MOCK_L2 = '{"type":"mock","max_size_gb":1,"mock_bandwidth_gb":10}'
SPEC = "(2,256,16,8,128):float16:4"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')


def series(text: str) -> set[tuple[str, frozenset[str]]]:
    """(sample name, label names) of every sample; ``le`` (histogram buckets) left out."""
    out = set()
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            labels = frozenset(_LABEL.findall(m.group(2) or "")) - {"le"}
            out.add((m.group(1), labels))
    return out


def _bench(lmcache_cli, venv, srv, mode: str, start: int) -> None:
    proc = lmcache_cli(
        venv,
        "bench",
        "server",
        "--rpc-url",
        srv.rpc_url,
        "--url",
        srv.http_url,
        "--mode",
        "cpu",
        "--transfer-mode",
        mode,
        "--kvcache-shape-spec",
        SPEC,
        "--num-tokens",
        "512",
        "--start",
        str(start),
        "--end",
        str(start + 3),
        "--interval",
        "0",
        "-q",
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.fixture(scope="module")
def scraped(start_pair, compat_venv, lmcache_cli) -> dict[str, str]:
    # every chunk's lifecycle followed on both (0.5.6 samples 1% by default, by key hash)
    extra = ("--l2-adapter", MOCK_L2, "--metrics-sample-rate", "1")
    pair = start_pair(transfer_mode="auto", extra_args=extra)
    out = {}
    for side, srv in pair.items():
        _bench(lmcache_cli, compat_venv, srv, "engine_driven", 0)
        _bench(lmcache_cli, compat_venv, srv, "lmcache_driven", 100)
        time.sleep(2)  # L2 stores run behind the requests
        assert srv.http("POST", "/cache/clear", json={"tier": "l1"}).status_code == 200
        _bench(lmcache_cli, compat_venv, srv, "engine_driven", 0)  # now from L2
        time.sleep(2)
        out[side] = srv.http("GET", "/metrics").text
    return out


# Sampled lifecycle histograms 0.5.6 shows when one of its 1% sample of engine blocks or
# storage-manager keys happens to be reused: parts this version does not have (docs/compat.md).
NOT_PROVIDED = ("lmcache_mp_l0_block_", "lmcache_mp_real_reuse_gap")


def test_every_0_5_6_series_and_label_set_is_ours_too(scraped):
    theirs, ours = series(scraped["theirs"]), series(scraped["ours"])
    names = {name for name, _labels in ours}
    missing = sorted(
        (name, sorted(labels))
        for name, labels in theirs - ours
        if name != "target_info" and not name.startswith(NOT_PROVIDED)
    )
    assert not missing, "series 0.5.6 shows and ours lacks (or labels differently):\n" + "\n".join(
        f"  {name}{{{','.join(labels)}}}" + ("  [name present]" if name in names else "")
        for name, labels in missing
    )


def test_the_workload_reached_every_tier_on_both(scraped):
    for side, text in scraped.items():
        names = {name for name, _labels in series(text)}
        for name in (
            "lmcache_mp_lookup_hit_l1_tokens_total",
            "lmcache_mp_l1_write_chunks_total",
            "lmcache_mp_num_chunks_loaded_total",
            "lmcache_mp_l0_l1_store_throughput_GB_per_second_count",
            "lmcache_mp_l2_store_completed_requests_total",
            "lmcache_mp_l2_usage_bytes",
            "lmcache_mp_l1_chunk_reuse_gap_seconds_count",
            "lmcache_mp_l1_chunk_lifetime_seconds_count",
        ):
            assert name in names, f"{side}: {name} missing; the workload did not get there"


def test_target_info_and_python_info_carry_0_5_6_labels(scraped):
    def labels_of(text: str, name: str) -> frozenset[str]:
        return next(labels for n, labels in series(text) if n == name)

    for name in ("target_info", "python_info"):
        assert labels_of(scraped["ours"], name) == labels_of(scraped["theirs"], name), name
