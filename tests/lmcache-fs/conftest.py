"""Fixtures of the lmcache-fs tests."""

from __future__ import annotations

import pytest

pytest.importorskip("lmcache.storage.fs", reason="lmcache-fs is not installed")


@pytest.fixture(params=["fs", "fs_native"])
def fs_type(request: pytest.FixtureRequest) -> str:
    return request.param
