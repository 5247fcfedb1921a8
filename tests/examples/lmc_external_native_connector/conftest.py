"""Fixtures of the native-connector example tests."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "lmc_external_native_connector",
    reason="lmc_external_native_connector is not installed (pip install examples/lmc_external_native_connector)",
)
