"""``lmcache server``: the multiprocess KV-cache server (RPC on ZeroMQ + HTTP admin API).

With no flags it starts a 4 GiB lazy L1 with LRU eviction, transfer mode ``auto``, RPC on
``localhost:5555`` and HTTP on ``127.0.0.1:8080``. Flag names and meanings follow
LMCache 0.5.6 (docs/design/protocol.md#defaults-shm). SIGINT/SIGTERM stop it cleanly and unlink its
SHM.
"""

from __future__ import annotations

import argparse
import gc
import signal
import socket

from lmcache.cli.errors import CLIError
from lmcache.cli.server_flags import (
    HelpFormatter,
    add_server_args,
    default_shm_name,
    one_line_parse_errors,
    startup_warnings,
    validate_args,
)
from lmcache.v1.errors import LMCacheError

__all__ = ["add_server_args", "build_configs", "default_shm_name", "add_arguments", "run"]

PARENT_POLL_S = 1.0


def _stop_when_gone(pid: int, server) -> None:
    """``--parent-pid``: a daemon thread stops ``server`` (uvicorn; the cleanup after it runs
    as for SIGTERM) once process ``pid`` has exited. When ``pid`` is this server's parent, its
    exit shows as a new parent (no PID-reuse race); otherwise the PID is polled."""
    import os
    import threading
    import time

    from lmcache.cli.server_flags import process_exists
    from lmcache.utils import init_logger

    is_parent = os.getppid() == pid

    def gone() -> bool:
        return os.getppid() != pid if is_parent else not process_exists(pid)

    def watch() -> None:
        while not gone():
            time.sleep(PARENT_POLL_S)
        init_logger(__name__).warning(
            "process %d (--parent-pid) has exited: lmcache server stopping", pid
        )
        server.should_exit = True

    threading.Thread(target=watch, name="lmcache-parent-watch", daemon=True).start()


# Its flag table needs the wider help column and the defaults shown.
HELP_FORMATTER = HelpFormatter


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser)
    one_line_parse_errors(parser)
    parser.set_defaults(func=run)


def build_configs(args: argparse.Namespace):
    """(MPServerConfig, StorageManagerConfig) from parsed flags; CLIError on bad values.

    This is where the parsed flags become typed configs, once: the storage engine is built
    from them and never sees ``args``."""
    from lmcache.v1.distributed.storage_flags import storage_manager_config
    from lmcache.v1.multiprocess.config import MPServerConfig

    validate_args(args)
    try:
        storage_config = storage_manager_config(vars(args))
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
        metrics_sample_rate=args.metrics_sample_rate,
        # 0.5.6: --disable-observability turns the KV event log off with the event bus
        kv_event_log_size=0 if args.disable_observability else args.kv_event_log_size,
        kv_events_config=args.kv_events_config or "",
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
    import uvicorn

    from lmcache.utils import init_logger
    from lmcache.v1.multiprocess.diagnostics import ExtraStatsLogger, GCMonitor
    from lmcache.v1.multiprocess.http_api import build_app
    from lmcache.v1.multiprocess.runtime import ServerRuntime

    logger = init_logger("lmcache.cli.server")
    mp_config, storage_config = build_configs(args)
    for warning in startup_warnings():
        logger.warning(warning)
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
    except LMCacheError:  # CLIError, or a config error whose message names the fix
        http_sock.close()
        raise
    except Exception as exc:
        http_sock.close()
        raise CLIError(f"cannot build the storage engine: {type(exc).__name__}: {exc}", 1) from None
    runtime.http_host, runtime.http_port = args.http_host, http_sock.getsockname()[1]
    gc_monitor = GCMonitor(args.gc_monitor_min_pause_ms, args.gc_monitor_top_objects)
    extra = ExtraStatsLogger(
        args.extra_logging_interval, runtime.metrics.value, runtime.storage.memory_usage
    )
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
        if args.enable_gc_monitor:
            gc_monitor.install()
        if args.enable_extra_logging:
            extra.start()
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        server = uvicorn.Server(config)
        # uvicorn re-raises the signal that stopped it once it is done; our handlers only
        # note it, so the cleanup below (stop RPC, engine, storage, unlink SHM) always runs.
        stopped_by: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, _f: stopped_by.append(s))
        if args.parent_pid is not None:
            _stop_when_gone(args.parent_pid, server)
        server.run(sockets=[http_sock])
        if stopped_by:
            logger.info("lmcache server stopping (signal %d)", stopped_by[0])
    finally:
        gc_monitor.remove()
        extra.stop()
        runtime.stop()
        http_sock.close()
        print("lmcache server: stopped", flush=True)
    return 0
