"""The server's KV event log and its subscriptions (docs/design/protocol.md#kv-events).

``KVEventLog`` records, in order, which chunks each storage tier stored and removed: it is a
``StorageKeyListener`` of the storage engine (L1 is medium ``"CPU"``, an L2 tier its adapter
type in upper case). A stored record carries its chunk's tokens and parent chunk hash, which
the write path binds to the chunk hash when a store arrives (``bind_tokens``); a chunk
whose tokens were never bound (loaded from L2 after a restart) is counted, not recorded.
A ``partial_chunk`` tail is bound and recorded the same way, as one block with fewer
tokens; only subscriptions of peers that negotiated the feature read its stored records.
The log keeps the last ``--kv-event-log-size`` records (0 turns events off).

``KVEventStreams`` serves LMCache 0.5.6's ``subscribe_kv_events`` stream (one batch per
credit, the client acks each) and feeds the optional vLLM-format ZeroMQ publisher
(``kv_event_publisher``). One thread does all of it: the data path only appends a record
under a lock, and a slow or absent subscriber only stops getting batches.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmcache.utils import init_logger
from lmcache.v1.distributed.internal_api import StorageKeyListener
from lmcache.v1.multiprocess.protocol import (
    KV_EVENT_KIND_REMOVED,
    KV_EVENT_KIND_STORED,
    KVEventBatch,
    KVEventRecord,
)

logger = init_logger(__name__)

# Chunk hash -> (its tokens, parent hash), for the stores whose chunks have not reached
# every tier yet; the oldest go first. 16384 chunks of 256 tokens hold 16 MiB of token ids.
TOKEN_BINDINGS = 16384
MAX_EVENTS_PER_BATCH = 1024
MAX_SUBSCRIPTIONS = 256


@dataclass(frozen=True)
class _Record:
    seq: int
    kind: str
    medium: str
    model_name: str
    hashes: tuple[bytes, ...]
    parent: bytes | None = None
    tokens: bytes = b""  # uint32 big-endian, decoded when a batch is built

    def to_wire(self) -> KVEventRecord:
        return KVEventRecord(
            seq=self.seq,
            kind=self.kind,
            medium=self.medium,
            model_name=self.model_name,
            block_hashes=list(self.hashes),
            parent_block_hash=self.parent,
            token_ids=token_list(self.tokens),
        )


def token_list(raw: bytes) -> list[int]:
    """uint32 big-endian token bytes as a list of ints."""
    return np.frombuffer(raw, dtype=">u4").tolist() if raw else []


class KVEventLog(StorageKeyListener):
    def __init__(self, size: int, chunk_size: int) -> None:
        if size < 0:
            raise ValueError(
                f"--kv-event-log-size must be >= 0 (got {size}); 0 turns KV events off"
            )
        self.capacity = int(size)
        self.chunk_size = int(chunk_size)
        self.cond = threading.Condition(threading.RLock())
        self._log: collections.deque[_Record] = collections.deque(maxlen=max(1, self.capacity))
        self._bindings: collections.OrderedDict[bytes, tuple[bytes, bytes | None]] = (
            collections.OrderedDict()
        )
        self.incarnation = time.time_ns()
        self.next_seq = 1
        self.unbound_stores = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    @property
    def depth(self) -> int:
        return len(self._log) if self.enabled else 0

    @property
    def last_seq(self) -> int:
        return self.next_seq - 1

    # ------------------------------------------------------------------ recording
    def bind_tokens(
        self,
        raw_tokens: bytes,
        hashes: list[bytes],
        first: int,
        last: int,
        tail: bytes | None = None,
    ) -> None:
        """Remember the tokens (uint32 big-endian ``raw_tokens`` of the whole prefix) and
        parent of chunks ``first..last-1`` of a store, whose chunk hashes are ``hashes``;
        ``tail`` is the hash of the store's ``partial_chunk`` tail (the tokens past chunk
        ``last``, whose parent is chunk ``last - 1``), None without one."""
        if not self.enabled:
            return
        step = 4 * self.chunk_size
        with self.cond:
            for i in range(first, min(last, len(hashes))):
                self._bind(hashes[i], raw_tokens[i * step : (i + 1) * step], hashes, i)
            if tail is not None and last <= len(hashes):
                self._bind(tail, raw_tokens[last * step :], hashes, last)
            while len(self._bindings) > TOKEN_BINDINGS:
                self._bindings.popitem(last=False)

    def _bind(self, h: bytes, tokens: bytes, hashes: list[bytes], pos: int) -> None:
        """Bind the block at chunk position ``pos`` (a chunk, or a tail) to its tokens and
        parent, the chunk before it (None for the first)."""
        self._bindings[h] = (tokens, hashes[pos - 1] if pos else None)
        self._bindings.move_to_end(h)

    def _append(
        self, kind: str, medium: str, model: str, hashes: tuple[bytes, ...], **kw: Any
    ) -> None:
        self._log.append(_Record(self.next_seq, kind, medium, model, hashes, **kw))
        self.next_seq += 1

    def on_keys_stored(self, medium: str, keys: list[Any]) -> None:
        if not self.enabled or not keys:
            return
        with self.cond:
            seen: set[tuple[str, bytes]] = set()
            for key in keys:
                h, model = key.chunk_hash, key.model_name
                if (model, h) in seen:  # the same chunk of other ranks or object groups
                    continue
                seen.add((model, h))
                binding = self._bindings.get(h)
                if binding is None:
                    self.unbound_stores += 1
                    continue
                tokens, parent = binding
                self._append(
                    KV_EVENT_KIND_STORED, medium, model, (h,), parent=parent, tokens=tokens
                )
            self.cond.notify_all()

    def on_keys_removed(self, medium: str, keys: list[Any]) -> None:
        if not self.enabled or not keys:
            return
        by_model: dict[str, dict[bytes, None]] = {}
        for key in keys:
            by_model.setdefault(key.model_name, {})[key.chunk_hash] = None
        with self.cond:
            for model, hashes in by_model.items():
                self._append(KV_EVENT_KIND_REMOVED, medium, model, tuple(hashes))
            self.cond.notify_all()

    # ------------------------------------------------------------------ reading
    def read(
        self, model_name: str | None, cursor: int, max_events: int, tails: bool = True
    ) -> KVEventBatch:
        """Up to ``max_events`` records of ``model_name`` (None: every model) after
        ``cursor``; ``next_cursor`` is where to resume, ``lost`` says records after
        ``cursor`` are gone (trimmed, or a cursor of another incarnation). Without
        ``tails`` the stored records of ``partial_chunk`` tails are left out: a reader
        that did not negotiate the feature (LMCache 0.5.6's connector) announces every
        stored record as a whole chunk."""
        if cursor < 0 or max_events <= 0:
            raise ValueError(
                f"cursor must be >= 0 and max_events > 0 (got cursor={cursor}, "
                f"max_events={max_events})"
            )
        if not self.enabled:
            return KVEventBatch(
                enabled=False, incarnation=self.incarnation, next_cursor=0, lost=False
            )
        out: list[_Record] = []
        with self.cond:
            last = self.last_seq
            first = self._log[0].seq if self._log else last + 1
            lost = cursor + 1 < first or cursor > last
            next_cursor = min(cursor, last)
            for rec in itertools.islice(self._log, max(0, cursor + 1 - first), None):
                next_cursor = rec.seq
                if not tails and self._is_tail(rec):
                    continue
                if model_name is None or rec.model_name == model_name:
                    out.append(rec)
                    if len(out) == max_events:
                        break
        return KVEventBatch(
            enabled=True,
            incarnation=self.incarnation,
            next_cursor=next_cursor,
            lost=lost,
            events=[r.to_wire() for r in out],  # token ids decoded outside the lock
        )

    def _is_tail(self, rec: _Record) -> bool:
        """A stored record of a tail: fewer tokens than a chunk."""
        return rec.kind == KV_EVENT_KIND_STORED and len(rec.tokens) < 4 * self.chunk_size

    def status(self, subscribers: int = 0) -> dict[str, Any]:
        """0.5.6's ``/status`` ``kv_events`` block."""
        with self.cond:
            return {
                "enabled": self.enabled,
                "incarnation": self.incarnation,
                "log_depth": self.depth,
                "log_capacity": self.capacity,
                "next_seq": self.next_seq,
                "lost_markers": 0,  # records are never dropped on the way into the log
                "unbound_stores": self.unbound_stores,
                "subscribers": subscribers,
            }


@dataclass
class _Subscription:
    key: tuple[bytes, bytes]  # (peer, request uid)
    instance_id: int
    model_name: str
    cursor: int
    max_events: int
    send: Callable[[Any], None]  # one reply frame; None ends the stream
    tails: bool = False  # the peer negotiated partial_chunk: it gets the tails' records
    credit: bool = True
    first: bool = True
    since: float = field(default_factory=time.monotonic)


class KVEventStreams:
    """Serves the log to 0.5.6-style subscriptions and to the vLLM-format publisher."""

    def __init__(self, log: KVEventLog, publisher: Any = None) -> None:
        self.log = log
        self.publisher = publisher
        self._subs: dict[tuple[bytes, bytes], _Subscription] = {}
        self._pub_cursor = log.last_seq
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def subscribers(self) -> int:
        with self.log.cond:
            return len(self._subs)

    def start(self) -> None:
        if self.publisher is not None:
            self.publisher.start()
        self._thread = threading.Thread(target=self._run, name="lmcache-kv-events", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self.log.cond:
            subs = list(self._subs.values())
            self._subs.clear()
            self.log.cond.notify_all()
        for sub in subs:
            sub.send(None)
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.publisher is not None:
            self.publisher.stop()

    # ------------------------------------------------------------------ subscriptions
    def subscribe(
        self,
        key: tuple[bytes, bytes],
        send: Callable[[Any], None],
        instance_id: int,
        model_name: str,
        cursor: int,
        max_events: int,
        tails: bool = False,
    ) -> None:
        """Start a stream; one per worker instance (a new one ends the previous one).
        ``tails``: the stream carries the stored records of ``partial_chunk`` tails."""
        if cursor < 0 or not 0 < max_events <= MAX_EVENTS_PER_BATCH:
            raise ValueError(
                f"cursor must be >= 0 and max_events in [1, {MAX_EVENTS_PER_BATCH}] "
                f"(got cursor={cursor}, max_events={max_events})"
            )
        sub = _Subscription(key, instance_id, model_name, cursor, max_events, send, tails)
        ended: list[_Subscription] = []
        with self.log.cond:
            for old in list(self._subs.values()):
                if old.instance_id == instance_id:
                    ended.append(self._subs.pop(old.key))
            while len(self._subs) >= MAX_SUBSCRIPTIONS:  # the oldest stream goes
                ended.append(self._subs.pop(next(iter(self._subs))))
            self._subs[key] = sub
            self.log.cond.notify_all()
        for old in ended:
            old.send(None)

    def control(self, key: tuple[bytes, bytes], action: bytes) -> None:
        """A client's ``ack`` (send the next batch) or ``cancel`` (end the stream)."""
        with self.log.cond:
            sub = self._subs.get(key)
            if sub is None:
                return
            if action == b"cancel":
                del self._subs[key]
            else:
                sub.credit = True
                self.log.cond.notify_all()
                return
        sub.send(None)

    def drop_instance(self, instance_id: int) -> None:
        """End the streams of a worker that unregistered or was reaped."""
        with self.log.cond:
            gone = [s for s in self._subs.values() if s.instance_id == instance_id]
            for s in gone:
                del self._subs[s.key]
        for s in gone:
            s.send(None)

    # ------------------------------------------------------------------ the thread
    def _ready(self) -> list[_Subscription]:
        last = self.log.last_seq
        return [s for s in self._subs.values() if s.credit and (s.first or s.cursor != last)]

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.log.cond:
                ready = self._ready()
                publish = self.publisher is not None and self._pub_cursor != self.log.last_seq
                if not ready and not publish:
                    self.log.cond.wait(timeout=1.0)
                    continue
            try:
                for sub in ready:
                    self._serve(sub)
                if publish:
                    self._publish()
            except Exception:  # never let one bad batch end the thread
                logger.exception("KV event stream failed")
                time.sleep(0.1)

    def _serve(self, sub: _Subscription) -> None:
        batch = self.log.read(sub.model_name, sub.cursor, sub.max_events, sub.tails)
        with self.log.cond:
            if self._subs.get(sub.key) is not sub:
                return
            sub.cursor = batch.next_cursor
            if not (sub.first or batch.events or batch.lost):
                return  # only other models' records
            sub.first = False
            sub.credit = False
        sub.send(batch)

    def _publish(self) -> None:
        batch = self.log.read(None, self._pub_cursor, MAX_EVENTS_PER_BATCH)
        if batch.lost and self._pub_cursor:
            logger.warning(
                "the KV event publisher fell behind the log; some events were not published"
            )
        self._pub_cursor = batch.next_cursor
        if batch.events:
            self.publisher.publish(batch.events)
