"""The HTTP admin API: 0.5.6's shapes (checked through the pydantic models), the routes'
behaviour against a real in-process server runtime, and the request hardening (issue 20):
JSON-only state changes, loopback Host check, cross-origin refusal, body cap, /env masking.

docs/compat.md "HTTP API" lists the routes; tests/compat/test_http_compat.py compares them
with a running LMCache 0.5.6 when LMCACHE_COMPAT_VENV is set.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json

import httpx
import pytest
import torch
from starlette.testclient import TestClient
from testsupport.ports import free_port
from testsupport.waiting import wait_result

from lmcache.v1.multiprocess import http_models as M
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.client import MPClient
from lmcache.v1.multiprocess.http_api import (
    block_checksums,
    build_app,
    compress_ranges,
    is_secret_name,
    mask_value,
    masked_environ,
)
from lmcache.v1.multiprocess.transfer_context import create_transfer_context

_ids = itertools.count(97000)
BASE = "http://127.0.0.1:8080"
CHUNK = 256  # the server's default chunk size
BLOCK = 16  # tokens per block of the test KV caches


@pytest.fixture(scope="module")
def runtime():
    from lmcache.cli.server import add_server_args, build_configs
    from lmcache.v1.multiprocess.runtime import ServerRuntime

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parser.parse_args(
        [
            "--host",
            "127.0.0.1",
            "--port",
            str(free_port()),
            "--l1-size-gb",
            "0.25",
            "--worker-reap-timeout-seconds",
            "0",
            "--shm-name",
            "",
            "--supported-transfer-mode",
            "auto",
        ]
    )
    rt = ServerRuntime.build(*build_configs(args))
    rt.http_host, rt.http_port = "127.0.0.1", 8080  # what the CLI sets after binding
    rt.start()
    yield rt
    rt.stop()


@pytest.fixture(scope="module")
def api(runtime):
    with TestClient(build_app(runtime), base_url=BASE) as client:
        yield client


class Worker:
    """An lmcache_driven CPU worker of this process: KV ``[2, NB, BS, NH, HS]`` per layer."""

    def __init__(self, runtime, model: str, num_blocks: int = 64) -> None:
        self.model = model
        self.client = MPClient(f"tcp://127.0.0.1:{runtime.config.port}", default_timeout=20)
        self.kv = [torch.randn(2, num_blocks, BLOCK, 2, 8).half() for _ in range(2)]
        self.instance_id = next(_ids)
        self.ctx = create_transfer_context(
            self.kv, instance_id=self.instance_id, req_client=self.client, mode="lmcache_driven"
        )
        self.ctx.register(model, 1)

    def key(self, tokens: list[int], rid: str, worker_id: int | None = 0) -> P.IPCCacheServerKey:
        return P.IPCCacheServerKey(
            model_name=self.model,
            world_size=1,
            worker_id=worker_id,
            token_ids=tokens,
            start=0,
            end=len(tokens),
            request_id=rid,
            num_kv_readers=1,
        )

    def store(self, tokens: list[int], block_ids: list[int]) -> None:
        assert self.ctx.submit_store(self.key(tokens, f"st-{next(_ids)}"), block_ids).result(20)

    def close(self) -> None:
        self.ctx.unregister()
        self.ctx.close()
        self.client.close()


@pytest.fixture
def worker(runtime):
    w = Worker(runtime, f"http-model-{next(_ids)}")
    yield w
    w.close()


def _tokens(n: int) -> list[int]:
    base = next(_ids) * 10_000
    return [base + i for i in range(n)]


def _l1_objects(api) -> int:
    return api.get("/status").json()["storage_manager"]["l1_manager"]["total_object_count"]


# ----------------------------------------------------------------- shapes (models)


def test_status_has_0_5_6_shape_plus_our_extensions(api):
    r = api.get("/status")
    assert r.status_code == 200
    st = M.StatusResponse.model_validate(r.json())
    assert st.engine_type == "MPCacheServer"
    sm = r.json()["storage_manager"]
    # 0.5.6: per-L1 parts keyed by tag, and the single-L1 names `describe kvcache` reads
    assert list(sm["l1_managers"]) == ["_default"]
    assert list(sm["store_controllers"]) == list(sm["l1_eviction_controllers"]) == ["_default"]
    assert sm["l1_manager"] == sm["l1_managers"]["_default"]
    assert sm["l1_manager"]["memory_total_bytes"] == sm["l1_usage"][1] > 0
    assert sm["num_l2_adapters"] == 0 and sm["l2_adapters"] == []
    assert sm["l1_eviction_controller"]["eviction_policy"] == "LRU"
    assert r.json()["worker_liveness"]["tracked_instances"] >= 0
    # ours, kept as extensions
    assert r.json()["transfer_modes"] == ["lmcache_driven", "engine_driven"]
    assert sm["l1"]["tag"] == "_default"


def test_a_handler_that_drifts_from_its_model_fails_loudly(runtime, monkeypatch):
    real = runtime.engine.status

    def drifted():
        st = real()
        st.pop("active_sessions")
        return st

    monkeypatch.setattr(runtime.engine, "status", drifted)
    with TestClient(build_app(runtime), base_url=BASE, raise_server_exceptions=False) as c:
        assert c.get("/status").status_code == 500


def test_status_is_503_when_the_storage_cannot_report(runtime, monkeypatch):
    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(runtime.storage.sm, "report_status", broken)
    with TestClient(build_app(runtime), base_url=BASE) as c:
        r = c.get("/status")
    assert r.status_code == 503 and "RuntimeError: boom" in r.json()["error"]


@pytest.mark.parametrize(
    "path, model",
    [
        ("/", M.RootResponse),
        ("/healthcheck", M.HealthResponse),
        ("/config", M.ConfigResponse),
        ("/config/adapters", M.AdaptersResponse),
        ("/periodic-threads", M.PeriodicThreadsResponse),
        ("/periodic-threads-health", M.PeriodicThreadsHealth),
        ("/quota", M.QuotaList),
        ("/quota/_default", M.QuotaInfo),
        ("/reconfigure/fs/l2/status", M.ReconfigureStatus),
    ],
)
def test_json_routes_answer_their_models(api, path, model):
    r = api.get(path)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    model.model_validate(r.json())


def test_config_names_the_http_frontend_as_0_5_6_does(api):
    cfg = api.get("/config").json()
    assert cfg["http"] == {"http_host": "127.0.0.1", "http_port": 8080}
    assert set(cfg) >= {"mp", "storage_manager", "observability", "http", "coordinator"}


@pytest.mark.parametrize("path", ["/version", "/lmc_version", "/commit_id"])
def test_version_routes_answer_a_json_string(api, path):
    r = api.get(path)
    assert r.status_code == 200 and isinstance(r.json(), str)


# -------------------------------------------------------------------- /cache/*


def test_clear_answers_0_5_6_shape_and_empties_l1(api, worker):
    worker.store(_tokens(CHUNK), list(range(16)))
    assert _l1_objects(api) >= 1
    for kwargs in ({}, {"json": {}}, {"json": {"tier": "l1", "force": False}}):
        r = api.post("/cache/clear", **kwargs)
        assert r.status_code == 200
        assert r.json() == {"status": "ok", "cleared": {"tier": "l1"}}
    assert _l1_objects(api) == 0
    assert api.post("/cache/clear", json={"tier": "l2"}).status_code == 400
    bad = api.post("/cache/clear", json={"tier": "zz"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "tier"]


def _reference_digests(kv: list[torch.Tensor], block_ids: list[int], per_chunk: int) -> list:
    """What 0.5.6's bench client computes on its side: per chunk, MD5 over each layer's
    blocks of the chunk along the block axis (dim 1 of [2, NB, BS, NH, HS])."""
    out = []
    for s in range(0, len(block_ids), per_chunk):
        md5 = hashlib.md5()
        ids = torch.tensor(block_ids[s : s + per_chunk])
        for t in kv:
            md5.update(t.index_select(1, ids).contiguous().view(torch.uint8).numpy().tobytes())
        out.append(md5.hexdigest())
    return out


def test_checksums_are_0_5_6_digests_of_the_workers_blocks(api, worker):
    blocks = list(range(4, 36))  # 2 chunks of 16 blocks
    body = {"block_ids": blocks, "chunk_size": 16, "instance_id": worker.instance_id}
    r = api.post("/cache/checksums", json=body)
    assert r.status_code == 200, r.text
    got = M.ChecksumResponse.model_validate(r.json())
    assert got.status == "success" and got.num_chunks == 2 and got.layerwise is False
    assert got.chunk_checksums == _reference_digests(worker.kv, blocks, 16)
    assert got.block_id_ranges == [[4, 35]]

    per_layer = api.post("/cache/checksums", json={**body, "layerwise": True}).json()
    assert per_layer["layerwise"] is True
    assert list(per_layer["chunk_checksums"]) == ["layer_0", "layer_1"]
    assert per_layer["chunk_checksums"]["layer_1"] == _reference_digests(worker.kv[1:], blocks, 16)


def test_checksums_follow_the_kv_after_a_retrieve(api, worker):
    # What 0.5.6's lmcache_driven bench does: digest, store, zero, retrieve, digest again.
    tokens = _tokens(CHUNK)
    body = {"block_ids": list(range(16)), "chunk_size": 16, "instance_id": worker.instance_id}
    before = api.post("/cache/checksums", json=body).json()["chunk_checksums"]
    worker.store(tokens, list(range(16)))
    for t in worker.kv:
        t[:, :16].zero_()
    assert api.post("/cache/checksums", json=body).json()["chunk_checksums"] != before
    assert worker.client.lookup_hits(worker.key(tokens, "cs-look", worker_id=None), 10.0) == 1
    fut = worker.ctx.submit_retrieve(worker.key(tokens, "cs-look"), list(range(16)))
    assert fut.result(20)
    assert api.post("/cache/checksums", json=body).json()["chunk_checksums"] == before


@pytest.mark.parametrize(
    "body, status",
    [
        ({"block_ids": [0, 1], "chunk_size": 1, "instance_id": 123456789}, 404),
        ({"block_ids": "x"}, 422),
        ({"block_ids": [0], "layerwise": "maybe"}, 422),
    ],
)
def test_checksums_errors(api, body, status):
    r = api.post("/cache/checksums", json=body)
    assert r.status_code == status
    if status == 422:  # 0.5.6's validation errors: a list under "detail"
        assert isinstance(r.json()["detail"], list)


def test_checksums_of_a_registered_worker_reject_bad_requests(api, worker):
    iid = worker.instance_id
    ok = {"block_ids": [0], "chunk_size": 1, "instance_id": iid}
    assert api.post("/cache/checksums", json={**ok, "block_ids": []}).status_code == 400
    assert api.post("/cache/checksums", json={**ok, "chunk_size": 0}).status_code == 400


def test_block_checksums_take_each_layouts_block_axis():
    # flashinfer [NB, 2, BS, NH, HS]: blocks on axis 0
    kv = [torch.randn(6, 2, BLOCK, 2, 8).half() for _ in range(3)]
    got = block_checksums(kv, None, [1, 2, 3, 4], 2, False)["chunk_checksums"]
    want = []
    for s in (1, 3):
        md5 = hashlib.md5()
        for t in kv:
            md5.update(t[s : s + 2].contiguous().view(torch.uint8).numpy().tobytes())
        want.append(md5.hexdigest())
    assert got == want


def test_block_checksums_hash_bfloat16_as_float32():
    kv = [torch.randn(2, 4, BLOCK, 2, 8).to(torch.bfloat16)]
    got = block_checksums(kv, None, [0], 1, False)["chunk_checksums"]
    f32 = kv[0][:, :1].to(torch.float32).contiguous().numpy().tobytes()
    assert got == [hashlib.md5(f32).hexdigest()]


def test_compress_ranges_keeps_order_and_shortens_runs_of_three():
    assert compress_ranges([1, 2, 3, 4, 5, 9, 10, 11, 12]) == [[1, 5], [9, 12]]
    assert compress_ranges([5, 3, 1, 2, 4]) == [5, 3, 1, 2, 4]
    assert compress_ranges([1, 2, 3, 4, 5, 7, 8]) == [[1, 5], 7, 8]
    assert compress_ranges([]) == []


def test_prefetch_answers_0_5_6_shapes(api, worker):
    unknown = {"model_name": "never-registered", "world_size": 1, "token_ids": _tokens(CHUNK)}
    r = api.post("/cache/prefetches", json=unknown)
    assert r.status_code == 503 and "no layout registered" in r.json()["detail"]
    tokens = _tokens(2 * CHUNK)
    worker.store(tokens, list(range(32)))
    body = {"model_name": worker.model, "world_size": 1, "token_ids": tokens}
    r = api.post("/cache/prefetches", json=body)
    assert r.status_code == 202
    sub = M.PrefetchSubmitted.model_validate(r.json())
    assert sub.status == "submitted" and sub.chunks == 2 and sub.request_id

    def completed():
        st = api.get(f"/cache/prefetches/{sub.request_id}").json()
        return st if st["status"] == "completed" else None

    st = wait_result(completed, "prefetch completed")
    assert st == {
        "request_id": sub.request_id,
        "status": "completed",
        "found_keys": 2,
        "total_keys": 2,
    }
    assert api.get(f"/cache/prefetches/{sub.request_id}").status_code == 404  # reported once
    noop = api.post("/cache/prefetches", json={**body, "token_ids": tokens[:10]})
    assert noop.status_code == 202 and noop.json() == {"chunks": 0, "status": "noop"}
    bad = api.post("/cache/prefetches", json={"model_name": "m"})
    assert bad.status_code == 422 and isinstance(bad.json()["detail"], list)
    wrong_way = api.post("/cache/prefetches", json={**body, "source_tier": "l1"})
    assert wrong_way.status_code == 400


def test_delete_objects_by_key_from_l1(api, worker, runtime):
    from lmcache.v1.distributed.api import ObjectKey

    tokens = _tokens(CHUNK)
    worker.store(tokens, list(range(16)))
    keys = [k for k in runtime.storage.sm.l1_managers[0]._resident if isinstance(k, ObjectKey)]
    enc = [k.to_encoded_object_key().to_dict() for k in keys]
    r = api.request("DELETE", "/cache/objects", json={"keys": enc, "tier": "l1"})
    assert r.status_code == 200
    assert r.json() == {"deleted": len(keys), "skipped": 0, "ok": True}
    assert api.request("DELETE", "/cache/objects", json={"keys": []}).status_code == 503
    assert api.request("DELETE", "/cache/objects", json={"tier": "bogus"}).status_code == 422


def test_object_listing_needs_an_l2_adapter(api):
    assert api.get("/cache/objects").status_code == 503
    assert api.get("/cache/objects", params={"tier": "l1"}).status_code == 400


# ------------------------------------------------------------------------ /quota


def test_quota_routes_drive_the_l2_quota_manager(api, runtime):
    qm = runtime.storage.sm.quota_manager
    r = api.put("/quota/alice", json={"limit_gb": 1.5})
    assert r.json() == {"cache_salt": "alice", "limit_gb": 1.5, "status": "ok"}
    assert qm.get_limit_bytes("alice") == int(1.5 * 1024**3)
    got = M.QuotaInfo.model_validate(api.get("/quota/alice").json())
    assert got.exists and got.limit_gb == 1.5
    api.put("/quota/_default", json={"limit_gb": 0.5})
    assert qm.get_limit_bytes("") == 512 * 1024**2  # _default is the anonymous salt
    assert set(api.get("/quota").json()["users"]) == {"alice", "_default"}
    assert api.delete("/quota/alice").json() == {"cache_salt": "alice", "status": "removed"}
    assert api.delete("/quota/alice").json()["status"] == "not_found"
    api.delete("/quota/_default")
    for bad in ({"x": 1}, {"limit_gb": -1}, {"limit_gb": "many"}, {"limit_gb": "nan"}):
        r = api.put("/quota/bob", json=bad)
        assert r.status_code == 400 and "error" in r.json()
    broken = api.put("/quota/bob", content=b"{nope", headers={"Content-Type": "application/json"})
    assert broken.status_code == 400 and broken.json() == {"error": "invalid JSON body"}
    assert "bob" not in qm.list_quotas()


def test_reconfigure_routes_answer_that_nothing_is_reconfigurable(api):
    assert api.get("/reconfigure/fs/l2/status").json() == {
        "enabled": False,
        "backend": "fs",
        "num_adapters": 0,
        "adapters": [],
    }
    r = api.post("/reconfigure/fs/l2/add", json={"adapter_index": 0})
    assert r.status_code == 404 and r.json() == {"error": "fs adapter not found"}
    assert api.get("/reconfigure/dax/l1/status").status_code == 409
    assert api.post("/reconfigure/dax/l1/add", json={"device_path": "/x"}).status_code == 409


# --------------------------------------------------------- observability routes


def test_periodic_threads_report_the_eviction_loops(api):
    def ran():
        ts = {t["name"]: t for t in api.get("/periodic-threads").json()["threads"]}
        return ts if ts.get("l1-eviction", {}).get("total_runs", 0) > 0 else None

    threads = wait_result(ran, "the L1 eviction loop ran once")
    l1 = threads["l1-eviction"]
    assert l1["level"] == "high" and l1["is_running"] and l1["is_active"]
    assert l1["last_summary"]["success"] is True
    body = api.get("/periodic-threads", params={"level": "high"}).json()
    assert {t["level"] for t in body["threads"]} == {"high"}
    assert body["summary"]["by_level"]["high"]["total"] == len(body["threads"])
    bad = api.get("/periodic-threads", params={"level": "bad"})
    assert bad.status_code == 400 and "error" in bad.json()
    assert api.get("/periodic-threads/l1-eviction").json()["name"] == "l1-eviction"
    missing = api.get("/periodic-threads/nope")
    assert missing.status_code == 404 and missing.json() == {"error": "Thread not found: nope"}
    health = api.get("/periodic-threads-health").json()
    assert health == {"healthy": True, "unhealthy_count": 0, "unhealthy_threads": []}


def test_text_routes_answer_plain_text(api):
    import logging

    r = api.post("/metrics/reset")
    assert r.text == "ok" and r.headers["content-type"].startswith("text/plain")
    assert "=== Loggers and Levels ===" in api.get("/loglevel").text
    before = logging.getLogger("lmcache.http-test").level
    set_ = api.get("/loglevel", params={"logger_name": "lmcache.http-test", "level": "debug"})
    assert set_.status_code == 200 and logging.getLogger("lmcache.http-test").level == 10
    assert api.get("/loglevel", params={"logger_name": "lmcache.http-test"}).text == (
        "lmcache.http-test: DEBUG"
    )
    logging.getLogger("lmcache.http-test").setLevel(before)
    bad = api.get("/loglevel", params={"logger_name": "x", "level": "bogus"})
    assert bad.status_code == 400 and bad.text == "Invalid log level: bogus"
    threads = api.get("/threads", params={"name": "mp-reaper"})
    assert threads.headers["content-type"].startswith("text/plain")
    assert "=== Thread Summary ===" in threads.text
    assert api.post("/run_script").status_code == 404


# --------------------------------------------------------------------------- /env


@pytest.mark.parametrize(
    "name",
    [
        "AWS_SECRET_ACCESS_KEY",
        "HF_TOKEN",
        "GITHUB_PAT",
        "MY_CREDENTIALS",
        "GOOGLE_APPLICATION_CREDENTIAL",
        "HTTP_AUTH",
        "OAUTH",
        "DB_PASSWD",
        "PGPASSWORD",
        "REDIS_PASSPHRASE",
        "SENTRY_DSN",
        "api.key",
    ],
)
def test_secret_names_are_masked(name):
    assert is_secret_name(name)


@pytest.mark.parametrize("name", ["PATH", "LD_LIBRARY_PATH", "PWD", "HOME", "AUTHOR", "LANG"])
def test_ordinary_names_are_shown(name):
    assert not is_secret_name(name)


@pytest.mark.parametrize(
    "value, shown",
    [
        ("redis://user:hunter2@cache:6379/0", "redis://***@cache:6379/0"),
        ("postgresql://admin:pw@db/x", "postgresql://***@db/x"),
        ("https://token@github.com/o/r.git", "https://***@github.com/o/r.git"),
        ("https://h/x?a=1&access_token=abc&b=2", "https://h/x?a=1&access_token=***&b=2"),
        ("s3://bucket/p?X-Amz-Signature=ff00", "s3://bucket/p?X-Amz-Signature=***"),
        ("http://cache:8080/path", "http://cache:8080/path"),
        ("/usr/bin:/bin", "/usr/bin:/bin"),
    ],
)
def test_credentials_in_values_are_masked(value, shown):
    assert mask_value(value) == shown


def test_env_route_masks_by_name_and_by_value(api, monkeypatch):
    monkeypatch.setenv("GITHUB_PAT", "ghp_secretvalue")
    monkeypatch.setenv("CACHE_URL", "redis://u:topsecret@h:6379")
    monkeypatch.setenv("LMCACHE_HTTP_TEST_PLAIN", "visible")
    r = api.get("/env")
    assert r.headers["content-type"].startswith("text/plain")  # 0.5.6: JSON as text
    env = json.loads(r.text)
    assert env["GITHUB_PAT"] == "***"
    assert env["CACHE_URL"] == "redis://***@h:6379"
    assert env["LMCACHE_HTTP_TEST_PLAIN"] == "visible"
    assert "topsecret" not in r.text and "ghp_secretvalue" not in r.text
    assert masked_environ({"PATH": "/bin"}) == {"PATH": "/bin"}


# ---------------------------------------------------------------------- hardening


@pytest.mark.parametrize(
    "headers, content",
    [
        ({"Content-Type": "application/x-www-form-urlencoded"}, b"tier=l1"),
        ({"Content-Type": "multipart/form-data; boundary=x"}, b"--x--"),
        ({"Content-Type": "text/plain"}, b'{"tier": "l1"}'),
        ({"Content-Type": "application/x-www-form-urlencoded"}, b""),  # an empty HTML form
        ({}, b'{"tier": "l1"}'),  # a body without a content type
    ],
)
def test_non_json_state_changes_are_refused_and_change_nothing(api, worker, headers, content):
    worker.store(_tokens(CHUNK), list(range(16)))
    before = _l1_objects(api)
    r = api.post("/cache/clear", headers=headers, content=content)
    assert r.status_code == 415, r.text
    assert "application/json" in r.json()["detail"]
    assert _l1_objects(api) == before >= 1
    assert api.put("/quota/x", headers=headers, content=content).status_code == 415


def test_bodyless_post_works_as_0_5_6_clients_send_it(api):
    # urllib with data=None (0.5.6's CLI) and `curl -X POST` send no body, no content type.
    assert api.post("/cache/clear").status_code == 200
    assert api.post("/metrics/reset").text == "ok"
    r = api.post("/cache/clear", headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "10.0.0.5:8080", ""])
def test_foreign_host_is_refused_on_a_loopback_bound_api(api, host):
    for method, path in (("GET", "/status"), ("POST", "/cache/clear")):
        r = api.request(method, path, headers={"Host": host})
        assert r.status_code == 400 and "loopback" in r.json()["detail"]


@pytest.mark.parametrize(
    "host", ["localhost:8080", "127.0.0.1", "127.0.0.1:9", "[::1]:8080", "LOCALHOST", "a.localhost"]
)
def test_loopback_hosts_are_served(api, host):
    assert api.get("/healthcheck", headers={"Host": host}).status_code == 200


def test_host_is_not_checked_when_bound_beyond_loopback(runtime, monkeypatch):
    monkeypatch.setattr(runtime, "http_host", "0.0.0.0")
    with TestClient(build_app(runtime), base_url="http://cache.internal:8080") as c:
        assert c.get("/healthcheck").status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {"Origin": "http://evil.example"},
        {"Origin": "null"},
        {"Origin": "http://127.0.0.1:9999"},  # another local port is another origin
        {"Sec-Fetch-Site": "cross-site"},
    ],
)
def test_cross_origin_state_changes_are_refused(api, worker, headers):
    worker.store(_tokens(CHUNK), list(range(16)))
    before = _l1_objects(api)
    r = api.post("/cache/clear", headers=headers)  # fetch(..., {mode: "no-cors"})
    assert r.status_code == 403
    assert _l1_objects(api) == before >= 1


def test_a_cross_site_page_cannot_set_log_levels(api):
    import logging

    lg = logging.getLogger("lmcache.http-csrf-test")
    params = {"logger_name": lg.name, "level": "debug"}
    r = api.get("/loglevel", params=params, headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403 and lg.level == logging.NOTSET
    r = api.get("/loglevel", params={"logger_name": lg.name}, headers={"Origin": "http://x.y"})
    assert r.status_code == 200  # reading a level changes nothing


def test_a_malformed_content_length_is_not_a_server_error(api):
    r = api.post("/cache/clear", headers={"Content-Length": "abc"})
    assert r.status_code < 500


def test_same_origin_post_is_served(api):
    r = api.post("/cache/clear", headers={"Origin": BASE, "Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 200


def test_bodies_over_the_cap_are_refused_before_they_are_read(runtime):
    with TestClient(build_app(runtime, max_body_bytes=1024), base_url=BASE) as c:
        big = json.dumps({"block_ids": list(range(400))}).encode()
        assert len(big) > 1024
        hdr = {"Content-Type": "application/json"}
        r = c.post("/cache/checksums", headers=hdr, content=big)
        assert r.status_code == 413 and "LMCACHE_HTTP_MAX_BODY_BYTES" in r.json()["detail"]

        def chunked():  # no Content-Length: the cap applies while reading
            for i in range(0, len(big), 100):
                yield big[i : i + 100]

        assert c.post("/cache/checksums", headers=hdr, content=chunked()).status_code == 413
        small = json.dumps({"tier": "l1"}).encode()
        assert c.post("/cache/clear", headers=hdr, content=small).status_code == 200


def test_a_real_server_refuses_a_huge_body_and_a_rebinding_host(lmcache_server):
    srv = lmcache_server(env={"LMCACHE_HTTP_MAX_BODY_BYTES": "65536"})
    big = b'{"block_ids": [' + b"1," * 1_000_000 + b"1]}"
    r = httpx.post(
        srv.http_url + "/cache/checksums",
        content=big,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413
    rebound = httpx.get(srv.http_url + "/status", headers={"Host": "attacker.example"})
    assert rebound.status_code == 400
    form = httpx.post(srv.http_url + "/cache/clear", data={"tier": "l1"})
    assert form.status_code == 415
    assert httpx.post(srv.http_url + "/cache/clear").json()["status"] == "ok"


def test_a_bad_body_cap_setting_is_named(monkeypatch, runtime):
    monkeypatch.setenv("LMCACHE_HTTP_MAX_BODY_BYTES", "lots")
    with pytest.raises(ValueError, match="LMCACHE_HTTP_MAX_BODY_BYTES='lots'"):
        build_app(runtime)
