"""Client library of the MP cache server (docs/design/protocol.md#client-library,
docs/design/protocol.md#framing).

Typical use (a vLLM worker or scheduler, a benchmark, a test)::

    from lmcache.v1.multiprocess.client import MPClient
    from lmcache.v1.multiprocess.protocol import IPCCacheServerKey

    client = MPClient("tcp://localhost:5555")          # "host:port" also works
    chunk = client.get_chunk_size()                      # blocking helpers ...
    fut = client.submit("lookup", key)                   # ... or futures for anything
    fut.result(timeout=5)                                # LMCacheTimeoutError on timeout
    client.negotiate_default_features()                  # error_replies, raw_payload_v1, ...
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
* ``call`` from a thread while no other thread uses the socket sends and receives in that
  thread, busy-polling for the reply for up to ``spin_us`` (default 500 us; ``spin_us=0`` or
  ``LMCACHE_MP_CLIENT_SPIN_US=0`` turns it off) before it sleeps: see ``SpinPolicy``.
* ``HeartbeatThread`` pings every ``interval`` and reports health transitions.

Why one module of about 960 lines: ``_Poller``, ``MPClient`` and ``MPFuture`` implement one
socket-ownership protocol together (``_io_lock``, whether the socket's FD is in the epoll
set, the fast waiters, the outbox of queued sends), each reading and changing the others'
private state. Its invariants are checked by reading those three side by side; split into
modules, the same private state would be shared across files. The parts that stand alone
(``SpinPolicy``, ``HeartbeatThread``) are small.
"""

from __future__ import annotations

import collections
import itertools
import os
import select
import threading
import time
from collections.abc import Callable, Container
from typing import Any

import msgspec
import zmq

from lmcache.utils import init_logger
from lmcache.v1.cpu_affinity import move_to_spare_cpus
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.framing import has_input, recv_frames, send_frames
from lmcache.v1.multiprocess.protocol import RemoteError
from lmcache.v1.multiprocess.token_hasher import tokens_to_be_bytes

logger = init_logger(__name__)

_PENDING = object()
# A synchronous waiter receives in its own thread for at most this long (see _wait_fast).
_FAST_WAIT_S = 0.005
_FAST_SLICE_S = 0.001
# (name, op frame) of every op, by name and by legacy id: op frames never change, and a
# call looks its op up once (one dict lookup on the round trip's hot path).
_OP_INFO: dict[str | int, tuple[str, bytes]] = {
    k: (spec.name, P.encode(P.op_wire_value(spec)))
    for spec in P.OPS
    for k in (spec.name, spec.legacy_id)
    if k is not None
}
# A call that owns the socket blocks in ZeroMQ's own receive for at most this long at a time,
# then sends what other threads queued meanwhile (the socket's RCVTIMEO, in ms).
_OWNED_SLICE_MS = 1
# How long ``call`` busy-polls for its reply before it sleeps in ZeroMQ's receive (us), unless
# the client is given ``spin_us`` or the environment sets it.
DEFAULT_SPIN_US = 500.0
MAX_SPIN_US = 1e6
SPIN_ENV = "LMCACHE_MP_CLIENT_SPIN_US"


def _op_info(op: str | int) -> tuple[str, bytes]:
    """(name, op frame) of an op given by name or legacy id; an unknown op is sent as given."""
    info = _OP_INFO.get(op)
    if info is not None and type(op) is not bool:  # True == 1 as a dict key
        return info
    return str(op), P.encode(op)


class _TokenBytesMemo:
    """The uint32 big-endian bytes of the last few token lists this process sent.

    One request's token list usually goes out several times (lookup, then retrieve and
    store), and converting it costs about 15-20 ns per token (60-80 us for 4096). A hit
    needs an equal list: comparing a list with the memo's shallow copy of it checks object
    identity per item (about 1 ns per token), so a list changed in place misses."""

    SIZE = 4

    def __init__(self) -> None:
        self._entries: collections.deque[tuple[list[int], bytes]] = collections.deque(
            maxlen=self.SIZE
        )
        self._lock = threading.Lock()

    def to_bytes(self, tokens: list[int]) -> bytes:
        n = len(tokens)
        with self._lock:
            for copy, raw in self._entries:
                # Same length and last token first: prompts of different requests often
                # share long prefixes, and a full comparison of those is not cheap.
                if len(copy) == n and n and copy[-1] == tokens[-1] and copy == tokens:
                    return raw
        raw = tokens_to_be_bytes(tokens)
        with self._lock:
            self._entries.append((list(tokens), raw))
        return raw


