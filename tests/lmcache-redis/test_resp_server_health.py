"""Issue 20, item 1, end to end: `lmcache server` shows a dead or unreachable Redis in
`/status` and `/healthcheck`, says why, and recovers when Redis comes back."""

from __future__ import annotations

import itertools
import json
import re

import httpx

_prompts = itertools.count(1)


def _health(srv) -> httpx.Response:
    return httpx.get(srv.http_url + "/healthcheck", timeout=5)


def _adapter(srv) -> dict:
    return httpx.get(srv.http_url + "/status", timeout=5).json()["storage_manager"]["l2_adapters"][
        0
    ]


def _store_new_prompt(engine, h) -> bool:
    first = 10 + next(_prompts) * 100_000  # a prompt no store used before
    return engine.ctx.submit_store(engine.key("s", first_token=first), h.BLOCK_IDS).result(60)


def test_health_follows_a_killed_and_restarted_redis(h, redis_server, lmcache_server):
    adapter = {
        "type": "resp",
        "host": "127.0.0.1",
        "port": redis_server.port,
        "health_check_interval_s": 0.2,
    }
    srv = lmcache_server("--l2-adapter", json.dumps(adapter))
    raw = redis_server.client()
    engine = h.Engine(srv.rpc_url, "health-resp", h.kv_cache(1, zeros=False))
    try:
        assert _store_new_prompt(engine, h)
        assert h.wait_until(lambda: raw.cmd("DBSIZE") >= 4, 30), "no write-behind to Redis"
        assert _health(srv).json() == {"status": "healthy"}
        a = _adapter(srv)
        assert a["is_healthy"] and a["health"]["last_success_time"] is not None

        redis_server.kill()
        assert h.wait_until(lambda: _health(srv).status_code == 503, 30), srv.log()[-3000:]
        body = _health(srv).json()
        assert body["status"] == "unhealthy" and "L2 adapter #0 (resp)" in body["reason"]
        st = httpx.get(srv.http_url + "/status", timeout=5).json()
        assert st["is_healthy"] is False and st["unhealthy_reasons"]
        a = st["storage_manager"]["l2_adapters"][0]
        assert a["is_healthy"] is False and a["health"]["last_error"]
        assert a["health"]["last_error_time"] > a["health"]["last_success_time"]

        # Stores keep landing in L1 while their write-behind to Redis fails, and the
        # failures are logged with their cause, not once per task.
        for _ in range(6):
            assert _store_new_prompt(engine, h)
        stores = st["storage_manager"]["store_controllers"]["_default"]
        assert h.wait_until(
            lambda: (
                httpx.get(srv.http_url + "/status", timeout=5).json()["storage_manager"][
                    "store_controllers"
                ]["_default"]["failed_tasks"]
                >= stores["failed_tasks"] + 6
            ),
            30,
        )
        failed = re.findall(r"L2 store task \d+ on adapter #0 \(resp\) failed .*", srv.log())
        assert 1 <= len(failed) <= 2, failed  # the first, and at most one 30 s summary
        assert "redis" in failed[0]  # the cause, in the connector's words

        redis_server.start()  # same port
        assert h.wait_until(
            lambda: _store_new_prompt(engine, h) and _health(srv).status_code == 200, 60
        ), srv.log()[-3000:]
        assert _adapter(srv)["health"]["healthy"] is True
        assert "L2 backend resp at 127.0.0.1" in srv.log() and "recovered" in srv.log()
    finally:
        engine.close()
        raw.close()


def test_an_unreachable_redis_at_start_up_warns_once_and_the_server_serves(h, lmcache_server):
    adapter = {
        "type": "resp",
        "host": "nonexistent.invalid",
        "port": 6379,
        "health_check_interval_s": 0.2,
    }
    srv = lmcache_server("--l2-adapter", json.dumps(adapter), healthy=False)
    assert h.wait_until(lambda: _health(srv).status_code == 503, 30), srv.log()[-3000:]
    assert "nonexistent.invalid" in _health(srv).json()["reason"]
    assert h.wait_until(lambda: _adapter(srv)["status"]["failures"] >= 5, 30)
    warnings = [line for line in srv.log().splitlines() if "is failing" in line]
    assert len(warnings) == 1, warnings  # once, however many health checks failed
    assert "L2 backend resp at nonexistent.invalid:6379 is failing" in warnings[0]
    assert "cannot resolve nonexistent.invalid" in warnings[0]
    # The server serves from L1 all the same.
    engine = h.Engine(srv.rpc_url, "unreachable-resp", h.kv_cache(2, zeros=False))
    try:
        assert _store_new_prompt(engine, h)
    finally:
        engine.close()
