"""Client library of the MP cache server (spec/protocol.md 1.3, 2).

Typical use (a vLLM worker or scheduler, a benchmark, a test)::

    from lmcache.v1.multiprocess.client import MPClient
    from lmcache.v1.multiprocess.protocol import IPCCacheServerKey

    client = MPClient("tcp://localhost:5555")          # "host:port" also works
    chunk = client.get_chunk_size()                      # blocking helpers ...
    fut = client.submit("lookup", key)                   # ... or futures for anything
    fut.result(timeout=5)                                # LMCacheTimeoutError on timeout
    client.negotiate_default_features()                  # error_replies + raw_payload_v1
    client.close()

Design:

* One DEALER socket per client (``CONNECT_TIMEOUT`` 5 s, ``RECONNECT_IVL_MAX`` 1 s, a
  disconnect monitor that keeps ``client.connected`` current).
* One reference-counted polling thread per process owns every client socket (ZMQ
  sockets are not thread-safe); ``submit`` only queues frames and wakes it. So any
  thread may call any method.
* Requests are ``[uid, op, *payloads]``; uids count from 0 per client; replies are
  matched by uid and their echoed op is checked. A None result is a 3-frame reply.
* ``MPFuture``: ``query()``, ``wait(timeout)``, ``result(timeout)``,
  ``add_done_callback(fn)``. A timed-out ``result`` removes the request from the
  pending table and a late reply to it is dropped. An error reply (ext type 2, only
  after negotiating ``error_replies``) raises ``RemoteError`` from ``result``.
* ``HeartbeatThread`` pings every ``interval`` and reports health transitions.
"""

from __future__ import annotations

import collections
import itertools
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from lmcache.utils import init_logger
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.protocol import RemoteError

logger = init_logger(__name__)

_PENDING = object()
_POLLER_IDS = itertools.count()
# A synchronous waiter receives in its own thread for at most this long (see _wait_fast).
_FAST_WAIT_S = 0.005
_FAST_SLICE_S = 0.001
# Op frames never change: encode them once.
_OP_FRAMES: dict[Any, bytes] = {
    P.op_wire_value(spec): P.encode(P.op_wire_value(spec)) for spec in P.OPS
}


class LMCacheTimeoutError(TimeoutError):
    """A request got no reply in time (the server may be down, busy or silent on an error)."""


def normalize_url(url: str) -> str:
    """``tcp://``, ``ipc://`` and ``inproc://`` select ZeroMQ; bare ``host:port`` means tcp."""
    if url.startswith(("tcp://", "ipc://", "inproc://")):
        return url
    if url.startswith(("grpc://", "grpc+unix://")):
        raise ValueError(f"URL scheme of {url!r} is not supported yet; use tcp://host:port")
    if "://" in url:
        raise ValueError(f"unknown URL scheme in {url!r}; use tcp://, ipc:// or inproc://")
    return f"tcp://{url}"


