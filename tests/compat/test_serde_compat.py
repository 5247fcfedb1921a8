"""Serde interchange with LMCache 0.5.6 through a real fs L2 directory: what one side stores
with a serde the other loads. ``fp8``: both sides decode to the same bytes and write the same
files; ``aesgcm`` (same master key, per-tenant keys): the source bytes come back exactly, and
another master key is a miss on both. Each side runs tests/compat/serde_fs_driver.py in its own
venv. Needs LMCACHE_COMPAT_VENV (see conftest.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from testsupport.serde_compat import ALL_HITS, NO_HITS, SIDES, drive, files


@pytest.fixture
def master_keys(tmp_path):
    good, other = tmp_path / "master.key", tmp_path / "other.key"
    good.write_bytes(os.urandom(32))
    other.write_bytes(os.urandom(32))
    return good, other


@pytest.mark.parametrize("writer", SIDES)
def test_fp8_written_by_one_side_decodes_the_same_on_both(venvs, tmp_path, writer):
    base = tmp_path / "fs"
    spec = {"type": "fs", "base_path": str(base), "serde": {"type": "fp8"}}
    assert drive(venvs, writer, ("store", spec, tmp_path / "w")) == [{"stored": True}]
    loaded = {}
    for side in SIDES:
        assert drive(venvs, side, ("load", spec, tmp_path / side)) == [ALL_HITS], side
        loaded[side] = (tmp_path / side / "loaded.bin").read_bytes()
    assert loaded["ours"] == loaded["theirs"]
    assert loaded["ours"] != (tmp_path / "w" / "source.bin").read_bytes()  # lossy, really fp8


def test_fp8_files_are_byte_identical(venvs, tmp_path):
    written = {}
    for side in SIDES:
        spec = {"type": "fs", "base_path": str(tmp_path / side / "fs"), "serde": {"type": "fp8"}}
        assert drive(venvs, side, ("store", spec, tmp_path / side)) == [{"stored": True}]
        written[side] = files(tmp_path / side / "fs")
    assert len(written["ours"]) == 4
    assert written["ours"] == written["theirs"]
    assert all(len(b) == 8192 for b in written["ours"].values())  # 1 byte per element


@pytest.mark.parametrize(("writer", "aes_bits"), [("theirs", 128), ("ours", 256)])
def test_aesgcm_written_by_one_side_opens_on_both(venvs, tmp_path, master_keys, writer, aes_bits):
    good, other = master_keys
    base = tmp_path / "fs"

    def spec(key: Path) -> dict:
        serde = {"type": "aesgcm", "master_key_path": str(key), "aes_bits": aes_bits}
        return {"type": "fs", "base_path": str(base), "serde": serde}

    assert drive(venvs, writer, ("store", spec(good), tmp_path / "w")) == [{"stored": True}]
    source = (tmp_path / "w" / "source.bin").read_bytes()
    stored = files(base)
    assert len(stored) == 4 and all(len(b) == 16384 + 29 for b in stored.values())
    assert all(b[0] == 1 and source[:64] not in b for b in stored.values())  # sealed
    for side in SIDES:
        got = drive(
            venvs,
            side,
            ("load", spec(good), tmp_path / side),
            ("load", spec(other), tmp_path / f"{side}-other"),  # another master key
        )
        assert got == [ALL_HITS, NO_HITS], side  # a miss, never garbage
        assert (tmp_path / side / "loaded.bin").read_bytes() == source, side
