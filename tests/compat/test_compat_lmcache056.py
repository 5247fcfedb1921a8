"""Wire compatibility with LMCache 0.5.6, driven through compat_check.py.

Runs only when LMCACHE_COMPAT_VENV names a venv holding PyPI ``lmcache==0.5.6`` (``nox -s
compat`` builds one); the default ``python -m pytest tests`` run skips it. Our side is the
venv running pytest, which must have ``lmcache-core`` installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

VENV = os.environ.get("LMCACHE_COMPAT_VENV")

pytestmark = pytest.mark.skipif(
    not VENV,
    reason="LMCACHE_COMPAT_VENV not set (a venv with lmcache==0.5.6; see docs/compat.md)",
)


def _load_checker():
    path = Path(__file__).with_name("compat_check.py")
    spec = importlib.util.spec_from_file_location("lmcache_compat_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def checker():
    mod = _load_checker()
    if not (Path(VENV) / "bin" / "lmcache").is_file():
        pytest.skip(f"LMCACHE_COMPAT_VENV={VENV} has no bin/lmcache (lmcache==0.5.6 not installed)")
    return mod


@pytest.mark.parametrize("shm", [False, True], ids=["copy", "shm"])
@pytest.mark.parametrize("server_side,client_side", [("ours", "theirs"), ("theirs", "ours")])
def test_client_stores_and_retrieves_bytes_through_foreign_server(
    checker, tmp_path, server_side, client_side, shm
):
    venvs = {"theirs": Path(VENV), "ours": Path(sys.prefix)}
    with checker.running_server(venvs[server_side], server_side, tmp_path, shm=shm) as urls:
        r = checker.run_client(
            venvs[client_side], client_side, *urls, checker.CHECK_SPEC, 3, tmp_path
        )
    assert r["verified"], (
        f"{client_side} client vs {server_side} server: {r['detail']}\n{r['output_tail']}"
    )
