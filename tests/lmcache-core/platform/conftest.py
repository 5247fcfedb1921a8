"""Fixtures for the platform tests: clean platform caches and env for every test."""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path

import pytest

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)  # for kv_reference_helpers (importlib import mode)

PLATFORM_ENV = ("LMCACHE_DEVICE_BACKEND", "DEVICE_TYPE", "LMCACHE_MP_TRANSFER_MODE")


@pytest.fixture(autouse=True)
def clean_platform(monkeypatch):
    from lmcache.v1.platform import reset_platform_caches

    for name in PLATFORM_ENV:
        monkeypatch.delenv(name, raising=False)
    reset_platform_caches()
    yield
    reset_platform_caches()


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """Write throwaway distributions with device entry points onto sys.path.

    ``make(dist_name, {ep_name: value}, {module_name: source})``; importlib.metadata finds
    ``<dist>.dist-info/entry_points.txt`` on sys.path.
    """
    root = tmp_path / f"plugins_{uuid.uuid4().hex[:8]}"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    created_modules: list[str] = []

    def make(dist_name: str, entry_points: dict[str, str], modules: dict[str, str] | None = None):
        for mod, src in (modules or {}).items():
            (root / f"{mod}.py").write_text(textwrap.dedent(src))
            created_modules.append(mod)
        info = root / f"{dist_name.replace('-', '_')}-0.3.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.3.1\n"
        )
        lines = ["[lmcache.device_plugins]"] + [f"{k} = {v}" for k, v in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        import importlib

        importlib.invalidate_caches()
        from lmcache.v1.platform import reset_platform_caches

        reset_platform_caches()
        return root

    yield make
    for mod in created_modules:
        sys.modules.pop(mod, None)
