"""The S3 requests of the adapter, over the AWS CRT S3 client (``awscrt``).

Every request is asynchronous: ``on_done(Outcome)`` runs on a CRT event-loop thread when it
ends. The transport owns what is about the wire: request paths and headers, reading a PUT
body from the caller's buffer, writing a GET body into the caller's buffer (bounds-checked),
describing failures (HTTP status and S3 error code, or the connection error) and cancelling
requests that run past the request timeout. ``close()`` makes every later callback refuse to
touch a caller's buffer, then cancels and waits for what is in flight.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmcache.storage.s3.config import S3L2AdapterConfig, S3Target
from lmcache.storage.s3.objects import list_path, object_path
from lmcache.v1.distributed.l2_adapters.api import init_logger

logger = init_logger(__name__)

CLOSE_WAIT_SECONDS = 10.0

# CRT error names that mean "could not talk to the server" (these count for the breaker).
_CONNECTION_ERROR_WORDS = ("SOCKET", "DNS", "TLS", "CONNECTION", "TIMEOUT", "CHANNEL", "HOST")


@dataclass
class Outcome:
    """How one request ended. ``error`` is None on success and on an expected 404."""

    status: int | None = None
    error: str | None = None  # None on success; why it failed otherwise (a 404 too)
    connection_error: bool = False  # counts toward the circuit breaker
    size: int | None = None  # HEAD: Content-Length; GET: the object's size when it mismatched
    body: bytes | None = None  # LIST: the XML
    code: str | None = None  # the S3 error code of an error response, when it has a body

    @property
    def missing(self) -> bool:
        """The object does not exist (a HEAD's 404 has no body to tell NoSuchBucket apart)."""
        return self.status == 404 and self.code in (None, "NoSuchKey")

    @property
    def reached_server(self) -> bool:
        """An HTTP answer came back (whatever its status)."""
        return self.status is not None and not self.connection_error


class SizeMismatch(Exception):
    """A GET body whose length differs from the destination buffer."""

    def __init__(self, size: int, capacity: int) -> None:
        super().__init__(f"object is {size} bytes, the buffer {capacity}")
        self.size = size
        self.capacity = capacity


class _Abandoned(Exception):
    """The adapter closed: the request must not touch the caller's buffer any more."""


class _Req:
    """One request in flight. ``lock`` makes "check abandoned, then touch the buffer" atomic
    with respect to ``close()``."""

    __slots__ = ("abandoned", "crt", "deadline", "lock", "received", "timed_out")

    def __init__(self, deadline: float) -> None:
        self.lock = threading.Lock()
        self.abandoned = False
        self.timed_out = False
        self.deadline = deadline
        self.crt: Any = None
        self.received = 0


class _ViewStream:
    """A PUT body read straight from the caller's buffer (what awscrt's InputStream wraps)."""

    def __init__(self, view: memoryview, req: _Req) -> None:
        self._view = view
        self._req = req
        self._pos = 0

    def readinto(self, buf: Any) -> int:
        with self._req.lock:
            if self._req.abandoned:
                raise _Abandoned()
            n = min(len(buf), len(self._view) - self._pos)
            buf[:n] = self._view[self._pos : self._pos + n]
            self._pos += n
            return n

    def read(self, size: int = -1) -> bytes:
        n = len(self._view) - self._pos if size is None or size < 0 else size
        out = bytearray(n)
        return bytes(out[: self.readinto(memoryview(out))])

    def seek(self, offset: int, whence: int = 0) -> int:  # a retry starts over
        base = {0: 0, 1: self._pos, 2: len(self._view)}[whence]
        self._pos = max(0, min(len(self._view), base + offset))
        return self._pos


def _header(headers: Any, name: str) -> str | None:
    for k, v in headers or ():
        if k.lower() == name:
            return v
    return None


_CODE_RE = re.compile(rb"<Code>([^<]{1,100})</Code>")


def _s3_error_code(body: bytes | None) -> str | None:
    m = _CODE_RE.search(body or b"")
    return m.group(1).decode("ascii", "replace") if m else None


def _make_credentials(cfg: S3L2AdapterConfig, bootstrap: Any) -> Any:
    """Static keys when both are given; else boto3's credential chain when boto3 is
    installed (profiles, SSO, credential_process, containers, web identity, IMDS); else the
    CRT's own default chain."""
    from awscrt import auth

    if cfg.aws_access_key_id and cfg.aws_secret_access_key:
        return auth.AwsCredentialsProvider.new_static(
            cfg.aws_access_key_id, cfg.aws_secret_access_key
        )
    try:
        import boto3
    except ImportError:
        logger.info("s3: credentials from the AWS CRT default chain (boto3 is not installed)")
        return auth.AwsCredentialsProvider.new_default_chain(bootstrap)
    creds = boto3.Session().get_credentials()
    if creds is None:
        raise RuntimeError(
            "s3: no AWS credentials found (boto3 checked the environment, profiles, container "
            "and instance metadata) — set aws_access_key_id and aws_secret_access_key in the "
            "adapter config, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
        )
    logger.info("s3: credentials from boto3's chain (method %s)", creds.method)

    def fetch() -> Any:
        frozen = creds.get_frozen_credentials()  # refreshes expiring credentials
        return auth.AwsCredentials(frozen.access_key, frozen.secret_key, frozen.token)

    return auth.AwsCredentialsProvider.new_delegate(fetch)


class S3Transport:
    def __init__(self, cfg: S3L2AdapterConfig) -> None:
        from awscrt import auth, io, s3

        self._s3 = s3
        self.target: S3Target = cfg.target()
        self.timeout = cfg.s3_request_timeout_seconds
        self._region = cfg.s3_region
        elg = io.EventLoopGroup(cfg.s3_num_io_threads)
        bootstrap = io.ClientBootstrap(elg, io.DefaultHostResolver(elg))
        credentials = _make_credentials(cfg, bootstrap)
        tls_options = None
        if self.target.tls and cfg.s3_prefer_http2:
            tls_options = io.TlsConnectionOptions(io.ClientTlsContext(io.TlsContextOptions()))
            tls_options.set_alpn_list(["h2", "http/1.1"])
        signing = None
        if cfg.s3_enable_s3express:
            signing = auth.AwsSigningConfig(
                algorithm=auth.AwsSigningAlgorithm.V4_S3EXPRESS,
                region=cfg.s3_region,
                service="s3",
                credentials_provider=credentials,
            )
        tls_mode = s3.S3RequestTlsMode.ENABLED if self.target.tls else s3.S3RequestTlsMode.DISABLED
        self._client = s3.S3Client(
            bootstrap=bootstrap,
            region=cfg.s3_region,
            credential_provider=credentials,
            signing_config=signing,
            tls_mode=tls_mode,
            tls_connection_options=tls_options,
            enable_s3express=cfg.s3_enable_s3express,
        )
        self._mu = threading.Condition()
        self._reqs: set[_Req] = set()
        self._closed = False

    # --- requests -------------------------------------------------------------------------

    def head(self, name: str, on_done: Callable[[Outcome], None]) -> None:
        got: dict[str, Any] = {}

        def on_headers(status_code: int, headers: Any, **_: Any) -> None:
            got["size"] = _header(headers, "content-length")

        def finish(req: _Req, out: Outcome) -> None:
            if out.status == 200 and out.error is None and got.get("size") is not None:
                out.size = int(got["size"])
            on_done(out)

        self._send("HEAD", object_path(self.target.path_prefix, name), "HeadObject", finish,
                   on_headers=on_headers)  # fmt: skip

    def get_into(self, name: str, view: memoryview, on_done: Callable[[Outcome], None]) -> None:
        """GET the object into ``view``. A body of another length writes nothing past the end:
        the declared length is checked before the first byte, every chunk again."""
        capacity = len(view)
        req_box: list[_Req] = []

        def on_headers(status_code: int, headers: Any, **_: Any) -> None:
            length = _header(headers, "content-length")
            if status_code in (200, 206) and length is not None and int(length) != capacity:
                raise SizeMismatch(int(length), capacity)

        def on_body(chunk: Any, offset: int, **_: Any) -> None:
            req = req_box[0]
            end = offset + len(chunk)
            with req.lock:
                if req.abandoned:
                    raise _Abandoned()
                if end > capacity:
                    raise SizeMismatch(end, capacity)
                view[offset:end] = chunk
                req.received += len(chunk)

        def finish(req: _Req, out: Outcome) -> None:
            if out.error is None and out.status is not None and req.received != capacity:
                out.size = req.received
                out.error = f"object is {req.received} bytes, the buffer {capacity}"
            on_done(out)

        self._send("GET", object_path(self.target.path_prefix, name), None, finish,
                   on_headers=on_headers, on_body=on_body, req_box=req_box)  # fmt: skip

    def put(self, name: str, view: memoryview, on_done: Callable[[Outcome], None]) -> None:
        headers = [("Content-Length", str(len(view))), ("Content-Type", "application/octet-stream")]
        self._send("PUT", object_path(self.target.path_prefix, name), None,
                   lambda _req, out: on_done(out), body=view, headers=headers)  # fmt: skip

    def delete(self, name: str, on_done: Callable[[Outcome], None]) -> None:
        self._send("DELETE", object_path(self.target.path_prefix, name), "DeleteObject",
                   lambda _req, out: on_done(out))  # fmt: skip

    def head_bucket(self, on_done: Callable[[Outcome], None]) -> None:
        """HeadBucket: 200 when the bucket exists and may be listed, 404 when it does not,
        403 without s3:ListBucket. Any answer at all shows the endpoint is reachable."""
        self._send("HEAD", self.target.path_prefix or "/", "HeadBucket",
                   lambda _req, out: on_done(out))  # fmt: skip

    def list_page(self, prefix: str | None, max_keys: int, token: str | None) -> Outcome:
        """One ListObjectsV2 page, blocking (at most the request timeout plus a margin)."""
        chunks: list[bytes] = []
        done = threading.Event()
        result: list[Outcome] = []

        def on_body(chunk: Any, offset: int, **_: Any) -> None:
            chunks.append(bytes(chunk))

        def finish(_req: _Req, out: Outcome) -> None:
            out.body = b"".join(chunks)
            result.append(out)
            done.set()

        path = list_path(self.target.path_prefix, prefix, max_keys, token)
        self._send("GET", path, "ListObjectsV2", finish, on_body=on_body)
        if not done.wait(self.timeout + 5):
            return Outcome(error=f"timed out after {self.timeout:g} s", connection_error=True)
        return result[0]

    # --- machinery ------------------------------------------------------------------------

    def _send(
        self,
        method: str,
        path: str,
        operation: str | None,
        finish: Callable[[_Req, Outcome], None],
        *,
        on_headers: Callable[..., None] | None = None,
        on_body: Callable[..., None] | None = None,
        body: memoryview | None = None,
        headers: list[tuple[str, str]] | None = None,
        req_box: list[_Req] | None = None,
    ) -> None:
        from awscrt.http import HttpHeaders, HttpRequest

        s3 = self._s3
        req = _Req(time.monotonic() + self.timeout)
        if req_box is not None:
            req_box.append(req)
        with self._mu:
            closed = self._closed
            if not closed:
                self._reqs.add(req)
        if closed:
            finish(req, Outcome(error="the adapter is closed"))
            return

        def on_done(error: Any = None, status_code: int | None = None, error_body: Any = None,
                    **_: Any) -> None:  # fmt: skip
            try:
                finish(req, self._outcome(req, error, status_code, error_body))
            except Exception:
                logger.exception("s3: completion of %s %s failed", method, path)
            finally:
                with self._mu:
                    self._reqs.discard(req)
                    self._mu.notify_all()

        try:
            http_headers = HttpHeaders([("Host", self.target.host), *(headers or [])])
            stream = _ViewStream(body, req) if body is not None else None
            if operation:  # HEAD, DELETE, LIST
                rtype, kwargs = s3.S3RequestType.DEFAULT, {"operation_name": operation}
            elif method == "GET":
                rtype, kwargs = s3.S3RequestType.GET_OBJECT, {}
            else:
                rtype, kwargs = s3.S3RequestType.PUT_OBJECT, {}
            req.crt = s3.S3Request(
                client=self._client,
                type=rtype,
                request=HttpRequest(method, path, http_headers, body_stream=stream),
                on_headers=on_headers,
                on_body=on_body,
                on_done=on_done,
                region=self._region,
                **kwargs,
            )
        except Exception as exc:
            with self._mu:
                self._reqs.discard(req)
            finish(req, Outcome(error=f"could not start the request: {exc!r}"))

    def _outcome(self, req: _Req, error: Any, status: int | None, error_body: Any) -> Outcome:
        from awscrt.exceptions import AwsCrtError

        if error is None:
            return Outcome(status=status or 200)
        if req.timed_out:
            return Outcome(error=f"timed out after {self.timeout:g} s", connection_error=True)
        if isinstance(error, _Abandoned) or req.abandoned:
            return Outcome(error="cancelled: the adapter closed")
        if isinstance(error, SizeMismatch):
            return Outcome(status=status or 200, error=str(error), size=error.size)
        if status is not None and status >= 300:
            code = _s3_error_code(error_body if isinstance(error_body, bytes) else None)
            text = f"HTTP {status}" + (f" {code}" if code else "")
            if status == 403 and code is None:
                text += " (HEAD requests answer 403 instead of 404 without s3:ListBucket)"
            return Outcome(status=status, error=text, connection_error=status >= 500, code=code)
        if isinstance(error, AwsCrtError):
            connection = any(w in error.name for w in _CONNECTION_ERROR_WORDS)
            return Outcome(error=f"{error.name}: {error.message}", connection_error=connection)
        return Outcome(error=repr(error))

    def cancel_overdue(self) -> None:
        now = time.monotonic()
        with self._mu:
            overdue = [r for r in self._reqs if r.deadline <= now and not r.timed_out]
        for req in overdue:
            req.timed_out = True
            if req.crt is not None:
                req.crt.cancel()

    def in_flight(self) -> int:
        with self._mu:
            return len(self._reqs)

    def close(self) -> None:
        """After this returns no request touches a caller's buffer."""
        with self._mu:
            self._closed = True
            reqs = list(self._reqs)
        for req in reqs:
            with req.lock:
                req.abandoned = True
        for req in reqs:
            if req.crt is not None:
                req.crt.cancel()
        with self._mu:
            if not self._mu.wait_for(lambda: not self._reqs, CLOSE_WAIT_SECONDS):
                logger.warning(
                    "s3: %d requests to %s still running %g s after close",
                    len(self._reqs),
                    self.target.url,
                    CLOSE_WAIT_SECONDS,
                )
        self._client = None
