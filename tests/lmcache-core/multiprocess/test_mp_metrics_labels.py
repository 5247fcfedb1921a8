"""/metrics carries LMCache 0.5.6's series names and label sets (a 0.5.6 dashboard keeps
working). The expected sets below are what a 0.5.6 server showed after the same kind of
workload; tests/compat/test_metrics_compat.py compares against a live 0.5.6 server."""

from __future__ import annotations

import re

import httpx

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')

# (sample name, label names) seen on LMCache 0.5.6 after stores, retrieves in both
# transfer modes, an L1 clear and loads back from a mock L2.
EXPECTED_056 = {
    ("lmcache_mp_lookup_requested_tokens_total", ("cache_salt", "model_name")),
    ("lmcache_mp_lookup_hit_tokens_total", ("cache_salt", "model_name")),
    ("lmcache_mp_lookups_requests_total", ("cache_salt", "model_name")),
    ("lmcache_mp_lookup_hit_l1_tokens_total", ("cache_salt", "model_name")),
    ("lmcache_mp_lookup_hit_l2_tokens_total", ("cache_salt", "model_name")),
    ("lmcache_mp_lookup_hit_l1_keys_total", ("cache_salt", "model_name")),
    ("lmcache_mp_lookup_hit_l2_keys_total", ("cache_salt", "model_name")),
    ("lmcache_mp_l1_read_chunks_total", ("l1_tag",)),
    ("lmcache_mp_l1_write_chunks_total", ("l1_tag",)),
    ("lmcache_mp_l1_evicted_chunks_total", ("l1_tag",)),
    ("lmcache_mp_l1_memory_usage_bytes", ("backend", "l1_tag")),
    ("lmcache_mp_l1_usage_ratio", ("backend", "l1_tag")),
    ("lmcache_mp_l1_staging_bytes", ("backend", "l1_tag")),
    ("lmcache_mp_l2_store_adapters", ("l1_tag", "state")),
    ("lmcache_mp_l2_prefetch_adapters", ("state",)),
    ("lmcache_mp_l2_usage_bytes", ("l2_name",)),
    ("lmcache_mp_l2_store_submitted_requests_total", ()),
    ("lmcache_mp_l2_store_submitted_objects_chunks_total", ()),
    ("lmcache_mp_l2_store_completed_requests_total", ("l2_name",)),
    ("lmcache_mp_l2_store_completed_objects_chunks_total", ()),
    ("lmcache_mp_l2_prefetch_lookup_requests_total", ()),
    ("lmcache_mp_l2_prefetch_lookup_objects_chunks_total", ()),
    ("lmcache_mp_l2_store_throughput_GB_per_second_count", ("l2_name",)),
    ("lmcache_mp_num_submitted_stores_total", ("device",)),
    ("lmcache_mp_num_finished_stores_total", ("device",)),
    ("lmcache_mp_num_submitted_retrieves_total", ("device",)),
    ("lmcache_mp_num_finished_retrieves_total", ("device",)),
    ("lmcache_mp_num_chunks_loaded_total", ("cache_salt", "model_name", "worker_id")),
    (
        "lmcache_mp_l0_l1_store_throughput_GB_per_second_count",
        ("device", "engine_id", "model_name"),
    ),
    ("lmcache_mp_l0_l1_load_throughput_GB_per_second_count", ("device", "engine_id", "model_name")),
    ("lmcache_mp_l1_eviction_loop_ticks_total", ()),
    ("lmcache_mp_event_bus_dropped_events_total", ()),
    ("lmcache_mp_event_bus_queue_depth", ()),
    ("lmcache_mp_event_bus_drain_lag_seconds", ()),
    ("lmcache_mp_active_prefetch_jobs", ()),
    ("lmcache_mp_active_p2p_lookup_jobs", ()),
    ("lmcache_mp_kv_events_log_depth", ()),
    ("python_info", ("implementation", "major", "minor", "patchlevel", "version")),
    (
        "target_info",
        (
            "service_instance_id",
            "service_name",
            "telemetry_sdk_language",
            "telemetry_sdk_name",
            "telemetry_sdk_version",
        ),
    ),
}

MOCK_L2 = '{"type":"mock","max_size_gb":1,"mock_bandwidth_gb":10}'


def series(text: str) -> set[tuple[str, tuple[str, ...]]]:
    out = set()
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            out.add((m.group(1), tuple(sorted(set(_LABEL.findall(m.group(2) or "")) - {"le"}))))
    return out


