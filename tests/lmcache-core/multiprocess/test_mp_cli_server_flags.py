"""``lmcache server`` takes every LMCache 0.5.6 command line: 0.5.6's forms (``--no-*``,
list flags), its defaults passed explicitly, and flags of features this version lacks
(harmless when they are off, one line when asked for). tests/compat/test_flags_compat.py
checks the same against 0.5.6's own ``--help``."""

from __future__ import annotations

import argparse

import pytest

from lmcache.cli.errors import CLIError

# What a launcher generated for 0.5.6 writes: its defaults, spelled out.
DEFAULTS_056 = [
    "--transport", "zmq", "--max-workers", "1", "--grpc-server-workers", "32",
    "--hash-algorithm", "blake3", "--engine-type", "default",
    "--supported-transfer-mode", "lmcache_driven", "--no-isolated-ipc",
    "--runtime-plugin-locations", "--runtime-plugin-config", "{}", "--shm-name", "",
    "--script-allowed-imports", "--no-run-script-api-enabled", "--no-separate-object-groups",
    "--enable", "--kv-event-log-size", "32768", "--p2p-advertise-url", "",
    "--p2p-listen-url", "", "--p2p-lookup-timeout", "30", "--p2p-load-timeout", "30",
    "--p2p-transfer-engine", "nixl", "--l1-use-lazy", "--l1-init-size-gb", "20",
    "--no-l1-use-hugepages", "--gds-l1-use-direct-io", "--gds-l1-backend", "auto",
    "--l1-write-ttl-seconds", "600", "--l1-read-ttl-seconds", "300",
    "--eviction-trigger-watermark", "0.8", "--eviction-ratio", "0.2",
    "--l2-store-policy", "default", "--l2-prefetch-policy", "default",
    "--prometheus-port", "9090", "--metrics-sample-rate", "0.01",
    "--event-bus-queue-size", "10000", "--lookup-hash-log-dir", "",
    "--lookup-hash-log-rotation-interval", "21600", "--lookup-hash-log-max-files", "100",
    "--gc-monitor-min-pause-ms", "1.0", "--gc-monitor-top-objects", "0",
    "--extra-logging-interval", "10.0", "--coordinator-event-transport", "http",
    "--coordinator-kafka-topic", "lmcache-cache-events", "--coordinator-blend-timeout", "1.0",
    "--l1-size-gb", "1", "--eviction-policy", "LRU",
]  # fmt: skip


def _parse(*argv: str) -> argparse.Namespace:
    from lmcache.cli.server import add_server_args
    from lmcache.cli.server_flags import one_line_parse_errors

    parser = argparse.ArgumentParser(prog="lmcache server")
    add_server_args(parser)
    one_line_parse_errors(parser)
    return parser.parse_args([*argv, "--port", "0", "--http-port", "0"])


def test_0_5_6_defaults_spelled_out_start():
    from lmcache.cli.server import build_configs

    mp, storage = build_configs(_parse(*DEFAULTS_056))
    assert mp.supported_transfer_mode == "lmcache_driven" and mp.max_gpu_workers == 1
    assert mp.shm_name == "" and storage.eviction_config.eviction_policy == "LRU"


@pytest.mark.parametrize(
    "argv",
    [
        ["--script-allowed-imports", "numpy", "pandas"],  # lists take several values
        ["--separate-object-groups"],
        ["--disable-grpc-metrics", "--disable-logging"],
        ["--p2p-lookup-timeout", "5", "--p2p-transfer-engine", "mooncake"],  # p2p is off
        ["--coordinator-heartbeat-interval", "2", "--coordinator-event-reporting"],
        ["--gds-l1-backend", "cufile", "--no-gds-l1-use-direct-io"],  # no GDS path
        ["--lookup-hash-log-max-files", "3", "--trace-output", "/tmp/t"],
        ["--enable-blend-reorder", "--enable-dedup-content", "--enable-segmented-prefix"],
        ["--format", "json", "--output", "/tmp/x", "-q"],
        ["--kv-event-log-size", "0"],
        ["--enable-gc-monitor", "--gc-monitor-top-objects", "5", "--enable-extra-logging"],
    ],
)
def test_0_5_6_flags_that_change_nothing_here_are_accepted(argv):
    from lmcache.cli.server import build_configs

    build_configs(_parse(*argv))


def test_help_of_every_flag_we_lack_says_so():
    """Their help comes from NOT_PROVIDED and DEPENDENT, also for ``--X/--no-X`` switches
    (--l1-use-hugepages and --gds-l1-use-direct-io once kept a help that promised a feature)."""
    from lmcache.cli.server import add_server_args
    from lmcache.cli.server_flags import DEPENDENT, NOT_PROVIDED

    parser = argparse.ArgumentParser(prog="lmcache server")
    add_server_args(parser)
    helps = {o: a.help or "" for a in parser._actions for o in a.option_strings}
    for flag in NOT_PROVIDED:
        assert helps[flag].startswith("not provided: "), (flag, helps[flag])
    for flag in DEPENDENT:
        assert helps[flag].startswith(f"read only with {DEPENDENT[flag]} "), (flag, helps[flag])


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--enable", "transfer_query", "other"], "--enable"),
        (["--runtime-plugin-locations", "a.py", "b.py"], "--runtime-plugin-locations"),
        (["--isolated-ipc"], "--isolated-ipc"),
        (["--l1-use-hugepages", "--shm-name", ""], "--l1-use-hugepages"),
        (["--coordinator-url", "http://c:9300"], "--coordinator-url"),
        (["--lookup-hash-log-dir", "/tmp/h"], "--lookup-hash-log-dir"),
        (["--otlp-endpoint", "http://otel:4317"], "--otlp-endpoint"),
    ],
)
def test_features_we_lack_stop_in_one_line_naming_the_flag(argv, flag):
    from lmcache.cli.server import build_configs

    with pytest.raises(CLIError) as err:
        build_configs(_parse(*argv))
    assert str(err.value).startswith(f"option {flag} is not supported") and "\n" not in str(
        err.value
    )


def test_gc_monitor_extra_logging_and_disable_logging_on_a_real_server(lmcache_server, mp):
    srv = lmcache_server(
        "--enable-gc-monitor",
        "--gc-monitor-min-pause-ms",
        "0",
        "--gc-monitor-top-objects",
        "2",
        "--enable-extra-logging",
        "--extra-logging-interval",
        "0.5",
        "--disable-logging",
    )
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model="diag")
    try:
        assert ctx.submit_store(mp.key("diag", model="diag"), list(range(1, 33))).result(20)
    finally:
        ctx.close()
        c.close()
    mp.wait_for(lambda: "stores 1 " in srv.log(), "an extra-stats line with the store")
    mp.wait_for(lambda: "GC generation" in srv.log(), "a GC pause logged")
    log = srv.log()
    assert "most common types:" in log
    # --disable-logging means 0.5.6's: no per-event logging; the INFO log stays
    assert "lmcache server listening" in log
