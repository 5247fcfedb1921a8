"""Config of the ``resp`` type (docs/design/storage-engine.md#backend-resp)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase


def _str(d: dict[str, Any], key: str, env: str) -> str:
    v = d.get(key, os.environ.get(env, ""))
    if not isinstance(v, str):
        raise ValueError(f"{key} must be a string")
    return v


def _positive_int(v: Any, key: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{key} must be a positive integer")
    return v


@dataclass
class RESPL2AdapterConfig(L2AdapterConfigBase):
    type_name = "resp"

    host: str
    port: int
    num_workers: int = 8
    username: str = ""
    password: str = ""
    max_capacity_gb: float = 0.0
    db: int = 0
    pipeline_depth: int = 16
    socket_timeout_s: float = 10.0
    health_check_interval_s: float = 5.0

    known_fields = frozenset(
        {
            "host",
            "port",
            "num_workers",
            "username",
            "password",
            "max_capacity_gb",
            "db",
            "pipeline_depth",
            "socket_timeout_s",
            "health_check_interval_s",
        }
    )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RESPL2AdapterConfig:
        # IMPROVE: the env fallbacks apply when the key is absent (0.5.6 required both keys).
        host = d.get("host", os.environ.get("LMCACHE_RESP_HOST"))
        if not isinstance(host, str) or not host:
            raise ValueError("host must be a non-empty string")
        port = d.get("port")
        if port is None and os.environ.get("LMCACHE_RESP_PORT"):
            try:
                port = int(os.environ["LMCACHE_RESP_PORT"])
            except ValueError:
                raise ValueError("port must be a positive integer") from None
        port = _positive_int(port, "port")
        if port > 65535:
            raise ValueError("port must be a positive integer (at most 65535)")
        db = d.get("db", 0)
        if isinstance(db, bool) or not isinstance(db, int) or db < 0:
            raise ValueError("db must be a non-negative integer")
        timeout = d.get("socket_timeout_s", 10.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError("socket_timeout_s must be a positive number")
        probe = d.get("health_check_interval_s", 5.0)
        if isinstance(probe, bool) or not isinstance(probe, (int, float)) or not probe >= 0:
            raise ValueError(
                f"health_check_interval_s must be a number of seconds >= 0 (got {probe!r}); "
                "0 turns the idle health check off"
            )
        return cls(
            host=host,
            port=port,
            num_workers=cls._validate_num_workers(d.get("num_workers", 8)),
            username=_str(d, "username", "LMCACHE_RESP_USERNAME"),
            password=_str(d, "password", "LMCACHE_RESP_PASSWORD"),
            max_capacity_gb=cls._parse_max_capacity_gb(d),
            db=db,
            pipeline_depth=_positive_int(d.get("pipeline_depth", 16), "pipeline_depth"),
            socket_timeout_s=float(timeout),
            health_check_interval_s=float(probe),
        )

    @classmethod
    def help(cls) -> str:
        return (
            "resp (alias redis): a Redis / RESP2 server through a pipelined C++ client.\n"
            'Example: {"type":"resp","host":"127.0.0.1","port":6379}\n'
            "  host             (str, required; env LMCACHE_RESP_HOST)\n"
            "  port             (int, required; env LMCACHE_RESP_PORT)\n"
            "  num_workers      (int, 8)      worker threads, one connection each\n"
            "  username         (str, '')     ACL user (env LMCACHE_RESP_USERNAME)\n"
            "  password         (str, '')     AUTH password (env LMCACHE_RESP_PASSWORD)\n"
            "  db               (int, 0)      database index (SELECT)\n"
            "  pipeline_depth   (int, 16)     commands per round trip\n"
            "  socket_timeout_s (float, 10)   connect and I/O timeout\n"
            "  health_check_interval_s (float, 5)  check the server this often while idle\n"
            "                   (0 = off); /status and /healthcheck show its health\n"
            "  max_capacity_gb  (float, 0)    capacity for usage and L2 eviction (0 = unlimited)\n"
        )
