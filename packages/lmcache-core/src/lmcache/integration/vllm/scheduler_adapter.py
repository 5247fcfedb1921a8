"""Scheduler side of the connector: lookups, hit arithmetic, lock bookkeeping, op emission.

Every request gets a :class:`RequestTracker` that moves
``PREFETCHING -> WAITING_FOR_LOAD -> READY``. The scheduler is blocked at most
``LOOKUP_WAIT_S`` per request: the first call sends the lookup and waits that long for
its result (a server answers in well under a millisecond, and "ask again" costs the
request a whole engine step: a decode step of the batch or more); after that its status
is polled on later calls, and while anything is pending the answer is ``(None, True)``
("ask again"). No lookup is sent for a prompt whose every loadable token vLLM's own
prefix cache already holds. A hit is
then loaded synchronously by default (``(n, False)``: the workers copy it before
the forward of the step that computes the rest of the prompt), or asynchronously
with ``lmcache.mp.sync_load=false`` (``(n, True)``, as LMCache 0.5.6).

Every read lock the server took for a lookup is given back exactly once: freed here when vLLM's prefix cache or the cap makes
the chunk unnecessary, consumed by the workers' retrieve otherwise, and
released by ``end_session`` as a last resort.

Nothing here imports vLLM: requests and scheduler outputs are read duck-typed.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lmcache.integration.vllm.mp_config import MPConnectorConfig
from lmcache.integration.vllm.mp_ops import LMCacheMPRequestMetadata, LoadStoreOp, chunk_floor
from lmcache.integration.vllm.parallel_strategy import ParallelStrategy
from lmcache.integration.vllm.server_link import ServerLink
from lmcache.utils import init_logger
from lmcache.v1.multiprocess.protocol import IPCCacheServerKey

logger = init_logger(__name__)

# How long request_finished waits for unacked lookup/status replies (spec: at most 1 s).
FINISH_WAIT_S = 1.0
# How long the first get_num_new_matched_tokens of a request waits for its lookup result
# before it answers "ask again" (which delays the request by one engine step).
LOOKUP_WAIT_S = 0.02
# At most this many end_session messages wait for a server that does not answer; older ones
# are dropped (the server's session TTL ends those sessions).
MAX_OWED_ENDS = 16384
# Server-side park time of one wait_prefetch_status (nonblocking_lookup_status=false).
WAIT_STATUS_S = 0.05


class RequestState(enum.Enum):
    PREFETCHING = enum.auto()
    WAITING_FOR_LOAD = enum.auto()
    READY = enum.auto()


@dataclass
class RequestTracker:
    request_id: str
    request: Any  # vLLM's Request: all_token_ids grows as tokens are generated
    prompt: list[int]
    cache_salt: str
    num_groups: int
    state: RequestState = RequestState.PREFETCHING
    vllm_hit: int = 0
    lmcache_hit: int = 0
    hit_known: bool = False
    allocated_block_ids: list[list[int]] = field(default_factory=list)
    num_scheduled_tokens: int = 0
    num_stored: int = 0
    stored_any: bool = False
    # Lookup bookkeeping: futures, when it was sent, whether we stopped waiting.
    lookup_key: IPCCacheServerKey | None = None
    lookup_future: Any = None
    status_future: Any = None
    lookup_sent_at: float = 0.0
    gave_up: bool = False
    # [locks_from, lmcache_hit) is still read-locked on the server for us.
    locks_from: int = 0
    locks_held: bool = False
    # Blocks of the RETRIEVE in flight; a failed load means vLLM recomputes past vllm_hit.
    loading_blocks: set[int] = field(default_factory=set)
    load_failed: bool = False
    # partial_chunk (the link negotiated it when the lookup went out): the lookup status is
    # in tokens and lmcache_hit may end in a tail; the prompt's own tail is stored once.
    partial: bool = False
    tail_stored: bool = False
    # The first call waited (LOOKUP_WAIT_S) for the lookup result; later calls only poll.
    lookup_waited: bool = False
    # No lookup was sent: vLLM's prefix cache held every token we could load.
    lookup_skipped: bool = False
    # A lookup of this request reached out to the server (before a preemption too): it has
    # a session there to end.
    contacted: bool = False

    def __post_init__(self) -> None:
        if not self.allocated_block_ids:
            self.allocated_block_ids = [[] for _ in range(self.num_groups)]

    @property
    def lookup_pending(self) -> bool:
        return self.lookup_future is not None and not self.hit_known

    def tokens(self) -> list[int]:
        toks = getattr(self.request, "all_token_ids", None)
        return list(toks) if toks is not None else self.prompt


def _prompt_of(request: Any) -> list[int]:
    toks = getattr(request, "prompt_token_ids", None)
    if toks is None:
        toks = getattr(request, "all_token_ids", None)
    return list(toks or [])


class LMCacheMPSchedulerAdapter:
    """Scheduler-side logic behind ``LMCacheMPConnector`` (one per scheduler process)."""

    def __init__(
        self,
        config: MPConnectorConfig,
        *,
        model_name: str,
        strategy: ParallelStrategy,
        vllm_block_size: int,
        group_block_sizes: list[int] | None = None,
        link: ServerLink | None = None,
    ) -> None:
        self.config = config
        self.model_name = model_name
        self.strategy = strategy
        self.vllm_block_size = vllm_block_size
        self.group_block_sizes = list(group_block_sizes or [vllm_block_size])
        self.link = link or ServerLink(config, role="scheduler")
        self.chunk_size = self.link.chunk_size
        check_chunk_size(self.chunk_size, vllm_block_size, self.group_block_sizes)
        self.hit_alignment = math.lcm(*self.group_block_sizes)
        self.trackers: dict[str, RequestTracker] = {}
        # Trackers that answered (0, False) before their lookup result came; read late, freed.
        self._abandoned: list[RequestTracker] = []
        self._new_block_records: list[dict[str, Any]] = []
        # Finished requests whose stores may still be on their way: end_session waits for
        # vLLM to report them in finished_sending (see request_finished).
        self._end_after_sending: set[str] = set()
        # end_session messages owed while the server did not answer (see _end_session).
        self._owed_ends: deque[str] = deque(maxlen=MAX_OWED_ENDS)
        self._owed_lock = threading.Lock()
        self.link.add_recovered_hook(self._send_owed_ends)
        self.gpu_block_pool: Any = None

    # -- helpers ------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.link.healthy

    def _key(self, t: RequestTracker, start: int, end: int) -> IPCCacheServerKey:
        return IPCCacheServerKey(
            model_name=self.model_name,
            world_size=self.strategy.kv_world_size,
            worker_id=None,
            token_ids=t.prompt,
            start=start,
            end=end,
            request_id=t.request_id,
            cache_salt=t.cache_salt,
            num_kv_readers=self.strategy.num_kv_readers,
        )

    def _new_tracker(self, request: Any) -> RequestTracker:
        t = RequestTracker(
            request_id=request.request_id,
            request=request,
            prompt=_prompt_of(request),
            cache_salt=getattr(request, "cache_salt", None) or "",
            num_groups=len(self.group_block_sizes),
        )
        self.trackers[t.request_id] = t
        return t

    def _lookup_end(self, t: RequestTracker) -> int:
        """Where a request's lookup ends: the most the server can hit."""
        if self.link.partial_chunk:  # whole chunks, then the longest stored tail the prompt holds
            return len(t.prompt) if len(t.prompt) >= self.hit_alignment else 0
        return chunk_floor(len(t.prompt), self.chunk_size)

    def _usable(self, t: RequestTracker, hit: int) -> int:
        """Of a hit of ``hit`` tokens, what vLLM may load: never the prompt's last token (vLLM
        computes it for the first output), aligned to every group's block size."""
        usable = min(hit, len(t.prompt) - 1)
        return usable // self.hit_alignment * self.hit_alignment

    def _send_lookup(self, t: RequestTracker) -> None:
        self.link.start_heartbeat()
        t.partial = self.link.partial_chunk
        end = self._lookup_end(t)
        t.lookup_key = self._key(t, 0, end)
        t.lookup_sent_at = time.monotonic()
        if end == 0:
            # Shorter than one chunk (one block with partial_chunk): nothing can hit, so
            # nothing is asked or locked.
            t.hit_known, t.lmcache_hit = True, 0
            return
        t.lookup_future = self.link.submit("lookup", t.lookup_key, self.strategy.kv_world_size)
        t.contacted = True

    def _advance_lookup(self, t: RequestTracker) -> None:
        """Move the lookup forward without blocking; sets ``hit_known`` once the result is in."""
        if t.hit_known or t.lookup_future is None:
            return
        if not t.lookup_future.query():
            return
        if t.status_future is None:
            try:
                t.lookup_future.result(0)
            except Exception as exc:
                logger.warning("lookup of request %s failed: %s", t.request_id, exc)
                t.hit_known, t.lmcache_hit = True, 0
                return
            # Only now: a status query that overtook its lookup would read 0 and leak locks.
            self._send_status(t)
            return
        if not t.status_future.query():
            return
        try:
            chunks = t.status_future.result(0)
        except Exception as exc:
            logger.warning("prefetch status of request %s failed: %s", t.request_id, exc)
            t.hit_known, t.lmcache_hit = True, 0
            return
        if chunks is None:  # still prefetching on the server: ask again
            self._send_status(t)
            return
        t.hit_known = True
        hit = int(chunks) if t.partial else int(chunks) * self.chunk_size
        t.lmcache_hit = min(hit, t.lookup_key.end)
        t.locks_from, t.locks_held = 0, t.lmcache_hit > 0

    def _wait_for_lookup(self, t: RequestTracker, budget: float) -> None:
        """Advance the lookup, waiting for its replies for up to ``budget`` seconds in all."""
        deadline = time.monotonic() + budget
        while not t.hit_known:
            fut = t.status_future if t.status_future is not None else t.lookup_future
            if fut is None or not fut.wait(max(0.0, deadline - time.monotonic())):
                return
            self._advance_lookup(t)
            now = t.status_future if t.status_future is not None else t.lookup_future
            if now is fut and not t.hit_known:
                return  # no progress on a reply that came: leave it to later calls

    def _send_status(self, t: RequestTracker) -> None:
        if self.config.nonblocking_lookup_status:
            t.status_future = self.link.submit("query_prefetch_status", t.request_id)
        else:
            t.status_future = self.link.submit("wait_prefetch_status", t.request_id, WAIT_STATUS_S)
            t.status_future.wait(WAIT_STATUS_S + 0.5)

    def _free_locks(self, t: RequestTracker, end: int) -> None:
        """Give back the read locks of ``[locks_from, end)`` (chunk-aligned, or ending in the
        hit's tail; empty sends nothing)."""
        if not t.locks_held:
            return
        start = t.locks_from
        end = t.lmcache_hit if end >= t.lmcache_hit else chunk_floor(end, self.chunk_size)
        if end > start:
            self.link.send(
                "free_lookup_locks", self._key(t, start, end), self.strategy.kv_world_size
            )
            t.locks_from = end
        if t.locks_from >= t.lmcache_hit:
            t.locks_held = False

    def _poll_abandoned(self) -> None:
        still = []
        for t in self._abandoned:
            self._advance_lookup(t)
            if t.hit_known:
                self._free_locks(t, t.lmcache_hit)
            else:
                still.append(t)
        self._abandoned = still

    def _abandon(self, t: RequestTracker) -> None:
        """Answer a miss now; a result that still arrives gets its locks freed."""
        t.gave_up = True
        if t.lookup_pending and all(a is not t for a in self._abandoned):
            self._abandoned.append(t)

    # -- vLLM scheduler calls ------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        if not self.config.eager_prefetch or not self.healthy:
            return
        if request.request_id not in self.trackers:
            t = self._new_tracker(request)
            self._send_lookup(t)
            self._advance_lookup(t)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._poll_abandoned()
        t = self.trackers.get(request.request_id)
        if t is not None and t.state is not RequestState.PREFETCHING:
            # Asked again after allocation: vLLM preempted the request and starts it over.
            self._reset_after_preemption(t.request_id)
            t = self.trackers[request.request_id]
        if t is None:
            t = self._new_tracker(request)
        if not self.healthy or t.gave_up:
            # Degraded: answer a miss at once, never contact the server.
            if not t.gave_up:
                self._abandon(t)
            t.vllm_hit = num_computed_tokens
            return 0, False
        t.lookup_skipped = False
        if t.lookup_key is None and not t.hit_known:
            if 0 < num_computed_tokens >= self._usable(t, self._lookup_end(t)):
                # vLLM's prefix cache holds every token we could load: nothing to look up
                # or lock (asked again, with less in vLLM's cache, this looks up after all)
                self.link.start_heartbeat()  # as a lookup would: the health checks run
                t.lookup_skipped = True
                t.vllm_hit = num_computed_tokens
                return 0, False
            self._send_lookup(t)
        if not t.hit_known:
            if not t.lookup_waited:
                t.lookup_waited = True
                self._wait_for_lookup(t, LOOKUP_WAIT_S)
            else:
                self._advance_lookup(t)
                if not t.hit_known:
                    self._advance_lookup(t)  # a status reply may already be in
            if not t.hit_known:
                if time.monotonic() - t.lookup_sent_at > self.config.lookup_timeout:
                    logger.warning(
                        "lookup of request %s got no result within lookup_timeout=%g s; "
                        "treating it as a miss",
                        t.request_id,
                        self.config.lookup_timeout,
                    )
                    self._abandon(t)
                    t.vllm_hit = num_computed_tokens
                    return 0, False
                return None, True
        t.vllm_hit = num_computed_tokens
        need = max(0, self._usable(t, t.lmcache_hit) - num_computed_tokens)
        return need, need > 0 and not self.config.sync_load

    def update_state_after_alloc(
        self,
        request: Any,
        block_ids: tuple[list[int], ...] | list[list[int]],
        num_external_tokens: int,
    ) -> None:
        t = self.trackers.get(request.request_id)
        if t is None:
            return
        self._append_blocks(t, block_ids, "full")
        if t.state is not RequestState.PREFETCHING:
            return
        if num_external_tokens > 0:
            t.state = RequestState.WAITING_FOR_LOAD
            # vLLM's prefix cache serves these chunks: they will not be retrieved.
            self._free_locks(t, chunk_floor(t.vllm_hit, self.chunk_size))
        else:
            t.state = RequestState.READY
            self._free_locks(t, t.lmcache_hit)
        # A tail hit is no whole chunk: the chunk it lies in is stored if the prompt fills it.
        t.num_stored = chunk_floor(t.lmcache_hit, self.chunk_size)
        if t.lookup_skipped:
            # what vLLM's prefix cache held was stored when this vLLM computed it
            t.num_stored = chunk_floor(t.vllm_hit, self.chunk_size)

    def _append_blocks(self, t: RequestTracker, block_ids: Any, mode: str) -> None:
        """Track the request's blocks per group.

        ``mode`` says what vLLM handed us: ``"full"`` (every block of the request, as in
        ``update_state_after_alloc`` and new requests: only the tail beyond what we hold is
        new), ``"new"`` (only newly allocated blocks, as for running requests) or
        ``"replace"`` (a request resumed after preemption got a fresh block list).
        """
        if block_ids is None:
            return
        for g, ids in enumerate(list(block_ids)[: t.num_groups]):
            ids = list(ids)
            cur = t.allocated_block_ids[g]
            if mode == "full" and ids[: len(cur)] == cur:
                added = ids[len(cur) :]
                cur.extend(added)
            elif mode == "new":
                added = ids
                cur.extend(ids)
            else:
                added = ids
                t.allocated_block_ids[g] = ids
            if added:
                self._new_block_records.append(
                    {"req_id": t.request_id, "new_block_ids": added, "new_token_ids": []}
                )

    def _slice_blocks(self, t: RequestTracker, start: int, end: int) -> list[list[int]]:
        return [
            t.allocated_block_ids[g][start // bs : end // bs]
            for g, bs in enumerate(self.group_block_sizes)
        ]

    def _allocated_tokens(self, t: RequestTracker) -> int:
        return min(
            len(t.allocated_block_ids[g]) * bs for g, bs in enumerate(self.group_block_sizes)
        )

    def build_ops(self, scheduler_output: Any) -> tuple[list[LMCacheMPRequestMetadata], bool]:
        """The per-step ops (RETRIEVE first, then STORE) and the preemption flush flag."""
        self._poll_abandoned()
        ops: list[LMCacheMPRequestMetadata] = []

        preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        for rid in preempted:
            self._reset_after_preemption(rid)

        for t in self.trackers.values():
            if t.state is not RequestState.WAITING_FOR_LOAD:
                continue
            start = chunk_floor(t.vllm_hit, self.chunk_size)
            end = t.lmcache_hit
            t.state = RequestState.READY
            if end <= start:
                continue
            op = LoadStoreOp(
                token_ids=t.prompt[:end],
                block_ids=self._slice_blocks(t, start, end),
                start=start,
                end=end,
                skip_first_n_tokens=max(0, t.vllm_hit - start),
            )
            ops.append(LMCacheMPRequestMetadata(t.request_id, "RETRIEVE", op, t.cache_salt))
            # The retrieve consumes the locks of [start, end) on every worker.
            t.locks_held = False
            t.loading_blocks = set(op.all_block_ids())

        num_scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        scheduled: list[str] = []
        for new in getattr(scheduler_output, "scheduled_new_reqs", []) or []:
            t = self.trackers.get(new.req_id)
            if t is None:
                continue
            self._append_blocks(t, new.block_ids, "full")
            t.num_scheduled_tokens += int(num_scheduled.get(new.req_id, 0))
            scheduled.append(new.req_id)
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = set(getattr(cached, "resumed_req_ids", None) or ())
            for i, rid in enumerate(cached.req_ids):
                t = self.trackers.get(rid)
                if t is None:
                    continue
                new_ids = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
                self._append_blocks(t, new_ids, "replace" if rid in resumed else "new")
                t.num_scheduled_tokens += int(num_scheduled.get(rid, 0))
                scheduled.append(rid)

        for rid in scheduled:
            op = self._store_op(self.trackers[rid])
            if op is not None:
                ops.append(op)

        self._report_block_allocation()
        return ops, bool(preempted)

    def _store_op(self, t: RequestTracker) -> LMCacheMPRequestMetadata | None:
        if t.state is not RequestState.READY:
            return None
        tokens = t.tokens()
        # Tokens whose KV exists once this step ran: the prefix vLLM had (its own, or
        # loaded from LMCache unless that load failed) plus everything scheduled since.
        prefix = t.vllm_hit if t.load_failed else max(t.vllm_hit, t.lmcache_hit)
        limit = min(len(tokens), self._allocated_tokens(t), t.num_scheduled_tokens + prefix)
        if not self.config.save_decode_cache:
            limit = min(limit, len(t.prompt))
        start = t.num_stored
        end = chunk_floor(limit, self.chunk_size)
        whole_end = end
        if t.partial and not t.tail_stored and limit >= len(t.prompt):
            # The prompt is computed: its tokens past the last whole chunk, floored to
            # vLLM's block size, go along as its tail (stored once per request).
            tail_end = len(t.prompt) // self.hit_alignment * self.hit_alignment
            if tail_end > max(chunk_floor(len(t.prompt), self.chunk_size), t.lmcache_hit):
                end = tail_end
                t.tail_stored = True
        if end - start < self.chunk_size and end == whole_end:
            return None
        op = LoadStoreOp(
            token_ids=list(tokens[:end]),
            block_ids=self._slice_blocks(t, start, end),
            start=start,
            end=end,
        )
        t.num_stored = whole_end
        t.stored_any = True
        return LMCacheMPRequestMetadata(t.request_id, "STORE", op, t.cache_salt)

    def _reset_after_preemption(self, rid: str) -> None:
        """vLLM freed the blocks and will schedule the request from scratch: look up afresh."""
        old = self.trackers.get(rid)
        if old is None:
            return
        if old.lookup_pending:
            self._abandon(old)  # its result still comes; its locks are freed then
        else:
            self._free_locks(old, old.lmcache_hit)
        fresh = self._new_tracker(old.request)
        fresh.stored_any = old.stored_any
        fresh.contacted = old.contacted

    def _report_block_allocation(self) -> None:
        records, self._new_block_records = self._new_block_records, []
        if records and self.healthy:
            # Counted by the server only; fire and forget.
            self.link.send("report_block_allocation", None, self.model_name, records)

    def update_connector_output(self, output: Any) -> None:
        """Note failed loads: vLLM recomputes those tokens, so they are stored again only
        once computed (and chunks LMCache lost are stored anew)."""
        invalid = set(getattr(output, "invalid_block_ids", None) or ())
        done = set(getattr(output, "finished_recving", None) or ())
        sent = set(getattr(output, "finished_sending", None) or ())
        for rid in sent & self._end_after_sending:
            self._end_after_sending.discard(rid)
            self._end_session(rid)
        for t in self.trackers.values():
            if not t.loading_blocks:
                continue
            if t.loading_blocks & invalid:
                t.load_failed = True
                t.num_stored = min(t.num_stored, chunk_floor(t.vllm_hit, self.chunk_size))
                if self.config.sync_load:
                    # vLLM drops what that step computed and recomputes from the first bad
                    # block (at or past vllm_hit): count computed tokens afresh from there.
                    t.num_scheduled_tokens = 0
            if t.request_id in done:
                t.loading_blocks = set()

    def request_finished(self, request: Any) -> bool:
        rid = request.request_id
        t = self.trackers.pop(rid, None)
        mine = [a for a in self._abandoned if a.request_id == rid]
        self._abandoned = [a for a in self._abandoned if a.request_id != rid]
        if t is not None and all(a is not t for a in mine):
            mine.append(t)
        if not mine:
            return False
        deadline = time.monotonic() + FINISH_WAIT_S
        for x in mine:
            while x.lookup_pending and self.healthy and time.monotonic() < deadline:
                # Let a late lookup/status reply land first, so no handler recreates the session.
                self._advance_lookup(x)
                fut = x.status_future if x.status_future is not None else x.lookup_future
                if not x.hit_known and fut is not None:
                    fut.wait(max(0.0, min(0.05, deadline - time.monotonic())))
            if x.hit_known:
                self._free_locks(x, x.lmcache_hit)
            else:
                # Never answered (server stalled or gone): stop waiting for good, so the
                # client keeps no slot for it; end_session frees what that lookup locked.
                self.link.forget(x.lookup_future)
                self.link.forget(x.status_future)
        stored = t.stored_any if t is not None else False
        if stored:
            # The workers' stores of this request may still be on their way, and a store
            # that reached the server after end_session would open the session again (to
            # linger until its TTL). So it ends once vLLM reports the request in
            # finished_sending: every store of it completed on every worker.
            self._end_after_sending.add(rid)
        elif any(x.contacted for x in mine):
            # Also releases, on the server, any lock share a lookup still holds.
            self._end_session(rid)
        # else: no lookup was sent for it (vLLM's prefix cache held it all, or the server was
        # unreachable): the server has no session of it to end
        return stored

    def _end_session(self, rid: str) -> None:
        """``end_session`` now, or once the server answers again. A server that stalled
        (SIGSTOP, overload) still holds the lookups sent before it stopped answering and
        opens their sessions, with read locks, when it resumes: without the end owed to
        them they would stay until the session TTL. A restarted server knows none of them
        and ignores the end."""
        with self._owed_lock:
            self._owed_ends.append(rid)
        if self.healthy:
            self._send_owed_ends()

    def _send_owed_ends(self) -> None:
        with self._owed_lock:
            owed = list(self._owed_ends)
            self._owed_ends.clear()
        for rid in owed:
            self.link.send("end_session", rid)

    def reset_cache(self) -> bool:
        if not self.healthy:
            return False
        try:
            self.link.submit("clear", False).result(self.config.mq_timeout)
        except Exception as exc:
            logger.warning("clear on %s failed: %s", self.link.url, exc)
            return False
        return True

    def shutdown(self) -> None:
        self.link.close()


def check_chunk_size(chunk_size: int, vllm_block_size: int, group_block_sizes: list[int]) -> None:
    for bs in [vllm_block_size, *group_block_sizes]:
        if bs <= 0 or chunk_size % bs:
            raise ValueError(
                f"the LMCache server's chunk size {chunk_size} is not a multiple of the vLLM "
                f"block size {bs}; start 'lmcache server --chunk-size' with a multiple of {bs}"
            )
