"""Per-request sessions and lookup jobs (docs/design/protocol.md#sessions,
docs/design/protocol.md#lookup-prefetch).

A ``Session`` per request_id holds the token ids and their cached chunk hashes, the
current lookup job, the lock shares still owed per (chunk, rank) and the in-flight
retrieve count. Its TTL counts from the last request that named it (IMPROVE). The table
holds at most ``max_sessions``: a new session beyond that evicts the least recently used
one (a client that never ends its sessions cannot grow the server without bound).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmcache.v1.multiprocess.token_hasher import (
    PrefixHashMemo,
    chunk_hashes,
    shared_chunks,
    tokens_to_be_bytes,
)


class LookupJob:
    """One prefetch job; completes once with the hit prefix length in chunks."""

    def __init__(self, num_kv_readers: int, first_chunk: int) -> None:
        self.num_kv_readers = num_kv_readers
        self.first_chunk = first_chunk
        self.hit_chunks: int | None = None
        self.superseded = False  # replaced by a newer lookup: release its locks when done
        self.consumed = False
        self._callbacks: list[Callable[[LookupJob], None]] = []
        self._lock = threading.Lock()
        self.is_done = False  # nothing blocks on a job: waiters register callbacks
        self.handle: Any = None
        self.rows: list[list[Any]] = []
        self.deferred_frees: list[tuple[int, int]] = []  # (first, last) chunk ranges
        # FEATURE_PARTIAL_CHUNK: what the tail probe needs (see SessionKeys._probe_tail), and
        # the tokens of the tail that hit after the whole chunks (read-locked like a chunk).
        self.tail_probe: Any = None
        self.tail_tokens = 0

    @property
    def locked_chunks(self) -> int:
        """Chunks (the tail counting as one) this job's hit read-locked after ``first_chunk``."""
        return int(self.hit_chunks or 0) + (1 if self.tail_tokens else 0)

    def complete(self, hit_chunks: int) -> None:
        with self._lock:
            if self.is_done:
                return
            self.hit_chunks = hit_chunks
            self.is_done = True
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def on_done(self, cb: Callable[[LookupJob], None]) -> None:
        with self._lock:
            if not self.is_done:
                self._callbacks.append(cb)
                return
        cb(self)


@dataclass
class Session:
    request_id: str
    last_used: float = field(default_factory=time.monotonic)
    token_bytes: bytes = b""
    hashes: list[bytes] = field(default_factory=list)
    job: LookupJob | None = None
    # Lock shares still owed: (chunk index, rank) -> shares; keys to release them with.
    shares: dict[tuple[int, int], int] = field(default_factory=dict)
    share_keys: dict[tuple[int, int], Any] = field(default_factory=dict)
    key_info: tuple[str, int, str] | None = None  # (model_name, world_size, cache_salt)
    inflight_retrieves: int = 0
    ended: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def hashes_for(
        self, token_ids: list[int] | bytes, chunk_size: int, memo: PrefixHashMemo | None = None
    ) -> list[bytes]:
        """Chunk hashes of ``token_ids``, reusing cached ones only while their tokens match:
        this session's, else the longest prefix ``memo`` knows from other requests."""
        raw = tokens_to_be_bytes(token_ids)
        n_full = (len(raw) // 4) // chunk_size
        step = chunk_size * 4
        old = self.token_bytes
        keep = shared_chunks(old, raw, step, min(len(self.hashes), n_full))
        prefix = self.hashes[:keep]
        if memo is not None and keep < n_full:
            known = memo.known_prefix(raw)
            if len(known) > keep:
                prefix = known
        hashes = chunk_hashes(None, chunk_size, prefix=prefix, token_bytes=raw)
        if memo is not None and len(hashes) > len(prefix):
            memo.remember(raw, hashes)
        if len(raw) >= len(old) or keep < len(self.hashes):
            self.token_bytes = raw
            self.hashes = hashes
        return hashes


class SessionTable:
    """Sessions by request id, least recently used first.

    ``on_evict(sessions)`` is called (outside the table's lock) with the sessions a new one
    pushed out; the caller ends them as if their TTL had run out."""

    def __init__(
        self,
        ttl_seconds: float,
        max_sessions: int = 0,
        on_evict: Callable[[list[Session]], None] | None = None,
    ) -> None:
        self.ttl = ttl_seconds
        self.max_sessions = max_sessions  # 0 = no cap
        self._on_evict = on_evict
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    def touch(self, request_id: str) -> Session:
        """Get or create the session and refresh its TTL."""
        now = time.monotonic()
        evicted: list[Session] = []
        with self._lock:
            s = self._sessions.get(request_id)
            if s is None or s.ended:
                s = Session(request_id)
                self._sessions[request_id] = s
                cap = self.max_sessions
                while cap > 0 and len(self._sessions) > cap:
                    evicted.append(self._sessions.popitem(last=False)[1])
            self._sessions.move_to_end(request_id)
            s.last_used = now
        if evicted and self._on_evict is not None:
            self._on_evict(evicted)
        return s

    def get(self, request_id: str, *, refresh: bool = True) -> Session | None:
        with self._lock:
            s = self._sessions.get(request_id)
            if s is not None and refresh:
                s.last_used = time.monotonic()
                self._sessions.move_to_end(request_id)
            return s

    def pop(self, request_id: str) -> Session | None:
        with self._lock:
            return self._sessions.pop(request_id, None)

    def expired(self) -> list[Session]:
        cutoff = time.monotonic() - self.ttl
        gone = []
        with self._lock:
            for s in self._sessions.values():  # least recently used first
                if s.last_used >= cutoff:
                    break
                gone.append(s)
            for s in gone:
                del self._sessions[s.request_id]
        return gone

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def all(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())
