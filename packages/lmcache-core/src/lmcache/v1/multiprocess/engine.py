"""Op handlers of the MP server: registrations, sessions, lookups, transfers, liveness.

``CacheEngine`` holds every piece of server state; ``server.MPCacheServer`` owns the
sockets and calls ``engine.handlers[op_name](ctx, *params)`` on the thread the op's
kind selects. Handlers raise ``RequestError`` for requests 0.5.6 would leave unanswered
(the transport turns it into silence or a negotiated error reply) and return False-ish
values where 0.5.6 already replies with one (spec/protocol.md 10).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache.utils import RateLimitedLog, init_logger
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.multiprocess import payload_codec as codec
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.config import MPServerConfig
from lmcache.v1.multiprocess.metrics import ServerMetrics
from lmcache.v1.multiprocess.protocol import ErrorCode, RequestError
from lmcache.v1.multiprocess.sessions import LookupJob, Session, SessionTable
from lmcache.v1.multiprocess.storage_bridge import StorageBridge
from lmcache.v1.multiprocess.token_hasher import (
    PrefixHashMemo,
    compute_kv_rank,
    tokens_to_be_bytes,
)

logger = init_logger(__name__)
# Conditions a busy server may hit many times a second (a full L1, a full session table).
_limited = RateLimitedLog(logger, interval=10.0)

ENGINE_DRIVEN = "engine_driven"
LMCACHE_DRIVEN = "lmcache_driven"
MODE_FIX = "start lmcache server with --supported-transfer-mode auto"
# Metric labels: the one L1 this server has (0.5.6's default tag), and the device of the
# engine-driven path, whose copies go through this host's memory.
L1_TAG = "_default"
HOST_DEVICE = "cpu"


# Engine-driven transfer ops that, on the SHM path, only touch server bookkeeping.
_BOOKKEEPING_OPS = frozenset(
    {"prepare_store", "commit_store", "prepare_retrieve", "commit_retrieve"}
)


class RequestContext:
    """What a handler knows about its request, and how it replies later when parked."""

    def __init__(self, peer: bytes, features: frozenset[str], reply: Callable[[Any], None]):
        self.peer = peer
        self.features = features
        self._reply = reply
        self._lock = threading.Lock()
        self._done = False
        self.deferred = False

    def defer(self) -> None:
        self.deferred = True

    def reply(self, value: Any) -> bool:
        """Send the (deferred) reply once; later calls are ignored."""
        return self.reply_with(lambda: value)

    def reply_with(self, make_value: Callable[[], Any]) -> bool:
        """``reply(make_value())``, where ``make_value`` runs only while no reply went out
        yet: a waiter that already timed out must not consume a result it cannot send."""
        with self._lock:
            if self._done:
                return False
            self._done = True
        self._reply(make_value())
        return True


class _Parker:
    """Timeouts of parked waits without holding a pool thread per wait."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="mp-parked-waits", daemon=True)
        self._thread.start()

    def at(self, deadline: float, fn: Callable[[], None]) -> None:
        with self._cv:
            heapq.heappush(self._heap, (deadline, next(self._seq), fn))
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (not self._heap or self._heap[0][0] > time.monotonic()):
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cv.wait(wait)
                if self._stop:
                    return
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:
                logger.exception("parked wait timeout callback failed")

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()


@dataclass
class Layout:
    """The host chunk layout registered for (model_name, world_size)."""

    model_name: str
    world_size: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    desc: Any
    refcount: int = 0

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass
class Reservation:
    keys: list[Any]  # one key per chunk of the range (own rank)
    objs: dict[Any, Any]  # reserved by this request
    positions: list[int]  # chunk positions (relative to start) of the reserved objs
    failed: int
    created: float = field(default_factory=time.monotonic)


@dataclass
class PendingRead:
    """An SHM read between prepare_retrieve and commit_retrieve. A worker that copies counts
    as an in-flight retrieve of its session, so an end_session meanwhile leaves the slots
    locked. A failed prepare (``copying`` False) still owes its worker's lookup shares."""

    key: P.IPCCacheServerKey
    keys: list[Any]  # read-locked by the request's lookup
    prepared: float
    session: Session
    copying: bool = True


@dataclass
class Instance:
    instance_id: int
    mode: str
    model_name: str
    world_size: int
    layout_key: tuple[str, int]
    strategy: str = "copy"  # engine_driven: "shm" or "copy"
    last_seen: float = field(default_factory=time.monotonic)
    pinged: bool = False
    reservations: dict[tuple, Reservation] = field(default_factory=dict)
    # SHM reads between prepare_retrieve and commit_retrieve
    pending_reads: dict[tuple, PendingRead] = field(default_factory=dict)
    kv_caches: list[torch.Tensor] = field(default_factory=list)
    layout_hints: dict[str, Any] = field(default_factory=dict)
    wrappers: list[Any] = field(default_factory=list)
    cache_context: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _dtype_from_name(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT,
            f"dtype_str {name!r} is not a torch dtype name; send e.g. 'bfloat16' or 'float16'",
        )
    return dt


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


