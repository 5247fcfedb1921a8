"""Worker side of the connector: registration, retrieves, stores, completion reporting.

One adapter per vLLM worker process. It registers the worker's paged KV cache
with the server under a random 63-bit ``instance_id`` (drawn from uuid4, never
the PID, so a restarted worker is a new instance), then runs the ops the
scheduler put in the step's metadata through its :class:`TransferRunner`
(``transfer_runner``), which it builds from the server link, the KV caches and a
:class:`TransferRunnerSpec` once vLLM registers the caches:

* RETRIEVE ops in ``start_load``: finished before it returns (synchronous loads,
  the default), or in the background with completion reported in ``finished_recving``
  (``lmcache.mp.sync_load=false``); failures as load-error block ids.
* STORE ops in ``start_store`` (vLLM's ``wait_for_save``), never waiting for the
  server; a request is reported in ``finished_sending`` once vLLM finished it
  and every store of it on this worker completed.

While the server is unreachable (degraded mode) stores are dropped and reported
finished and retrieves fail as load errors, so vLLM recomputes and nothing
blocks. When the server is back the adapter re-registers under the same
``instance_id`` before it reports healthy.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmcache.integration.vllm.kv_events import WorkerKVEvents
from lmcache.integration.vllm.mp_config import MPConnectorConfig
from lmcache.integration.vllm.mp_ops import LMCacheMPRequestMetadata
from lmcache.integration.vllm.parallel_strategy import ParallelStrategy
from lmcache.integration.vllm.scheduler_adapter import check_chunk_size
from lmcache.integration.vllm.server_link import TRANSFER_OPS, ServerLink
from lmcache.integration.vllm.transfer_runner import DoneFuture, TransferRunner, TransferRunnerSpec
from lmcache.integration.vllm.vllm_base import KVConnectorTransferResults
from lmcache.utils import init_logger
from lmcache.v1 import cpu_affinity
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.protocol import IPCCacheServerKey

logger = init_logger(__name__)

# Bound on unregistration at shutdown: the server may be gone already.
UNREGISTER_TIMEOUT_S = 2.0
# At shutdown, stores already submitted get this long to finish (vLLM kills a worker later).
SHUTDOWN_FLUSH_S = 5.0

# ``(request ids, failed here) -> failed on any rank``: run by every TP rank in the same step
# with the same ids (a collective); see LMCacheMPWorkerAdapter.failed_on_any_rank.
FailedLoadAgreement = Callable[[list[str], set[str]], set[str]]


def new_instance_id() -> int:
    """A random 63-bit id (fits msgpack int64 and every server-side table)."""
    return uuid.uuid4().int & ((1 << 63) - 1)


@dataclass
class _Pending:
    future: Any
    block_ids: list[int]
    submitted_at: float


@dataclass
class _RequestIO:
    stores: list[_Pending] = field(default_factory=list)
    retrieves: list[_Pending] = field(default_factory=list)
    retrieve_failed: bool = False
    had_store_op: bool = False


@dataclass
class KVGroup:
    engine_group_id: int
    layer_names: list[str]
    tokens_per_block: int


class LMCacheMPWorkerAdapter:
    def __init__(
        self,
        config: MPConnectorConfig,
        *,
        model_name: str,
        strategy: ParallelStrategy,
        vllm_block_size: int,
        kv_cache_config: Any = None,
        link: ServerLink | None = None,
        instance_id: int | None = None,
        kv_events: bool = False,
    ) -> None:
        # Our threads in this process (the client's, the transfer thread, the SHM mapper)
        # start on the cores vLLM left to the serving framework, not on its compute cores.
        cpu_affinity.enable()
        self.config = config
        self.model_name = model_name
        self.strategy = strategy
        self.vllm_block_size = vllm_block_size
        self.kv_cache_config = kv_cache_config
        self.instance_id = instance_id if instance_id is not None else new_instance_id()
        self.link = link or ServerLink(
            config,
            role=f"worker (rank {strategy.vllm_rank})",
            instance_id=self.instance_id,
            on_recover=self._reregister,
            on_unhealthy=None,
        )
        self.chunk_size = self.link.chunk_size
        self.transfer: TransferRunner | None = None
        # vLLM's paged layout inside a block: "NHD" (default) or "HND"; the connector sets it.
        self.kv_layout = "NHD"
        self.kv_caches: dict[str, Any] = {}
        self.groups: list[KVGroup] = []
        self._io: dict[str, _RequestIO] = {}
        self._finished_pending: set[str] = set()  # finished by vLLM, stores still running
        self._forget: set[str] = set()  # finished and reported: dropped once no load runs
        self._load_errors: set[int] = set()
        # Requests whose synchronous load failed in this step: their stores of the same step
        # (wait_for_save) are dropped; start_store consumes the set.
        self._sync_failed: set[str] = set()
        # Requests loaded synchronously in this step (start_load; start_store consumes it).
        self._sync_loaded: set[str] = set()
        # With tensor parallelism a failed load on one rank corrupts what EVERY rank computes
        # on top of it (the ranks all-reduce each layer): the connector sets this to a
        # collective over vLLM's TP group, so that every rank drops those stores.
        self.failed_on_any_rank: FailedLoadAgreement | None = None
        self._lock = threading.Lock()
        # vLLM's KV events (kv_events_config.enable_kv_cache_events): one worker per server
        # subscribes to the server's event log once its caches are registered
        self.kv_events: WorkerKVEvents | None = None
        self._want_kv_events = kv_events and strategy.is_kv_event_subscriber

    # -- registration ---------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.link.healthy and self.transfer is not None

    def _derive_groups(self, layer_names: list[str]) -> list[KVGroup]:
        groups = getattr(self.kv_cache_config, "kv_cache_groups", None) or []
        if not groups:
            return [KVGroup(0, list(layer_names), self.vllm_block_size)]
        out = []
        for i, g in enumerate(groups):
            names = [n for n in g.layer_names if n in self.kv_caches]
            out.append(KVGroup(i, names, int(g.kv_cache_spec.block_size)))
        return out

    def engine_group_infos(self) -> list[dict[str, Any]]:
        index = {name: i for i, name in enumerate(self.kv_caches)}
        return [
            {
                "engine_group_id": g.engine_group_id,
                "layer_indices": [index[n] for n in g.layer_names],
                "tokens_per_block": g.tokens_per_block,
                "sw_size_tokens": -1,
                "extra_object_group_tag": 0,
                "recurrent_state": False,
            }
            for g in self.groups
        ]

    def layout_hints(self) -> dict[str, Any]:
        first = next(iter(self.kv_caches.values()))
        hints: dict[str, Any] = {
            "kv_layout": self.kv_layout,
            "tokens_per_block": self.groups[0].tokens_per_block,
        }
        shape = tuple(getattr(first, "shape", ()))
        if len(shape) == 4:  # vLLM's fused [NB, NH, BS, 2*HS] (HND) / [NB, BS, NH, 2*HS]
            heads_dim = 1 if self.kv_layout == "HND" else 2
            hints["num_kv_heads"], hints["head_dim"] = int(shape[heads_dim]), int(shape[3]) // 2
        elif len(shape) == 5:
            heads_dim = 2 if self.kv_layout == "HND" else 3
            hints["num_kv_heads"], hints["head_dim"] = int(shape[heads_dim]), int(shape[4])
        elif len(shape) == 3:
            hints["num_kv_heads"], hints["head_dim"] = 1, int(shape[2])
        return hints

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if not kv_caches:
            raise ValueError("register_kv_caches got no KV cache tensors")
        self.kv_caches = dict(kv_caches)
        self.groups = self._derive_groups(list(self.kv_caches))
        check_chunk_size(
            self.chunk_size, self.vllm_block_size, [g.tokens_per_block for g in self.groups]
        )
        self.transfer = TransferRunner(self.link, self.kv_caches, self.transfer_spec())
        self.link.start_heartbeat()
        if self._want_kv_events and self.kv_events is None:
            self.kv_events = self._start_kv_events()

    def _start_kv_events(self) -> WorkerKVEvents | None:
        if P.KV_EVENT_CAPABILITY not in self.link.experimental():
            logger.warning(
                "vLLM asked for KV events, but the LMCache server at %s does not offer them "
                "(it lacks '%s': started with --kv-event-log-size 0?); take_events stays empty",
                self.link.url,
                P.KV_EVENT_CAPABILITY,
            )
            return None
        events = WorkerKVEvents(
            self.link.url, self.instance_id, self.model_name, tails=self.link.partial_chunk
        )
        events.start()
        return events

    def take_kv_events(self) -> list[Any]:
        """vLLM's events for what the server stored and removed since the last call."""
        return [] if self.kv_events is None else self.kv_events.take()

    def transfer_spec(self) -> TransferRunnerSpec:
        """What the transfer runner registers: this worker's ids, KV geometry and settings."""
        return TransferRunnerSpec(
            instance_id=self.instance_id,
            model_name=self.model_name,
            kv_world_size=self.strategy.kv_world_size,
            engine_group_infos=tuple(self.engine_group_infos()),
            layout_hints=self.layout_hints(),
            mode=self.config.mp_transfer_mode,
            mq_timeout=self.config.mq_timeout,
        )

    def _reregister(self) -> None:
        """After a server restart: same instance_id, fresh mappings (run by the heartbeat)."""
        if self.transfer is None:
            return
        self._drain_for_restart()
        # A transfer waiting for a reply the old server never sent (it was killed with the
        # request in hand) holds the transfer thread for its whole RPC timeout (mq_timeout,
        # 300 s by default), and the re-registration below queues behind it: fail those
        # requests now. A resumed server answered its requests before the ping that brought
        # us here; the reservations of one it still answers late expire on the server.
        client = self.link.client
        abandoned = client.abandon_pending(
            client.pending_mark(),
            f"the server at {self.link.url} was unreachable meanwhile",
            TRANSFER_OPS,  # the transfer thread's; a KV-event subscription retries by itself
        )
        if abandoned:
            logger.info("failed %d request(s) left unanswered before the outage", abandoned)
        self.transfer.reregister()
        logger.info("worker instance %d re-registered with %s", self.instance_id, self.link.url)

    def _drain_for_restart(self) -> None:
        """Transfers sent to the old server never complete: fail retrieves, drop stores."""
        with self._lock:
            for io in self._io.values():
                for p in io.retrieves:
                    if not p.future.query():
                        p.future = DoneFuture(False)
                io.stores = [p for p in io.stores if p.future.query()]

    # -- keys -------------------------------------------------------------------------
    def key_for(self, meta: LMCacheMPRequestMetadata) -> IPCCacheServerKey:
        op = meta.op
        return IPCCacheServerKey(
            model_name=self.model_name,
            world_size=self.strategy.kv_world_size,
            worker_id=self.strategy.kv_worker_id,
            token_ids=list(op.token_ids),
            start=op.start,
            end=op.end,
            request_id=meta.request_id,
            cache_salt=meta.cache_salt,
            num_kv_readers=self.strategy.num_kv_readers,
        )

    def _io_for(self, rid: str) -> _RequestIO:
        io = self._io.get(rid)
        if io is None:
            io = self._io[rid] = _RequestIO()
        return io

    # -- retrieves ------------------------------------------------------------------------
    def start_load(self, requests: list[LMCacheMPRequestMetadata]) -> None:
        """Run the step's RETRIEVE ops: before returning when loads are synchronous (vLLM
        computes the rest of those prompts in this very step), else in the background."""
        retrieves = [r for r in requests if r.direction == "RETRIEVE"]
        if not retrieves:
            return
        if self.config.sync_load:
            self._sync_loaded = {r.request_id for r in retrieves}
            self._load_now(retrieves)
            return
        healthy = self.healthy
        with self._lock:
            for meta in retrieves:
                io = self._io_for(meta.request_id)
                now = time.monotonic()
                deadline = now + self.config.retrieve_timeout
                fut = self._submit_retrieve(meta, healthy, inline=False, deadline=deadline)
                io.retrieves.append(_Pending(fut, meta.op.all_block_ids(), now))

    def _submit_retrieve(
        self,
        meta: LMCacheMPRequestMetadata,
        healthy: bool,
        inline: bool,
        deadline: float | None = None,
    ) -> Any:
        """``deadline`` (time.monotonic()): when the caller stops waiting; an inline retrieve
        fails once it is past, and nothing writes into the blocks after it."""
        transfer = self.transfer  # None once shut down
        if not healthy or transfer is None:
            return DoneFuture(False)
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return transfer.submit_retrieve(
                self.key_for(meta),
                meta.op.block_ids,
                meta.op.skip_first_n_tokens,
                inline=inline,
                timeout=timeout,
            )
        except Exception as exc:
            logger.warning("retrieve of %s failed to start: %s", meta.request_id, exc)
            return DoneFuture(False)

    def _load_now(self, retrieves: list[LMCacheMPRequestMetadata]) -> None:
        """Synchronous loads: every retrieve has ended when this returns. A failed one is
        reported through ``get_block_ids_with_load_errors`` (vLLM then recomputes from the
        first bad block), and the request's stores of this step are skipped: what the
        forward computes on top of a failed load must never reach the cache."""
        healthy = self.healthy
        # One deadline for the step's loads, inline ones included: the forward waits on them.
        deadline = time.monotonic() + self.config.retrieve_timeout
        futures = [
            (meta, self._submit_retrieve(meta, healthy, inline=True, deadline=deadline))
            for meta in retrieves
        ]
        failed: set[int] = set()
        for meta, fut in futures:
            if fut.wait(max(0.0, deadline - time.monotonic())) and _outcome(fut):
                continue
            if not fut.query():
                self._warn_retrieve_timeout(meta.request_id)
            self._sync_failed.add(meta.request_id)
            failed.update(meta.op.all_block_ids())
        if failed:
            with self._lock:
                self._load_errors.update(failed)

    def _warn_retrieve_timeout(self, rid: str) -> None:
        logger.warning(
            "retrieve for request %s unfinished after retrieve_timeout=%g s; failing it",
            rid,
            self.config.retrieve_timeout,
        )

    # -- stores -------------------------------------------------------------------------
    def start_store(self, requests: list[LMCacheMPRequestMetadata]) -> None:
        sync_failed, self._sync_failed = self._sync_failed, set()
        sync_loaded, self._sync_loaded = self._sync_loaded, set()
        stores = [r for r in requests if r.direction == "STORE"]
        if not stores:
            return
        # Every rank got the same metadata, so every rank takes this branch in the same step.
        at_risk = sorted({r.request_id for r in stores} & sync_loaded)
        if at_risk and self.failed_on_any_rank is not None:
            sync_failed = self.failed_on_any_rank(at_risk, sync_failed & set(at_risk))
        writer = self.strategy.is_kv_writer
        healthy = self.healthy
        transfer = self.transfer  # None once shut down
        with self._lock:
            for meta in stores:
                io = self._io_for(meta.request_id)
                io.had_store_op = True
                if not writer or not healthy or transfer is None:
                    continue  # MLA non-writer, or degraded: nothing to wait for
                if meta.request_id in sync_failed:
                    continue  # computed on top of a failed load this step: not stored
                try:
                    fut = transfer.submit_store(self.key_for(meta), meta.op.block_ids)
                except Exception as exc:
                    logger.warning("store of %s failed to start: %s", meta.request_id, exc)
                    continue
                io.stores.append(_Pending(fut, meta.op.all_block_ids(), time.monotonic()))

    def flush_stores(self) -> None:
        """Before vLLM reuses blocks of preempted requests: let in-flight stores finish."""
        deadline = time.monotonic() + self.config.mq_timeout
        with self._lock:
            pending = [p for io in self._io.values() for p in io.stores]
        for p in pending:
            if not self.healthy:
                break
            p.future.wait(max(0.0, deadline - time.monotonic()))
        if self.transfer is not None:
            self.transfer.flush()

    # -- completion --------------------------------------------------------------------------
    def _poll(self) -> tuple[set[str], set[str]]:
        """Collect finished transfers; returns (request ids whose retrieves all ended, failed ones)."""
        recving: set[str] = set()
        failed: set[str] = set()
        healthy = self.healthy
        now = time.monotonic()
        for rid, io in self._io.items():
            if io.stores:
                still = []
                for p in io.stores:
                    if p.future.query():
                        ok = _outcome(p.future)
                        if not ok:
                            logger.warning("store for request %s was not saved by the server", rid)
                    elif healthy:
                        still.append(p)
                    # unhealthy: dropped, reported as done
                io.stores = still
            if io.retrieves:
                done = True
                for p in io.retrieves:
                    if p.future.query():
                        if not _outcome(p.future):
                            io.retrieve_failed = True
                            self._load_errors.update(p.block_ids)
                    elif (
                        not healthy or now - p.submitted_at > self.config.retrieve_timeout
                    ) and p.future.abandon():
                        # abandon(): nothing writes into these blocks any more, so vLLM may
                        # recompute into them or give them to another request
                        if healthy:
                            self._warn_retrieve_timeout(rid)
                        p.future = DoneFuture(False)
                        io.retrieve_failed = True
                        self._load_errors.update(p.block_ids)
                    else:
                        done = False  # still running, or its copy is (local, short)
                if done:
                    io.retrieves = []
                    recving.add(rid)
                    if io.retrieve_failed:
                        failed.add(rid)
                    io.retrieve_failed = False
        return recving, failed

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_sending, finished_recving)`` as vLLM expects them.

        A finished request is reported as sending once all its stores on this worker are
        done; a request whose stores this worker skipped (an MLA non-writer, degraded mode)
        as soon as it finishes. Requests that never had a STORE op are not reported: the
        scheduler answered False in ``request_finished`` and vLLM freed them already.
        """
        sending, recving, _ = self._collect(finished_req_ids)
        return (sending or None), (recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's ``KVConnectorTransferResults``: like ``get_finished`` plus the failed loads
        (also in ``finished_recving``, so the scheduler releases them)."""
        sending, recving, failed = self._collect(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving, failed_recving=failed
        )

    def _collect(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        with self._lock:
            recving, failed = self._poll()
            for rid in finished_req_ids or ():
                io = self._io.get(rid)
                if io is None:
                    continue
                if io.had_store_op:
                    self._finished_pending.add(rid)
                else:
                    # No STORE op was emitted, so request_finished told vLLM to free the
                    # blocks at once: nothing to report, forget it once no load runs.
                    self._forget.add(rid)
            sending = {rid for rid in self._finished_pending if not self._io[rid].stores}
            for rid in sending:
                self._finished_pending.discard(rid)
                self._forget.add(rid)
            for rid in list(self._forget):
                io = self._io.get(rid)
                if io is None or not io.retrieves:
                    self._io.pop(rid, None)
                    self._forget.discard(rid)
        return sending, recving, failed

    def take_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events.stop()
        self.link.stop_heartbeat()  # no re-registration after this point
        transfer, self.transfer = self.transfer, None
        if transfer is not None:
            try:
                transfer.close(
                    timeout=min(UNREGISTER_TIMEOUT_S, self.config.mq_timeout),
                    # vLLM's offline API shuts down right after its last output: let the
                    # stores of that last step land instead of dropping them
                    flush_timeout=min(SHUTDOWN_FLUSH_S, self.config.mq_timeout),
                )
            except Exception as exc:
                logger.warning("unregistering instance %d failed: %s", self.instance_id, exc)
        self.link.close()


def _outcome(future: Any) -> bool:
    try:
        res = future.result(0)
    except Exception as exc:
        logger.warning("transfer failed: %s", exc)
        return False
    if isinstance(res, (list, tuple)):  # lmcache_driven replies [event_handle, ok]
        res = res[-1] if res else False
    return bool(res)