_token_bytes_memo = _TokenBytesMemo()


def _with_token_bytes(payload: Any) -> Any:
    """A key whose token ids travel as uint32 big-endian bytes (``token_ids_u32be``)."""
    if isinstance(payload, P.IPCCacheServerKey) and isinstance(payload.token_ids, list):
        raw = _token_bytes_memo.to_bytes(payload.token_ids)
        return msgspec.structs.replace(payload, token_ids=raw)
    return payload


def _reply_value(frames: list[zmq.Frame], op_bytes: bytes, uid: int) -> Any:
    """The value a well-formed reply (uid, op[, payload]) carries for a request of
    ``op_bytes``; an exception instance for an op echo mismatch or an undecodable payload."""
    if frames[1].bytes != op_bytes:
        return P.RemoteError("BAD_REQUEST", f"reply echoed a different op for uid {uid}")
    if len(frames) == 2:
        return None
    try:
        return P.decode(frames[2].buffer)
    except Exception as exc:
        return exc


_yield_cpu: Callable[[], None] = getattr(os, "sched_yield", lambda: None)


def _spin_us(spin_us: float | None) -> float:
    """The busy-poll window in microseconds: ``spin_us``, else $LMCACHE_MP_CLIENT_SPIN_US, else
    the default; a bad value raises ValueError naming where it came from and the fix."""
    source, raw = "spin_us", spin_us
    if spin_us is None:
        env = os.environ.get(SPIN_ENV, "").strip()
        if not env:
            return DEFAULT_SPIN_US
        source, raw = SPIN_ENV, env
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = -1.0
    if not 0.0 <= value <= MAX_SPIN_US:
        raise ValueError(
            f"{source}={raw!r} is not a number of microseconds in 0..{MAX_SPIN_US:g}; "
            f"leave it unset for the default ({DEFAULT_SPIN_US:g}) or use 0 to never busy-poll"
        )
    return value


