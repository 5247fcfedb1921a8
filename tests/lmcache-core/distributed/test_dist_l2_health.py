"""HealthTracker and the health convention of L2 adapter status (issue 20, item 1)."""

from __future__ import annotations

import logging

from lmcache.v1.distributed.l2_adapters import health as health_mod
from lmcache.v1.distributed.l2_adapters.health import HealthTracker, adapter_health


def test_an_operation_is_failing_until_it_succeeds_again(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(health_mod.time, "monotonic", lambda: now[0])
    t = HealthTracker("fs at /data")
    st = t.status()
    assert st["healthy"] and st["last_error"] is None and st["last_success_time"] is None
    with caplog.at_level(logging.INFO, logger="lmcache"):
        t.success("lookup")
        t.failure("store", "No space left on device")
        t.failure("store", "No space left on device")
        t.success("lookup")  # lookups work on a full disk: stores still fail
        st = t.status()
        assert not st["healthy"] and st["failing_ops"] == ["store"]
        assert st["last_error"] == "store: No space left on device" and st["failures"] == 2
        t.success("store")
        assert t.healthy
    messages = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert len(messages) == 2  # one warning, one recovery
    assert (
        messages[0][0] == "WARNING"
        and "fs at /data is failing: store failed: No space" in (messages[0][1])
    )
    assert messages[1] == ("INFO", "L2 backend fs at /data recovered (store succeeded)")


def test_a_failure_nothing_retried_goes_stale(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(health_mod.time, "monotonic", lambda: now[0])
    t = HealthTracker("x")
    t.failure("load", "boom")
    assert not t.healthy
    now[0] += health_mod.STALE_AFTER_S + 1
    assert t.healthy and t.status()["last_error"] == "load: boom"


def test_adapter_health_reads_any_status():
    assert adapter_health({"is_healthy": True})["healthy"] is True  # a 0.5.6 adapter
    assert adapter_health({})["healthy"] is True
    bad = adapter_health({"is_healthy": True, "healthy": False, "last_error": "e"})
    assert bad["healthy"] is False and bad["last_error"] == "e"
    assert adapter_health({"is_healthy": False, "error": "raised"})["last_error"] == "raised"
