"""Issue 20, item 1, with files: a directory that stops taking writes (a full or vanished
disk) turns the server unhealthy with the cause, costs a few log lines instead of one per
file, and the server recovers once the directory is back."""

from __future__ import annotations

import itertools
import json
import os
import re

import httpx

_prompts = itertools.count(1)


def _status(srv) -> dict:
    return httpx.get(srv.http_url + "/status", timeout=5).json()


def _failed_tasks(srv) -> int:
    return _status(srv)["storage_manager"]["store_controllers"]["_default"]["failed_tasks"]


def _store_idle(srv) -> bool:
    ctl = _status(srv)["storage_manager"]["store_controllers"]["_default"]
    return ctl["pending_keys"] == 0 and ctl["in_flight_tasks"] == 0


def _store_new_prompt(engine, h) -> bool:
    first = 10 + next(_prompts) * 100_000
    return engine.ctx.submit_store(engine.key("s", first_token=first), h.BLOCK_IDS).result(60)


def test_failing_directory_is_reported_with_its_cause_and_few_lines(
    h, fs_type, tmp_path, lmcache_server
):
    base = tmp_path / "l2"
    adapter = {"type": fs_type, "base_path": str(base), "fsync": False}
    srv = lmcache_server("--l2-adapter", json.dumps(adapter))
    engine = h.Engine(srv.rpc_url, f"health-{fs_type}", h.kv_cache(3, zeros=False))
    try:
        assert _store_new_prompt(engine, h)
        data = lambda: [n for n in os.listdir(base) if n.endswith(".data")]  # noqa: E731
        assert h.wait_until(lambda: len(data()) >= 4, 30), "no write-behind to the directory"

        # The directory goes away; a file takes its name, so every write fails.
        os.rename(base, tmp_path / "l2.away")
        base.write_bytes(b"")
        before = _failed_tasks(srv)
        for _ in range(6):
            assert _store_new_prompt(engine, h)  # L1 still takes them
        assert h.wait_until(lambda: _failed_tasks(srv) > before and _store_idle(srv), 30)
        r = httpx.get(srv.http_url + "/healthcheck", timeout=5)
        assert r.status_code == 503 and f"L2 adapter #0 ({fs_type})" in r.json()["reason"]
        health = _status(srv)["storage_manager"]["l2_adapters"][0]["health"]
        assert "Not a directory" in health["last_error"]
        log = srv.log()
        failed = re.findall(r"L2 store task \d+ on adapter #0 .* failed .*", log)
        assert 1 <= len(failed) <= 2, failed  # 24 failed files: 1-2 lines
        assert "Not a directory" in failed[0]
        assert len(re.findall(r"fs: store of .* failed", log)) <= 2

        # The directory comes back: the next write-behind succeeds, the server is healthy.
        base.unlink()
        os.rename(tmp_path / "l2.away", base)
        assert h.wait_until(
            lambda: (
                _store_new_prompt(engine, h)
                and httpx.get(srv.http_url + "/healthcheck", timeout=5).status_code == 200
            ),
            60,
        ), srv.log()[-3000:]
    finally:
        engine.close()
