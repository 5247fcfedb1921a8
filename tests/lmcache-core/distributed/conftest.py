"""Fixtures for the distributed tests."""

from __future__ import annotations

import pytest

from lmcache.v1.distributed.l2_adapters.registry import L2AdapterRegistry, use_l2_adapter_registry


@pytest.fixture
def l2_registry():
    """A fresh default ``L2AdapterRegistry``: core's built-in types, no entry points.

    Whatever a test registers stays in it and is gone afterwards."""
    with use_l2_adapter_registry(L2AdapterRegistry(entry_point_group=None)) as registry:
        yield registry
