"""Fixtures of the lmcache-raw-block tests: a pre-sized file as the device, the shared L2 test
helpers and adapters closed at teardown."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lmcache.storage.raw_block", reason="lmcache-raw-block is not installed")
pytest.importorskip(
    "lmcache_rust_raw_block_io", reason="pip install lmcache-rust-raw-block-io (CI installs it)"
)


@pytest.fixture
def device(tmp_path) -> Path:
    """A 16 MiB pre-sized file (the adapter never creates or grows its device)."""
    path = tmp_path / "kv.img"
    with open(path, "wb") as f:
        f.truncate(16 << 20)
    return path
