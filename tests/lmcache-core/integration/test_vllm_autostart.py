"""``lmcache.mp.autostart``: the connector starts a real ``lmcache server`` when none answers,
one per port whatever the number of adapters and processes, and the server stops cleanly when
the process that started it exits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from testsupport.ports import free_port
from testsupport.waiting import eventually

from lmcache.integration.vllm.mp_config import parse_extra_config
from lmcache.integration.vllm.server_autostart import answers, server_command
from lmcache.integration.vllm.server_link import ServerLink

P = "lmcache.mp."


def extra(port: int, args: str = "", **more) -> dict:
    return {
        P + "host": "tcp://127.0.0.1",
        P + "port": str(port),
        P + "autostart": "true",
        P + "autostart.server_args": args,
        P + "autostart.wait_timeout": "60",
        **more,
    }


def alive(pid: int) -> bool:
    """Running and not a zombie (a server whose parent exited is reaped by init, or not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def started():
    """Servers a test's links started in this process: stopped at teardown."""
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        p.terminate()
        p.wait(15)


def test_the_keys_and_their_defaults():
    cfg = parse_extra_config({})
    assert (cfg.autostart, cfg.autostart_server_args, cfg.autostart_wait_timeout) == (False, "", 90)
    cfg = parse_extra_config(extra(6001, "--l1-size-gb 1 --http-port 9001"))
    assert cfg.autostart and cfg.autostart_wait_timeout == 60
    command = server_command(cfg)
    assert command[1:4] == ["-m", "lmcache.cli.main", "server"]
    assert command[4:] == [
        "--host", "127.0.0.1", "--port", "6001", "--http-host", "127.0.0.1",
        "--parent-pid", str(os.getpid()), "--l1-size-gb", "1", "--http-port", "9001",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "settings, words",
    [
        ({P + "autostart.server_args": "--port 7000"}, ["--port", P + "port"]),
        ({P + "autostart.server_args": "--po=7000"}, ["--port", "'--po=7000'"]),
        ({P + "autostart.server_args": "--http-host 0.0.0.0"}, ["--http-host"]),
        ({P + "autostart.server_args": "--parent-pid 1"}, ["--parent-pid"]),
        ({P + "autostart.server_args": "--l1-size-gb '1"}, ["shell quoting"]),
        ({P + "autostart.wait_timeout": "0"}, ["autostart.wait_timeout", "greater than 0"]),
        ({P + "host": "tcp://10.1.2.3"}, ["'tcp://10.1.2.3'", "tcp://localhost", "yourself"]),
    ],
)
def test_bad_settings_name_the_key_and_the_fix(settings, words):
    with pytest.raises(ValueError) as err:
        parse_extra_config({**extra(6001), **settings})
    for word in words:
        assert word in str(err.value)


def test_a_remote_host_is_fine_without_autostart():
    assert parse_extra_config({P + "host": "tcp://10.1.2.3"}).autostart is False


def test_the_first_link_starts_the_server_and_the_next_ones_use_it(started):
    port = free_port()
    http_port = free_port()
    cfg = parse_extra_config(
        extra(port, f"--l1-size-gb 0.25 --chunk-size 128 --http-port {http_port}")
    )
    assert not answers(cfg.server_url)
    first = ServerLink(cfg, role="scheduler (test)")
    try:
        assert first.server_process is not None
        started.append(first.server_process)
        assert first.chunk_size == 128  # autostart.server_args reached the server
        second = ServerLink(cfg, role="worker (test)")
        try:
            assert second.server_process is None  # it answered: nothing started
            assert second.chunk_size == 128
        finally:
            second.close()
    finally:
        first.close()


def test_a_server_that_cannot_start_is_reported_with_the_key_to_fix():
    port = free_port()
    cfg = parse_extra_config(extra(port, "--l1-size-gb -1"))
    with pytest.raises(ConnectionError) as err:
        ServerLink(cfg, role="worker (test)")
    text = str(err.value)
    assert "exited with code" in text and P + "autostart.server_args" in text
    assert "--l1-size-gb -1" in text  # the command it ran


STARTER = textwrap.dedent(
    """
    import json, os, sys
    from lmcache.integration.vllm.mp_config import parse_extra_config
    from lmcache.integration.vllm.server_autostart import ensure_server

    process = ensure_server(parse_extra_config(json.loads(sys.argv[1])))
    print(json.dumps({"started": process.pid if process else None}), flush=True)
    sys.stdin.read()  # hold on until the test says so, then exit without any cleanup
    os._exit(0)
    """
)


def started_pid(starter: subprocess.Popen) -> int | None:
    """The starter's report (the server it started prints to the same stdout)."""
    for line in starter.stdout:
        if line.startswith("{"):
            return json.loads(line)["started"]
    raise AssertionError(f"the starter exited with {starter.wait()} before reporting")


def test_concurrent_starters_start_one_server_which_stops_when_its_starter_exits():
    """Three processes (vLLM's scheduler and workers) ask at once: one server starts, the
    others use it. When the process that started it dies, the server stops by itself, and
    cleanly: its shared-memory pool is unlinked."""
    port, http_port = free_port(), free_port()
    shm = f"lmcache_l1_pool_autostart{port}"
    settings = extra(port, f"--l1-size-gb 0.25 --http-port {http_port} --shm-name {shm}")
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    starters = [
        subprocess.Popen(
            [sys.executable, "-c", STARTER, json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(3)
    ]
    try:
        pids = [started_pid(s) for s in starters]
        server_pids = [p for p in pids if p is not None]
        assert len(server_pids) == 1, pids
        (server_pid,) = server_pids
        assert answers(f"tcp://127.0.0.1:{port}")
        assert os.path.exists(f"/dev/shm/{shm}")
        owner = starters[pids.index(server_pid)]
        others = [s for s in starters if s is not owner]
        for s in others:  # the others leaving changes nothing
            s.stdin.close()
            s.wait(30)
        assert answers(f"tcp://127.0.0.1:{port}")
        owner.stdin.close()  # the starter exits (os._exit: no cleanup of its own)
        owner.wait(30)
        eventually(lambda: not alive(server_pid), "the server stopped with its starter", 60)
        assert not os.path.exists(f"/dev/shm/{shm}")  # a clean stop
    finally:
        for s in starters:
            if s.poll() is None:
                s.kill()
                s.wait(10)
        for pid in server_pids if "server_pids" in dir() else []:
            if alive(pid):
                os.kill(pid, 9)
