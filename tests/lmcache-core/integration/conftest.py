"""Fixtures of the vLLM connector tests: the harness module and a shared real ``lmcache server``."""

from __future__ import annotations

import os
import sys

import pytest

# The harness lives next to the tests (importlib import mode: put this folder on the path).
sys.path.insert(0, os.path.dirname(__file__))


def _root_conftest(config: pytest.Config):
    """tests/conftest.py (the server engineer's ``LMCacheServerProcess`` and ``free_port``)."""
    for plugin in config.pluginmanager.get_plugins():
        if hasattr(plugin, "LMCacheServerProcess") and hasattr(plugin, "free_port"):
            return plugin
    raise RuntimeError("tests/conftest.py (LMCacheServerProcess, free_port) is not loaded")


@pytest.fixture(scope="module")
def shared_server(request):
    """One real ``lmcache server`` for a whole test module (starting one takes seconds).

    Tests on it use distinct prompts and leave no locks behind; tests that restart, stall or
    shrink the server start their own with the ``lmcache_server`` fixture.
    """
    root = _root_conftest(request.config)
    port, http_port = root.free_port(), root.free_port()
    args = [
        "--l1-size-gb", "0.25",
        "--worker-reap-timeout-seconds", "0",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--http-port", str(http_port),
    ]  # fmt: skip
    srv = root.LMCacheServerProcess(args, None, port, http_port)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.cleanup()
