"""Shared fixtures for the LMCache 0.5.6 conformance tests (tests/compat/).

Every test here needs ``LMCACHE_COMPAT_VENV``: a venv holding PyPI ``lmcache==0.5.6`` (``nox
-s compat`` builds one). Without it each test skips, naming the variable. "Ours" is the venv
running pytest (``sys.prefix``), which must have ``lmcache-core`` installed.

What the fixtures offer:

* ``compat_venv`` (session): the 0.5.6 venv as a ``Path`` (skips when unset or without
  ``bin/lmcache``). ``venvs`` (session): ``{"theirs": <0.5.6 venv>, "ours": sys.prefix}``.
* ``start_pair(transfer_mode="auto", shm=False, extra_args=())``: a module-scoped factory
  that starts 0.5.6's ``lmcache server`` and ours with the same flags (both at once,
  0.5.6 takes ~20-50 s to import) and returns ``{"theirs": Server, "ours": Server}``.
  Pairs are cached per argument set, so test files asking for the same flags share them.
* ``server_pair``: ``start_pair()`` with the defaults (both transfer modes, copy path).
* ``Server``: ``side``, ``venv``, ``rpc_url``, ``http_url``, ``logdir``;
  ``server.http(method, path, **httpx_kwargs) -> httpx.Response``.
* ``run_lmcache(venv, *args, timeout=600)``: runs that venv's ``lmcache`` CLI with the
  banner and usage tracking off; returns the ``subprocess.CompletedProcess`` (text).
* ``checker``: tests/compat/compat_check.py as a module (``running_server``,
  ``run_client``, ``CHECK_SPEC``, ``QUIET_ENV``, ``free_port``...).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import httpx
import pytest

COMPAT_VENV_VAR = "LMCACHE_COMPAT_VENV"


def _load_checker() -> ModuleType:
    path = Path(__file__).with_name("compat_check.py")
    spec = importlib.util.spec_from_file_location("lmcache_compat_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CHECKER = _load_checker()


@pytest.fixture(scope="session")
def checker() -> ModuleType:
    return CHECKER


@pytest.fixture(scope="session")
def compat_venv() -> Path:
    venv = os.environ.get(COMPAT_VENV_VAR)
    if not venv:
        pytest.skip(
            f"{COMPAT_VENV_VAR} not set (a venv with lmcache==0.5.6; `nox -s compat` builds one)"
        )
    if not (Path(venv) / "bin" / "lmcache").is_file():
        pytest.skip(f"{COMPAT_VENV_VAR}={venv} has no bin/lmcache (lmcache==0.5.6 not installed)")
    return Path(venv)


@pytest.fixture(scope="session")
def venvs(compat_venv: Path) -> dict[str, Path]:
    return {"theirs": compat_venv, "ours": Path(sys.prefix)}


@dataclass
class Server:
    side: str  # "theirs" (0.5.6) or "ours"
    venv: Path
    rpc_url: str
    http_url: str
    logdir: Path

    def http(self, method: str, path: str, **kwargs) -> httpx.Response:
        kwargs.setdefault("timeout", 30.0)
        return httpx.request(method, self.http_url + path, **kwargs)


def run_lmcache(venv: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CHECKER.lmcache_bin(venv)), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **CHECKER.QUIET_ENV},
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def lmcache_cli():
    """``run_lmcache`` as a fixture, for test files that prefer fixtures to imports."""
    return run_lmcache


@pytest.fixture(scope="module")
def start_pair(venvs: dict[str, Path]):
    stack = ExitStack()
    pairs: dict[tuple, dict[str, Server]] = {}
    logdir = Path(tempfile.mkdtemp(prefix="lmcache-compat-"))

    def start(
        transfer_mode: str = "auto", shm: bool = False, extra_args: tuple[str, ...] = ()
    ) -> dict[str, Server]:
        key = (transfer_mode, shm, tuple(extra_args))
        if key in pairs:
            return pairs[key]

        def one(side: str) -> tuple[str, str]:
            cm = CHECKER.running_server(
                venvs[side],
                side,
                logdir,
                shm=shm,
                transfer_mode=transfer_mode,
                extra_args=tuple(extra_args),
            )
            urls = cm.__enter__()
            stack.push(cm.__exit__)
            return urls

        with ThreadPoolExecutor(2) as pool:
            urls = dict(zip(("theirs", "ours"), pool.map(one, ("theirs", "ours")), strict=True))
        pairs[key] = {
            side: Server(side, venvs[side], *urls[side], logdir) for side in ("theirs", "ours")
        }
        return pairs[key]

    with stack:
        yield start


@pytest.fixture(scope="module")
def server_pair(start_pair) -> dict[str, Server]:
    return start_pair()