class MPFuture:
    """The eventual reply of one request."""

    __slots__ = ("_callbacks", "_client", "_event", "_lock", "_value", "op", "uid")

    def __init__(self, client: MPClient | None, uid: int, op: str) -> None:
        self._client = client
        self.uid = uid
        self.op = op
        self._event = threading.Event()
        self._value: Any = _PENDING
        self._callbacks: list[Callable[[MPFuture], None]] = []
        self._lock = threading.Lock()

    @classmethod
    def resolved(cls, value: Any, op: str = "") -> MPFuture:
        fut = cls(None, -1, op)
        fut._set(value)
        return fut

    def _set(self, value: Any) -> None:
        with self._lock:
            if self._value is not _PENDING:
                return
            self._value = value
            callbacks, self._callbacks = self._callbacks, []
        self._event.set()
        for cb in callbacks:
            try:
                cb(self)
            except Exception:
                logger.exception("MPFuture callback for %s failed", self.op)

    def add_done_callback(self, fn: Callable[[MPFuture], None]) -> None:
        with self._lock:
            if self._value is _PENDING:
                self._callbacks.append(fn)
                return
        fn(self)

    def query(self) -> bool:
        """True once the reply (or an error) arrived; never blocks."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        """The reply value; raises RemoteError for an error reply, LMCacheTimeoutError on timeout."""
        if not self._event.is_set() and self._client is not None:
            t0 = time.monotonic()
            self._client._wait_fast(self, timeout)
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - t0))
        if not self._event.wait(timeout):
            if self._client is not None:
                self._client._forget(self.uid)
            raise LMCacheTimeoutError(f"no reply to {self.op} (uid {self.uid}) within {timeout} s")
        value = self._value
        if isinstance(value, BaseException):
            raise value
        return value


class _Poller:
    """The process-wide thread that serves every client socket.

    Socket ownership is shared through each client's ``_io_lock``: whoever holds it may
    send and receive, and always drains the socket to EAGAIN before letting go. The
    thread watches each socket's ``zmq.FD`` (edge-triggered: it fires only after a drain
    to EAGAIN, which the rule guarantees) instead of the socket itself, so caller
    threads can send and receive directly without a thread handoff (``MPClient.call``).
    """

    _instance: _Poller | None = None
    _guard = threading.Lock()

    def __init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        self._outbox: collections.deque = collections.deque()  # clients with queued frames
        self._clients: dict[int, MPClient] = {}  # zmq.FD -> client
        self._monitors: dict[zmq.Socket, MPClient] = {}
        self._to_add: list[MPClient] = []
        self._to_remove: list[tuple[MPClient, threading.Event]] = []
        self._to_rearm: list[MPClient] = []
        self._refs = 0
        self._stop = False
        self._wake_r = self.ctx.socket(zmq.PAIR)
        self._wake_w = self.ctx.socket(zmq.PAIR)
        # a fresh name each time: a previous poller may still be closing its socket
        addr = f"inproc://lmcache-client-wake-{os.getpid()}-{next(_POLLER_IDS)}"
        self._wake_r.bind(addr)
        self._wake_w.connect(addr)
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="lmcache-mp-client", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls) -> _Poller:
        with cls._guard:
            if cls._instance is None:
                cls._instance = _Poller()
            cls._instance._refs += 1
            return cls._instance

    def release(self) -> None:
        with _Poller._guard:
            self._refs -= 1
            if self._refs > 0:
                return
            _Poller._instance = None
            self._stop = True
        self.wake()
        self._thread.join(timeout=5)

    def wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_w.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass

    def add(self, client: MPClient) -> None:
        with self._lock:
            self._to_add.append(client)
        self.wake()

    def remove(self, client: MPClient) -> None:
        done = threading.Event()
        with self._lock:
            self._to_remove.append((client, done))
        self.wake()
        done.wait(timeout=5)

    def rearm(self, client: MPClient) -> None:
        """Watch ``client``'s FD again (it was parked while a caller received itself)."""
        with self._lock:
            self._to_rearm.append(client)
        self.wake()

    def kick(self, client: MPClient) -> None:
        """``client`` has queued frames the thread must send."""
        self._outbox.append(client)
        self.wake()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        parked: set[int] = set()
        while True:
            events = dict(poller.poll(100))
            if self._wake_r in events:
                while True:
                    try:
                        self._wake_r.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            with self._lock:
                adds, self._to_add = self._to_add, []
                removes, self._to_remove = self._to_remove, []
                rearms, self._to_rearm = self._to_rearm, []
            for c in rearms:
                with c._io_lock:
                    if c._fd is None or c._fd not in self._clients:
                        continue
                    if c._fd not in parked:
                        continue
                    parked.discard(c._fd)
                    poller.register(c._fd, zmq.POLLIN)
                    replies = c._flush_and_drain()
                c._on_replies(replies)
            for c in adds:
                with c._io_lock:
                    c._open(self.ctx)
                    assert c._fd is not None
                    self._clients[c._fd] = c
                    poller.register(c._fd, zmq.POLLIN)
                    if c._monitor is not None:
                        self._monitors[c._monitor] = c
                        poller.register(c._monitor, zmq.POLLIN)
                    replies = c._flush_and_drain()
                c._on_replies(replies)
            while self._outbox:
                c = self._outbox.popleft()
                with c._io_lock:
                    replies = c._flush_and_drain()
                c._on_replies(replies)
            for key in events:
                c = self._clients.get(key) if isinstance(key, int) else None
                if c is not None:
                    if c._park_if_waited():
                        # a caller is receiving itself; stop watching until it is done,
                        # or this thread would steal (or spin on) its reply
                        poller.unregister(key)
                        parked.add(key)
                        continue
                    with c._io_lock:
                        replies = c._flush_and_drain()
                    c._on_replies(replies)
                elif key in self._monitors:
                    self._monitors[key]._on_monitor_event()
            for c, done in removes:
                with c._io_lock:
                    if c._fd is not None and c._fd in self._clients:
                        if c._fd in parked:
                            parked.discard(c._fd)
                        else:
                            poller.unregister(c._fd)
                        del self._clients[c._fd]
                    if c._monitor is not None and c._monitor in self._monitors:
                        poller.unregister(c._monitor)
                        del self._monitors[c._monitor]
                    c._close_sockets()
                done.set()
            if self._stop:
                for c in list(self._clients.values()):
                    with c._io_lock:
                        c._close_sockets()
                self._wake_r.close(linger=0)
                self._wake_w.close(linger=0)
                return


