"""``lmcache server``: the multiprocess KV-cache server (RPC on ZeroMQ + HTTP admin API).

With no flags it starts a 4 GiB lazy L1 with LRU eviction, transfer mode ``auto``, RPC on
``localhost:5555`` and HTTP on ``127.0.0.1:8080``. Flag names and meanings follow
LMCache 0.5.6 (spec/protocol.md 13). SIGINT/SIGTERM stop it cleanly and unlink its SHM.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import signal
import socket
import sys

from lmcache.cli.errors import CLIError

L1_SIZE_GB_DEFAULT = 4.0
EVICTION_POLICY_DEFAULT = "LRU"

# (flag, dest, default) of recognised options this version refuses when changed (5.4).
LATER_OPTIONS: tuple[tuple[str, str, object], ...] = (
    ("--l1-use-hugepages", "l1_use_hugepages", False),
    ("--l1-devdax-path", "l1_devdax_path", None),
    ("--gds-l1-path", "gds_l1_path", None),
    ("--gds-l1-use-direct-io", "gds_l1_use_direct_io", False),
    ("--gds-l1-backend", "gds_l1_backend", "auto"),
    ("--l1-manager", "l1_manager", []),
    ("--enable-tracing", "enable_tracing", False),
    ("--otlp-endpoint", "otlp_endpoint", None),
    ("--trace-level", "trace_level", None),
    ("--trace-output", "trace_output", None),
    ("--enable-gc-monitor", "enable_gc_monitor", False),
    ("--lookup-hash-log-dir", "lookup_hash_log_dir", None),
    ("--enable-extra-logging", "enable_extra_logging", False),
    ("--prometheus-port", "prometheus_port", 9090),
    ("--transport", "transport", "zmq"),
    ("--grpc-server-workers", "grpc_server_workers", 32),
    ("--isolated-ipc", "isolated_ipc", False),
    ("--engine-type", "engine_type", "default"),
    ("--enable", "enable", []),
    ("--server-module", "server_module", []),
    ("--kv-event-log-size", "kv_event_log_size", 32768),
    ("--coordinator-url", "coordinator_url", None),
    ("--p2p-advertise-url", "p2p_advertise_url", None),
    ("--p2p-listen-url", "p2p_listen_url", None),
    ("--p2p-transfer-engine", "p2p_transfer_engine", None),
    ("--runtime-plugin-locations", "runtime_plugin_locations", None),
    ("--runtime-plugin-config", "runtime_plugin_config", None),
    ("--script-allowed-imports", "script_allowed_imports", None),
)


# Help for flags whose definition (here or in the storage layer) carries none.
_EXTRA_HELP = {
    "--disable-observability": "turn off metrics and the event bus",
    "--disable-metrics": "turn off the Prometheus /metrics counters",
    "--disable-logging": "log only WARNING and above",
}
_LATER_HELP = "not supported yet: a changed value stops startup"


_STATES_DEFAULT = re.compile(r"\(default\b|; default\b")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description as written and appends each flag's default to its help,
    unless the help text already states one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            not action.option_strings
            or action.default is argparse.SUPPRESS
            or _STATES_DEFAULT.search(text)
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


def _fill_missing_help(parser: argparse.ArgumentParser) -> None:
    later_flags = {flag for flag, _dest, _default in LATER_OPTIONS}
    for action in parser._actions:
        if action.help or not action.option_strings:
            continue
        flag = action.option_strings[-1]
        if flag in _EXTRA_HELP:
            action.help = _EXTRA_HELP[flag]
        elif flag in later_flags:
            action.help = _LATER_HELP
        else:
            action.help = flag.lstrip("-").replace("-", " ")


def _bool_arg(text: str) -> bool:
    v = str(text).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    from lmcache.v1.distributed.config import add_storage_manager_args

    g = parser.add_argument_group("RPC server")
    g.add_argument("--host", default="localhost", help="RPC bind host (default localhost)")
    g.add_argument("--port", type=int, default=5555, help="RPC port (default 5555)")
    g.add_argument("--chunk-size", type=int, default=256, help="tokens per chunk (default 256)")
    g.add_argument(
        "--hash-algorithm",
        default="blake3",
        help="token hash; builtin and sha256_cbor are not supported yet",
    )
    g.add_argument("--null-block-id", type=int, default=0, help="vLLM's null block id (default 0)")
    g.add_argument(
        "--max-workers", type=int, default=4, help="default size of both pools (default 4)"
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
    g.add_argument(
        "--supported-transfer-mode",
        choices=("lmcache_driven", "engine_driven", "auto"),
        default="auto",
        help="transfer modules to load (default auto = both)",
    )
    g.add_argument(
        "--worker-reap-timeout-seconds",
        type=float,
        default=120.0,
        help="reap a pinging worker silent this long (0 disables; default 120)",
    )
    g.add_argument(
        "--worker-registration-grace-seconds",
        type=float,
        default=3600.0,
        help="reap a never-pinging worker after this long (default 3600)",
    )
    g.add_argument(
        "--retrieve-lease-seconds",
        type=float,
        default=10.0,
        help="an engine-driven SHM read stays locked this long after prepare_retrieve even if "
        "its worker is dropped, so workers need not await commit_retrieve (0 = they must; "
        "default 10)",
    )
    g.add_argument(
        "--session-ttl-seconds",
        type=float,
        default=600.0,
        help="drop a request's session this long after its last use (default 600)",
    )
    g.add_argument(
        "--max-sessions",
        type=int,
        default=10000,
        help="keep at most this many request sessions; a new one beyond it ends the least "
        "recently used and counts it in lmcache_mp_sessions_evicted_total (0 = no cap; "
        "default 10000)",
    )
    g.add_argument(
        "--separate-object-groups",
        action="store_true",
        default=False,
        help="one memory object per attention window",
    )
    h = parser.add_argument_group("HTTP admin API and observability")
    h.add_argument("--http-host", default="127.0.0.1", help="HTTP bind host (default 127.0.0.1)")
    h.add_argument("--http-port", type=int, default=8080, help="HTTP port (default 8080)")
    h.add_argument("--instance-id", default=None, help="service.instance.id (default: random UUID)")
    h.add_argument("--disable-observability", action="store_true", default=False)
    h.add_argument("--disable-metrics", action="store_true", default=False)
    h.add_argument("--disable-logging", action="store_true", default=False)
    h.add_argument("--event-bus-queue-size", type=int, default=10000, help="accepted, unused")
    h.add_argument("--metrics-sample-rate", type=float, default=0.01, help="accepted, unused")
    h.add_argument(
        "--run-script-api-enabled",
        type=_bool_arg,
        default=False,
        help="never supported: true stops startup",
    )
    later = parser.add_argument_group(
        "Recognised but not supported yet (a changed value stops startup)"
    )
    later.add_argument("--enable-tracing", action="store_true", default=False)
    later.add_argument("--otlp-endpoint", default=None)
    later.add_argument("--trace-level", default=None)
    later.add_argument("--trace-output", default=None)
    later.add_argument("--enable-gc-monitor", action="store_true", default=False)
    later.add_argument("--lookup-hash-log-dir", default=None)
    later.add_argument("--enable-extra-logging", action="store_true", default=False)
    later.add_argument("--prometheus-port", type=int, default=9090)
    later.add_argument("--transport", default="zmq")
    later.add_argument("--grpc-server-workers", type=int, default=32)
    later.add_argument("--isolated-ipc", type=_bool_arg, nargs="?", const=True, default=False)
    later.add_argument("--engine-type", default="default")
    later.add_argument("--enable", action="append", default=[])
    later.add_argument("--server-module", action="append", default=[])
    later.add_argument("--kv-event-log-size", type=int, default=32768)
    later.add_argument("--coordinator-url", default=None)
    later.add_argument("--p2p-advertise-url", default=None)
    later.add_argument("--p2p-listen-url", default=None)
    later.add_argument("--p2p-transfer-engine", default=None)
    later.add_argument("--runtime-plugin-locations", default=None)
    later.add_argument("--runtime-plugin-config", default=None)
    later.add_argument("--script-allowed-imports", default=None)
    add_storage_manager_args(
        parser,
        l1_size_gb_default=L1_SIZE_GB_DEFAULT,
        eviction_policy_default=EVICTION_POLICY_DEFAULT,
        include_shm_name=True,
    )
    # Embedded default: the engine-driven SHM pool is on, named after the port (so a restart
    # on the same port reclaims a stale segment); --shm-name "" turns it off as in 0.5.6.
    parser.set_defaults(shm_name=None)
    for action in parser._actions:
        if "--shm-name" in action.option_strings:
            action.help = (
                "POSIX shared-memory name for the L1 pool that engine-driven workers map; "
                '"" disables SHM (copy path) (default: lmcache_l1_pool_<port>)'
            )
    _fill_missing_help(parser)


def register(subparsers: argparse._SubParsersAction, with_flags: bool = True) -> None:
    parser = subparsers.add_parser(
        "server",
        help="run the multiprocess KV-cache server",
        description=__doc__,
        formatter_class=_HelpFormatter,
    )
    if not with_flags:
        return
    add_server_args(parser)

    def one_line_error(message: str) -> None:
        print(f"lmcache server: error: {message}", file=sys.stderr)
        sys.exit(2)

    parser.error = one_line_error  # type: ignore[method-assign]
    parser.set_defaults(func=run)


def validate_args(args: argparse.Namespace) -> None:
    """Exit-2 checks of values argparse cannot express (each names the flag and the fix)."""
    from lmcache.v1.multiprocess.token_hasher import (
        LATER_HASH_ALGORITHMS,
        SUPPORTED_HASH_ALGORITHMS,
    )

    for flag, dest, default in LATER_OPTIONS:
        if getattr(args, dest, default) not in (default, None) or (
            isinstance(default, list) and getattr(args, dest, None)
        ):
            raise CLIError(f"option {flag} is not supported by this version of lmcache server")
    if args.run_script_api_enabled:
        raise CLIError(
            "--run-script-api-enabled true is refused: this server never executes scripts sent over HTTP"
        )
    if args.hash_algorithm in LATER_HASH_ALGORITHMS:
        raise CLIError("option --hash-algorithm is not supported by this version of lmcache server")
    if args.hash_algorithm not in SUPPORTED_HASH_ALGORITHMS:
        raise CLIError(f"--hash-algorithm {args.hash_algorithm!r} is unknown; use blake3")
    if args.chunk_size <= 0:
        raise CLIError(f"--chunk-size must be positive (got {args.chunk_size})")
    for flag, v in (
        ("--port", args.port),
        ("--http-port", args.http_port),
    ):
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
    ):
        if v < 0:
            raise CLIError(f"{flag} must be >= 0 (got {v})")
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


def default_shm_name(args: argparse.Namespace) -> str:
    """The SHM pool name used when --shm-name is not given ("" where SHM cannot work)."""
    if getattr(args, "l1_use_hugepages", False):
        return ""  # hugepages and SHM exclude each other; hugepages were asked for explicitly
    suffix = args.port if args.port else os.getpid()
    return f"lmcache_l1_pool_{suffix}"


def build_configs(args: argparse.Namespace):
    """(MPServerConfig, StorageManagerConfig) from parsed flags; CLIError on bad values."""
    from lmcache.v1.distributed.config import parse_args_to_storage_manager_config
    from lmcache.v1.multiprocess.config import MPServerConfig

    validate_args(args)
    try:
        storage_config = parse_args_to_storage_manager_config(args)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    kwargs = dict(
        host=args.host,
        port=args.port,
        chunk_size=args.chunk_size,
        hash_algorithm=args.hash_algorithm,
        null_block_id=args.null_block_id,
        max_gpu_workers=args.max_gpu_workers or args.max_workers,
        max_cpu_workers=args.max_cpu_workers or args.max_workers,
        supported_transfer_mode=args.supported_transfer_mode,
        shm_name=args.shm_name or "",
        worker_reap_timeout_seconds=args.worker_reap_timeout_seconds,
        worker_registration_grace_seconds=args.worker_registration_grace_seconds,
        session_ttl_seconds=args.session_ttl_seconds,
        max_sessions=args.max_sessions,
        l1_write_ttl_seconds=float(args.l1_write_ttl_seconds),
        retrieve_lease_seconds=args.retrieve_lease_seconds,
        separate_object_groups=args.separate_object_groups,
        disable_metrics=bool(args.disable_metrics or args.disable_observability),
    )
    if args.instance_id:
        kwargs["instance_id"] = args.instance_id
    return MPServerConfig(**kwargs), storage_config


def _bind_http(host: str, port: int) -> socket.socket:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(fam, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CLIError(
            f"cannot bind the HTTP API to {host}:{port}: {exc.strerror}; pick another --http-port"
        ) from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _freeze_startup_heap() -> int:
    """Collect once, then move every object alive now (imported modules, the storage
    engine's tables) out of the garbage collector's reach and return how many that is.

    Full collections walk every tracked object: over the ~200k objects a started server
    holds, one took 185-220 ms here, a stall for every request in flight, and one comes
    whenever the heap has grown by a quarter of its long-lived part. Objects made from now
    on are collected as usual."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from lmcache.utils import init_logger
    from lmcache.v1.multiprocess.http_api import build_app
    from lmcache.v1.multiprocess.runtime import ServerRuntime

    logger = init_logger("lmcache.cli.server")
    if args.disable_logging:
        logging.getLogger("lmcache").setLevel(logging.WARNING)
    mp_config, storage_config = build_configs(args)
    if args.http_host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning(
            "HTTP admin API binds to %s: it has no authentication, anyone who can reach it can "
            "clear the cache",
            args.http_host,
        )
    if 0 < args.worker_reap_timeout_seconds < 30:
        logger.warning(
            "--worker-reap-timeout-seconds %s is below 3 x the client heartbeat (10 s); healthy "
            "workers may be reaped",
            args.worker_reap_timeout_seconds,
        )
    http_sock = _bind_http(args.http_host, args.http_port)
    try:
        runtime = ServerRuntime.build(mp_config, storage_config)
    except CLIError:
        http_sock.close()
        raise
    except Exception as exc:
        http_sock.close()
        raise CLIError(f"cannot build the storage engine: {type(exc).__name__}: {exc}", 1) from None
    runtime.http_host, runtime.http_port = args.http_host, http_sock.getsockname()[1]
    try:
        try:
            endpoint = runtime.start()
        except OSError as exc:
            raise CLIError(str(exc), 1) from None
        mem = storage_config.l1_manager_config.memory_config
        logger.info(
            "lmcache server listening: rpc=%s http=http://%s:%d chunk_size=%d hash=%s L1=%.2f GiB "
            "(lazy=%s) eviction=%s transfer_modes=%s shm=%s",
            endpoint,
            args.http_host,
            runtime.http_port,
            mp_config.chunk_size,
            mp_config.hash_algorithm,
            mem.size_in_bytes / (1 << 30),
            mem.use_lazy or bool(runtime.shm.name),
            storage_config.eviction_config.eviction_policy,
            ",".join(mp_config.transfer_modes),
            runtime.shm.name or f"disabled ({runtime.shm.disabled_reason})",
        )
        print(
            f"lmcache server: RPC on {endpoint}, HTTP on http://{args.http_host}:{runtime.http_port}",
            flush=True,
        )
        app = build_app(runtime)
        frozen = _freeze_startup_heap()
        logger.debug("start-up heap frozen: %d objects left out of garbage collection", frozen)
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        server = uvicorn.Server(config)
        # uvicorn re-raises the signal that stopped it once it is done; our handlers only
        # note it, so the cleanup below (stop RPC, engine, storage, unlink SHM) always runs.
        stopped_by: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, _f: stopped_by.append(s))
        server.run(sockets=[http_sock])
        if stopped_by:
            logger.info("lmcache server stopping (signal %d)", stopped_by[0])
    finally:
        runtime.stop()
        http_sock.close()
        print("lmcache server: stopped", flush=True)
    return 0