class CacheEngine:
    def __init__(
        self,
        config: MPServerConfig,
        storage: StorageBridge,
        metrics: ServerMetrics,
        *,
        shm_name: str = "",
        shm_pool_size: int = 0,
        shm_disabled_reason: str = "",
    ) -> None:
        self.config = config
        self.cs = config.chunk_size
        self.storage = storage
        self.metrics = metrics
        self.shm_name = shm_name
        self.shm_pool_size = shm_pool_size
        self.shm_disabled_reason = shm_disabled_reason
        self.sessions = SessionTable(
            config.session_ttl_seconds, config.max_sessions, self._evict_sessions
        )
        self.hash_memo = PrefixHashMemo(self.cs)
        self.layouts: dict[tuple[str, int], Layout] = {}
        self.instances: dict[int, Instance] = {}
        self._lock = threading.RLock()
        # Reads of dropped workers whose lease is still running: (lease end, read)
        self._leased_reads: list[tuple[float, PendingRead]] = []
        self._warned_early_exit: set[tuple[str, int]] = set()
        self._lookup_waiters = ThreadPoolExecutor(8, thread_name_prefix="mp-lookup-wait")
        # The copies between L1 and the CPU KV caches of lmcache_driven workers all run on
        # this one thread (see _copy_host_kv).
        self._host_copier = ThreadPoolExecutor(1, thread_name_prefix="mp-host-copy")
        self._parker = _Parker()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.features = list(P.SUPPORTED_FEATURES)
        self.block_allocation_reports = 0
        self.handlers: dict[str, Callable[..., Any]] = {
            "register_kv_cache": self.register_kv_cache,
            "unregister_kv_cache": self.unregister_instance,
            "register_kv_cache_engine_driven_context": self.register_engine_driven,
            "unregister_kv_cache_engine_driven_context": self.unregister_instance,
            "store": self.store,
            "retrieve": self.retrieve,
            "lookup": self.lookup,
            "query_prefetch_status": self.query_prefetch_status,
            "wait_prefetch_status": self.wait_prefetch_status,
            "free_lookup_locks": self.free_lookup_locks,
            "end_session": self.end_session,
            "prepare_store": self.prepare_store,
            "commit_store": self.commit_store,
            "prepare_retrieve": self.prepare_retrieve,
            "commit_retrieve": self.commit_retrieve,
            "clear": self.clear,
            "get_chunk_size": lambda ctx: self.cs,
            "ping": self.ping,
            "report_block_allocation": self.report_block_allocation,
            "noop": lambda ctx: "OK",
            "get_experimental": lambda ctx: list(self.features),
        }

    def runs_inline(self, op: str, args: list[Any]) -> bool:
        """Whether a transfer op is only bookkeeping and may run on the loop thread: the
        prepare/commit ops of a worker on the SHM path (the worker copies; the server only
        reserves, publishes or unlocks). The copy path moves payloads and stays on the pool."""
        if op not in _BOOKKEEPING_OPS or len(args) < 2:
            return False
        try:
            inst = self.instances.get(args[1])
        except TypeError:
            return False
        if inst is None or inst.mode != ENGINE_DRIVEN or inst.strategy != "shm":
            return False
        return op != "commit_store" or len(args) < 3 or not args[2]

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        for name, fn in (("mp-session-cleaner", self._clean_loop), ("mp-reaper", self._reap_loop)):
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self._parker.stop()
        for t in self._threads:
            t.join(timeout=5)
        self._lookup_waiters.shutdown(wait=False, cancel_futures=True)
        self._host_copier.shutdown(wait=False, cancel_futures=True)
        for inst_id in list(self.instances):
            self._drop_instance(inst_id, reason="shutdown")

    # ------------------------------------------------------------------ helpers
    def _copy_host_kv(self, inst: Instance, copy: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``copy(inst.kv_caches, *args, **kw)`` (a gather or scatter of the worker's KV): on
        the host-copy thread when the KV caches are CPU tensors, else (device copies on the
        slot's stream) in the calling thread.

        torch splits each of a request's many small CPU copies over OpenMP threads, and
        libgomp keeps a thread team per thread that ever ran a parallel region. Once a
        process has more OpenMP threads than cores, libgomp's workers stop spinning between
        regions (100 spins instead of 300000, GOMP_SPINCOUNT), so every copy waits for a
        worker to be woken. With each affinity slot copying for itself, a 64 MiB
        lmcache_driven store took 12-13 ms until a second slot had copied, 22-26 ms after
        (2 cores, server-side gather 5.9 then ~3 GB/s); one copying thread keeps one team.
        """
        if not inst.kv_caches or inst.kv_caches[0].device.type != "cpu":
            return copy(inst.kv_caches, *args, **kw)
        return self._host_copier.submit(copy, inst.kv_caches, *args, **kw).result()

    def _keys(
        self, hashes: list[bytes], first: int, last: int, key: P.IPCCacheServerKey, ranks
    ) -> list[list[Any]]:
        return fan_out_keys(key, hashes, first, last, ranks)

    def _validate(self, key: P.IPCCacheServerKey, *, aligned: bool) -> None:
        P.validate_key(key, chunk_aligned=aligned, chunk_size=self.cs)

    def _hashes(self, session: Session, key: P.IPCCacheServerKey, end: int) -> list[bytes]:
        try:
            with session.lock:
                return session.hashes_for(P.token_prefix(key, end), self.cs, self.hash_memo)
        except ValueError as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc

    def _instance(self, instance_id: int, mode: str) -> Instance:
        inst = self.instances.get(instance_id)
        if inst is None or inst.mode != mode:
            raise RequestError(
                ErrorCode.NOT_REGISTERED,
                f"instance {instance_id} is not registered for {mode} transfers; re-register it",
            )
        inst.last_seen = time.monotonic()
        return inst

    def _require_mode(self, mode: str) -> None:
        enabled = (
            self.config.engine_driven_enabled
            if mode == ENGINE_DRIVEN
            else self.config.lmcache_driven_enabled
        )
        if not enabled:
            logger.error(
                "a worker asked for %s transfers but this server was started with "
                "--supported-transfer-mode %s; %s",
                mode,
                self.config.supported_transfer_mode,
                MODE_FIX,
            )
            raise RequestError(
                ErrorCode.MODE_NOT_ENABLED,
                f"{mode} transfers are not enabled on this server; {MODE_FIX}",
            )

    def _check_chunk_fits(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """A layout whose one chunk does not fit in L1 could never be stored: refuse it."""
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        total = self.storage.memory_usage()[1]
        if nbytes > total:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                f"one chunk of this KV layout takes {nbytes} bytes (shape {list(shape)}, "
                f"{_dtype_name(dtype)}), more than the whole L1 ({total} bytes): check the "
                f"registered layout, or start the server with --l1-size-gb of at least "
                f"{-(-nbytes // (1 << 30))} (or a smaller --chunk-size)",
            )

    def _layout_acquire(
        self, key: tuple[str, int], shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        from lmcache.v1.distributed.api import MemoryLayoutDesc

        with self._lock:
            lay = self.layouts.get(key)
            if lay is None or lay.shape != shape or lay.dtype != dtype:
                if lay is not None and lay.refcount > 0:
                    logger.warning(
                        "layout of model %r world_size %d changes from %s %s to %s %s",
                        key[0],
                        key[1],
                        lay.shape,
                        lay.dtype,
                        shape,
                        dtype,
                    )
                desc = MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[dtype])
                refs = lay.refcount if lay is not None else 0
                lay = Layout(key[0], key[1], shape, dtype, desc, refs)
                self.layouts[key] = lay
            lay.refcount += 1

    def _layout_release(self, key: tuple[str, int]) -> None:
        with self._lock:
            lay = self.layouts.get(key)
            if lay is not None and lay.refcount > 0:
                lay.refcount -= 1  # dormant at 0: lookups keep working across restarts

    # ------------------------------------------------------------------ registration
    def register_engine_driven(
        self, ctx: RequestContext, payload: P.RegisterEngineDrivenContextPayload
    ):
        self._require_mode(ENGINE_DRIVEN)
        dtype = _dtype_from_name(payload.dtype_str)
        slots = payload.num_physical_slots or self.cs
        if payload.use_mla:
            shape = (payload.num_layers, slots, payload.hidden_dim_size)
        else:
            shape = (2, payload.num_layers, slots, payload.hidden_dim_size)
        if min(shape) <= 0 or not 1 <= payload.world_size <= 255:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, f"bad engine-driven layout {shape}")
        self._check_chunk_fits(shape, dtype)
        lkey = (payload.model_name, payload.world_size)
        strategy = "shm" if self.shm_name else "copy"
        self._replace_instance(
            Instance(
                payload.instance_id,
                ENGINE_DRIVEN,
                payload.model_name,
                payload.world_size,
                lkey,
                strategy=strategy,
                meta={
                    "block_size": payload.block_size,
                    "use_mla": payload.use_mla,
                    "shape": list(shape),
                    "dtype": _dtype_name(dtype),
                },
            ),
            shape,
            dtype,
        )
        if self.shm_disabled_reason and self.config.shm_name:
            logger.warning(
                "engine-driven worker %d uses the copy path: SHM is disabled (%s)",
                payload.instance_id,
                self.shm_disabled_reason,
            )
        logger.info(
            "Registered engine-driven instance %d (model=%s, world_size=%d, chunk=%s %s, path=%s)",
            payload.instance_id,
            payload.model_name,
            payload.world_size,
            shape,
            _dtype_name(dtype),
            strategy,
        )
        return {"shm_name": self.shm_name, "pool_size": self.shm_pool_size}

    def register_kv_cache(
        self,
        ctx: RequestContext,
        instance_id: int,
        kv_cache: Any,
        model_name: str,
        world_size: int,
        engine_type: str = "vllm",
        layout_hints: dict | None = None,
        engine_group_infos: list | None = None,
    ):
        self._require_mode(LMCACHE_DRIVEN)
        from lmcache.v1.multiprocess.transfer_context.base import kv_geometry

        wrappers = list(kv_cache or [])
        if not wrappers:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT, "register_kv_cache got no KV cache wrappers"
            )
        tensors = []
        try:
            for w in wrappers:
                if not hasattr(w, "to_tensor"):
                    raise RequestError(
                        ErrorCode.BAD_REQUEST,
                        f"kv_cache entry is {type(w).__name__}, not a DeviceIPCWrapper (ext type 1)",
                    )
                tensors.append(w.to_tensor())
            geo = kv_geometry(tensors, layout_hints or {})
            if len({(tuple(t.shape), t.dtype) for t in tensors}) != 1:
                raise RequestError(
                    ErrorCode.INVALID_ARGUMENT,
                    "layers of different shapes need several kernel groups, which this server does not support yet",
                )
        except RequestError:
            _close_all(wrappers)
            raise
        except Exception as exc:
            _close_all(wrappers)
            logger.error("register_kv_cache for instance %d failed: %s", instance_id, exc)
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT, f"cannot open the KV cache: {exc}"
            ) from exc
        cache_context = _open_cache_context(
            instance_id, wrappers, tensors, self.cs, layout_hints, engine_group_infos
        )
        if self.cs % geo.block_size:
            _close_cache_context(cache_context)
            _close_all(wrappers)
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                f"chunk_size {self.cs} is not a multiple of the block size {geo.block_size}",
            )
        shape = geo.chunk_shape(self.cs)
        try:
            self._check_chunk_fits(shape, geo.dtype)
        except RequestError:
            _close_cache_context(cache_context)
            _close_all(wrappers)
            raise
        lkey = (model_name, world_size)
        self._replace_instance(
            Instance(
                instance_id,
                LMCACHE_DRIVEN,
                model_name,
                world_size,
                lkey,
                kv_caches=tensors,
                layout_hints=dict(layout_hints or {}),
                wrappers=wrappers,
                cache_context=cache_context,
                meta={
                    "kv_layout": str((layout_hints or {}).get("kv_layout") or "NHD"),
                    "engine_type": engine_type,
                    "num_layers": geo.num_layers,
                    "block_size": geo.block_size,
                    "shape": list(shape),
                    "dtype": _dtype_name(geo.dtype),
                },
            ),
            shape,
            geo.dtype,
        )
        logger.info(
            "Registered lmcache-driven instance %d (model=%s, world_size=%d, layers=%d, format=%s)",
            instance_id,
            model_name,
            world_size,
            geo.num_layers,
            geo.fmt.name,
        )
        return None

    def _replace_instance(self, inst: Instance, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        with self._lock:
            old = self.instances.get(inst.instance_id)
        if old is not None:
            same = (
                old.mode == inst.mode
                and old.layout_key == inst.layout_key
                and old.meta.get("shape") == inst.meta.get("shape")
                and old.meta.get("dtype") == inst.meta.get("dtype")
                and not inst.wrappers
            )
            if same:  # idempotent: refresh liveness only
                old.last_seen = time.monotonic()
                return
            self._drop_instance(inst.instance_id, reason="re-registered")
        self._layout_acquire(inst.layout_key, shape, dtype)
        with self._lock:
            self.instances[inst.instance_id] = inst

    def unregister_instance(self, ctx: RequestContext | None, instance_id: int):
        self._drop_instance(instance_id, reason="unregistered")
        return None

    def _drop_instance(self, instance_id: int, reason: str) -> Instance | None:
        with self._lock:
            inst = self.instances.pop(instance_id, None)
        if inst is None:
            return None
        with inst.lock:
            reservations, inst.reservations = inst.reservations, {}
            reads, inst.pending_reads = inst.pending_reads, {}
        for res in reservations.values():
            self.storage.abort_write(list(res.objs))  # never admit half-written data (9.2)
        self._release_after_lease(list(reads.values()))
        if inst.cache_context is not None:
            try:
                inst.cache_context.close()
            except Exception:
                pass
        inst.kv_caches = []
        _close_all(inst.wrappers)
        self._layout_release(inst.layout_key)
        logger.info("Instance %d (%s) removed: %s", instance_id, inst.mode, reason)
        return inst

    def _release_after_lease(self, reads: list[PendingRead]) -> None:
        """Release a dropped worker's share of its pending SHM reads once their lease ends
        (a failed read's at once: nothing copies from it): a worker whose copy finished
        within the lease did not wait for commit_retrieve, so its slots must not be reused
        before then. Through the session's share count, as commit_retrieve does, so a share
        that end_session already released is not released again."""
        lease = self.config.retrieve_lease_seconds
        now = time.monotonic()
        for read in reads:
            if read.copying and lease > 0 and now < read.prepared + lease:
                with self._lock:
                    self._leased_reads.append((read.prepared + lease, read))
            else:
                self._finish_read(read)

    def _release_expired_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [read for end, read in self._leased_reads if end <= now]
            self._leased_reads = [r for r in self._leased_reads if r[0] > now]
        for read in due:
            self._finish_read(read)

    def _finish_read(self, read: PendingRead) -> None:
        self._release_worker_shares(read.session, read.key, read.keys)
        if read.copying:
            self._retrieve_done(read.session)

    def ping(self, ctx: RequestContext, instance_id: int | None = None):
        if instance_id is not None:
            inst = self.instances.get(instance_id)
            if inst is not None:
                inst.last_seen = time.monotonic()
                inst.pinged = True
        return True

    # ------------------------------------------------------------------ lookup
    def lookup(
        self,
        ctx: RequestContext,
        key: P.IPCCacheServerKey,
        tp_size: Any = None,
        wait_timeout: float | None = None,
    ):
        """Starts the prefetch job; 0.5.6 replies nil. With ``wait_timeout``
        (``FEATURE_LOOKUP_WAIT``) the reply is wait_prefetch_status's answer instead."""
        self._start_lookup(key)
        if wait_timeout is None:
            return None
        return self.wait_prefetch_status(ctx, key.request_id, wait_timeout)

    def _start_lookup(self, key: P.IPCCacheServerKey) -> None:
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
        who = {"cache_salt": key.cache_salt, "model_name": key.model_name}
        self.metrics.inc("lmcache_mp_lookups_requests", **who)
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
                "lmcache_mp_lookup_early_exit_requests", reason="no_gpu_context", **who
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
        if last <= first:
            job.complete(0)
            return
        job.rows = self._keys(hashes, first, last, key, range(key.world_size))
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
            self._lookup_waiters.submit(self._wait_job, session, job)

    def _wait_job(self, session: Session, job: LookupJob) -> None:
        while not self._stop.is_set():
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
        model, _world_size, salt = session.key_info
        self.metrics.inc_many(
            {
                "lmcache_mp_lookup_hit_tokens": hit * self.cs,
                "lmcache_mp_lookup_hit_l1_keys": out.l1_keys,
                "lmcache_mp_lookup_hit_l2_keys": out.l2_keys,
                "lmcache_mp_lookup_hit_l1_tokens": out.l1_keys * self.cs // ranks,
                "lmcache_mp_lookup_hit_l2_tokens": out.l2_keys * self.cs // ranks,
            },
            cache_salt=salt,
            model_name=model,
        )
        readers, first_chunk = job.num_kv_readers, job.first_chunk
        with session.lock:
            shares, share_keys = session.shares, session.share_keys
            for r, row in enumerate(job.rows):
                for j in range(hit):
                    ck = (first_chunk + j, r)
                    shares[ck] = shares.get(ck, 0) + readers
                    share_keys[ck] = row[j]
            frees, job.deferred_frees = job.deferred_frees, []
        job.complete(hit)
        for first, last in frees:
            self._free_range(session, first, last)
        if job.superseded or session.ended:
            self._release_job_locks(job, session)

    def _release_job_locks(self, job: LookupJob, session: Session | None = None) -> None:
        """Release the shares a finished, superseded or orphaned job still holds."""
        if session is None or not job.rows or job.hit_chunks is None:
            return
        self._free_range(session, job.first_chunk, job.first_chunk + job.hit_chunks)

    def _consume(self, session: Session | None) -> int | None:
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
            return int(job.hit_chunks or 0)

    def query_prefetch_status(self, ctx: RequestContext, request_id: str):
        return self._consume(self.sessions.get(request_id))

    def wait_prefetch_status(self, ctx: RequestContext, request_id: str, timeout: float):
        session = self.sessions.get(request_id)
        if session is None or session.job is None:
            return 0
        job = session.job
        if job.is_done:
            return self._consume(session)
        ctx.defer()

        def on_done(_job: LookupJob) -> None:
            if session.job is job:
                ctx.reply_with(lambda: self._consume(session))
            else:
                ctx.reply(0)

        def on_timeout() -> None:
            if ctx.reply(None):
                self.metrics.inc("lmcache_mp_timeouts", exception_type="LMCacheTimeoutError")

        self._parker.at(time.monotonic() + max(0.0, float(timeout)), on_timeout)
        job.on_done(on_done)
        return None

    def free_lookup_locks(self, ctx: RequestContext, key: P.IPCCacheServerKey, tp_size: Any = None):
        if key.num_kv_readers < 1:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                f"num_kv_readers must be >= 1 (got {key.num_kv_readers}); the client must set it on free keys",
            )
        self._validate(key, aligned=True)
        if key.start == key.end:
            self.sessions.get(key.request_id)  # a no-op, but it still names the session (TTL)
            return None
        session = self.sessions.touch(key.request_id)
        first, last = key.start // self.cs, key.end // self.cs
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

    def _release_worker_shares(
        self, session: Session, key: P.IPCCacheServerKey, keys: list[Any]
    ) -> None:
        """One share per key of this worker's rank, each at most once per lookup share, taken
        from the session the read began in (a later session of the same request id has
        shares of its own)."""
        first = key.start // self.cs
        rank = key.worker_id or 0
        owed = [k for j, k in enumerate(keys) if self._take_share(session, first + j, rank)]
        self.storage.release_read(owed, 1)

    def end_session(self, ctx: RequestContext, request_id: str):
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
        self._close_session(session)
        return None

    def _close_session(self, session: Session) -> None:
        """End a session (end_session, or its TTL ran out): a lookup still running is
        superseded, and its shares are freed now, or by the last retrieve still copying
        from them (``_retrieve_done``)."""
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
            self._close_session(session)

    def _retrieve_done(self, session: Session) -> None:
        with session.lock:
            session.inflight_retrieves -= 1
            release = session.ended and session.inflight_retrieves == 0
        if release:
            self._free_range(session, 0, 1 << 62)

    def _retrieve_begin(self, session: Session) -> Session:
        with session.lock:
            session.inflight_retrieves += 1
        return session

    # ------------------------------------------------------------------ writes
    def _own_keys(self, key: P.IPCCacheServerKey) -> tuple[Session, list[Any]]:
        self._validate(key, aligned=True)
        if key.worker_id is None:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                "store/retrieve keys need a worker_id (the worker's KV rank)",
            )
        session = self.sessions.touch(key.request_id)
        hashes = self._hashes(session, key, key.end)
        session.key_info = (key.model_name, key.world_size, key.cache_salt)
        first, last = key.start // self.cs, key.end // self.cs
        return session, self._keys(hashes, first, last, key, [key.worker_id])[0]

    def _reserve(
        self, inst: Instance, keys: list[Any], positions_filter: list[bool] | None = None
    ) -> Reservation:
        lay = self.layouts[inst.layout_key]
        want = [k for i, k in enumerate(keys) if positions_filter is None or positions_filter[i]]
        out = self.storage.reserve_write(want, lay.desc)
        if out.failed:
            self.metrics.inc(
                "lmcache_mp_l1_allocation_failure_chunks",
                len(out.failed),
                during="l1_store",
                model_name=inst.model_name,
            )
            used, total = self.storage.memory_usage()
            _limited.warning(
                "l1_full",
                "L1 is full: %d chunk(s) of a store were not cached (L1 %d of %d bytes used); "
                "raise --l1-size-gb or add an L2 tier",
                len(out.failed),
                used,
                total,
            )
        positions = [i for i, k in enumerate(keys) if k in out.objs]
        return Reservation(keys, out.objs, positions, len(out.failed))

    def _admit(self, res: Reservation) -> bool:
        bad = self.storage.finish_write(list(res.objs))
        if res.objs:
            self.metrics.inc(
                "lmcache_mp_l1_write_chunks",
                len(res.objs) - len(bad),
                l1_tag=L1_TAG,
                cache_salt=_salt(res.keys),
            )
        return not bad and res.failed == 0

    def prepare_store(self, ctx: RequestContext, key: P.IPCCacheServerKey, instance_id: int):
        inst = self._instance(instance_id, ENGINE_DRIVEN)
        _session, keys = self._own_keys(key)
        self.metrics.inc("lmcache_mp_num_submitted_stores", device=HOST_DEVICE)
        res = self._reserve(inst, keys)
        rkey = (key.request_id, key.start, key.end)
        with inst.lock:
            stale = inst.reservations.pop(rkey, None)
            inst.reservations[rkey] = res
        if stale is not None:
            self.storage.abort_write(list(stale.objs))
        lay = self.layouts[inst.layout_key]
        if inst.strategy == "shm":
            slots = [
                {
                    "offset": int(obj.metadata.address),
                    "length": lay.nbytes,
                    "shape": list(lay.shape),
                    "dtype": _dtype_name(lay.dtype),
                }
                for obj in res.objs.values()
            ]
            return {"context": {"slots": slots, "chunk_indices": res.positions}}
        if codec_feature(ctx):
            return {"context": {"encoding": "raw_v1", "chunk_indices": res.positions}}
        return {"context": {}}

    def commit_store(
        self, ctx: RequestContext, key: P.IPCCacheServerKey, instance_id: int, data: bytes = b""
    ):
        inst = self._instance(instance_id, ENGINE_DRIVEN)
        with inst.lock:
            res = inst.reservations.pop((key.request_id, key.start, key.end), None)
        if res is None:
            return False
        ok = self._commit(inst, key, res, data)
        self.metrics.inc("lmcache_mp_num_finished_stores", device=HOST_DEVICE)
        return ok

    def _commit(
        self, inst: Instance, key: P.IPCCacheServerKey, res: Reservation, data: bytes
    ) -> bool:
        lay = self.layouts[inst.layout_key]
        try:
            enc = codec.detect_encoding(data)
        except codec.PayloadError as exc:
            return self._reject(res, exc)
        if enc == codec.ENCODING_EMPTY:
            if inst.strategy != "shm":
                return self._reject(
                    res,
                    codec.PayloadError("empty_copy", "empty commit_store payload on the copy path"),
                )
            return self._admit(res)
        if inst.strategy == "shm":
            logger.warning(
                "worker %d could not use SHM '%s'; switching it to the copy path",
                inst.instance_id,
                self.shm_name,
            )
            inst.strategy = "copy"
        n = len(res.keys)
        try:
            if enc == codec.ENCODING_PICKLE:
                tensors = codec.restricted_unpickle_tensors(
                    data,
                    expected_count=n,
                    expected_shape=lay.shape,
                    expected_dtype=lay.dtype,
                    max_bytes=n * (lay.nbytes + codec.PICKLE_SLACK_PER_CHUNK),
                )
                chunks = [codec.tensor_bytes(t) for t in tensors]
            else:
                chunks = codec.decode_raw_v1(data, n)
            for i, k in enumerate(res.keys):
                obj = res.objs.get(k)
                if obj is None:
                    continue
                src = chunks[i]
                if len(src) != lay.nbytes:
                    raise codec.PayloadError(
                        "raw_v1_length", f"chunk {i} has {len(src)} bytes, expected {lay.nbytes}"
                    )
                _obj_bytes(obj, lay.nbytes)[:] = src
        except codec.PayloadError as exc:
            return self._reject(res, exc)
        return self._admit(res)

    def _reject(self, res: Reservation, exc: codec.PayloadError) -> bool:
        logger.error("commit_store payload rejected: %s", exc)
        self.metrics.inc("lmcache_mp_rejected_payloads", reason=exc.reason)
        self.storage.abort_write(list(res.objs))
        return False

    def store(
        self,
        ctx: RequestContext,
        key: P.IPCCacheServerKey,
        instance_id: int,
        block_ids: list[list[int]],
        event_ipc_handle: bytes = b"",
    ):
        self._require_mode(LMCACHE_DRIVEN)
        inst = self.instances.get(instance_id)
        if inst is None or inst.mode != LMCACHE_DRIVEN:
            self.metrics.inc("lmcache_mp_num_submitted_stores", device="unknown")
            return (b"", False)
        self.metrics.inc("lmcache_mp_num_submitted_stores", device=_device(inst))
        inst.last_seen = time.monotonic()
        _session, keys = self._own_keys(key)
        from lmcache.v1.multiprocess.transfer_context.base import gather_paged_kv_to_cpu

        bpc = self.cs // inst.meta["block_size"]
        ids = list(block_ids[0]) if block_ids else []
        if len(ids) < len(keys) * bpc:
            return (b"", False)  # fail closed: never copy out of bounds
        null = self.config.null_block_id
        wanted = [any(b != null for b in ids[i * bpc : (i + 1) * bpc]) for i in range(len(keys))]
        res = self._reserve(inst, keys, wanted)
        try:
            if res.objs:
                lay = self.layouts[inst.layout_key]
                outs = [_obj_tensor(res.objs[keys[i]], lay) for i in res.positions]
                t0 = time.perf_counter()
                self._copy_host_kv(
                    inst,
                    gather_paged_kv_to_cpu,
                    ids[: len(keys) * bpc],
                    bpc,
                    layout_hints=inst.layout_hints,
                    out=outs,
                    chunk_indices=res.positions,
                )
                self._observe_gbps(
                    "lmcache_mp_l0_l1_store_throughput_GB_per_second",
                    inst,
                    len(outs) * lay.nbytes,
                    t0,
                )
        except Exception as exc:
            logger.error("store for instance %d failed: %s", instance_id, exc)
            self.storage.abort_write(list(res.objs))
            return (b"", False)
        ok = self._admit(res)
        self.metrics.inc("lmcache_mp_num_finished_stores", device=_device(inst))
        return (b"", ok)

    # ------------------------------------------------------------------ reads
    def retrieve(
        self,
        ctx: RequestContext,
        key: P.IPCCacheServerKey,
        instance_id: int,
        block_ids: list[list[int]],
        event_ipc_handle: bytes = b"",
        skip_first_n_tokens: int = 0,
    ):
        self._require_mode(LMCACHE_DRIVEN)
        session, keys = self._own_keys(key)
        self._retrieve_begin(session)
        try:
            inst = self.instances.get(instance_id)
            if inst is None or inst.mode != LMCACHE_DRIVEN:
                self.metrics.inc("lmcache_mp_num_submitted_retrieves", device="unknown")
                return (b"", False)
            self.metrics.inc("lmcache_mp_num_submitted_retrieves", device=_device(inst))
            inst.last_seen = time.monotonic()
            from lmcache.v1.multiprocess.transfer_context.base import scatter_cpu_to_paged_kv

            bpc = self.cs // inst.meta["block_size"]
            ids = list(block_ids[0]) if block_ids else []
            objs = self.storage.read_locked(keys)
            if objs is None or len(ids) < len(keys) * bpc:
                self._count_read_failure(inst, len(keys))
                return (b"", False)
            lay = self.layouts[inst.layout_key]
            t0 = time.perf_counter()
            self._copy_host_kv(
                inst,
                scatter_cpu_to_paged_kv,
                ids[: len(keys) * bpc],
                [_obj_tensor(o, lay) for o in objs],
                bpc,
                skip_first_n_tokens,
                layout_hints=inst.layout_hints,
            )
            self._observe_gbps(
                "lmcache_mp_l0_l1_load_throughput_GB_per_second",
                inst,
                len(keys) * lay.nbytes,
                t0,
            )
            self._count_reads(inst, key, len(keys))
            self.metrics.inc("lmcache_mp_num_finished_retrieves", device=_device(inst))
            return (b"", True)
        except RequestError:
            raise
        except Exception as exc:
            logger.error("retrieve for instance %d failed: %s", instance_id, exc)
            return (b"", False)
        finally:
            self._release_worker_shares(session, key, keys)  # one share per key, success or not
            self._retrieve_done(session)

    def prepare_retrieve(self, ctx: RequestContext, key: P.IPCCacheServerKey, instance_id: int):
        inst = self._instance(instance_id, ENGINE_DRIVEN)
        session, keys = self._own_keys(key)
        self.metrics.inc("lmcache_mp_num_submitted_retrieves", device=HOST_DEVICE)
        lay = self.layouts[inst.layout_key]
        objs = self.storage.read_locked(keys)
        if objs is None:
            self._count_read_failure(inst, len(keys))
            if inst.strategy != "shm":
                self._release_worker_shares(session, key, keys)
            else:
                with inst.lock:
                    inst.pending_reads[(key.request_id, key.start, key.end, "failed")] = (
                        PendingRead(key, keys, time.monotonic(), session, copying=False)
                    )
            return {"success": False, "data": b"", "context": {}}
        self._count_reads(inst, key, len(keys))
        if inst.strategy == "shm":
            slots = [
                {
                    "offset": int(o.metadata.address),
                    "length": lay.nbytes,
                    "shape": list(lay.shape),
                    "dtype": _dtype_name(lay.dtype),
                }
                for o in objs
            ]
            with inst.lock:
                inst.pending_reads[(key.request_id, key.start, key.end)] = PendingRead(
                    key, keys, time.monotonic(), self._retrieve_begin(session)
                )
            context: dict[str, Any] = {"slots": slots}
            lease = self.config.retrieve_lease_seconds
            if lease > 0:  # a field 0.5.6 clients ignore; ours skip awaiting commit_retrieve
                context["lease_s"] = lease
            return {"success": True, "data": b"", "context": context}
        try:
            if codec_feature(ctx):
                data = codec.encode_raw_v1([_obj_bytes(o, lay.nbytes) for o in objs])
                context = {
                    "encoding": "raw_v1",
                    "shape": list(lay.shape),
                    "dtype": _dtype_name(lay.dtype),
                }
            else:
                data = codec.pickle_tensors([_obj_tensor(o, lay) for o in objs])
                context = {}
        finally:
            self._release_worker_shares(session, key, keys)
        self.metrics.inc("lmcache_mp_num_finished_retrieves", device=HOST_DEVICE)
        return {"success": True, "data": data, "context": context}

    def commit_retrieve(self, ctx: RequestContext, key: P.IPCCacheServerKey, instance_id: int):
        inst = self._instance(instance_id, ENGINE_DRIVEN)
        rkey = (key.request_id, key.start, key.end)
        with inst.lock:
            read = inst.pending_reads.pop(rkey, None)
            failed = inst.pending_reads.pop((*rkey, "failed"), None)
        if read is not None:
            self._finish_read(read)
            self.metrics.inc("lmcache_mp_num_finished_retrieves", device=HOST_DEVICE)
            return True
        if failed is not None:
            self._finish_read(failed)
            return False
        return inst.strategy != "shm"

    def _observe_gbps(self, name: str, inst: Instance, nbytes: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        if dt > 0 and nbytes:
            self.metrics.observe(
                name,
                nbytes / dt / 1e9,
                device=_device(inst),
                engine_id=str(inst.instance_id),
                model_name=inst.model_name,
            )

    def _count_reads(self, inst: Instance, key: P.IPCCacheServerKey, n: int) -> None:
        self.metrics.inc("lmcache_mp_l1_read_chunks", n, l1_tag=L1_TAG, cache_salt=key.cache_salt)
        self.metrics.inc(
            "lmcache_mp_num_chunks_loaded",
            n,
            cache_salt=key.cache_salt,
            model_name=inst.model_name,
            worker_id=str(inst.instance_id),
        )

    def _count_read_failure(self, inst: Instance, n: int) -> None:
        self.metrics.inc(
            "lmcache_mp_l1_read_failure_chunks",
            n,
            during="l1_retrieve",
            reason="not_found",
            model_name=inst.model_name,
        )

    # ------------------------------------------------------------------ maintenance
    def clear(self, ctx: RequestContext, force: bool = False):
        self.storage.clear(bool(force))
        return None

    def report_block_allocation(
        self, ctx: RequestContext, instance_id=None, model_name=None, records=None
    ):
        self.block_allocation_reports += 1
        self.metrics.inc("lmcache_mp_report_block_allocation")
        return None

    # ------------------------------------------------------------------ background
    def clean_period(self) -> float:
        """Seconds between session-cleaner cycles."""
        return max(0.2, min(60.0, self.config.session_ttl_seconds / 4))

    def reap_period(self) -> float:
        """Seconds between reaper cycles; 0 when reaping is off."""
        timeouts = [
            t
            for t in (
                self.config.worker_reap_timeout_seconds,
                self.config.worker_registration_grace_seconds,
            )
            if t > 0
        ]
        if not timeouts or self.config.worker_reap_timeout_seconds <= 0:
            return 0.0
        return max(0.1, min(30.0, min(timeouts) / 4))

    def _clean_loop(self) -> None:
        period = self.clean_period()
        while not self._stop.wait(period):
            try:
                self.clean_once()
            except Exception:
                logger.exception("session cleaner cycle failed")

    def clean_once(self) -> None:
        self._release_expired_leases()
        for s in self.sessions.expired():
            self._close_session(s)
        ttl = self.config.l1_write_ttl_seconds
        cutoff = time.monotonic() - ttl
        for inst in list(self.instances.values()):
            with inst.lock:
                old = [k for k, r in inst.reservations.items() if r.created < cutoff]
                gone = [inst.reservations.pop(k) for k in old]
            for r in gone:
                self.storage.abort_write(list(r.objs))

    def _reap_loop(self) -> None:
        period = self.reap_period()
        if not period:
            return
        while not self._stop.wait(period):
            try:
                self.reap_once()
            except Exception:
                logger.exception("reaper cycle failed")

    def reap_once(self) -> list[int]:
        now = time.monotonic()
        reap, grace = (
            self.config.worker_reap_timeout_seconds,
            self.config.worker_registration_grace_seconds,
        )
        victims = []
        with self._lock:
            for inst in self.instances.values():
                limit = reap if inst.pinged else grace
                if limit > 0 and now - inst.last_seen > limit:
                    victims.append(inst.instance_id)
        for iid in victims:  # the liveness lock is not held while releasing
            inst = self._drop_instance(iid, reason="reaped (no liveness signal)")
            if inst is not None:
                logger.warning("Reaped instance %d (%s): silent for too long", iid, inst.mode)
                self.metrics.inc("lmcache_mp_reaped_instances", mode=inst.mode)
        self._reclaim_silent_workers()
        self._release_expired_leases()
        return victims

    def _reclaim_silent_workers(self) -> None:
        """Release the staging (unfinished stores, pending SHM reads) of every worker silent
        (no request, no ping) for ``--worker-reap-timeout-seconds``, also of one that never
        pinged: such a worker stays registered for the whole registration grace (an hour by
        default, for 0.5.6 clients that never ping), but a dead one must not hold L1 that
        long. Nothing is reclaimed while reaping is off."""
        limit = self.config.worker_reap_timeout_seconds
        if limit <= 0:
            return
        cutoff = time.monotonic() - limit
        for inst in list(self.instances.values()):
            if inst.last_seen >= cutoff:
                continue
            with inst.lock:
                if not inst.reservations and not inst.pending_reads:
                    continue
                reservations, inst.reservations = inst.reservations, {}
                reads, inst.pending_reads = inst.pending_reads, {}
            for res in reservations.values():
                self.storage.abort_write(list(res.objs))  # never admit half-written data
            self._release_after_lease(list(reads.values()))
            self.metrics.inc("lmcache_mp_reclaimed_staging", len(reservations) + len(reads))
            logger.warning(
                "Instance %d (%s) silent for more than %.0f s: released its %d unfinished "
                "store(s) and %d unfinished SHM read(s); it stays registered",
                inst.instance_id,
                inst.mode,
                limit,
                len(reservations),
                len(reads),
            )

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        gpu, non_cuda = {}, {}
        for iid, inst in list(self.instances.items()):
            meta = {
                "mode": inst.mode,
                "model_name": inst.model_name,
                "world_size": inst.world_size,
                **inst.meta,
            }
            (gpu if inst.mode == LMCACHE_DRIVEN else non_cuda)[str(iid)] = meta
        return {
            "active_sessions": len(self.sessions),
            "max_sessions": self.config.max_sessions,
            "active_prefetch_jobs": sum(
                1 for s in self.sessions.all() if s.job is not None and not s.job.is_done
            ),
            "registered_gpu_ids": [int(i) for i in gpu],
            "cache_context_meta": gpu,
            "registered_non_cuda_instance_ids": [int(i) for i in non_cuda],
            "non_cuda_context_meta": non_cuda,
            "worker_liveness": {
                "enabled": self.config.worker_reap_timeout_seconds > 0,
                "reap_timeout_seconds": self.config.worker_reap_timeout_seconds,
                "registration_grace_seconds": self.config.worker_registration_grace_seconds,
                "tracked_instances": len(self.instances),
            },
            "layouts": {
                f"{m}@{ws}": {
                    "shape": list(lay.shape),
                    "dtype": _dtype_name(lay.dtype),
                    "refcount": lay.refcount,
                }
                for (m, ws), lay in list(self.layouts.items())
            },
        }


def fan_out_keys(
    key: P.IPCCacheServerKey, hashes: list[bytes], first: int, last: int, ranks: Any = None
) -> list[list[Any]]:
    """One row of ObjectKeys per kv rank over chunks [first, last) (4.3).

    ``ranks`` None means: the key's own rank, or every rank for a nil worker_id.
    """
    if ranks is None:
        ranks = range(key.world_size) if key.worker_id is None else [key.worker_id]
    model, salt = key.model_name, key.cache_salt
    span = tuple(hashes[first:last])
    return [
        list(_object_keys.row(span, model, compute_kv_rank(key.world_size, r), salt)) for r in ranks
    ]


class _ObjectKeyCache:
    """The one ObjectKey of each recently seen (hash, model, rank, group, salt), and whole
    rows of them by (chunk hashes, model, rank, salt).

    The storage layer keeps the key objects a store brought in its dicts; a lookup that
    brings those same objects finds them by identity instead of running ObjectKey.__eq__
    (about 80 times for a 16-chunk lookup). A prompt seen before (every cache hit) gets its
    row with one dict lookup instead of building or finding 16 keys. Everything is dropped
    once either table holds more than ``MAX_KEYS`` keys. Any thread may use it (single dict
    operations; a lost race only yields equal, separate keys, or a slightly late clear)."""

    MAX_KEYS = 1 << 16

    def __init__(self) -> None:
        self._keys: dict[tuple[Any, ...], ObjectKey] = {}
        self._rows: dict[tuple[Any, ...], tuple[ObjectKey, ...]] = {}
        self._row_keys = 0  # keys in _rows, counted once per row

    def row(
        self, chunk_hashes: tuple[bytes, ...], model: str, kv_rank: int, salt: str
    ) -> tuple[ObjectKey, ...]:
        row = self._rows.get((chunk_hashes, model, kv_rank, salt))
        if row is not None:
            return row
        if len(self._keys) > self.MAX_KEYS or self._row_keys > self.MAX_KEYS:
            self._keys, self._rows, self._row_keys = {}, {}, 0
        keys = self._keys
        out = []
        for h in chunk_hashes:
            fields = (h, model, kv_rank, 0, salt)
            k = keys.get(fields)
            if k is None:
                k = keys[fields] = ObjectKey(*fields)
            out.append(k)
        row = self._rows[(chunk_hashes, model, kv_rank, salt)] = tuple(out)
        self._row_keys += len(row)
        return row


_object_keys = _ObjectKeyCache()


def codec_feature(ctx: RequestContext) -> bool:
    return P.FEATURE_RAW_PAYLOAD_V1 in ctx.features


def _obj_bytes(obj: Any, nbytes: int) -> memoryview:
    return memoryview(obj.byte_array).cast("B")[:nbytes]


def _obj_tensor(obj: Any, lay: Layout) -> torch.Tensor:
    """A typed view of an L1 object in the registered chunk layout (no copy)."""
    raw = torch.frombuffer(_obj_bytes(obj, lay.nbytes), dtype=torch.uint8)
    return raw.view(lay.dtype).view(lay.shape)


def _open_cache_context(
    instance_id: int,
    wrappers: list[Any],
    tensors: list[Any],
    chunk_size: int,
    layout_hints: dict | None,
    engine_group_infos: list | None,
) -> Any:
    """platform.md §6.3 check 4: the device's cache context, then event IPC on its device.

    A device without either fails the registration (a RequestError the client sees as a
    failed REGISTER); it never silently registers and it never takes the server down.
    """
    from lmcache.v1.platform.base.event_ipc import get_event_ipc_backend
    from lmcache.v1.platform.cache_context import create_cache_context

    # The worker sends a hints dict; the platform factory takes the layout hint itself
    # ("NHD"/"HND", or one per layer).
    hints = layout_hints or {}
    layout_hint = hints.get("kv_layout") if isinstance(hints, dict) else hints
    cache_context = None
    try:
        cache_context = create_cache_context(
            tensors, chunk_size, layout_hint or None, engine_group_infos or ()
        )
        device = cache_context.device
        get_event_ipc_backend(device).check_event_support(device)
        return cache_context
    except Exception as exc:
        _close_cache_context(cache_context)
        _close_all(wrappers)
        code = (
            ErrorCode.NOT_SUPPORTED
            if isinstance(exc, NotImplementedError | RuntimeError)
            else ErrorCode.INVALID_ARGUMENT
        )
        logger.error(
            "register_kv_cache for instance %d failed: %s: %s", instance_id, type(exc).__name__, exc
        )
        raise RequestError(
            code, f"lmcache_driven registration needs a cache context with event IPC: {exc}"
        ) from exc


def _close_cache_context(cache_context: Any) -> None:
    if cache_context is None:
        return
    try:
        cache_context.close()
    except Exception as exc:
        logger.warning("closing a cache context failed: %s", exc)


def _close_all(wrappers: list[Any]) -> None:
    for w in wrappers:
        try:
            w.close()
        except Exception:
            pass


def _device(inst: Instance) -> str:
    """The device type of a worker's registered KV cache (a metric label)."""
    return inst.kv_caches[0].device.type if inst.kv_caches else HOST_DEVICE


def _salt(keys: list[Any]) -> str:
    """The cache_salt of a request's keys (a metric label)."""
    return str(getattr(keys[0], "cache_salt", "") or "") if keys else ""
