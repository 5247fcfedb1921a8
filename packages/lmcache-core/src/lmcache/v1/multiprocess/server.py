"""The RPC front door of ``lmcache server``: one ROUTER socket, one loop thread, pools.

docs/design/protocol.md#server-threads, docs/design/protocol.md#framing:

* The loop thread (``mq-server-thread``) is the only thread touching the ROUTER. It
  blocks in ZeroMQ's own receive, decodes and dispatches every request and sends every
  reply. Pool threads queue their replies and wake it with an empty message through an
  in-process DEALER connected to the same ROUTER, so one blocking receive waits for both
  (no epoll pass and no readiness checks per request).
* SYNC ops run inline; AFFINITY ops run FIFO on the slot of their peer identity
  (``--max-gpu-workers`` slots, assigned round-robin on first sight); NORMAL ops run on
  the ``--max-cpu-workers`` pool. ``wait_prefetch_status`` parks without a thread.
  An AFFINITY op that is only bookkeeping (``CacheEngine.runs_inline``: the prepare/commit
  ops of the SHM path) runs inline when its slot has nothing queued, which keeps FIFO per
  slot and saves the two thread hand-offs of a pool op (a fifth of a 64 MiB store here).
* Streams (``subscribe_kv_events``): the handler keeps its request context and sends
  one reply frame per batch; the client's ``[uid, b"", b"ack"|b"cancel"]`` frames go to
  ``CacheEngine.stream_control``.
* Errors: old peers get 0.5.6's silence; peers that negotiated ``error_replies`` get
  ``ext(2, {code, message, retryable})``. Nothing a peer sends stops the loop.
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import zmq

from lmcache.utils import init_logger
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.engine import CacheEngine, RequestContext
from lmcache.v1.multiprocess.framing import recv_frames, send_frames
from lmcache.v1.multiprocess.protocol import ErrorCode, HandlerKind, RequestError

logger = init_logger(__name__)


# Requests up to this size may be decoded on the loop thread to see whether they run inline.
_INLINE_MAX_PAYLOAD = 65536
# Routing id of the in-process waker (peers cannot take it: it connects before the RPC
# port is bound, and a ROUTER keeps the first peer of an id).
_WAKE_ID = b"lmcache-server-loop-wake"
# The loop's receive timeout: how often it looks at the stop flag when nothing arrives.
_LOOP_RCVTIMEO_MS = 500
_NO_FEATURES: frozenset[str] = frozenset()
# Room for a request's own fields next to its largest possible payload (a whole L1 of KV).
_MESSAGE_SLACK = 16 << 20


def max_message_bytes(l1_total_bytes: int) -> int:
    """The largest message a peer may send (``ZMQ_MAXMSGSIZE``): no payload larger than
    the whole L1 can ever be stored, so a bigger one is refused before it is buffered (the
    peer is disconnected and its DEALER reconnects; the request gets no reply)."""
    return int(l1_total_bytes) + _MESSAGE_SLACK


class MPCacheServer:
    def __init__(self, engine: CacheEngine, max_message_bytes: int = 0) -> None:
        self.engine = engine
        self.config = engine.config
        self.metrics = engine.metrics
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._waker: zmq.Socket | None = None
        self._waker_lock = threading.Lock()
        self._wake_pending = False
        self._outbox: collections.deque = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_ident: int | None = None
        self._features: dict[bytes, frozenset[str]] = {}
        self._affinity_slots: dict[bytes, int] = {}
        self._rr = itertools.count()
        self._affinity = [
            ThreadPoolExecutor(1, thread_name_prefix=f"mp-affinity-{i}")
            for i in range(max(1, self.config.max_gpu_workers))
        ]
        # Per slot: ops handed to it (loop thread only) and ops it finished (its thread only).
        self._slot_submitted = [0] * len(self._affinity)
        self._slot_finished = [0] * len(self._affinity)
        self._normal = ThreadPoolExecutor(
            max(1, self.config.max_cpu_workers), thread_name_prefix="mp-normal"
        )
        self._warned_unknown: set[tuple[Any, bytes]] = set()
        self._supported_ops: dict[bytes, P.OpSpec] = {}  # op frame -> its op, once seen
        self._warned_sharing = False
        self.endpoint = ""
        self.accepting = True
        self.max_message_bytes = max_message_bytes  # 0: no limit

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, _LOOP_RCVTIMEO_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes or -1)
        wake_addr = f"inproc://lmcache-server-wake-{id(self):x}"
        sock.bind(wake_addr)
        waker = self._ctx.socket(zmq.DEALER)
        waker.setsockopt(zmq.LINGER, 0)
        waker.setsockopt(zmq.IDENTITY, _WAKE_ID)
        waker.connect(wake_addr)
        host = self.config.host
        bind_host = "127.0.0.1" if host == "localhost" else host
        addr = f"tcp://{bind_host}:{self.config.port}"
        try:
            sock.bind(addr)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            waker.close(linger=0)
            if exc.errno == zmq.EADDRINUSE:
                fix = "pick another --port or stop the process using it"
            else:
                fix = (
                    "pass a --host this machine owns (e.g. localhost or 0.0.0.0) and a valid --port"
                )
            raise OSError(f"cannot bind the RPC socket to {addr}: {exc}; {fix}") from exc
        self._sock = sock
        self._waker = waker
        self.endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._thread = threading.Thread(target=self._loop, name="mq-server-thread", daemon=True)
        self._thread.start()
        return self.endpoint

    def stop(self) -> None:
        self.accepting = False
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for ex in [*self._affinity, self._normal]:
            ex.shutdown(wait=False, cancel_futures=True)
        with self._waker_lock:
            if self._waker is not None:
                self._waker.close(linger=0)
                self._waker = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        assert self._sock is not None
        sock = self._sock
        self._loop_ident = threading.get_ident()
        while not self._stop.is_set():
            self._flush(sock)
            try:
                frames = recv_frames(sock, block=True)
            except zmq.Again:  # the receive timeout: look at the stop flag
                continue
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                logger.error("RPC receive failed: %s", exc)
                continue
            if len(frames) == 2 and frames[0].bytes == _WAKE_ID:
                self._wake_pending = False  # before the flush at the top of the loop sends them
                continue
            try:
                self._dispatch(frames)
            except Exception:  # never let one request stop the loop
                logger.exception("Error handling operation")
        self._flush(sock)

    def _flush(self, sock: zmq.Socket) -> None:
        while self._outbox:
            frames = self._outbox.popleft()
            try:
                send_frames(sock, frames)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    logger.warning("Response destination disconnected")
                else:
                    logger.error("Failed to send a reply: %s", exc)

    def _post(self, frames: list[Any]) -> None:
        self._outbox.append(frames)
        # The loop flushes before every receive; only other threads must wake it, and one
        # wake-up in flight is enough (the loop clears the flag before it flushes).
        if threading.get_ident() != self._loop_ident and not self._wake_pending:
            self._wake()

    def _wake(self) -> None:
        self._wake_pending = True
        with self._waker_lock:
            if self._waker is not None:
                try:
                    send_frames(self._waker, [b""])
                except zmq.ZMQError as exc:
                    logger.error("cannot wake the RPC loop: %s", exc)

    # ------------------------------------------------------------------ dispatch
    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        peer = frames[0].bytes
        if len(frames) < 3:
            self._count_error("?", ErrorCode.BAD_REQUEST)
            logger.error(
                "Bad request from peer %s: %d frames (need uid and op)", peer.hex(), len(frames)
            )
            return
        uid_b, op_b = frames[1].bytes, frames[2].bytes
        if op_b == P.STREAM_CONTROL_OP:  # [uid, b"", b"ack"|b"cancel"] of a stream
            action = frames[3].bytes if len(frames) > 3 else b""
            self.engine.stream_control(peer, uid_b, action)
            return
        features = self._features.get(peer, _NO_FEATURES)

        def reply(value: Any) -> None:
            self._reply(peer, uid_b, op_b, value, features)

        fail = functools.partial(self._fail, peer, uid_b, op_b, features)

        try:
            P.decode(uid_b)
            spec = self._supported_ops.get(op_b)
            op_val = None if spec is not None else P.decode(op_b)
        except Exception:
            fail("?", ErrorCode.BAD_REQUEST, "undecodable uid or op frame")
            return
        if spec is None:
            spec = P.lookup_op(op_val)
            if spec is not None and spec.supported and len(self._supported_ops) < 1024:
                self._supported_ops[op_b] = spec  # op frames name a handful of ops
        if spec is None or not spec.supported:
            code = ErrorCode.UNKNOWN_OP if spec is None else ErrorCode.NOT_SUPPORTED
            if (repr(op_val), peer) not in self._warned_unknown and len(
                self._warned_unknown
            ) < 10000:
                self._warned_unknown.add((repr(op_val), peer))
                logger.error(
                    "No handler registered: op %r from peer %s is not supported by this server",
                    op_val,
                    peer.hex(),
                )
            self._count_error(str(op_val), code)
            if P.FEATURE_ERROR_REPLIES in features:
                reply(
                    P.RemoteError(
                        code.value, f"op {op_val!r} is not supported by this server", False
                    )
                )
            return
        payloads = frames[3:]
        if not spec.min_params <= len(payloads) <= spec.max_params:
            fail(
                spec.name,
                ErrorCode.BAD_REQUEST,
                f"{spec.name} takes {spec.min_params}..{spec.max_params} payload frames, got {len(payloads)}",
            )
            return
        if not self.accepting:
            fail(spec.name, ErrorCode.SHUTTING_DOWN, "server is stopping")
            return
        if spec.name == "negotiate_features":
            args = self._decode_args(spec, payloads, fail)
            if args is None:
                return
            enabled = frozenset(f for f in args[0] if f in P.OFFERED_FEATURES)
            self._features[peer] = enabled
            reply(sorted(enabled))
            return
        ctx = RequestContext(peer, features, reply, uid_b)
        # Payloads are decoded where the op runs: a pool op's payload (up to a whole
        # request's KV on the copy path) never holds up the loop thread.
        task = (spec, ctx, payloads, uid_b, op_b)
        if spec.kind == HandlerKind.SYNC:
            self._run(*task)
        elif spec.kind == HandlerKind.AFFINITY:
            slot = self._slot(peer)
            idle = self._slot_submitted[slot] == self._slot_finished[slot]
            if idle and sum(len(f) for f in payloads) <= _INLINE_MAX_PAYLOAD:
                args = self._decode_args(spec, payloads, fail)
                if args is None:
                    return
                if self.engine.runs_inline(spec.name, args):
                    self._call(spec, ctx, args, uid_b, op_b)
                    return
                self._submit_to_slot(slot, self._call, spec, ctx, args, uid_b, op_b)
            else:
                self._submit_to_slot(slot, self._run, *task)
        else:
            self._normal.submit(self._run, *task)

    def _submit_to_slot(self, slot: int, fn: Any, *task: Any) -> None:
        self._slot_submitted[slot] += 1

        def run() -> None:
            try:
                fn(*task)
            finally:
                self._slot_finished[slot] += 1

        self._affinity[slot].submit(run)

    def _decode_args(
        self, spec: P.OpSpec, payloads: list[zmq.Frame], fail: Callable[[str, ErrorCode, str], None]
    ) -> list[Any] | None:
        """The decoded params, or None after ``fail`` has answered the request."""
        try:
            return [
                P.decode_param(p, f.buffer) for p, f in zip(spec.params, payloads, strict=False)
            ]
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError, TypeError) as exc:
            fail(spec.name, ErrorCode.BAD_REQUEST, f"bad payload for {spec.name}: {exc}")
            return None

    def _slot(self, peer: bytes) -> int:
        slot = self._affinity_slots.get(peer)
        if slot is None:
            slot = next(self._rr) % len(self._affinity)
            self._affinity_slots[peer] = slot
            if len(self._affinity_slots) > len(self._affinity) and not self._warned_sharing:
                self._warned_sharing = True
                logger.warning(
                    "%d clients share %d affinity slots; raise --max-gpu-workers to give each worker its own",
                    len(self._affinity_slots),
                    len(self._affinity),
                )
        return slot

    def _run(
        self,
        spec: P.OpSpec,
        ctx: RequestContext,
        payloads: list[zmq.Frame],
        uid_b: bytes,
        op_b: bytes,
    ) -> None:
        fail = functools.partial(self._fail, ctx.peer, uid_b, op_b, ctx.features)
        args = self._decode_args(spec, payloads, fail)
        if args is None:
            return
        self._call(spec, ctx, args, uid_b, op_b)

    def _call(
        self, spec: P.OpSpec, ctx: RequestContext, args: list[Any], uid_b: bytes, op_b: bytes
    ) -> None:
        t0 = time.perf_counter() if spec.kind == HandlerKind.AFFINITY else 0.0
        try:
            result = self.engine.handlers[spec.name](ctx, *args)
        except RequestError as exc:
            self._fail(ctx.peer, uid_b, op_b, ctx.features, spec.name, exc.code, exc.message)
            return
        except Exception as exc:
            logger.exception("Error in blocking handler for %s", spec.name)
            self._fail(
                ctx.peer,
                uid_b,
                op_b,
                ctx.features,
                spec.name,
                ErrorCode.INTERNAL,
                f"{type(exc).__name__}: {exc}",
            )
            return
        if spec.kind == HandlerKind.AFFINITY:  # the transfer ops
            self.metrics.observe(
                "lmcache_mp_transfer_phase_seconds", time.perf_counter() - t0, phase=spec.name
            )
        if not ctx.deferred:  # no one else holds ctx: reply without its once-only guard
            self._reply(ctx.peer, uid_b, op_b, result, ctx.features)

    def _reply(
        self, peer: bytes, uid_b: bytes, op_b: bytes, value: Any, features: frozenset[str]
    ) -> None:
        frames: list[Any] = [peer, uid_b, op_b]
        if value is not None:
            try:
                frames.append(P.encode(value))
            except Exception as exc:
                logger.exception("cannot encode the reply to %r", op_b)
                if P.FEATURE_ERROR_REPLIES not in features:
                    return
                frames.append(
                    P.encode(P.RemoteError("INTERNAL", f"unencodable reply: {exc}", True))
                )
        self._post(frames)

    def _fail(
        self,
        peer: bytes,
        uid_b: bytes,
        op_b: bytes,
        features: frozenset[str],
        op_name: str,
        code: ErrorCode,
        message: str,
    ) -> None:
        logger.error(
            "Request failed (op=%s, uid=%r, peer=%s): %s: %s",
            op_name,
            uid_b,
            peer.hex(),
            code.value,
            message,
        )
        self._count_error(op_name, code)
        if P.FEATURE_ERROR_REPLIES in features:
            err = P.RemoteError(code.value, message, code in P.RETRYABLE_CODES)
            self._post([peer, uid_b, op_b, P.encode(err)])

    def _count_error(self, op: str, code: ErrorCode) -> None:
        self.metrics.inc("lmcache_mp_request_errors", op=op, code=code.value)
