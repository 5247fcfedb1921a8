"""Issue 27: `resp` against a Redis Cluster node is refused at start-up (it would lose every key
another node owns), against a real 3-master cluster; a server that does not answer is not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from testsupport.ports import free_port

from lmcache.v1.errors import LMCacheConfigError


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )


def _server(adapter: dict) -> subprocess.CompletedProcess:
    return _cli(
        "server",
        "--l2-adapter",
        json.dumps(adapter),
        "--l1-size-gb",
        "0.25",
        "--shm-name",
        "",
        "--worker-reap-timeout-seconds",
        "0",
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--http-port",
        str(free_port()),
    )


def _one_error_line(proc: subprocess.CompletedProcess, prefix: str) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, out
    return lines[0]


def _assert_cluster_message(text: str, port: int) -> None:
    assert f"127.0.0.1:{port}" in text
    assert "Redis Cluster node" in text and "cluster_enabled:1" in text
    assert "one server" in text and "another node" in text
    assert "standalone Redis/Valkey server" in text
    assert "valkey type" in text and "pip install lmcache-valkey" in text
    assert '"cluster_mode": true' in text


def test_server_refuses_a_cluster_node_in_one_line(redis_cluster):
    port = redis_cluster.ports[0]
    proc = _server({"type": "resp", "host": "127.0.0.1", "port": port})
    line = _one_error_line(proc, "lmcache server: error: ")
    _assert_cluster_message(line, port)
    assert "SELECT" not in line


def test_server_refuses_a_cluster_node_with_db_and_names_select(redis_cluster):
    port = redis_cluster.ports[1]
    proc = _server({"type": "redis", "host": "127.0.0.1", "port": port, "db": 1})
    line = _one_error_line(proc, "lmcache server: error: ")
    _assert_cluster_message(line, port)
    assert "db 1" in line and "SELECT is not allowed in cluster mode" in line


def test_bench_l2_refuses_a_cluster_node_in_one_line(redis_cluster):
    port = redis_cluster.ports[2]
    proc = _cli(
        "bench",
        "l2",
        "--l2-adapter",
        json.dumps({"type": "resp", "host": "127.0.0.1", "port": port}),
        "--num-keys",
        "2",
        "--data-size-kb",
        "4",
        "--rounds",
        "1",
    )
    _assert_cluster_message(_one_error_line(proc, "lmcache bench: error: "), port)


def test_creating_the_adapter_raises_the_config_error(h, adapters, redis_cluster):
    port = redis_cluster.ports[0]
    with pytest.raises(LMCacheConfigError) as err:
        adapters.append(h.build("resp", host="127.0.0.1", port=port, num_workers=1))
    assert isinstance(err.value, ValueError)  # LMCache's config errors are ValueErrors too
    _assert_cluster_message(str(err.value), port)
    assert "\n" not in str(err.value)


def test_a_configured_password_does_not_hide_the_cluster(h, adapters, redis_cluster):
    """The probe sends AUTH first; a node without a password rejects it and still answers
    INFO, so the node is still recognised."""
    port = redis_cluster.ports[1]
    with pytest.raises(LMCacheConfigError, match="Redis Cluster node"):
        adapters.append(
            h.build("resp", host="127.0.0.1", port=port, username="u", password="p", db=2)
        )


def test_standalone_server_with_password_and_db_is_accepted(
    h, adapters, redis_server_with_password
):
    a = h.build(
        "resp",
        host="127.0.0.1",
        port=redis_server_with_password.port,
        password=redis_server_with_password.password,
        db=3,
        num_workers=1,
    )
    adapters.append(a)
    assert h.store(a, [h.key(1)], [h.make_obj(64)]).is_successful()


def test_nobody_listening_is_not_refused_and_reports_unhealthy(h, adapters):
    port = free_port()  # nothing listens here
    a = h.build("resp", host="127.0.0.1", port=port, num_workers=1, health_check_interval_s=0.2)
    adapters.append(a)
    assert h.wait_until(lambda: a.report_status()["last_error"] is not None, 20)
    st = a.report_status()
    assert st["is_healthy"] is False and st["last_success_time"] is None
