"""`lmcache server` CLI help and validation (docs/design/protocol.md#defaults-shm), clean stop on
signals, and the client's handling of a timed-out request."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys

import msgspec
import pytest
import zmq

from lmcache.cli.errors import CLIError
from lmcache.v1.multiprocess.client import LMCacheTimeoutError, MPClient


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    return subprocess.run(
        [sys.executable, "-m", "lmcache.cli.main", "server", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def _help_blocks(text: str) -> dict[str, str]:
    """flag -> its help entry (whitespace collapsed), from `--help` output."""
    blocks: dict[str, str] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        m = re.match(r"^  (-{1,2}[a-z0-9-]+)", line)
        if m:
            current = [line]
            for flag in re.findall(r"(--[a-z0-9-]+)", line.split("  ", 2)[1]):
                blocks[flag] = current  # type: ignore[assignment]
        elif current is not None and line.startswith("    "):
            current.append(line)
        else:
            current = None
    return {f: " ".join(" ".join(b).split()) for f, b in blocks.items()}


# docs/design/protocol.md#defaults-shm: every flag with the default `--help` must show for it.
SECTION_13_DEFAULTS = {
    "--host": "localhost",
    "--port": "5555",
    "--chunk-size": "256",
    "--hash-algorithm": "blake3",
    "--null-block-id": "0",
    "--max-workers": "4",
    "--max-gpu-workers": "--max-workers",
    "--max-cpu-workers": "--max-workers",
    "--supported-transfer-mode": "auto",
    "--shm-name": "lmcache_l1_pool_<port>",
    "--l1-size-gb": "4",
    "--eviction-policy": "LRU",
    "--l1-use-lazy": "on",
    "--l1-init-size-gb": "20",
    "--l1-align-bytes": "4096",
    "--l1-use-hugepages": "off",
    "--l1-devdax-path": "none",
    "--gds-l1-path": "none",
    "--gds-l1-use-direct-io": "on",
    "--gds-l1-backend": "auto",
    "--l1-manager": "none",
    "--l1-write-ttl-seconds": "600",
    "--l1-read-ttl-seconds": "300",
    "--eviction-trigger-watermark": "0.8",
    "--eviction-ratio": "0.2",
    "--l2-adapter": "none",
    "--l2-store-policy": "default",
    "--l2-prefetch-policy": "default",
    "--l2-prefetch-max-in-flight": "8",
    "--periodic-notifier-interval-ms": "5",
    "--l2-lookup-timeout-seconds": "30",
    "--l2-load-timeout-seconds": "60",
    "--worker-reap-timeout-seconds": "120",
    "--worker-registration-grace-seconds": "3600",
    "--session-ttl-seconds": "600",
    "--http-host": "127.0.0.1",
    "--http-port": "8080",
    "--instance-id": "random UUID",
    "--disable-observability": "off",
    "--disable-metrics": "off",
    "--disable-logging": "off",
    "--event-bus-queue-size": "10000",
    "--metrics-sample-rate": "0.01",
    "--enable-tracing": "off",
    "--otlp-endpoint": "none",
    "--trace-level": "none",
    "--trace-output": "none",
    "--enable-gc-monitor": "off",
    "--lookup-hash-log-dir": '""',
    "--enable-extra-logging": "off",
    "--prometheus-port": "9090",
    "--transport": "zmq",
    "--grpc-server-workers": "32",
    "--isolated-ipc": "off",
    "--separate-object-groups": "off",
    "--engine-type": "default",
    "--enable": "none",
    "--server-module": "none",
    "--kv-event-log-size": "32768",
    "--coordinator-url": "none",
    "--p2p-advertise-url": '""',
    "--p2p-listen-url": '""',
    "--p2p-transfer-engine": "nixl",
    "--runtime-plugin-locations": "none",
    "--runtime-plugin-config": "{}",
    "--script-allowed-imports": "none",
    "--run-script-api-enabled": "off",
}


def test_help_shows_every_section_13_flag_with_its_default():
    out = _cli("--help")
    assert out.returncode == 0, out.stderr
    blocks = _help_blocks(out.stdout)
    missing = [f for f in SECTION_13_DEFAULTS if f not in blocks]
    assert not missing, f"flags absent from --help: {missing}"
    wrong = {}
    for flag, default in SECTION_13_DEFAULTS.items():
        m = re.search(r"\(default:? ([^)]*)\)|; default ([^)]*)\)", blocks[flag])
        shown = (m.group(1) or m.group(2)) if m else None
        if shown is None or not (shown == default or shown.startswith(default)):
            wrong[flag] = blocks[flag]
    assert not wrong, f"flags whose help lacks the right default: {wrong}"
    # every flag (not only those of section 13) explains itself
    for flag, text in blocks.items():
        description = re.sub(r"^-\S+( [A-Z_\[\]{},a-z]+)?(, -\S+)?", "", text).strip()
        assert not description.startswith("(default"), f"{flag} has no help text: {text}"


def _parse(*argv: str) -> argparse.Namespace:
    from lmcache.cli.server import add_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("bad", ["a/b", "/a/b", "a/", "/", "a\0b"])
def test_bad_shm_name_is_refused_naming_the_flag(bad):
    from lmcache.cli.server import build_configs

    with pytest.raises(CLIError) as exc:
        build_configs(_parse("--shm-name", bad))
    assert "--shm-name" in str(exc.value) and "without '/'" in str(exc.value)


@pytest.mark.parametrize("flag", ["--worker-reap-timeout-seconds", "--retrieve-lease-seconds"])
def test_negative_durations_are_refused_naming_the_flag(flag):
    from lmcache.cli.server import build_configs

    with pytest.raises(CLIError, match=f"^{flag} must be >= 0 \\(got -1.0\\)$"):
        build_configs(_parse(flag, "-1"))
    mp_config, _storage = build_configs(_parse(flag, "0"))  # 0 turns each off
    assert mp_config.retrieve_lease_seconds == (0 if flag == "--retrieve-lease-seconds" else 10)


def test_one_leading_slash_is_accepted():
    from lmcache.cli.server import build_configs
    from lmcache.v1.distributed.l1_memory import normalize_shm_name

    _mp_config, storage = build_configs(_parse("--shm-name", "/plain"))
    name = storage.l1_manager_config.memory_config.shm_name
    assert normalize_shm_name(name) == "lmcache_l1_pool_plain"


def test_shm_name_with_slash_exits_2_without_traceback():
    out = _cli("--shm-name", "a/b", "--port", "0", "--http-port", "0")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "--shm-name 'a/b'" in out.stderr and "e.g. --shm-name lmcache" in out.stderr
    assert "Traceback" not in out.stderr and "FileNotFoundError" not in out.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_cleanly_and_unlinks_shm(lmcache_server, sig):
    name = f"sig{os.getpid()}_{int(sig)}"
    path = f"/dev/shm/lmcache_l1_pool_{name}"
    srv = lmcache_server("--shm-name", name)
    assert os.path.exists(path)
    srv.proc.send_signal(sig)
    assert srv.proc.wait(30) == 0, srv.log()
    assert not os.path.exists(path), srv.log()
    assert "lmcache server: stopped" in srv.log()


def test_timed_out_request_leaves_pending_table_and_late_reply_is_dropped():
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)  # a server that answers only when the test says so
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = MPClient(f"tcp://127.0.0.1:{port}", default_timeout=10)
    try:
        fut = client.submit("noop")
        assert router.poll(10_000)
        ident, uid, op = router.recv_multipart()
        with pytest.raises(LMCacheTimeoutError):
            fut.result(0.2)
        assert client.pending_count() == 0
        router.send_multipart([ident, uid, op, msgspec.msgpack.encode("LATE")])
        fut2 = client.submit("noop")
        assert router.poll(10_000)
        ident2, uid2, op2 = router.recv_multipart()
        assert uid2 != uid
        router.send_multipart([ident2, uid2, op2, msgspec.msgpack.encode("OK")])
        assert fut2.result(10) == "OK"  # the late reply did not answer the new request
        assert fut.query() is False  # nor the timed-out one
        assert client.pending_count() == 0
    finally:
        client.close()
        router.close(linger=0)


def test_bad_host_error_names_the_host_flag():
    out = _cli("--host", "999.1.1.1", "--port", "0", "--http-port", "0", "--l1-size-gb", "0.1")
    assert out.returncode != 0
    assert "--host" in out.stderr and "pick another --port" not in out.stderr, out.stderr