class MPClient:
    """A request client of one ``lmcache server`` (thread-safe; see the module docstring)."""

    def __init__(
        self,
        url: str = "tcp://localhost:5555",
        *,
        default_timeout: float | None = 300.0,
        identity: bytes | None = None,
    ) -> None:
        self.url = normalize_url(url)
        self.default_timeout = default_timeout
        self.connected = False
        self.features: frozenset[str] = frozenset()
        self._identity = identity
        self._uids = itertools.count()
        self._pending: dict[int, tuple[MPFuture, bytes]] = {}
        self._pending_lock = threading.Lock()
        self._sock: zmq.Socket | None = None
        self._fd: int | None = None  # the socket's zmq.FD while it is open
        self._monitor: zmq.Socket | None = None
        self._io_lock = threading.Lock()  # held by whoever touches _sock (see _Poller)
        self._outq: collections.deque[list[bytes]] = collections.deque()
        self._sockets_closed = False
        self._closed = False
        self._fast_lock = threading.Lock()
        self._fast_waiters = 0
        self._parked = False
        self._poller = _Poller.acquire()
        self._poller.add(self)

    # -- poller-thread side ------------------------------------------------
    def _open(self, ctx: zmq.Context) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.CONNECT_TIMEOUT, 5000)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if self._identity:
            sock.setsockopt(zmq.IDENTITY, self._identity)
        try:
            self._monitor = sock.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
            )
        except zmq.ZMQError:
            self._monitor = None
        sock.connect(self.url)
        self._sock = sock
        self._fd = sock.getsockopt(zmq.FD)

    def _on_monitor_event(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        assert self._monitor is not None
        while True:
            try:
                msg = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg["event"] == zmq.EVENT_CONNECTED:
                self.connected = True
            elif msg["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                if self.connected:
                    logger.warning("Disconnected from lmcache server at %s", self.url)
                self.connected = False

    def _close_sockets(self) -> None:
        self._sockets_closed = True
        self._fd = None
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._sock.close(linger=0)
            self._sock = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    # -- socket I/O: callers hold _io_lock -------------------------------------------
    def _flush_and_drain(self) -> list[list[zmq.Frame]]:
        """Send the queued requests, then receive until EAGAIN; returns the replies.

        Replies are resolved by ``_on_replies`` after the lock is released, so future
        callbacks never run under it.
        """
        sock = self._sock
        if sock is None:
            if self._sockets_closed:
                while self._outq:
                    self._fail(self._outq.popleft(), ConnectionError("client is closed"))
            return []  # not open yet: the poller flushes right after opening
        while self._outq:
            frames = self._outq.popleft()
            try:
                sock.send_multipart(frames, copy=len(frames[-1]) < 65536)
            except zmq.ZMQError as exc:
                self._fail(frames, exc)
        replies = []
        try:
            # EVENTS also re-arms the edge-triggered FD; cheaper than recv raising EAGAIN
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                replies.append(sock.recv_multipart(zmq.NOBLOCK, copy=False))
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EAGAIN:
                logger.warning("receive from %s failed: %s", self.url, exc)
        return replies

    def _on_replies(self, replies: list[list[zmq.Frame]]) -> None:
        for frames in replies:
            self._on_reply(frames)

    def _wait_fast(self, fut: MPFuture, timeout: float | None) -> None:
        """Wait briefly for ``fut`` by receiving in the calling thread.

        Most replies arrive within a millisecond; receiving them here saves the handoff
        through the polling thread. That thread watches the same FD, so whichever thread
        drains first resolves the future; the short poll slices bound the wait when the
        other one won the race between our check and our poll.
        """
        fd = self._fd
        if fd is None or _FAST_WAIT_S <= 0:
            return
        budget = _FAST_WAIT_S if timeout is None else min(_FAST_WAIT_S, max(0.0, timeout))
        end = time.monotonic() + budget
        p = select.poll()
        p.register(fd, select.POLLIN)
        with self._fast_lock:
            self._fast_waiters += 1
        try:
            while not fut._event.is_set():
                left = end - time.monotonic()
                if left <= 0:
                    return
                if not p.poll(min(left, _FAST_SLICE_S) * 1000.0):
                    continue
                with self._io_lock:
                    if self._fd != fd:
                        return  # closed meanwhile; result() reports it
                    replies = self._flush_and_drain()
                self._on_replies(replies)
        finally:
            with self._fast_lock:
                self._fast_waiters -= 1
                rearm = self._fast_waiters == 0 and self._parked
                if rearm:
                    self._parked = False
            if rearm:
                self._poller.rearm(self)

    def _park_if_waited(self) -> bool:
        """Polling thread: True (and parked) when a caller is receiving in ``_wait_fast``."""
        with self._fast_lock:
            if self._fast_waiters > 0:
                self._parked = True
                return True
            return False

    def _on_reply(self, frames: list[zmq.Frame]) -> None:
        if len(frames) not in (2, 3):
            logger.warning("Dropping malformed reply with %d frames from %s", len(frames), self.url)
            return
        try:
            uid = P.decode(frames[0].buffer)
        except Exception:
            logger.warning("Dropping reply with an undecodable uid from %s", self.url)
            return
        with self._pending_lock:
            entry = self._pending.pop(uid, None)
        if entry is None:
            return  # late reply to a timed-out request, or not ours
        fut, op_bytes = entry
        if frames[1].bytes != op_bytes:
            fut._set(P.RemoteError("BAD_REQUEST", f"reply echoed a different op for uid {uid}"))
            return
        if len(frames) == 2:
            fut._set(None)
            return
        try:
            fut._set(P.decode(frames[2].buffer))
        except Exception as exc:
            fut._set(exc)

    def _fail(self, frames: list[bytes], exc: BaseException) -> None:
        try:
            uid = P.decode(frames[0])
        except Exception:
            return
        with self._pending_lock:
            entry = self._pending.pop(uid, None)
        if entry is not None:
            entry[0]._set(exc)

    def _forget(self, uid: int) -> None:
        with self._pending_lock:
            self._pending.pop(uid, None)

    # -- public API ----------------------------------------------------------
    def submit(self, op: str | int, *payloads: Any) -> MPFuture:
        """Send one request; ``op`` is a name (or a raw int id) and payloads are positional."""
        if self._closed:
            raise ConnectionError(f"MPClient for {self.url} is closed")
        spec = P.lookup_op(op)
        wire_op = P.op_wire_value(spec) if spec is not None else op
        uid = next(self._uids)
        op_bytes = _OP_FRAMES.get(wire_op) or P.encode(wire_op)
        fut = MPFuture(self, uid, spec.name if spec else str(op))
        frames = [P.encode(uid), op_bytes, *(P.encode(p) for p in payloads)]
        with self._pending_lock:
            self._pending[uid] = (fut, op_bytes)
        # Send from this thread when nobody else holds the socket (no handoff); else queue
        # for the polling thread. Both keep per-client FIFO: the queue is flushed first.
        if self._io_lock.acquire(blocking=False):
            try:
                self._outq.append(frames)
                replies = self._flush_and_drain() if self._sock is not None else None
            finally:
                self._io_lock.release()
            if replies is not None:
                self._on_replies(replies)
                return fut
        else:
            self._outq.append(frames)
        self._poller.kick(self)
        return fut

    def call(self, op: str | int, *payloads: Any, timeout: float | None = -1.0) -> Any:
        """``submit(...).result(timeout)``; timeout -1 means ``default_timeout``."""
        t = self.default_timeout if timeout == -1.0 else timeout
        return self.submit(op, *payloads).result(t)

    def pending_count(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._poller.remove(self)
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            fut._set(ConnectionError(f"MPClient for {self.url} closed"))
        self._poller.release()

    def __enter__(self) -> MPClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers for common ops ------------------------------------------------
    def get_chunk_size(self, timeout: float | None = -1.0) -> int:
        return self.call("get_chunk_size", timeout=timeout)

    def ping(self, instance_id: int | None = None, timeout: float | None = -1.0) -> bool:
        return bool(self.call("ping", instance_id, timeout=timeout))

    def noop(self, timeout: float | None = -1.0) -> str:
        return self.call("noop", timeout=timeout)

    def get_experimental(self, timeout: float | None = -1.0) -> list[str]:
        return list(self.call("get_experimental", timeout=timeout) or [])

    def negotiate_default_features(
        self, wanted: tuple[str, ...] = P.SUPPORTED_FEATURES, timeout: float | None = 10.0
    ) -> frozenset[str]:
        """Enable the features the server advertises (safe against LMCache 0.5.6 servers,
        which advertise none of ours). Call again after every (re-)registration."""
        offered = set(self.get_experimental(timeout=timeout))
        ask = [f for f in wanted if f in offered]
        if not ask:
            self.features = frozenset()
            return self.features
        enabled = self.call("negotiate_features", ask, timeout=timeout)
        self.features = frozenset(enabled or [])
        return self.features


class HeartbeatThread(threading.Thread):
    """Pings every ``interval`` s; calls ``on_unhealthy()`` / ``on_healthy()`` on transitions.

    ``instance_id`` None is the scheduler's health check (the server tracks nothing).
    """

    def __init__(
        self,
        client: MPClient,
        instance_id: int | None = None,
        interval: float = 10.0,
        on_unhealthy: Callable[[], None] | None = None,
        on_healthy: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name="lmcache-heartbeat", daemon=True)
        self.client = client
        self.instance_id = instance_id
        self.interval = interval
        self.healthy = True
        self._on_unhealthy = on_unhealthy
        self._on_healthy = on_healthy
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        while not self._stop_event.is_set():
            start = time.monotonic()
            try:
                ok = self.client.ping(self.instance_id, timeout=self.interval)
            except Exception:
                ok = False
            if ok and not self.healthy:
                self.healthy = True
                if self._on_healthy:
                    self._on_healthy()
            elif not ok and self.healthy:
                self.healthy = False
                logger.warning("lmcache server at %s did not answer a ping", self.client.url)
                if self._on_unhealthy:
                    self._on_unhealthy()
            self._stop_event.wait(max(0.0, self.interval - (time.monotonic() - start)))


__all__ = [
    "HeartbeatThread",
    "LMCacheTimeoutError",
    "MPClient",
    "MPFuture",
    "RemoteError",
    "normalize_url",
]