class SpinPolicy:
    """Whether a synchronous call busy-polls for its reply, per op.

    Waking a thread that sleeps in a receive costs tens to hundreds of microseconds on
    virtual machines (an idle vCPU is woken through the hypervisor), as much as the rest of
    a small round trip. A caller that polls for up to ``spin_us`` catches a quick reply
    without that wake-up (a ``noop`` round trip here: 80-160 us instead of 100-250). The
    poll yields the CPU and the GIL every turn. An op whose reply did not come within the
    window (a long transfer) skips the poll for its next 1, 2, 4 ... ``MAX_SKIP`` calls, so
    slow ops cost almost no polling; one reply caught in the window makes the op poll every
    call again. Used by the thread that holds the client's socket, one at a time.
    """

    MAX_SKIP = 64

    def __init__(self, spin_us: float) -> None:
        self.window_s = max(0.0, spin_us) / 1e6
        self._skip: dict[bytes, list[int]] = {}  # op -> [calls left to skip, next penalty]
        self.polled = 0
        self.caught = 0
        self.skipped = 0

    def should_poll(self, op: bytes) -> bool:
        if self.window_s <= 0.0:
            return False
        state = self._skip.get(op)
        if state is not None and state[0] > 0:
            state[0] -= 1
            self.skipped += 1
            return False
        return True

    def record(self, op: bytes, caught: bool) -> None:
        self.polled += 1
        if caught:
            self.caught += 1
            self._skip.pop(op, None)
            return
        state = self._skip.setdefault(op, [0, 1])
        state[0] = state[1]
        state[1] = min(state[1] * 2, self.MAX_SKIP)

    def stats(self) -> dict[str, float]:
        return {
            "spin_us": self.window_s * 1e6,
            "polled": self.polled,
            "caught": self.caught,
            "skipped": self.skipped,
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

    __slots__ = ("_callbacks", "_client", "_latch", "_lock", "_value", "op", "uid")

    def __init__(self, client: MPClient | None, uid: int, op: str) -> None:
        self._client = client
        self.uid = uid
        self.op = op
        # Held until the value is set: waiters acquire and pass it on. A third of the cost
        # of a threading.Event, and one is made per request.
        self._latch = threading.Lock()
        self._latch.acquire()
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
        self._latch.release()
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
        return self._value is not _PENDING

    def wait(self, timeout: float | None = None) -> bool:
        if self._value is not _PENDING:
            return True
        if not self._latch.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        self._latch.release()
        return True

    def result(self, timeout: float | None = None) -> Any:
        """The reply value; raises RemoteError for an error reply, LMCacheTimeoutError on timeout."""
        if self._value is _PENDING and self._client is not None:
            t0 = time.monotonic()
            self._client._wait_fast(self, timeout)
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - t0))
        if not self.wait(timeout):
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
    thread watches each socket's ``zmq.FD`` in an epoll set instead of the socket itself,
    so caller threads can send and receive directly without a thread handoff
    (``MPClient.call``). A caller that waits for its own reply takes its socket's FD out
    of the epoll set while it does (epoll_ctl is safe from any thread), so a synchronous
    call never wakes this thread at all; the FD goes back into the set only when a request
    is still pending (``MPClient._return_fd``), so back-to-back calls touch the set once.

    This thread never waits for a socket another thread holds: that holder drains the
    socket before letting go and hands back queued sends (``MPClient._release_io``).
    """

    _instance: _Poller | None = None
    _guard = threading.Lock()

    def __init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        self._outbox: collections.deque = collections.deque()  # clients with queued frames
        self._clients: dict[int, MPClient] = {}  # zmq.FD -> client
        self._monitors: dict[int, MPClient] = {}  # monitor socket's zmq.FD -> client
        self._to_add: list[MPClient] = []
        self._to_remove: list[tuple[MPClient, threading.Event]] = []
        self._refs = 0
        self._stop = False
        self._epoll = select.epoll()
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._wake_fd, select.EPOLLIN)
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
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:  # closed: the thread is gone
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

    def watch(self, fd: int) -> None:
        """Watch a client FD (again); if input is already pending, epoll reports it now."""
        try:
            self._epoll.register(fd, select.EPOLLIN)
        except (FileExistsError, OSError):
            pass

    def unwatch(self, fd: int) -> None:
        try:
            self._epoll.unregister(fd)
        except (FileNotFoundError, OSError):
            pass

    def kick(self, client: MPClient) -> None:
        """``client`` has queued frames the thread must send."""
        self._outbox.append(client)
        self.wake()

    def _run(self) -> None:
        move_to_spare_cpus()  # an engine worker's: off its compute cores (cpu_affinity)
        while True:
            try:
                events = self._epoll.poll(0.1)
            except InterruptedError:
                continue
            for fd, _ in events:
                if fd == self._wake_fd:
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass
            with self._lock:
                adds, self._to_add = self._to_add, []
                removes, self._to_remove = self._to_remove, []
            for c in adds:
                with c._io_lock:
                    c._open(self.ctx)
                    assert c._fd is not None
                    self._clients[c._fd] = c
                    with c._fast_lock:
                        if c._fast_waiters == 0:
                            self.watch(c._fd)
                            c._fd_watched = True
                    if c._monitor is not None:
                        mfd = c._monitor.getsockopt(zmq.FD)
                        self._monitors[mfd] = c
                        self.watch(mfd)
                    replies = c._flush_and_drain()
                c._on_replies(replies)
            while self._outbox:
                self._outbox.popleft()._serve_if_free()
            for fd, _ in events:
                c = self._clients.get(fd)
                if c is not None:
                    c._serve_if_free()
                elif fd in self._monitors:
                    self._monitors[fd]._on_monitor_event()
            for c, done in removes:
                with c._io_lock:
                    if c._fd is not None and c._fd in self._clients:
                        self.unwatch(c._fd)
                        del self._clients[c._fd]
                    for mfd, owner in list(self._monitors.items()):
                        if owner is c:
                            self.unwatch(mfd)
                            del self._monitors[mfd]
                    c._close_sockets()
                done.set()
            if self._stop:
                for c in list(self._clients.values()):
                    with c._io_lock:
                        c._close_sockets()
                self._epoll.close()
                os.close(self._wake_fd)
                return


class MPClient:
    """A request client of one ``lmcache server`` (thread-safe; see the module docstring)."""

    def __init__(
        self,
        url: str = "tcp://localhost:5555",
        *,
        default_timeout: float | None = 300.0,
        identity: bytes | None = None,
        spin_us: float | None = None,
    ) -> None:
        self.url = normalize_url(url)
        self.default_timeout = default_timeout
        # Busy-polling of synchronous calls (SpinPolicy); None: $LMCACHE_MP_CLIENT_SPIN_US or
        # DEFAULT_SPIN_US; 0 never polls.
        self.spin = SpinPolicy(_spin_us(spin_us))
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
        # Callers receiving in their own thread; while > 0 the poller does not watch the FD.
        self._fast_waiters = 0
        self._fd_watched = False  # whether the poller's epoll set holds _fd (under _fast_lock)
        self._poller = _Poller.acquire()
        self._poller.add(self)

    # -- poller-thread side ------------------------------------------------
    def _open(self, ctx: zmq.Context) -> None:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.CONNECT_TIMEOUT, 5000)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.setsockopt(zmq.RCVTIMEO, _OWNED_SLICE_MS)  # only blocking receives use it
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

        monitor = self._monitor
        if monitor is None:
            return
        # Drain to "no input" (EVENTS), which also clears the FD the epoll set watches.
        while has_input(monitor):
            try:
                msg = recv_monitor_message(monitor, zmq.NOBLOCK)
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
        self._fd_watched = False
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
        self._flush(sock)
        replies = []
        try:
            # EVENTS also re-arms the edge-triggered FD; cheaper than recv raising EAGAIN
            while has_input(sock):
                replies.append(recv_frames(sock))
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EAGAIN:
                logger.warning("receive from %s failed: %s", self.url, exc)
        return replies

    def _serve_if_free(self) -> None:
        """The polling thread's turn: send and receive unless another thread holds the
        socket (that holder drains it and hands back queued sends when it lets go)."""
        if not self._io_lock.acquire(blocking=False):
            return
        try:
            replies = self._flush_and_drain()
        finally:
            self._io_lock.release()
        self._on_replies(replies)

    def _flush(self, sock: zmq.Socket) -> None:
        """Send the queued requests (callers hold _io_lock)."""
        while self._outq:
            frames = self._outq.popleft()
            try:
                send_frames(sock, frames)
            except zmq.ZMQError as exc:
                self._fail(frames, exc)

    def _on_replies(self, replies: list[list[zmq.Frame]]) -> None:
        for frames in replies:
            claimed = self._claim(frames)
            if claimed is not None:
                claimed[0]._set(claimed[1])

    def _hold_fd(self) -> None:
        """This thread receives for itself now: keep the polling thread off the FD."""
        with self._fast_lock:
            self._fast_waiters += 1
            if self._fd_watched and self._fd is not None:
                self._poller.unwatch(self._fd)
                self._fd_watched = False

    def _return_fd(self) -> None:
        """The last receiving caller is done: the polling thread watches the FD again only
        if a request is still pending (submit() watches it again for the next one)."""
        with self._fast_lock:
            self._fast_waiters -= 1
            if self._fast_waiters == 0 and self._pending:
                self._watch_fd()

    def _watch_fd(self) -> None:
        """Put the FD back in the polling thread's set (call with _fast_lock held)."""
        if not self._fd_watched and self._fd is not None:
            self._poller.watch(self._fd)
            self._fd_watched = True

    def _release_io(self) -> None:
        """Let go of the socket; sends that other threads queued meanwhile go to the polling
        thread, which does not wait for a held socket."""
        self._io_lock.release()
        if self._outq:
            self._poller.kick(self)

    def _wait_fast(self, fut: MPFuture, timeout: float | None) -> None:
        """Wait briefly for ``fut`` by receiving in the calling thread.

        Most replies arrive within a millisecond; receiving them here saves the handoff
        through the polling thread. The FD is out of the polling thread's epoll set while
        callers wait here (``_hold_fd``), so the thread is not woken by a reply a caller is
        about to read (and replies for other requests that arrive meanwhile are drained here
        and resolved as usual).
        """
        fd = self._fd
        if fd is None or _FAST_WAIT_S <= 0:
            return
        budget = _FAST_WAIT_S if timeout is None else min(_FAST_WAIT_S, max(0.0, timeout))
        end = time.monotonic() + budget
        p = select.poll()
        p.register(fd, select.POLLIN)
        self._hold_fd()
        try:
            # Every holder of _io_lock drains to "no input" before letting go, so a reply
            # that is already here has left the FD readable: polling first is enough.
            while fut._value is _PENDING:
                left = end - time.monotonic()
                if left <= 0:
                    return
                if not p.poll(min(left, _FAST_SLICE_S) * 1000.0):
                    continue
                self._io_lock.acquire()
                try:
                    if self._fd != fd:
                        return  # closed meanwhile; result() reports it
                    replies = self._flush_and_drain()
                finally:
                    self._release_io()
                self._on_replies(replies)
        finally:
            self._return_fd()

    def _call_owning_socket(
        self,
        op: str | int,
        payloads: tuple[Any, ...],
        timeout: float | None,
    ) -> Any:
        """``call`` while this thread holds ``_io_lock`` (it is released here).

        The request goes out from this thread and the reply is received here with a
        blocking ZeroMQ receive: no poll object, no readiness checks, no other thread
        woken. The socket is held for at most ``_FAST_WAIT_S``; every ``_OWNED_SLICE_MS``
        the requests other threads queued meanwhile are sent (in order). Replies to other
        requests are resolved as usual once the socket is let go. A reply that takes
        longer is left to ``result()``. A reply that arrives in time needs no future: the
        request enters the pending table only when this thread lets go of the socket first
        (until then no other thread can receive its reply).
        """
        t0 = time.monotonic()
        sock = self._sock
        if sock is None:  # not open yet, or closed meanwhile: the usual path reports it
            self._release_io()
            return self.submit(op, *payloads).result(timeout)
        try:
            name, op_bytes = _op_info(op)
            uid = next(self._uids)
            frames = self._request_frames(uid, op_bytes, payloads)
        except BaseException:
            self._release_io()
            raise
        budget = _FAST_WAIT_S if timeout is None else min(_FAST_WAIT_S, max(0.0, timeout))
        uid_frame = frames[0]
        self._hold_fd()
        others: list[list[zmq.Frame]] = []
        mine = None
        fut = None
        try:
            if self._outq:
                self._flush(sock)  # requests other threads queued first: per-client FIFO
            send_frames(sock, frames)  # a failure raises here, to this caller
            if self.spin.should_poll(op_bytes):
                window = self.spin.window_s  # never past the call's own timeout
                if timeout is not None:
                    window = min(window, max(0.0, timeout))
                self.spin.record(op_bytes, self._poll_for_input(sock, window))
            end = t0 + budget
            while mine is None and not self._closed:
                try:
                    got = recv_frames(sock, block=True)
                except zmq.Again:
                    if time.monotonic() >= end:
                        break
                    self._flush(sock)  # what other threads queued meanwhile
                    continue
                except zmq.ZMQError as exc:
                    logger.warning("receive from %s failed: %s", self.url, exc)
                    break
                if got[0].bytes != uid_frame:
                    others.append(got)
                elif len(got) in (2, 3):
                    mine = got
                else:
                    logger.warning(
                        "Dropping malformed reply with %d frames from %s", len(got), self.url
                    )
            if mine is None:  # left to result(): from now on anyone may receive the reply
                fut = MPFuture(self, uid, name)
                with self._pending_lock:
                    if self._closed:  # close() already failed every pending request
                        fut._set(ConnectionError(f"MPClient for {self.url} closed"))
                    else:
                        self._pending[uid] = (fut, op_bytes)
            # Replies to other requests leave the pending table now (their futures are set
            # once the socket is let go), so they do not count as still awaited below.
            claimed = [c for c in map(self._claim, others) if c is not None] if others else []
            if self._outq:
                self._flush(sock)
            if self._pending:
                # Someone may wait through the FD (the polling thread or _wait_fast): drain
                # to "no input" so it signals the next reply. Otherwise the next sender
                # drains after sending, as every sender does.
                claimed += [c for c in map(self._claim, self._flush_and_drain()) if c]
        finally:
            self._release_io()
            self._return_fd()
        for other, value in claimed:
            other._set(value)
        if mine is not None:
            value = _reply_value(mine, op_bytes, uid)
            if isinstance(value, BaseException):
                raise value
            return value
        assert fut is not None
        if timeout is not None:
            timeout = max(0.0, timeout - (time.monotonic() - t0))
        return fut.result(timeout)

    @staticmethod
    def _poll_for_input(sock: zmq.Socket, window_s: float) -> bool:
        """Busy-polls ``sock`` for up to ``window_s``; True if a message came (see SpinPolicy).

        Each turn yields the CPU (and the GIL) to whatever else is ready to run: on a busy
        core that may be the ZeroMQ I/O thread that is about to deliver the reply."""
        end = time.perf_counter() + window_s
        while not has_input(sock):
            if time.perf_counter() >= end:
                return False
            _yield_cpu()
        return True

    def _claim(self, frames: list[zmq.Frame]) -> tuple[MPFuture, Any] | None:
        """Take the pending request a reply answers: (its future, the value to set), or None
        for a reply that is malformed, late or not ours. The future is not set here, so a
        thread holding the socket can claim replies and resolve them after letting go."""
        if len(frames) not in (2, 3):
            logger.warning("Dropping malformed reply with %d frames from %s", len(frames), self.url)
            return None
        try:
            uid = P.decode(frames[0].buffer)
        except Exception:
            logger.warning("Dropping reply with an undecodable uid from %s", self.url)
            return None
        with self._pending_lock:
            entry = self._pending.pop(uid, None)
        if entry is None:
            return None  # late reply to a timed-out request, or not ours
        fut, op_bytes = entry
        return fut, _reply_value(frames, op_bytes, uid)

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
    def _request_frames(self, uid: int, op_bytes: bytes, payloads: tuple[Any, ...]) -> list[bytes]:
        if payloads and P.FEATURE_TOKEN_IDS_U32BE in self.features:
            payloads = tuple(_with_token_bytes(p) for p in payloads)
        return [P.encode(uid), op_bytes, *(P.encode(p) for p in payloads)]

    def submit(self, op: str | int, *payloads: Any) -> MPFuture:
        """Send one request; ``op`` is a name (or a raw int id) and payloads are positional."""
        if self._closed:
            raise ConnectionError(f"MPClient for {self.url} is closed")
        name, op_bytes = _op_info(op)
        uid = next(self._uids)
        fut = MPFuture(self, uid, name)
        frames = self._request_frames(uid, op_bytes, payloads)
        with self._pending_lock:
            self._pending[uid] = (fut, op_bytes)
        if not self._fd_watched:  # the polling thread may have to receive this reply
            with self._fast_lock:
                if self._fast_waiters == 0:
                    self._watch_fd()
        # Send from this thread when nobody else holds the socket (no handoff); else queue
        # for the polling thread. Both keep per-client FIFO: the queue is flushed first.
        if self._io_lock.acquire(blocking=False):
            try:
                self._outq.append(frames)
                replies = self._flush_and_drain() if self._sock is not None else None
            finally:
                self._release_io()
            if replies is not None:
                self._on_replies(replies)
                return fut
        else:
            self._outq.append(frames)
        self._poller.kick(self)
        return fut

    def call(self, op: str | int, *payloads: Any, timeout: float | None = -1.0) -> Any:
        """``submit(...).result(timeout)``; timeout -1 means ``default_timeout``.

        When no other thread is using the socket, the request is sent and its reply
        received in this thread (``_call_owning_socket``)."""
        t = self.default_timeout if timeout == -1.0 else timeout
        if not self._closed and self._io_lock.acquire(blocking=False):
            return self._call_owning_socket(op, payloads, t)
        return self.submit(op, *payloads).result(t)

    def pending_mark(self) -> int:
        """A mark between the requests sent so far and those sent later (``abandon_pending``)."""
        return next(self._uids)

    def abandon_pending(self, before: int, reason: str, ops: Container[str] | None = None) -> int:
        """Fail every request sent before ``before`` (a ``pending_mark``) that still awaits its
        reply (of ``ops`` only, if given), with ``LMCacheTimeoutError(reason)``: a server that
        was killed and restarted never answers them, and their callers would otherwise wait
        out their whole timeout. A late reply to one is dropped. Returns how many failed."""
        with self._pending_lock:
            old = [
                uid
                for uid, (fut, _) in self._pending.items()
                if uid < before and (ops is None or fut.op in ops)
            ]
            futures = [self._pending.pop(uid)[0] for uid in old]
        for fut in futures:
            fut._set(LMCacheTimeoutError(f"{fut.op} (uid {fut.uid}) abandoned: {reason}"))
        return len(futures)

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

    def lookup_hits(
        self, key: P.IPCCacheServerKey, wait: float = 30.0, tp_size: Any = 1
    ) -> int | None:
        """Look ``key`` up and wait up to ``wait`` s for the hit prefix in chunks (in tokens
        once this client negotiated ``partial_chunk``; None when the server's wait ran out,
        the status then stays queryable). One round trip where
        the server offers ``lookup_wait``, a lookup with its wait sent right behind it where
        it offers ``ordered_lookup``, else (LMCache 0.5.6) a lookup, then the wait."""
        timeout = wait + self.default_timeout if self.default_timeout is not None else None
        if P.FEATURE_LOOKUP_WAIT in self.features:
            return self.call("lookup", key, tp_size, float(wait), timeout=timeout)
        if P.FEATURE_ORDERED_LOOKUP in self.features:
            ack = self.submit("lookup", key, tp_size)
            hits = self.call("wait_prefetch_status", key.request_id, float(wait), timeout=timeout)
            ack.result(timeout)
            return hits
        self.call("lookup", key, tp_size, timeout=timeout)
        return self.call("wait_prefetch_status", key.request_id, float(wait), timeout=timeout)

    def get_experimental(self, timeout: float | None = -1.0) -> list[str]:
        return list(self.call("get_experimental", timeout=timeout) or [])

    def negotiate_default_features(
        self, wanted: tuple[str, ...] | None = None, timeout: float | None = 10.0
    ) -> frozenset[str]:
        """Enable the features the server advertises (safe against LMCache 0.5.6 servers,
        which advertise none of ours). Call again after every (re-)registration. ``wanted``
        None: ``SUPPORTED_FEATURES`` plus the opt-in ones this client enabled before (a
        transfer context sharing the connector's client keeps its ``partial_chunk``)."""
        if wanted is None:
            wanted = P.SUPPORTED_FEATURES + tuple(
                f for f in P.OPT_IN_FEATURES if f in self.features
            )
        offered = set(self.get_experimental(timeout=timeout))
        ask = [f for f in wanted if f in offered]
        if not ask:
            self.features = frozenset()
            return self.features
        enabled = self.call("negotiate_features", ask, timeout=timeout)
        self.features = frozenset(enabled or [])
        return self.features


