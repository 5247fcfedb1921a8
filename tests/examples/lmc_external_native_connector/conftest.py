"""Fixtures of the native-connector example tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "lmc_external_native_connector",
    reason="lmc_external_native_connector is not installed (pip install examples/lmc_external_native_connector)",
)


def _load_helpers() -> Any:
    path = Path(__file__).resolve().parents[2] / "native" / "l2_helpers.py"
    spec = importlib.util.spec_from_file_location("_lmcache_l2_test_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.Helpers


Helpers = _load_helpers()


@pytest.fixture
def h() -> Any:
    return Helpers
