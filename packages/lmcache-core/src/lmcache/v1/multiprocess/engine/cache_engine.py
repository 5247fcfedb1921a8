"""``CacheEngine``: the server state, the op table, lifecycle and status. Each op's
handler lives in the mixin of its area (instances, lookup, write_path, read_path,
janitor); ``CacheEngine`` combines them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.config import MPServerConfig
from lmcache.v1.multiprocess.engine.instances import InstancesMixin
from lmcache.v1.multiprocess.engine.janitor import JanitorMixin
from lmcache.v1.multiprocess.engine.lookup import LookupMixin
from lmcache.v1.multiprocess.engine.read_path import ReadPathMixin
from lmcache.v1.multiprocess.engine.state import (
    BOOKKEEPING_OPS,
    ENGINE_DRIVEN,
    LMCACHE_DRIVEN,
    Instance,
    Layout,
    Parker,
    PendingRead,
    RequestContext,
    dtype_name,
)
from lmcache.v1.multiprocess.engine.write_path import WritePathMixin
from lmcache.v1.multiprocess.metrics import ServerMetrics
from lmcache.v1.multiprocess.sessions import SessionTable
from lmcache.v1.multiprocess.storage_bridge import StorageBridge
from lmcache.v1.multiprocess.token_hasher import PrefixHashMemo


class CacheEngine(InstancesMixin, LookupMixin, WritePathMixin, ReadPathMixin, JanitorMixin):
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
        self._parker = Parker()
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
        if op not in BOOKKEEPING_OPS or len(args) < 2:
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
                    "dtype": dtype_name(lay.dtype),
                    "refcount": lay.refcount,
                }
                for (m, ws), lay in list(self.layouts.items())
            },
        }