def test_metrics_keep_0_5_6_names_and_label_sets(lmcache_server, mp):
    srv = lmcache_server("--instance-id", "ops-test", "--l2-adapter", MOCK_L2)
    model = "labels-m"
    for mode in ("engine_driven", "lmcache_driven"):
        c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), mode=mode, model=model)
        try:
            tokens = [t + (0 if mode == "engine_driven" else 10**6) for t in mp.TOKENS]
            key = mp.key(f"st-{mode}", model=model, tokens=tokens)
            assert ctx.submit_store(key, list(range(1, 33))).result(20)
            miss = [t + 10**7 for t in tokens]  # not in L1: the lookup asks L2
            assert mp.lookup_hits(c, tokens=miss, model=model, rid=f"miss-{mode}") == 0
            assert mp.lookup_hits(c, tokens=tokens, model=model, rid=f"lk-{mode}") == 2
            assert ctx.submit_retrieve(
                mp.key(f"lk-{mode}", model=model, tokens=tokens), [*range(33, 64), 0]
            ).result(20)
        finally:
            ctx.close()
            c.close()
    mp.wait_for(
        lambda: mp.metric(srv, "lmcache_mp_l2_store_completed_requests_total") >= 2,
        "the L2 stores finished",
    )
    text = httpx.get(srv.http_url + "/metrics", timeout=10).text
    missing = sorted(EXPECTED_056 - series(text))
    assert not missing, f"0.5.6 series missing or labelled differently: {missing}"
    assert 'target_info{service_instance_id="ops-test"' in text
    assert 'lmcache_mp_l1_write_chunks_total{l1_tag="_default"} 4.0' in text
    assert f'lmcache_mp_lookups_requests_total{{cache_salt="",model_name="{model}"}} 4.0' in text
    assert 'lmcache_mp_l2_usage_bytes{l2_name="mock"}' in text


def test_salted_l1_chunks_add_the_cache_salt_label(lmcache_server, mp):
    # 0.5.6 adds cache_salt to the L1 chunk counters only for salted keys
    srv = lmcache_server()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model="salty")
    try:
        key = mp.key("salted", model="salty", cache_salt="tenant-a")
        assert ctx.submit_store(key, list(range(1, 33))).result(20)
    finally:
        ctx.close()
        c.close()
    text = httpx.get(srv.http_url + "/metrics", timeout=10).text
    assert 'lmcache_mp_l1_write_chunks_total{cache_salt="tenant-a",l1_tag="_default"} 2.0' in text
    # a dashboard summing by l1_tag sees both kinds of traffic
    assert ("lmcache_mp_l1_write_chunks_total", ("cache_salt", "l1_tag")) in series(text)


def test_l1_lifecycle_follows_sampled_chunks():
    from lmcache.v1.multiprocess.l1_lifecycle import EVICT_REUSE_WAIT_S, L1Lifecycle

    now = [100.0]
    life = L1Lifecycle(1.0, clock=lambda: now[0])
    life.on_l1_keys_write_finished(["a", "b"])
    now[0] = 103.0
    life.on_l1_keys_read_finished(["a"])
    now[0] = 110.0
    life.on_l1_keys_deleted_by_manager(["a"])
    assert sorted(life.drain()) == [
        ("idle_before_evict", 7.0),
        ("lifetime", 10.0),
        ("reuse_gap", 3.0),
    ]
    now[0] = 112.0
    life.on_l1_keys_write_finished(["a"])  # written again 2 s after it left
    assert life.drain() == [("evict_reuse_gap", 2.0)]
    life.on_l1_keys_deleted_by_manager(["b"])
    now[0] += EVICT_REUSE_WAIT_S  # never written again: counts as the cap
    assert ("evict_reuse_gap", EVICT_REUSE_WAIT_S) in life.drain()
    none = L1Lifecycle(0.0, clock=lambda: now[0])
    none.on_l1_keys_write_finished(["a"])
    none.on_l1_keys_deleted_by_manager(["a"])
    assert none.drain() == []  # a chunk outside the sample is never followed


def test_l1_lifecycle_histograms_on_a_real_server(lmcache_server, mp):
    srv = lmcache_server("--metrics-sample-rate", "1")
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model="life")
    try:
        assert ctx.submit_store(mp.key("life", model="life"), list(range(1, 33))).result(20)
        assert mp.lookup_hits(c, model="life", rid="life-read") == 2
        assert ctx.submit_retrieve(mp.key("life-read", model="life"), [*range(33, 64), 0]).result(
            20
        )
    finally:
        ctx.close()
        c.close()
    assert httpx.post(srv.http_url + "/cache/clear", json={"tier": "l1"}).status_code == 200
    names = {n for n, _labels in series(httpx.get(srv.http_url + "/metrics").text)}
    for name in ("lifetime", "idle_before_evict", "reuse_gap"):
        assert f"lmcache_mp_l1_chunk_{name}_seconds_count" in names, name
