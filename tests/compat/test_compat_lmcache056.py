"""Wire compatibility with LMCache 0.5.6, driven through compat_check.py.

Runs only when LMCACHE_COMPAT_VENV names a venv holding PyPI ``lmcache==0.5.6`` (``nox -s
compat`` builds one); the default ``python -m pytest tests`` run skips it. Our side is the
venv running pytest, which must have ``lmcache-core`` installed.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("shm", [False, True], ids=["copy", "shm"])
@pytest.mark.parametrize("server_side,client_side", [("ours", "theirs"), ("theirs", "ours")])
def test_client_stores_and_retrieves_bytes_through_foreign_server(
    checker, venvs, tmp_path, server_side, client_side, shm
):
    with checker.running_server(venvs[server_side], server_side, tmp_path, shm=shm) as urls:
        r = checker.run_client(
            venvs[client_side], client_side, *urls, checker.CHECK_SPEC, 3, tmp_path
        )
    assert r["verified"], (
        f"{client_side} client vs {server_side} server: {r['detail']}\n{r['output_tail']}"
    )
