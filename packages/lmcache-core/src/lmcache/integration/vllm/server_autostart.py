"""Start ``lmcache server`` from the connector: ``lmcache.mp.autostart`` (LMCache 0.5.6's keys).

Each adapter of an engine (the scheduler's and every worker's) calls :func:`ensure_server`
before it connects. The first one that finds no server answering on ``lmcache.mp.host`` /
``port`` starts one and waits until it answers; the others wait for it. A lock file per port
makes that one at a time, in this process or any other, whatever order vLLM builds the
adapters in, so two adapters never start two servers on one port (the second would fail to
bind, after taking the first one's shared-memory name).

The server lives as long as the process that started it: it gets ``--parent-pid`` and stops
cleanly (its SHM unlinked) once that process has exited, however it exited. Its output goes
where the engine's goes. For a cache that outlives vLLM restarts, start ``lmcache server``
yourself.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from lmcache.integration.vllm.mp_config import PREFIX, MPConnectorConfig, autostart_host
from lmcache.utils import init_logger
from lmcache.v1.multiprocess.client import MPClient

logger = init_logger(__name__)

PROBE_TIMEOUT_S = 1.0  # one ping; a server that is up answers in milliseconds
POLL_S = 0.2

__all__ = ["ensure_server", "server_command"]


def server_command(config: MPConnectorConfig) -> list[str]:
    """The ``lmcache server`` command the autostart runs (this Python, this environment)."""
    host = autostart_host(config)
    return [
        sys.executable,
        "-m",
        "lmcache.cli.main",
        "server",
        "--host",
        host,
        "--port",
        str(config.port),
        "--http-host",
        host,
        "--parent-pid",
        str(os.getpid()),
        *shlex.split(config.autostart_server_args),
    ]


def ensure_server(config: MPConnectorConfig) -> subprocess.Popen[bytes] | None:
    """With ``lmcache.mp.autostart``: make sure a server answers at ``config.server_url``,
    starting one if none does. Returns the process when this call started it, else None.
    ConnectionError, naming the key to change, when it does not answer in
    ``autostart.wait_timeout`` seconds or exits first."""
    if not config.autostart:
        return None
    url = config.server_url
    deadline = time.monotonic() + config.autostart_wait_timeout
    with _start_lock(config.port, deadline):
        if answers(url):
            logger.info("LMCache server answers at %s: %sautostart starts none", url, PREFIX)
            return None
        command = server_command(config)
        logger.info("%sautostart: starting the LMCache server: %s", PREFIX, shlex.join(command))
        process = subprocess.Popen(command)
        try:
            _wait_until_answering(process, url, deadline, config.autostart_wait_timeout)
        except BaseException:
            _stop(process)
            raise
        logger.info("LMCache server (pid %d) answers at %s", process.pid, url)
        return process


def answers(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    try:
        with MPClient(url, default_timeout=timeout) as client:
            return client.ping(timeout=timeout)
    except Exception:
        return False


def _wait_until_answering(
    process: subprocess.Popen[bytes], url: str, deadline: float, wait_timeout: float
) -> None:
    command = shlex.join(process.args)  # type: ignore[arg-type]
    while True:
        code = process.poll()
        if code is not None:
            raise ConnectionError(
                f"the LMCache server that {PREFIX}autostart started exited with code {code} "
                f"before it answered at {url} (its messages are above; fix "
                f"{PREFIX}autostart.server_args or free the port). Command: {command}"
            )
        if answers(url):
            return
        if time.monotonic() >= deadline:
            raise ConnectionError(
                f"the LMCache server that {PREFIX}autostart started did not answer at {url} "
                f"within {wait_timeout:g} s; raise {PREFIX}autostart.wait_timeout if it needs "
                f"longer to start. Command: {command}"
            )
        time.sleep(POLL_S)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@contextlib.contextmanager
def _start_lock(port: int, deadline: float) -> Iterator[None]:
    """One starter at a time per port and user (``flock``: released when its holder exits)."""
    path = os.path.join(tempfile.gettempdir(), f"lmcache-autostart-{os.getuid()}-{port}.lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise ConnectionError(
                        f"another process (holding {path}) has been starting the LMCache "
                        f"server on port {port} for longer than {PREFIX}autostart.wait_timeout"
                    ) from None
                time.sleep(POLL_S)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
