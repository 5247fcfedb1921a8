"""The start-up check of the ``resp`` type: refuse a Redis Cluster node.

``resp`` talks to one server. A cluster node answers ``MOVED`` for every key whose slot
another node owns, so stores would land only partly and reads of those keys would miss
without an error. One short RESP2 exchange over a plain socket (``AUTH`` when configured,
then ``INFO cluster``) tells; a server that cannot be reached or does not answer is not
refused here (the adapter's health reports it, as for any server that is down).
"""

from __future__ import annotations

import socket
import time

from lmcache.v1.distributed.l2_adapters.api import LMCacheConfigError, init_logger

logger = init_logger(__name__)

PROBE_TIMEOUT_S = 2.0
"""Upper bound of the whole probe (connect, AUTH, INFO); ``socket_timeout_s`` if smaller."""

_MAX_REPLY = 1 << 20


def _command(*args: str) -> bytes:
    parts = [a.encode() for a in args]
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


class _Reader:
    """Reads RESP2 replies from a socket until a deadline (simple, error, integer, bulk)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.buf = b""

    def _fill(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer in time")
        self.sock.settimeout(left)
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed")
        self.buf += chunk
        if len(self.buf) > _MAX_REPLY:
            raise ValueError("reply too long")

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def reply(self) -> tuple[bool, bytes]:
        """(ok, payload): ok is False for an error reply (``-ERR ...``)."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind in (b"+", b":"):
            return True, rest
        if kind == b"-":
            return False, rest
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return True, b""
            while len(self.buf) < n + 2:
                self._fill()
            data, self.buf = self.buf[:n], self.buf[n + 2 :]
            return True, data
        raise ValueError(f"unexpected reply {line[:40]!r}")


def cluster_info(
    host: str, port: int, username: str = "", password: str = "", timeout_s: float = PROBE_TIMEOUT_S
) -> str | None:
    """The server's ``INFO cluster`` text, or None when it cannot be had (no connection, no
    answer in ``timeout_s``, an error reply such as ``NOAUTH``)."""
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            out = b""
            if password:
                out += (
                    _command("AUTH", username, password) if username else _command("AUTH", password)
                )
            out += _command("INFO", "cluster")
            sock.sendall(out)
            reader = _Reader(sock, deadline)
            if password:
                ok, text = reader.reply()
                if not ok:  # INFO then answers NOAUTH too; the adapter reports the cause
                    logger.debug("resp probe of %s:%s: AUTH failed: %s", host, port, text[:200])
            ok, text = reader.reply()
    except (OSError, ValueError) as exc:  # TimeoutError and ConnectionError are OSErrors
        logger.debug(
            "resp probe of %s:%s got no answer (%s); not checked for cluster mode", host, port, exc
        )
        return None
    if not ok:
        logger.debug("resp probe of %s:%s: INFO cluster failed: %s", host, port, text[:200])
        return None
    return text.decode("utf-8", "replace")


def is_cluster_node(info: str) -> bool:
    """Whether ``INFO cluster`` text says the node runs in cluster mode."""
    return any(line.strip() == "cluster_enabled:1" for line in info.splitlines())


def cluster_refusal(endpoint: str, db: int) -> str:
    """The one-line message that refuses a cluster node as a ``resp`` server."""
    text = (
        f"resp L2 adapter at {endpoint}: the server is a Redis Cluster node (cluster_enabled:1). "
        "The resp type talks to one server and would lose every key that hashes to a slot "
        "another node owns (the node answers MOVED: those stores fail and their reads miss). "
    )
    if db != 0:
        text += f"Also db {db} cannot be used: SELECT is not allowed in cluster mode. "
    return text + (
        "Fix: point resp at a standalone Redis/Valkey server (cluster mode off), or use the "
        'valkey type for a cluster (pip install lmcache-valkey; {"type": "valkey", '
        '"startup_nodes": "host:port,...", "cluster_mode": true}).'
    )


def refuse_cluster(
    host: str, port: int, username: str, password: str, db: int, socket_timeout_s: float
) -> None:
    """Raise ``LMCacheConfigError`` when ``host:port`` is a Redis Cluster node; otherwise
    (a standalone server, or no answer) return."""
    info = cluster_info(host, port, username, password, min(socket_timeout_s, PROBE_TIMEOUT_S))
    if info is not None and is_cluster_node(info):
        raise LMCacheConfigError(cluster_refusal(f"{host}:{port}", db))
