"""Config of the ``valkey`` type: LMCache 0.5.6's keys, plus two of ours (``tls_ca_file``,
``health_check_interval_s``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lmcache.v1.distributed.l2_adapters.api import init_logger
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

logger = init_logger(__name__)

KEY_SEPARATOR = "@"
"""Joins ``key_prefix`` and the object name (0.5.6's layout: ``<prefix>@<object name>``)."""


def parse_startup_nodes(raw: Any) -> list[tuple[str, int]]:
    """``"host:port,host:port"`` -> ``[(host, port), ...]``; raises ``ValueError`` naming the
    bad entry."""
    example = 'e.g. "startup_nodes": "10.0.0.1:6379,10.0.0.2:6379"'
    if not isinstance(raw, str) or not raw.strip():
        raise ValueError(
            f"startup_nodes must be a non-empty 'host:port[,host:port...]' string, got {raw!r} "
            f"({example})"
        )
    nodes: list[tuple[str, int]] = []
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry:
            continue
        host, sep, port_text = entry.rpartition(":")
        port = int(port_text) if port_text.isdigit() else 0
        if not sep or not host or not 0 < port <= 65535:
            raise ValueError(
                f"startup_nodes entry {entry!r} is not 'host:port' with a port in 1..65535 "
                f"({example})"
            )
        nodes.append((host, port))
    if not nodes:
        raise ValueError(f"startup_nodes {raw!r} names no node ({example})")
    return nodes


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"{key} must be true or false, got {v!r}")
    return v


def _str(d: dict[str, Any], key: str) -> str:
    v = d.get(key, "")
    if v is None:
        return ""
    if not isinstance(v, str):
        raise ValueError(f"{key} must be a string, got {v!r}")
    return v


def _seconds(d: dict[str, Any], key: str, default: float, allow_zero: bool = False) -> float:
    v = d.get(key, default)
    ok = (
        isinstance(v, (int, float))
        and not isinstance(v, bool)
        and (v >= 0 if allow_zero else v > 0)
    )
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{key} must be a number of seconds {bound}, got {v!r}")
    return float(v)


@dataclass
class ValkeyL2AdapterConfig(L2AdapterConfigBase):
    """Where the Valkey / Redis deployment is and how to reach it (docs/storage-backends.md)."""

    type_name = "valkey"

    startup_nodes: list[tuple[str, int]]
    cluster_mode: bool = False
    username: str = ""
    password: str = ""
    key_prefix: str = ""
    num_workers: int = 8
    tls_enable: bool = False
    database_id: int | None = None
    request_timeout: float = 5.0
    connection_timeout: float = 10.0
    max_capacity_gb: float = 0.0
    ttl_seconds: int | None = None
    # ours
    tls_ca_file: str = ""
    health_check_interval_s: float = 5.0

    known_fields = frozenset(
        {
            "startup_nodes",
            "cluster_mode",
            "username",
            "password",
            "key_prefix",
            "num_workers",
            "tls_enable",
            "database_id",
            "request_timeout",
            "connection_timeout",
            "max_capacity_gb",
            "ttl_seconds",
            "tls_ca_file",
            "health_check_interval_s",
        }
    )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ValkeyL2AdapterConfig:
        nodes = parse_startup_nodes(d.get("startup_nodes"))
        cluster_mode = _bool(d, "cluster_mode", False)
        key_prefix = _str(d, "key_prefix")
        if KEY_SEPARATOR in key_prefix:
            raise ValueError(
                f"key_prefix {key_prefix!r} contains {KEY_SEPARATOR!r}, which separates the "
                "prefix from the object name; use another character"
            )
        database_id = d.get("database_id")
        if database_id is not None and (
            isinstance(database_id, bool) or not isinstance(database_id, int) or database_id < 0
        ):
            raise ValueError(f"database_id must be a non-negative integer, got {database_id!r}")
        if cluster_mode and database_id is not None:
            logger.warning(
                "valkey: database_id %d is ignored in cluster mode (a cluster has only "
                "database 0); remove it or use key_prefix to separate deployments",
                database_id,
            )
            database_id = None
        if not cluster_mode and len(nodes) > 1:
            logger.warning(
                "valkey: cluster_mode is false, so only the first of %d startup_nodes (%s:%d) "
                "is used; set cluster_mode true for a cluster",
                len(nodes),
                *nodes[0],
            )
        ttl = d.get("ttl_seconds")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl <= 0):
            raise ValueError(f"ttl_seconds must be a positive integer or omitted, got {ttl!r}")
        tls_enable = _bool(d, "tls_enable", False)
        tls_ca_file = _str(d, "tls_ca_file")
        if tls_ca_file and not tls_enable:
            raise ValueError(
                f"tls_ca_file {tls_ca_file!r} is set but tls_enable is false; "
                'add "tls_enable": true'
            )
        cap = cls._parse_max_capacity_gb(d)
        if ttl is not None and cap > 0:
            logger.warning(
                "valkey: ttl_seconds with max_capacity_gb > 0: keys the server expires are "
                "still counted as used; prefer max_capacity_gb 0 with a TTL"
            )
        return cls(
            startup_nodes=nodes,
            cluster_mode=cluster_mode,
            username=_str(d, "username"),
            password=_str(d, "password"),
            key_prefix=key_prefix,
            num_workers=cls._validate_num_workers(d.get("num_workers", 8)),
            tls_enable=tls_enable,
            database_id=database_id,
            request_timeout=_seconds(d, "request_timeout", 5.0),
            connection_timeout=_seconds(d, "connection_timeout", 10.0),
            max_capacity_gb=cap,
            ttl_seconds=ttl,
            tls_ca_file=tls_ca_file,
            health_check_interval_s=_seconds(d, "health_check_interval_s", 5.0, allow_zero=True),
        )

    @property
    def endpoint(self) -> str:
        """The seed nodes as configured, for logs and errors."""
        return ",".join(f"{h}:{p}" for h, p in self.startup_nodes)

    @classmethod
    def help(cls) -> str:
        return (
            "valkey: Valkey or Redis, standalone or cluster, through valkey-glide (sync).\n"
            'Example: {"type":"valkey","startup_nodes":"10.0.0.1:6379,10.0.0.2:6379",'
            '"cluster_mode":true}\n'
            "  startup_nodes    (str, required) 'host:port[,host:port...]'; a cluster is\n"
            "                   discovered from any reachable seed; standalone uses the first\n"
            "  cluster_mode     (bool, false)  Valkey/Redis Cluster (slot map, MOVED/ASK)\n"
            "  username         (str, '')      ACL user\n"
            "  password         (str, '')      AUTH password\n"
            "  key_prefix       (str, '')      names become '<prefix>@<object name>' (no '@')\n"
            "  num_workers      (int, 8)       worker threads, one client each\n"
            "  tls_enable       (bool, false)  TLS to every node\n"
            "  tls_ca_file      (str, '')      PEM CA bundle for TLS (default: system trust)\n"
            "  database_id      (int, none)    standalone database; ignored in cluster mode\n"
            "  request_timeout  (float, 5)     seconds per command\n"
            "  connection_timeout (float, 10)  seconds to connect\n"
            "  max_capacity_gb  (float, 0)     capacity for usage and L2 eviction (0 = the\n"
            "                   server's own eviction decides)\n"
            "  ttl_seconds      (int, none)    expire every stored key after this many seconds\n"
            "  health_check_interval_s (float, 5) check every node this often (0 = off);\n"
            "                   /status names the nodes that are down\n"
        )
