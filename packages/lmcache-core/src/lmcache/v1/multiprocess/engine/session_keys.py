"""``SessionKeys``: the sessions of requests and the object keys they hold.

A request's session turns its tokens into chunk hashes and ObjectKeys (``own_keys``, every
store and retrieve); its lookup job read-locks the hit prefix and records the locks as the
session's read shares, which retrieves, ``free_lookup_locks``, ``end_session`` and the
session's TTL give back. The op handlers here: ``lookup``, ``query_prefetch_status``,
``wait_prefetch_status``, ``free_lookup_locks`` and ``end_session``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.utils import RateLimitedLog, init_logger
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.config import MPServerConfig
from lmcache.v1.multiprocess.engine.layouts import LayoutTable
from lmcache.v1.multiprocess.engine.parker import Parker
from lmcache.v1.multiprocess.engine.records import (
    PendingRead,
    RequestContext,
    fan_out_keys,
    tail_keys,
)
from lmcache.v1.multiprocess.metrics import ServerMetrics
from lmcache.v1.multiprocess.protocol import ErrorCode, RequestError
from lmcache.v1.multiprocess.sessions import LookupJob, Session, SessionTable
from lmcache.v1.multiprocess.storage_bridge import LookupOutcome, StorageBridge
from lmcache.v1.multiprocess.token_hasher import NONE_HASH, PrefixHashMemo, tokens_to_be_bytes

logger = init_logger(__name__)
# Conditions a busy server may hit many times a second (a full L1, a full session table).
_limited = RateLimitedLog(logger, interval=10.0)
# How long a lookup's tail probe waits for L2 in all (FEATURE_PARTIAL_CHUNK).
TAIL_L2_WAIT_S = 2.0


class SessionKeys:
    """Owns the session table, the prefix hash memo, the lookup waiters and parked waits,
    and the read leases of dropped workers."""

    def __init__(
        self,
        config: MPServerConfig,
        storage: StorageBridge,
        metrics: ServerMetrics,
        layouts: LayoutTable,
    ) -> None:
        self.config = config
        self.cs = config.chunk_size
        self.storage = storage
        self.metrics = metrics
        self.layouts = layouts
        self.sessions = SessionTable(
            config.session_ttl_seconds, config.max_sessions, self._evict_sessions
        )
        self.hash_memo = PrefixHashMemo(self.cs)
        self._warned_early_exit: set[tuple[str, int]] = set()
        self._waiters = ThreadPoolExecutor(8, thread_name_prefix="mp-lookup-wait")
        self._parker = Parker()
        self._stopped = threading.Event()
        # Reads of dropped workers whose lease is still running: (lease end, read)
        self._leased_reads: list[tuple[float, PendingRead]] = []
        self._leases_lock = threading.Lock()
        # Told the tokens and hashes of each store (the KV event log binds them to chunks):
        # (uint32 big-endian tokens of the prefix, chunk hashes, first chunk, end chunk,
        # the hash of the key's partial_chunk tail or None).
        self.on_store: Callable[[bytes, list[bytes], int, int, bytes | None], None] | None = None

    def stop(self) -> None:
        self._stopped.set()
        self._parker.stop()
        self._waiters.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ keys
    def _validate(self, key: P.IPCCacheServerKey, *, aligned: bool, partial: bool = False) -> None:
        P.validate_key(key, chunk_aligned=aligned, chunk_size=self.cs, partial=partial)

    def _hashes(self, session: Session, key: P.IPCCacheServerKey, end: int) -> list[bytes]:
        try:
            with session.lock:
                return session.hashes_for(P.token_prefix(key, end), self.cs, self.hash_memo)
        except ValueError as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc

    def own_keys(
        self, key: P.IPCCacheServerKey, store: bool = False, partial: bool = False
    ) -> tuple[Session, list[Any]]:
        """The session of a store or retrieve and the ObjectKeys of its chunks for the key's
        own rank (``RequestError`` for a misaligned key or one without a worker_id). A
        ``store`` also goes to ``on_store``. ``partial`` (``FEATURE_PARTIAL_CHUNK``): a key
        ending inside a chunk has its tail's key last."""
        self._validate(key, aligned=True, partial=partial)
        if key.worker_id is None:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                "store/retrieve keys need a worker_id (the worker's KV rank)",
            )
        session = self.sessions.touch(key.request_id)
        hashes = self._hashes(session, key, key.end)
        session.key_info = (key.model_name, key.world_size, key.cache_salt)
        first, last = key.start // self.cs, key.end // self.cs
        keys = fan_out_keys(key, hashes, first, last, [key.worker_id])[0]
        tail = key.end % self.cs > 0  # only a partial_chunk peer's key gets past _validate
        raw = b""
        if tail or (store and self.on_store is not None):
            raw = tokens_to_be_bytes(P.token_prefix(key, key.end))
        if tail:
            parent = hashes[last - 1] if last else NONE_HASH
            keys = [*keys, *tail_keys(key, parent, raw[last * self.cs * 4 :], [key.worker_id])]
        if store and self.on_store is not None:
            self.on_store(raw, hashes, first, last, keys[-1].chunk_hash if tail else None)
        return session, keys

    # ------------------------------------------------------------------ lookup
    def lookup(
        self,
        ctx: RequestContext,
        key: P.IPCCacheServerKey,
        tp_size: Any = None,
        wait_timeout: float | None = None,
    ) -> int | None:
        """Starts the prefetch job; 0.5.6 replies nil. With ``wait_timeout``
        (``FEATURE_LOOKUP_WAIT``) the reply is wait_prefetch_status's answer instead."""
        self._start_lookup(key, P.FEATURE_PARTIAL_CHUNK in ctx.features)
        if wait_timeout is None:
            return None
        return self.wait_prefetch_status(ctx, key.request_id, wait_timeout)

    def _start_lookup(self, key: P.IPCCacheServerKey, partial: bool = False) -> None:
        if key.num_kv_readers < 1:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                f"num_kv_readers must be >= 1 (got {key.num_kv_readers}); the client must set it on lookup keys",
            )
        self._validate(key, aligned=False)
        lkey = (key.model_name, key.world_size)
        lay = self.layouts.get(lkey)
        if lay is None:  # nothing hashes the tokens then, but they must be valid all the same
            try:
                tokens_to_be_bytes(P.token_prefix(key, key.end))
            except ValueError as exc:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc
        session = self.sessions.touch(key.request_id)
        who: dict[str, str] = {"cache_salt": key.cache_salt, "model_name": key.model_name}
        self.metrics.inc("lmcache_mp_lookups_requests", 1.0, **who)
        first = key.start // self.cs
        job = LookupJob(key.num_kv_readers, first)
        with session.lock:
            old, session.job = session.job, job
            session.key_info = (key.model_name, key.world_size, key.cache_salt)
        if old is not None:
            old.superseded = True
            if old.is_done:
                self._release_job_locks(old, session)
        if lay is None:
            self.metrics.inc(
                "lmcache_mp_lookup_early_exit_requests", 1.0, reason="no_gpu_context", **who
            )
            if lkey not in self._warned_early_exit:
                self._warned_early_exit.add(lkey)
                logger.warning(
                    "lookup for model '%s' world_size %d before any worker registered it; reporting 0 hits. "
                    "Check that workers use the same model name and KV world size",
                    key.model_name,
                    key.world_size,
                )
            job.complete(0)
            return
        try:
            hashes = self._hashes(session, key, key.end)
        except RequestError:
            job.complete(0)  # a query of this request answers 0 instead of pending forever
            raise
        last = len(hashes)
        self.metrics.inc("lmcache_mp_lookup_requested_tokens", max(0, key.end - key.start), **who)
        if partial and lay.block_size > 0 and key.end >= first * self.cs + lay.block_size:
            job.tail_probe = (key, hashes, lay)
        if last <= first:
            if job.tail_probe is None:
                job.complete(0)
                return
            self._finish_job(session, job, LookupOutcome(0, 0, 0))
            return
        job.rows = fan_out_keys(key, hashes, first, last, range(key.world_size))
        try:
            # The common case: L1 alone answers at once, without a prefetch request.
            now = self.storage.lookup_l1_now(job.rows, key.num_kv_readers)
            if now is None:
                job.handle = self.storage.submit_lookup(
                    job.rows, lay.desc, key.num_kv_readers, key.request_id
                )
        except Exception as exc:
            logger.error("lookup %s: prefetch submit failed: %s", key.request_id, exc)
            job.complete(0)
            return
        if now is not None:
            self._finish_job(session, job, now)
        elif self.storage.wait_lookup(job.handle, 0):
            self._finish_job(session, job)
        else:
            self._waiters.submit(self._wait_job, session, job)

    def _wait_job(self, session: Session, job: LookupJob) -> None:
        while not self._stopped.is_set():
            if self.storage.wait_lookup(job.handle, 1.0):
                break
        self._finish_job(session, job)

    def _finish_job(self, session: Session, job: LookupJob, out: Any = None) -> None:
        """Record a finished lookup's hits as the session's read shares and complete it;
        ``out`` is the outcome when it was answered directly, else it comes from the handle."""
        n = len(job.rows[0]) if job.rows else 0
        if out is None:
            try:
                out = self.storage.lookup_result(job.handle, n)
            except Exception as exc:
                logger.error("lookup %s: prefetch result failed: %s", session.request_id, exc)
                job.complete(0)
                return
        hit = out.hit_chunks
        ranks = max(1, len(job.rows))
        model, _world_size, salt = session.key_info or ("", 0, "")
        tail_rows: list[Any] = []
        tail = LookupOutcome(0, 0, 0)
        counts: dict[str, float] = {}
        if job.tail_probe is not None:
            job.tail_tokens, tail_rows, tail = self._probe_tail(session, job, hit)
            counts["lmcache_mp_lookup_hit_tail_tokens"] = job.tail_tokens
        # A tail is one key per rank holding tail_tokens tokens (vLLM loads it as it loads
        # a chunk), so the key and tier counters count it as the chunks are counted.
        tail_ranks = max(1, len(tail_rows))
        counts.update(
            {
                "lmcache_mp_lookup_hit_tokens": hit * self.cs + job.tail_tokens,
                "lmcache_mp_lookup_hit_l1_keys": out.l1_keys + tail.l1_keys,
                "lmcache_mp_lookup_hit_l2_keys": out.l2_keys + tail.l2_keys,
                "lmcache_mp_lookup_hit_l1_tokens": out.l1_keys * self.cs // ranks
                + tail.l1_keys * job.tail_tokens // tail_ranks,
                "lmcache_mp_lookup_hit_l2_tokens": out.l2_keys * self.cs // ranks
                + tail.l2_keys * job.tail_tokens // tail_ranks,
            }
        )
        self.metrics.inc_many(counts, cache_salt=salt, model_name=model)
        readers, first_chunk = job.num_kv_readers, job.first_chunk
        with session.lock:
            shares, share_keys = session.shares, session.share_keys
            for r, row in enumerate(job.rows):
                for j in range(hit):
                    ck = (first_chunk + j, r)
                    shares[ck] = shares.get(ck, 0) + readers
                    share_keys[ck] = row[j]
            for r, tkey in enumerate(tail_rows):  # the tail is locked as chunk first + hit
                ck = (first_chunk + hit, r)
                shares[ck] = shares.get(ck, 0) + readers
                share_keys[ck] = tkey
            frees, job.deferred_frees = job.deferred_frees, []
        job.complete(hit)
        for first, last in frees:
            self._free_range(session, first, last)
        if job.superseded or session.ended:
            self._release_job_locks(job, session)

    def _release_job_locks(self, job: LookupJob, session: Session | None = None) -> None:
        """Release the shares a finished, superseded or orphaned job still holds."""
        if session is None or job.hit_chunks is None or not (job.rows or job.tail_tokens):
            return
        self._free_range(session, job.first_chunk, job.first_chunk + job.locked_chunks)

    def _probe_tail(
        self, session: Session, job: LookupJob, hit: int
    ) -> tuple[int, list[Any], LookupOutcome]:
        """``FEATURE_PARTIAL_CHUNK``: after ``hit`` whole chunks, the longest stored tail at
        the first missing chunk, read-locked on every rank: (its tokens, its key per rank,
        its lookup outcome: which tier held it), or (0, [], nothing). Candidate lengths are
        the multiples of the registered block size below a chunk that the lookup's range
        holds, longest first; L1 answers at once, an L2 check of one candidate waits at most
        ``TAIL_L2_WAIT_S`` in all."""
        key, hashes, lay = job.tail_probe
        job.tail_probe = None
        pos = job.first_chunk + hit  # the first chunk that missed (or the one past the range)
        room = min(key.end - pos * self.cs, self.cs - 1)
        bs = lay.block_size
        none = LookupOutcome(0, 0, 0)
        if room < bs:
            return 0, [], none
        raw = tokens_to_be_bytes(P.token_prefix(key, pos * self.cs + room))
        parent = hashes[pos - 1] if pos > 0 else NONE_HASH
        deadline = time.monotonic() + TAIL_L2_WAIT_S
        readers = job.num_kv_readers
        for n in range(room // bs * bs, 0, -bs):
            keys = tail_keys(key, parent, raw[pos * self.cs * 4 : (pos * self.cs + n) * 4])
            rows = [[k] for k in keys]
            try:
                out = self.storage.lookup_l1_now(rows, readers)
                if out is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        continue
                    handle = self.storage.submit_lookup(
                        rows, lay.desc, readers, f"{session.request_id}#tail{n}"
                    )
                    self.storage.wait_lookup(handle, left)
                    out = self.storage.lookup_result(handle, 1)
            except Exception as exc:
                logger.error("lookup %s: tail probe failed: %s", session.request_id, exc)
                return 0, [], none
            if out.hit_chunks >= 1:
                return n, keys, out
        return 0, [], none

    def consume(self, session: Session | None, tokens: bool = False) -> int | None:
        """The hit chunks of the session's lookup, reported once (0 after that, or without a
        lookup); None while the lookup runs. ``tokens`` (``FEATURE_PARTIAL_CHUNK``): the hit
        in tokens, its tail included."""
        if session is None:
            return 0
        with session.lock:
            job = session.job
            if job is None or job.consumed:
                return 0
            if not job.is_done:
                return None
            job.consumed = True
            session.job = None
            if tokens:
                return int(job.hit_chunks or 0) * self.cs + job.tail_tokens
            return int(job.hit_chunks or 0)

    def query_prefetch_status(self, ctx: RequestContext, request_id: str) -> int | None:
        return self.consume(self.sessions.get(request_id), P.FEATURE_PARTIAL_CHUNK in ctx.features)

    def wait_prefetch_status(
        self, ctx: RequestContext, request_id: str, timeout: float
    ) -> int | None:
        session = self.sessions.get(request_id)
        if session is None or session.job is None:
            return 0
        job = session.job
        tokens = P.FEATURE_PARTIAL_CHUNK in ctx.features
        if job.is_done:
            return self.consume(session, tokens)
        ctx.defer()

        def on_done(_job: LookupJob) -> None:
            if session.job is job:
                ctx.reply_with(lambda: self.consume(session, tokens))
            else:
                ctx.reply(0)

        def on_timeout() -> None:
            if ctx.reply(None):
                self.metrics.inc("lmcache_mp_timeouts", exception_type="LMCacheTimeoutError")

        self._parker.at(time.monotonic() + max(0.0, float(timeout)), on_timeout)
        job.on_done(on_done)
        return None

    def free_lookup_locks(
        self, ctx: RequestContext, key: P.IPCCacheServerKey, tp_size: Any = None
    ) -> None:
        if key.num_kv_readers < 1:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                f"num_kv_readers must be >= 1 (got {key.num_kv_readers}); the client must set it on free keys",
            )
        self._validate(key, aligned=True, partial=P.FEATURE_PARTIAL_CHUNK in ctx.features)
        if key.start == key.end:
            self.sessions.get(key.request_id)  # a no-op, but it still names the session (TTL)
            return None
        session = self.sessions.touch(key.request_id)
        first, last = key.start // self.cs, -(-key.end // self.cs)  # a tail counts as a chunk
        with session.lock:
            job = session.job
            if job is not None and not job.is_done:
                job.deferred_frees.append((first, last))  # applied when the job ends
                return None
        self._free_range(session, first, last)
        return None

    def _free_range(self, session: Session, first: int, last: int) -> None:
        to_release: list[tuple[Any, int]] = []
        with session.lock:
            for ck in [ck for ck in session.shares if first <= ck[0] < last]:
                n = session.shares.pop(ck)
                to_release.append((session.share_keys.pop(ck), n))
        by_n: dict[int, list[Any]] = {}
        for k, n in to_release:
            by_n.setdefault(n, []).append(k)
        for n, keys in by_n.items():
            self.storage.release_read(keys, n)

    def _take_share(self, session: Session, chunk: int, rank: int) -> bool:
        with session.lock:
            n = session.shares.get((chunk, rank), 0)
            if n <= 0:
                return False
            if n == 1:
                del session.shares[(chunk, rank)]
                session.share_keys.pop((chunk, rank), None)
            else:
                session.shares[(chunk, rank)] = n - 1
            return True

    def release_worker_shares(
        self, session: Session, key: P.IPCCacheServerKey, keys: list[Any]
    ) -> None:
        """One share per key of this worker's rank, each at most once per lookup share, taken
        from the session the read began in (a later session of the same request id has
        shares of its own)."""
        first = key.start // self.cs
        rank = key.worker_id or 0
        owed = [k for j, k in enumerate(keys) if self._take_share(session, first + j, rank)]
        self.storage.release_read(owed, 1)

    def end_session(self, ctx: RequestContext | None, request_id: str) -> None:
        session = self.sessions.pop(request_id)
        if session is None:
            return None
        with session.lock:
            info, hashes = session.key_info, list(session.hashes)
        if info is not None and hashes:  # refresh the LRU position of every key of the request
            model, ws, salt = info
            k = P.IPCCacheServerKey(
                model_name=model,
                world_size=ws,
                worker_id=None,
                token_ids=[],
                start=0,
                end=0,
                request_id=request_id,
                cache_salt=salt,
            )
            self.storage.touch([x for row in fan_out_keys(k, hashes, 0, len(hashes)) for x in row])
        self.close_session(session)
        return None

    def close_session(self, session: Session) -> None:
        """End a session (end_session, or its TTL ran out): a lookup still running is
        superseded, and its shares are freed now, or by the last retrieve still copying
        from them (``retrieve_done``)."""
        with session.lock:
            session.ended = True
            job = session.job
            inflight = session.inflight_retrieves
        if job is not None and not job.is_done:
            job.superseded = True
        if inflight == 0:
            self._free_range(session, 0, 1 << 62)

    def _evict_sessions(self, sessions: list[Session]) -> None:
        """Sessions pushed out of a full table (``--max-sessions``) end as if their TTL ran out."""
        self.metrics.inc("lmcache_mp_sessions_evicted", len(sessions))
        _limited.warning(
            "sessions_evicted",
            "session table full (--max-sessions %d): ended the least recently used session %r; "
            "clients must call end_session for finished requests, or raise --max-sessions",
            self.config.max_sessions,
            sessions[0].request_id,
        )
        for session in sessions:
            self.close_session(session)

    def retrieve_done(self, session: Session) -> None:
        """A retrieve of ``session`` (``retrieve_begin``) is over; the last one of an ended
        session frees its shares."""
        with session.lock:
            session.inflight_retrieves -= 1
            release = session.ended and session.inflight_retrieves == 0
        if release:
            self._free_range(session, 0, 1 << 62)

    def retrieve_begin(self, session: Session) -> Session:
        """A retrieve copies from ``session``'s read-locked chunks: an end_session meanwhile
        leaves them locked until ``retrieve_done``."""
        with session.lock:
            session.inflight_retrieves += 1
        return session

    def close_expired_sessions(self) -> None:
        """End every session whose TTL ran out (the session cleaner)."""
        for session in self.sessions.expired():
            self.close_session(session)

    # ------------------------------------------------------------------ SHM reads
    def finish_read(self, read: PendingRead) -> None:
        """An SHM read is over (commit_retrieve, or its worker dropped): give back its
        worker's shares, and its in-flight count if it copied."""
        self.release_worker_shares(read.session, read.key, read.keys)
        if read.copying:
            self.retrieve_done(read.session)

    def release_after_lease(self, reads: list[PendingRead]) -> None:
        """Release a dropped worker's share of its pending SHM reads once their lease ends
        (a failed read's at once: nothing copies from it): a worker whose copy finished
        within the lease did not wait for commit_retrieve, so its slots must not be reused
        before then. Through the session's share count, as commit_retrieve does, so a share
        that end_session already released is not released again."""
        lease = self.config.retrieve_lease_seconds
        now = time.monotonic()
        for read in reads:
            if read.copying and lease > 0 and now < read.prepared + lease:
                with self._leases_lock:
                    self._leased_reads.append((read.prepared + lease, read))
            else:
                self.finish_read(read)

    def release_expired_leases(self) -> None:
        now = time.monotonic()
        with self._leases_lock:
            due = [read for end, read in self._leased_reads if end <= now]
            self._leased_reads = [r for r in self._leased_reads if r[0] > now]
        for read in due:
            self.finish_read(read)
