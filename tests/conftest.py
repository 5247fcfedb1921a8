"""Shared fixtures for every test directory.

* ``free_port()`` / ``free_tcp_port`` fixture: a TCP port nobody listens on right now.
* ``lmcache_server`` fixture: a factory that starts a real ``lmcache server`` subprocess
  on free ports and returns a handle once the server answers; every server it started is
  stopped (SIGTERM, then SIGKILL) at teardown::

      def test_x(lmcache_server):
          srv = lmcache_server("--l1-size-gb", "0.5", env={"LMCACHE_LOG_LEVEL": "DEBUG"})
          srv.rpc_url      # "tcp://127.0.0.1:<port>"
          srv.http_url     # "http://127.0.0.1:<port>"
          srv.log()        # everything the server printed so far
          srv.stop()       # optional; returns the exit code

  A server whose L2 backend is down answers ``/healthcheck`` with 503; pass
  ``healthy=False`` to take that answer as "ready" too.

  ``lmcache_server_module`` is the same factory with module scope (one server shared by
  a test module). Defaults: ``--l1-size-gb 0.25``, ``--worker-reap-timeout-seconds 0`` and ``--shm-name ""``
  (the copy path; the CLI's own default turns SHM on) unless the test
  passes its own value of those flags or ``test_defaults=False`` (then only the ports and
  ``--host 127.0.0.1`` are added).
* ``sigstop`` fixture: ``sigstop(pid)`` stops a process (a server a test wants to stall)
  and returns once every thread of it has stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
from testsupport.ports import free_port
from testsupport.waiting import eventually


@pytest.fixture
def free_tcp_port() -> int:
    return free_port()


class LMCacheServerProcess:
    """A running ``lmcache server`` subprocess."""

    def __init__(self, args: list[str], env: dict[str, str] | None, port: int, http_port: int):
        self.port = port
        self.http_port = http_port
        self.rpc_url = f"tcp://127.0.0.1:{port}"
        self.http_url = f"http://127.0.0.1:{http_port}"
        self.args = args
        fd, self._log_path = tempfile.mkstemp(prefix="lmcache-server-", suffix=".log")
        self._log = os.fdopen(fd, "wb")
        full_env = dict(os.environ)
        full_env.setdefault("LMCACHE_TRACK_USAGE", "false")
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache.cli.main", "server", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=full_env,
        )

    def log(self) -> str:
        with open(self._log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 60.0, healthy: bool = True) -> None:
        import httpx

        ready = (200,) if healthy else (200, 503)

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"lmcache server exited with {self.proc.returncode}:\n{self.log()}"
                )
            try:
                r = httpx.get(self.http_url + "/healthcheck", timeout=1.0)
                if r.status_code in ready:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"lmcache server did not become ready in {timeout} s:\n{self.log()}")

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def cleanup(self) -> None:
        self.stop()
        self._log.close()
        try:
            os.unlink(self._log_path)
        except OSError:
            pass


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _server_factory():
    started: list[LMCacheServerProcess] = []

    def start(
        *args: str,
        env: dict[str, str] | None = None,
        ready_timeout: float = 60.0,
        test_defaults: bool = True,
        healthy: bool = True,
    ) -> LMCacheServerProcess:
        argv = list(args)
        if (
            test_defaults
            and not _has_flag(argv, "--l1-size-gb")
            and not _has_flag(argv, "--l1-manager")
        ):
            argv += ["--l1-size-gb", "0.25"]
        if test_defaults and not _has_flag(argv, "--worker-reap-timeout-seconds"):
            argv += ["--worker-reap-timeout-seconds", "0"]
        if test_defaults and not _has_flag(argv, "--shm-name"):
            argv += ["--shm-name", ""]  # the copy path unless a test asks for SHM
        port, http_port = free_port(), free_port()
        argv += ["--host", "127.0.0.1", "--port", str(port), "--http-port", str(http_port)]
        srv = LMCacheServerProcess(argv, env, port, http_port)
        started.append(srv)
        srv.wait_ready(ready_timeout, healthy)
        return srv

    return start, started


@pytest.fixture
def lmcache_server() -> Iterator:
    start, started = _server_factory()
    yield start
    for srv in started:
        srv.cleanup()


@pytest.fixture(scope="module")
def lmcache_server_module() -> Iterator:
    """Same factory, but the servers live for the whole test module (faster suites)."""
    start, started = _server_factory()
    yield start
    for srv in started:
        srv.cleanup()


def _all_threads_stopped(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # gone: nothing of it runs
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue  # the thread exited meanwhile
        if state not in ("T", "t"):
            return False
    return True


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped.

    kill() returns as soon as the signal is queued; the process stops only when the thread
    the kernel picked to take it gets a CPU, and until then its other threads keep running
    (on a busy 2-core host long enough to answer a request that was sent right after)."""
    os.kill(pid, signal.SIGSTOP)
    eventually(lambda: _all_threads_stopped(pid), f"every thread of process {pid} stopped", timeout)


@pytest.fixture
def sigstop():
    """``sigstop(pid)``: SIGSTOP a process and wait until all its threads have stopped."""
    return stop_process


@pytest.fixture
def h() -> Any:
    """The L2 adapter test helpers (``testsupport.l2.Helpers``)."""
    from testsupport.l2 import Helpers

    return Helpers


@pytest.fixture
def adapters() -> Iterator[list[Any]]:
    """Collects adapters to close at teardown (closing twice is harmless)."""
    made: list[Any] = []
    yield made
    for a in made:
        a.close()
