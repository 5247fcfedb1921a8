"""init_logger: one ``lmcache`` root, level from LMCACHE_LOG_LEVEL, both import paths."""

from __future__ import annotations

import logging

from lmcache.logging import init_logger as legacy_init_logger
from lmcache.utils import init_logger


def test_names_are_rooted_under_lmcache():
    assert init_logger("lmcache.v1.x").name == "lmcache.v1.x"
    assert init_logger("vendor_plugin").name == "lmcache.vendor_plugin"
    assert legacy_init_logger is init_logger


def test_records_reach_the_lmcache_root(caplog):
    logger = init_logger("lmcache.test_logging")
    with caplog.at_level(logging.INFO, logger="lmcache"):
        logger.info("hello %s", "world")
    assert "hello world" in caplog.text


def test_nvtx_annotate_is_transparent_without_cuda():
    from lmcache.utils import _lmcache_nvtx_annotate

    @_lmcache_nvtx_annotate
    def add(a, b):
        return a + b

    @_lmcache_nvtx_annotate(name="named")
    def mul(a, b):
        return a * b

    assert add(2, 3) == 5
    assert mul(2, 3) == 6
    assert add.__name__ == "add"


def test_rate_limited_log_logs_the_first_then_counts_the_rest(caplog, monkeypatch):
    import lmcache.utils.log as log_mod
    from lmcache.utils import RateLimitedLog

    now = [1000.0]
    monkeypatch.setattr(log_mod.time, "monotonic", lambda: now[0])
    limited = RateLimitedLog(init_logger("lmcache.test_rate"), interval=30.0)
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        assert limited.warning("disk", "store of %s failed", "a") is True
        for i in range(5741):  # a full disk, 40 s of it
            now[0] += 40 / 5741
            limited.warning("disk", "store of %s failed", i)
        assert limited.warning("other", "lookup failed") is True  # another key: not hidden
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "store of a failed"
    assert len(lines) == 3 and lines[2] == "lookup failed"
    assert lines[1].startswith("store of ") and "more like this in the last 30 s" in lines[1]
    assert int(lines[1].split("(")[1].split()[0]) > 4000  # the left-out ones are counted
