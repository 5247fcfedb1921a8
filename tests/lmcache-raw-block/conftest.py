"""Fixtures of the lmcache-raw-block tests: a pre-sized file as the device, the shared L2 test
helpers and adapters closed at teardown."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lmcache.storage.raw_block", reason="lmcache-raw-block is not installed")
pytest.importorskip(
    "lmcache_rust_raw_block_io", reason="pip install lmcache-rust-raw-block-io (CI installs it)"
)


def _load_helpers() -> Any:
    path = Path(__file__).resolve().parent.parent / "native" / "l2_helpers.py"
    spec = importlib.util.spec_from_file_location("_lmcache_l2_test_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def h() -> Any:
    return _load_helpers().Helpers


@pytest.fixture
def device(tmp_path) -> Path:
    """A 16 MiB pre-sized file (the adapter never creates or grows its device)."""
    path = tmp_path / "kv.img"
    with open(path, "wb") as f:
        f.truncate(16 << 20)
    return path


@pytest.fixture
def adapters():
    """Collects adapters to close at teardown (closing twice is harmless)."""
    made: list[Any] = []
    yield made
    for a in made:
        a.close()
