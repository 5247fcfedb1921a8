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
