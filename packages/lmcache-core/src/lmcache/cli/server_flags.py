"""Every flag of ``lmcache server``: LMCache 0.5.6's names, forms and meanings, plus ours.

Every command line 0.5.6's own ``lmcache server --help`` allows parses here. A flag selects
one of four fates, and ``validate_args`` applies them:

* **provided**: it means what it means in 0.5.6 (the storage and RPC flags, the GC
  monitor, extra logging, ...), with our defaults where docs/design/protocol.md#defaults-shm changes
  them.
* **not provided** (``NOT_PROVIDED``): a feature this version lacks. Its off value (0.5.6's
  default, also when passed explicitly) is accepted; any other value stops start-up with
  ``option --X is not supported by this version of lmcache server: <why>`` (exit 2).
* **only with a feature we lack** (``DEPENDENT``): a setting that 0.5.6 reads only when
  another flag turns a feature on (``--p2p-load-timeout`` without ``--p2p-advertise-url``,
  ``--gds-l1-backend`` without ``--gds-l1-path``, ...). Without that flag it does nothing
  in 0.5.6 either, so any value is accepted; with it, the feature's flag stops start-up.
* **nothing to do here**: ``--prometheus-port`` (0.5.6's ``lmcache server`` serves
  ``/metrics`` on the HTTP port and never opens it), ``--disable-grpc-metrics`` (no gRPC),
  ``--event-bus-queue-size`` (no event bus), ``--format/--output/-q`` (the server prints
  no report in 0.5.6 either).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any

from lmcache.cli.errors import CLIError

L1_SIZE_GB_DEFAULT = 4.0
EVICTION_POLICY_DEFAULT = "LRU"

# flag -> (the values that leave the feature off, why it stops otherwise). The first value
# is 0.5.6's default.
NOT_PROVIDED: dict[str, tuple[tuple[Any, ...], str]] = {
    "--transport": (("zmq",), "only the ZeroMQ transport is provided"),
    "--engine-type": (("default",), "CacheBlend (blend) is not provided"),
    "--isolated-ipc": ((False,), "CUDA IPC for isolated containers is not provided"),
    "--runtime-plugin-locations": (([], None), "runtime plugins are not provided"),
    "--enable": (([], None), "experimental transfer modules are not provided"),
    "--server-module": (([], None), "out-of-tree server modules are not provided"),
    "--p2p-advertise-url": (("", None), "peer-to-peer KV transfer is not provided"),
    "--l1-manager": (([], None), "tagged L1 managers are not provided; use --l1-size-gb"),
    "--l1-use-hugepages": ((False,), "hugepage-backed L1 is not provided"),
    "--l1-devdax-path": ((None, ""), "a devdax L1 is not provided"),
    "--gds-l1-path": ((None, ""), "a GDS L1 is not provided"),
    "--enable-tracing": ((False,), "OpenTelemetry tracing is not provided"),
    "--otlp-endpoint": (
        (None, ""),
        "OTLP push is not provided; scrape /metrics on the HTTP port instead",
    ),
    "--lookup-hash-log-dir": (("", None), "lookup hash logging is not provided"),
    "--trace-level": ((None,), "trace recording is not provided"),
    "--coordinator-url": ((None, ""), "the MP coordinator is not provided"),
}

# Settings 0.5.6 reads only when the named flag turns their feature on.
DEPENDENT: dict[str, str] = {
    "--grpc-server-workers": "--transport grpc",
    "--runtime-plugin-config": "--runtime-plugin-locations",
    "--script-allowed-imports": "--run-script-api-enabled",
    "--enable-segmented-prefix": "--engine-type blend",
    "--enable-dedup-content": "--engine-type blend",
    "--enable-blend-reorder": "--engine-type blend",
    "--p2p-listen-url": "--p2p-advertise-url",
    "--p2p-lookup-timeout": "--p2p-advertise-url",
    "--p2p-load-timeout": "--p2p-advertise-url",
    "--p2p-transfer-engine": "--p2p-advertise-url",
    "--gds-l1-use-direct-io": "--gds-l1-path",
    "--gds-l1-backend": "--gds-l1-path",
    "--lookup-hash-log-rotation-interval": "--lookup-hash-log-dir",
    "--lookup-hash-log-rotation-max-size": "--lookup-hash-log-dir",
    "--lookup-hash-log-max-files": "--lookup-hash-log-dir",
    "--trace-output": "--trace-level",
    "--coordinator-advertise-ip": "--coordinator-url",
    "--coordinator-heartbeat-interval": "--coordinator-url",
    "--coordinator-event-reporting": "--coordinator-url",
    "--coordinator-event-flush-interval": "--coordinator-url",
    "--coordinator-event-transport": "--coordinator-url",
    "--coordinator-kafka-bootstrap-servers": "--coordinator-url",
    "--coordinator-kafka-topic": "--coordinator-url",
    "--coordinator-kafka-delivery-timeout": "--coordinator-url",
    "--coordinator-blend-timeout": "--coordinator-url",
    "--coordinator-blend-match-concurrency": "--coordinator-url",
    "--coordinator-l2-event-reporting": "--coordinator-url",
    "--coordinator-l2-event-flush-interval": "--coordinator-url",
}

_STATES_DEFAULT = re.compile(r"\(default\b|; default\b")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description as written and appends each flag's default to its help,
    unless the help text already states one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or action.default is argparse.SUPPRESS
            or _STATES_DEFAULT.search(text)
            or isinstance(action, argparse._StoreFalseAction)
        ):
            return text
        return f"{text} (default: {_default_text(action.default)})".lstrip()


def _default_text(value: object) -> str:
    if value is True:
        return "on"
    if value is False:
        return "off"
    if value is None or value == []:
        return "none"
    if value == "":
        return '""'
    return str(value).replace("%", "%%")


def _switch(group: Any, flag: str, default: bool, help_text: str) -> None:
    """``--X`` / ``--no-X``, as 0.5.6 spells its switches."""
    group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)


def _not_provided_help(flag: str) -> str:
    return f"not provided: {NOT_PROVIDED[flag][1]}; another value than the default stops startup"


def _dependent_help(flag: str) -> str:
    return f"read only with {DEPENDENT[flag]} (not provided); accepted"


def add_server_args(parser: argparse.ArgumentParser) -> None:
    from lmcache.v1.distributed.storage_flags import add_storage_flags

    g = parser.add_argument_group("MP server")
    g.add_argument("--instance-id", default=None, help="service.instance.id (default: random UUID)")
    g.add_argument(
        "--transport",
        choices=("zmq", "grpc"),
        default="zmq",
    )
    g.add_argument("--host", default="localhost", help="RPC bind host")
    g.add_argument("--port", type=int, default=5555, help="RPC port")
    g.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk")
    g.add_argument("--null-block-id", type=int, default=0, help="vLLM's null block id")
    g.add_argument(
        "--max-workers", type=int, default=4, help="default size of both pools (0.5.6: 1)"
    )
    g.add_argument(
        "--max-gpu-workers",
        type=int,
        default=None,
        help="affinity pool slots (default --max-workers)",
    )
    g.add_argument(
        "--max-cpu-workers",
        type=int,
        default=None,
        help="normal pool threads (default --max-workers)",
    )
    g.add_argument("--grpc-server-workers", type=int, default=32)
    g.add_argument(
        "--hash-algorithm",
        default="blake3",
        help="token hash; builtin and sha256_cbor are not supported yet",
    )
    g.add_argument(
        "--engine-type",
        choices=("default", "blend"),
        default="default",
    )
    g.add_argument(
        "--supported-transfer-mode",
        choices=("lmcache_driven", "engine_driven", "auto"),
        default="auto",
        help="transfer modules to load: auto = both (0.5.6: lmcache_driven)",
    )
    _switch(g, "--isolated-ipc", False, "")
    g.add_argument(
        "--runtime-plugin-locations",
        nargs="*",
        default=[],
    )
    g.add_argument("--runtime-plugin-config", default="{}")
    g.add_argument(
        "--script-allowed-imports",
        nargs="*",
        default=[],
    )
    _switch(
        g,
        "--run-script-api-enabled",
        False,
        "never provided: this server runs no code sent over HTTP, so true stops startup",
    )
    _switch(g, "--separate-object-groups", False, "one memory object per attention window")
    g.add_argument(
        "--worker-reap-timeout-seconds",
        type=float,
        default=120.0,
        help="reap a pinging worker silent this long (0 disables)",
    )
    g.add_argument(
        "--session-ttl-seconds",
        type=float,
        default=600.0,
        help="drop a request's session this long after its last use",
    )
    g.add_argument(
        "--max-sessions",
        type=int,
        default=10000,
        help="keep at most this many request sessions; a new one beyond it ends the least "
        "recently used and counts it in lmcache_mp_sessions_evicted_total (0 = no cap)",
    )
    g.add_argument(
        "--worker-registration-grace-seconds",
        type=float,
        default=3600.0,
        help="reap a never-pinging worker after this long",
    )
    g.add_argument(
        "--retrieve-lease-seconds",
        type=float,
        default=10.0,
        help="ours: an engine-driven SHM read stays locked this long after prepare_retrieve even "
        "if its worker is dropped, so workers need not await commit_retrieve (0 = they must)",
    )
    for flag in ("--enable-segmented-prefix", "--enable-dedup-content", "--enable-blend-reorder"):
        g.add_argument(flag, action="store_true", default=False)
    g.add_argument("--enable", nargs="*", default=[])
    g.add_argument(
        "--kv-event-log-size",
        type=int,
        default=32768,
        help="store/eviction records of L1 and L2 kept for KV-event subscribers (the vLLM "
        "connector's take_events); 0 turns KV events off (docs/server.md#kv-events)",
    )
    g.add_argument(
        "--kv-events-config",
        default="",
        help="ours: publish the KV events on ZeroMQ in vLLM's own format, for cache-aware "
        "routers; the JSON of vLLM's --kv-events-config, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv"}\' '
        "(off by default; needs --kv-event-log-size > 0)",
    )
    g.add_argument("--server-module", action="append", default=[])

    p2p = parser.add_argument_group("P2P (not provided)")
    p2p.add_argument("--p2p-advertise-url", default="")
    p2p.add_argument("--p2p-listen-url", default="")
    p2p.add_argument(
        "--p2p-lookup-timeout",
        type=float,
        default=30.0,
    )
    p2p.add_argument("--p2p-load-timeout", type=float, default=30.0)
    p2p.add_argument("--p2p-transfer-engine", default="nixl")

    add_storage_flags(
        parser,
        l1_size_gb_default=L1_SIZE_GB_DEFAULT,
        eviction_policy_default=EVICTION_POLICY_DEFAULT,
        include_shm_name=True,
    )
    # Embedded default: the engine-driven SHM pool is on, named after the port (so a restart
    # on the same port reclaims a stale segment); --shm-name "" turns it off as in 0.5.6.
    parser.set_defaults(shm_name=None)

    parser.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="ours: stop cleanly once process PID has exited (the vLLM connector's "
        "lmcache.mp.autostart passes the process that started the server)",
    )

    h = parser.add_argument_group("HTTP frontend")
    h.add_argument("--http-host", default="127.0.0.1", help="HTTP bind host")
    h.add_argument("--http-port", type=int, default=8080, help="HTTP port")

    o = parser.add_argument_group("Observability")
    o.add_argument(
        "--disable-observability",
        action="store_true",
        default=False,
        help="no metrics (as --disable-metrics) and no per-event logging",
    )
    o.add_argument(
        "--disable-metrics", action="store_true", default=False, help="no /metrics counters"
    )
    o.add_argument(
        "--disable-grpc-metrics",
        action="store_true",
        default=False,
        help="accepted: there is no gRPC transport, so there are no gRPC metrics",
    )
    o.add_argument(
        "--disable-logging",
        action="store_true",
        default=False,
        help="as in 0.5.6, no per-event logging; this server has none to turn off, so its "
        "log stays as it is (use LMCACHE_LOG_LEVEL to change the level)",
    )
    o.add_argument("--enable-tracing", action="store_true", default=False)
    o.add_argument("--otlp-endpoint", default=None)
    o.add_argument("--event-bus-queue-size", type=int, default=10000, help="accepted, unused")
    o.add_argument(
        "--prometheus-port",
        type=int,
        default=9090,
        help="accepted: as in 0.5.6's lmcache server, /metrics is served on --http-port and "
        "this port is never opened",
    )
    o.add_argument(
        "--metrics-sample-rate",
        type=float,
        default=0.01,
        help="share of L1 chunks whose lifetime and reuse gaps the metrics follow (0, 1]",
    )
    o.add_argument("--lookup-hash-log-dir", default="")
    for flag, default in (
        ("--lookup-hash-log-rotation-interval", 21600),
        ("--lookup-hash-log-rotation-max-size", 104857600),
        ("--lookup-hash-log-max-files", 100),
    ):
        o.add_argument(flag, type=int, default=default)
    o.add_argument(
        "--enable-gc-monitor",
        action="store_true",
        default=False,
        help="time every garbage collection and log the slow ones at INFO",
    )
    o.add_argument(
        "--gc-monitor-min-pause-ms",
        type=float,
        default=1.0,
        help="log only collections that took at least this long (0 logs every one)",
    )
    o.add_argument(
        "--gc-monitor-top-objects",
        type=int,
        default=0,
        help="add the N most common object types of the collected generation (walks it on "
        "every collection: for debugging)",
    )
    o.add_argument(
        "--enable-extra-logging",
        action="store_true",
        default=False,
        help="log store/retrieve counts and throughput and L1 use at INFO, periodically",
    )
    o.add_argument(
        "--extra-logging-interval",
        type=float,
        default=10.0,
        help="seconds between extra-logging lines",
    )
    o.add_argument("--trace-level", choices=("storage", "events"), default=None)
    o.add_argument("--trace-output", default=None)

    c = parser.add_argument_group("Coordinator (not provided)")
    c.add_argument("--coordinator-url", default=None)
    for flag, kwargs in (
        ("--coordinator-advertise-ip", {}),
        ("--coordinator-heartbeat-interval", {"type": float}),
        ("--coordinator-event-reporting", {"action": "store_true"}),
        ("--coordinator-event-flush-interval", {"type": float}),
        ("--coordinator-event-transport", {"choices": ("http", "kafka"), "default": "http"}),
        ("--coordinator-kafka-bootstrap-servers", {"default": ""}),
        ("--coordinator-kafka-topic", {"default": "lmcache-cache-events"}),
        ("--coordinator-kafka-delivery-timeout", {"type": float, "default": 300.0}),
        ("--coordinator-blend-timeout", {"type": float, "default": 1.0}),
        ("--coordinator-blend-match-concurrency", {"type": int, "default": 8}),
        ("--coordinator-l2-event-reporting", {"action": "store_true"}),
        ("--coordinator-l2-event-flush-interval", {"type": float}),
    ):
        c.add_argument(flag, **{"default": None, **kwargs})

    # 0.5.6 gives every command these (its server prints no report; any value parses there).
    r = parser.add_argument_group("Report flags (accepted, unused: the server prints no report)")
    r.add_argument("--format", default=None, metavar="FORMAT")
    r.add_argument("--output", default=None, metavar="PATH")
    r.add_argument("-q", "--quiet", action="store_true", default=False)
    # The help of the flags in NOT_PROVIDED and DEPENDENT comes from those tables.
    for action in parser._actions:
        flag = action.option_strings[0] if action.option_strings else ""
        if flag == "--shm-name":
            action.help = (
                "POSIX shared-memory name for the L1 pool that engine-driven workers map; "
                '"" disables SHM (copy path) (default: lmcache_l1_pool_<port>)'
            )
        elif flag in NOT_PROVIDED:
            action.help = _not_provided_help(flag)
        elif flag in DEPENDENT:
            action.help = _dependent_help(flag)
        elif not action.help and action.option_strings:
            action.help = action.option_strings[-1].lstrip("-").replace("-", " ")


def validate_args(args: argparse.Namespace) -> None:
    """Exit-2 checks of values argparse cannot express (each names the flag and the fix)."""
    from lmcache.v1.multiprocess.token_hasher import (
        LATER_HASH_ALGORITHMS,
        SUPPORTED_HASH_ALGORITHMS,
    )

    for flag, (off_values, why) in NOT_PROVIDED.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value not in off_values:
            raise CLIError(
                f"option {flag} is not supported by this version of lmcache server: {why}"
            )
    if args.run_script_api_enabled:
        raise CLIError(
            "--run-script-api-enabled is refused: this server never executes scripts sent over HTTP"
        )
    if args.hash_algorithm in LATER_HASH_ALGORITHMS:
        raise CLIError("option --hash-algorithm is not supported by this version of lmcache server")
    if args.hash_algorithm not in SUPPORTED_HASH_ALGORITHMS:
        raise CLIError(f"--hash-algorithm {args.hash_algorithm!r} is unknown; use blake3")
    if args.chunk_size <= 0:
        raise CLIError(f"--chunk-size must be positive (got {args.chunk_size})")
    if args.kv_event_log_size < 0:
        raise CLIError(
            f"--kv-event-log-size must be >= 0 (got {args.kv_event_log_size}); 0 turns KV events off"
        )
    from lmcache.v1.multiprocess.kv_event_publisher import KVEventsConfig

    try:
        kv_pub = KVEventsConfig.parse(args.kv_events_config)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if kv_pub.enabled and (args.kv_event_log_size == 0 or args.disable_observability):
        raise CLIError(
            "--kv-events-config publishes the KV event log, which --kv-event-log-size 0 or "
            "--disable-observability turns off; drop one of them"
        )
    for flag, v in (("--port", args.port), ("--http-port", args.http_port)):
        if not 0 <= v <= 65535:
            raise CLIError(f"{flag} must be a TCP port 0..65535 (got {v})")
    for flag, v in (
        ("--max-workers", args.max_workers),
        ("--max-gpu-workers", args.max_gpu_workers),
        ("--max-cpu-workers", args.max_cpu_workers),
    ):
        if v is not None and v < 1:
            raise CLIError(f"{flag} must be >= 1 (got {v})")
    for flag, v in (
        ("--worker-reap-timeout-seconds", args.worker_reap_timeout_seconds),
        ("--worker-registration-grace-seconds", args.worker_registration_grace_seconds),
        ("--session-ttl-seconds", args.session_ttl_seconds),
        ("--retrieve-lease-seconds", args.retrieve_lease_seconds),
        ("--gc-monitor-min-pause-ms", args.gc_monitor_min_pause_ms),
        ("--gc-monitor-top-objects", args.gc_monitor_top_objects),
    ):
        if v < 0:
            raise CLIError(f"{flag} must be >= 0 (got {v})")
    if not 0 < args.metrics_sample_rate <= 1:
        raise CLIError(f"--metrics-sample-rate must be in (0, 1] (got {args.metrics_sample_rate})")
    if args.extra_logging_interval <= 0:
        raise CLIError(
            f"--extra-logging-interval must be positive (got {args.extra_logging_interval})"
        )
    if args.parent_pid is not None and not process_exists(args.parent_pid):
        raise CLIError(
            f"--parent-pid {args.parent_pid}: no such process; give the PID of a running "
            "process, or drop the flag"
        )
    if args.shm_name is None:
        args.shm_name = default_shm_name(args)
    shm_name = args.shm_name
    # One leading "/" is POSIX style and stripped; any other "/" or a NUL cannot name a
    # /dev/shm file, so refuse it here instead of failing deep in the storage engine.
    if "/" in shm_name[1:] or "\0" in shm_name or shm_name == "/":
        raise CLIError(
            f"--shm-name {shm_name!r} is not a valid shared-memory name: use a plain name "
            "without '/' (one leading '/' is allowed) or NUL, e.g. --shm-name lmcache"
        )
    if args.max_sessions < 0:
        raise CLIError(
            f"--max-sessions must be >= 0 (got {args.max_sessions}); 0 turns the cap off"
        )
    if args.session_ttl_seconds == 0:
        raise CLIError("--session-ttl-seconds must be positive (got 0)")


def startup_warnings() -> list[str]:
    """What the environment asks for that this version does not do (logged at start-up)."""
    if os.environ.get("LMCACHE_COORDINATOR_URL"):
        return [
            "LMCACHE_COORDINATOR_URL is set, but this version has no MP coordinator client: "
            "the server does not register with it"
        ]
    return []


def process_exists(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def default_shm_name(args: argparse.Namespace) -> str:
    """The SHM pool name used when --shm-name is not given ("" where SHM cannot work)."""
    if getattr(args, "l1_use_hugepages", False):
        return ""  # hugepages and SHM exclude each other; hugepages were asked for explicitly
    suffix = args.port if args.port else os.getpid()
    return f"lmcache_l1_pool_{suffix}"


def one_line_parse_errors(parser: argparse.ArgumentParser) -> None:
    """argparse's usage-plus-message becomes one ``lmcache server: error:`` line."""

    def one_line_error(message: str) -> None:
        print(f"lmcache server: error: {message}", file=sys.stderr)
        sys.exit(2)

    parser.error = one_line_error  # type: ignore[method-assign]