class HeartbeatThread(threading.Thread):
    """Pings every ``interval`` s; calls ``on_unhealthy()`` / ``on_healthy()`` on transitions
    and ``on_answered()`` after every answered ping.

    ``instance_id`` None is the scheduler's health check (the server tracks nothing).
    """

    def __init__(
        self,
        client: MPClient,
        instance_id: int | None = None,
        interval: float = 10.0,
        on_unhealthy: Callable[[], None] | None = None,
        on_healthy: Callable[[], None] | None = None,
        on_answered: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name="lmcache-heartbeat", daemon=True)
        self.client = client
        self.instance_id = instance_id
        self.interval = interval
        self.healthy = True
        self._on_unhealthy = on_unhealthy
        self._on_healthy = on_healthy
        self._on_answered = on_answered  # after every answered ping
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        move_to_spare_cpus()
        while not self._stop_event.is_set():
            start = time.monotonic()
            try:
                ok = self.client.ping(self.instance_id, timeout=self.interval)
            except Exception:
                ok = False
            if ok and self._on_answered:
                self._on_answered()
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
    "DEFAULT_SPIN_US",
    "HeartbeatThread",
    "LMCacheTimeoutError",
    "MPClient",
    "MPFuture",
    "RemoteError",
    "SPIN_ENV",
    "SpinPolicy",
    "normalize_url",
]
