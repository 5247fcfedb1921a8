"""Fixtures of the lmcache-fs tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache.storage.fs", reason="lmcache-fs is not installed")


def _load_helpers() -> Any:
    path = Path(__file__).resolve().parent.parent / "native" / "l2_helpers.py"
    spec = importlib.util.spec_from_file_location("_lmcache_l2_test_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Helpers


Helpers = _load_helpers()


@pytest.fixture
def h() -> Any:
    return Helpers


@pytest.fixture
def adapters():
    """Collects adapters to close at teardown."""
    made: list[Any] = []
    yield made
    for a in made:
        a.close()


@pytest.fixture(params=["fs", "fs_native"])
def fs_type(request: pytest.FixtureRequest) -> str:
    return request.param
