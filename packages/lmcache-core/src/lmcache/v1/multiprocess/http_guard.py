"""Request hygiene for the HTTP admin API (an ASGI middleware in front of the FastAPI app).

The admin API has no authentication and may clear the cache, so it must not be reachable
through a browser that visits a hostile page, and one request must not cost the server
hundreds of MiB:

* Host: when the API is bound to a loopback address, a request whose ``Host`` names
  anything but a loopback name or address is refused (400). This is what stops DNS
  rebinding (``evil.example`` resolving to 127.0.0.1): the browser sends ``Host:
  evil.example``. Any port is accepted (tunnels and port-forwards change it).
* State-changing methods (POST, PUT, PATCH, DELETE): a body must be JSON. A request with a
  ``Content-Type`` other than ``application/json`` (or ``*/*+json``), or with a body but no
  ``Content-Type``, is refused (415): HTML forms can only send urlencoded, multipart or
  text/plain bodies, so a cross-site form post never reaches a route. A request without a
  body is allowed with or without a content type (0.5.6's ``quota delete`` and ``curl -X
  POST .../cache/clear`` send requests like that), unless it carries browser cross-site markers: an ``Origin``
  that is not this server, or ``Sec-Fetch-Site: cross-site`` (403). Command-line clients
  send neither. ``GET /loglevel?...&level=`` (0.5.6 sets log levels through a GET) gets the
  same cross-site check.
* Body size: at most ``max_body_bytes`` (default 16 MiB: a 1M-token prefetch, 0.5.6's own
  cap, is ~8 MB of JSON). A larger ``Content-Length`` is refused before anything is read,
  and a chunked body is read only up to the cap (413).
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 16 << 20
MAX_BODY_ENV = "LMCACHE_HTTP_MAX_BODY_BYTES"
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def max_body_bytes_from_env() -> int:
    raw = os.environ.get(MAX_BODY_ENV, "")
    if not raw:
        return DEFAULT_MAX_BODY_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{MAX_BODY_ENV}={raw!r} is not a byte count; set e.g. 16777216") from None
    if value <= 0:
        raise ValueError(f"{MAX_BODY_ENV}={raw!r} must be > 0")
    return value


def is_loopback_host(host: str) -> bool:
    """``host`` (a name or address, no port) names this machine's loopback interface."""
    host = host.strip().lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _hostname(host_header: str) -> str:
    """The name or address part of a ``Host`` header value (``[::1]:80`` -> ``::1``)."""
    h = host_header.strip()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


class AdminGuard:
    def __init__(self, app: ASGIApp, *, bound_host: str, max_body_bytes: int) -> None:
        self.app = app
        self.check_host = is_loopback_host(bound_host)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self._refusal(scope, headers)
        if refusal is None and scope["method"].upper() in STATE_CHANGING:
            body, refusal = await self._read_body(receive, headers)
            if refusal is None:
                receive = _replay(body, receive)
        if refusal is not None:
            await _reply(send, *refusal)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope, headers: dict[str, str]) -> tuple[int, str] | None:
        method = scope["method"].upper()
        host = headers.get("host", "")
        if self.check_host and not is_loopback_host(_hostname(host)):
            return 400, (
                f"Host {host!r} is not a loopback name; this API is bound to loopback and "
                "answers only requests for localhost/127.0.0.1/::1 (DNS-rebinding guard)"
            )
        if method not in STATE_CHANGING:
            if _sets_log_level(scope):
                return _cross_site(method, headers, host)
            return None
        content_type = headers.get("content-type")
        length = headers.get("content-length", "")
        has_body = (length.isdigit() and int(length) > 0) or "transfer-encoding" in headers
        if content_type is not None and not _is_json(content_type):
            return 415, (
                f"{method} bodies must be JSON (Content-Type: application/json), "
                f"got {content_type!r}"
            )
        if content_type is None and has_body:
            return 415, f"{method} with a body needs Content-Type: application/json"
        refusal = _cross_site(method, headers, host)
        if refusal is None and length.isdigit() and int(length) > self.max_body_bytes:
            return 413, self._too_large()
        return refusal

    def _too_large(self) -> str:
        return (
            f"request body exceeds {self.max_body_bytes} bytes; set {MAX_BODY_ENV} "
            "to accept larger bodies"
        )

    async def _read_body(
        self, receive: Receive, headers: dict[str, str]
    ) -> tuple[bytes, tuple[int, str] | None]:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", (400, "client disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", (413, self._too_large())
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _sets_log_level(scope: Scope) -> bool:
    """``GET /loglevel?...&level=...``: the one GET that changes state (0.5.6's route)."""
    return scope.get("path") == "/loglevel" and b"level=" in scope.get("query_string", b"")


def _cross_site(method: str, headers: dict[str, str], host: str) -> tuple[int, str] | None:
    """Browser markers of a request another site's page made; CLI clients send neither."""
    origin = headers.get("origin")
    if origin is not None and _hostport(origin) != host.strip().lower():
        return 403, f"cross-origin {method} from {origin!r} refused (this API has no CORS)"
    if headers.get("sec-fetch-site", "").lower() == "cross-site":
        return 403, f"cross-site {method} refused (this API has no CORS)"
    return None


def _hostport(origin: str) -> str:
    """``http://host:port`` -> ``host:port`` (``null`` and junk never match a Host)."""
    parts = urlsplit(origin.strip().lower())
    return parts.netloc if parts.scheme in ("http", "https") else "\0"


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reply(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
