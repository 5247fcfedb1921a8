"""The ``valkey`` type against LMCache 0.5.6's own: the same config stores the same names and
bytes, so each reads what the other stored (a standalone redis-server, with a key_prefix).
0.5.6's venv needs valkey-glide-sync (``pip install valkey-glide-sync==2.6.0``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from testsupport.resp_engines import REDIS_SERVER, RawRedis, RedisServer

DRIVER = Path(__file__).with_name("valkey_driver.py")


@pytest.fixture
def redis(tmp_path):
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


def _env(python: str) -> dict[str, str]:
    """Ours runs with this process's environment (PYTHONPATH may point at a checkout);
    0.5.6 with none of it, so that it imports only its own lmcache."""
    if python == sys.executable:
        return {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    return {"LMCACHE_TRACK_USAGE": "false", "PATH": "/usr/bin:/bin"}


def _run(python: str, mode: str, port: int) -> dict:
    spec = {"type": "valkey", "startup_nodes": f"127.0.0.1:{port}", "key_prefix": "dep"}
    spec["num_workers"] = 2
    proc = subprocess.run(
        [python, str(DRIVER), mode, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(python),
        cwd=str(DRIVER.parent.parent),  # not tests/compat: no shadowing of lmcache
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _dump(port: int) -> dict[bytes, bytes]:
    raw = RawRedis(port)
    try:
        return {k: raw.cmd("GET", k) for k in raw.cmd("KEYS", "*")}
    finally:
        raw.close()


@pytest.fixture
def theirs(compat_venv) -> str:
    python = str(compat_venv / "bin" / "python")
    probe = subprocess.run([python, "-c", "import glide_sync"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(
            f"0.5.6's venv lacks valkey-glide-sync: {python} -m pip install valkey-glide-sync==2.6.0"
        )
    return python


def test_same_names_and_bytes_both_ways(theirs, redis):
    assert _run(theirs, "store", redis.port) == {"stored": True}
    by_theirs = _dump(redis.port)
    assert len(by_theirs) == 6 and all(k.startswith(b"dep@org/compat-model@") for k in by_theirs)
    assert _run(sys.executable, "load", redis.port) == {"hits": list(range(6)), "bytes_equal": True}
    redis.client_cmd("FLUSHALL")
    assert _run(sys.executable, "store", redis.port) == {"stored": True}
    assert _dump(redis.port) == by_theirs  # our names and bytes are 0.5.6's
    assert _run(theirs, "load", redis.port) == {"hits": list(range(6)), "bytes_equal": True}
