"""Client side of ``subscribe_kv_events`` (docs/design/protocol.md#kv-events): a thread
with its own DEALER socket that keeps one subscription open, acks each batch, and
subscribes again after the stream ends or the connection drops.

The wire is LMCache 0.5.6's, so it works against both servers: the request
``[uid, "subscribe_kv_events", instance_id, model_name, cursor, max_events]``, one reply
``[uid, op, KVEventBatch]`` per credit, ``[uid, b"", b"ack"|b"cancel"]`` from the client,
``[uid, op]`` when the server ends the stream. It resumes from the last ``next_cursor``;
when the server's ``incarnation`` changed (a restart) it starts again from cursor 0.
Given ``features`` (ours: ``partial_chunk``, for a server that offered it to the caller's
link), it negotiates them on its socket before each subscription.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import msgspec
import zmq

from lmcache.utils import init_logger
from lmcache.v1.multiprocess import protocol as P

logger = init_logger(__name__)

_OP = msgspec.msgpack.encode("subscribe_kv_events")
_NEGOTIATE_OP = msgspec.msgpack.encode("negotiate_features")
_BATCH = msgspec.msgpack.Decoder(P.KVEventBatch)
_POLL_MS = 500
MAX_EVENTS = 1024


class KVEventSubscriber:
    """Calls ``on_batch(batch)`` for every batch, on its own thread. ``batch.lost`` means:
    withdraw everything announced so far, then apply the batch's records (events fell out
    of the log, or the server restarted). Stops for good, calling ``on_disabled(reason)``,
    when the server keeps no event log."""

    def __init__(
        self,
        url: str,
        instance_id: int,
        model_name: str,
        on_batch: Callable[[P.KVEventBatch], None],
        on_disabled: Callable[[str], None] | None = None,
        retry_s: float = 1.0,
        features: tuple[str, ...] = (),
    ) -> None:
        self.url = url
        self.instance_id = instance_id
        self.model_name = model_name
        self._on_batch = on_batch
        self._on_disabled = on_disabled
        self._retry_s = retry_s
        self.features = features
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._uids = itertools.count(1)
        self.cursor = 0
        self.incarnation: int | None = None
        self.batches = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lmcache-kv-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _subscribe(self, sock: zmq.Socket, cursor: int) -> bytes:
        if self.features:  # its reply, on a uid of no stream, is skipped like a late frame
            nuid = msgspec.msgpack.encode(next(self._uids))
            sock.send_multipart([nuid, _NEGOTIATE_OP, msgspec.msgpack.encode(list(self.features))])
        uid = msgspec.msgpack.encode(next(self._uids))
        args = (self.instance_id, self.model_name, cursor, MAX_EVENTS)
        sock.send_multipart([uid, _OP, *(msgspec.msgpack.encode(a) for a in args)])
        return uid

    def _run(self) -> None:
        ctx: zmq.Context = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self.url)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            uid = self._subscribe(sock, self.cursor)
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if monitor in ready:
                    monitor.recv_multipart()
                    # the stream died with the connection; the DEALER sends this once it
                    # is back (a restarted server answers with a new incarnation)
                    uid = self._subscribe(sock, self.cursor)
                if sock not in ready:
                    continue
                frames = sock.recv_multipart()
                if len(frames) < 2 or frames[0] != uid:
                    continue  # a late frame of a stream given up
                if len(frames) == 2:  # the server ended the stream: subscribe again
                    self._stop.wait(self._retry_s)
                    uid = self._subscribe(sock, self.cursor)
                    continue
                uid = self._handle(sock, uid, frames[2])
        except Exception:
            if not self._stop.is_set():
                logger.exception("KV event subscription to %s failed", self.url)
        finally:
            monitor.close(linger=0)
            sock.close(linger=0)

    def _handle(self, sock: zmq.Socket, uid: bytes, payload: bytes) -> bytes:
        """Deliver one batch and ack it; the uid of the stream to read next."""
        try:
            batch = _BATCH.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            logger.warning("KV event subscription: the server sent no batch: %r", payload[:200])
            sock.send_multipart([uid, P.STREAM_CONTROL_OP, P.STREAM_CANCEL])
            self._stop.wait(self._retry_s)
            return self._subscribe(sock, self.cursor)
        if not batch.enabled:
            self._stop.set()
            if self._on_disabled is not None:
                self._on_disabled("the server keeps no KV event log (--kv-event-log-size 0)")
            return uid
        if self.incarnation is None:  # nothing announced yet: a trimmed log loses nothing
            batch.lost = False
        elif batch.incarnation != self.incarnation:  # the server restarted
            batch.lost = True
            if self.cursor != 0:  # our cursor means nothing in the new log: read it all
                self.incarnation, self.cursor = batch.incarnation, 0
                sock.send_multipart([uid, P.STREAM_CONTROL_OP, P.STREAM_CANCEL])
                batch.events = []
                self._on_batch(batch)
                return self._subscribe(sock, 0)
        self.incarnation = batch.incarnation
        self.cursor = batch.next_cursor
        self.batches += 1
        self._on_batch(batch)
        sock.send_multipart([uid, P.STREAM_CONTROL_OP, P.STREAM_ACK])
        return uid
