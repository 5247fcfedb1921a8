"""``CacheEngine``: builds the engine's collaborators and wires them, owns the op table,
lifecycle and status.

The collaborators, each with its own state: ``LayoutTable`` (registered chunk layouts),
``SessionKeys`` (sessions, their keys, lookups and read shares), ``InstanceRegistry``
(registered workers, liveness), ``HostKVCopier`` (the server's KV copies), ``WritePath``,
``ReadPath`` and ``Janitor`` (cleaner and reaper threads). Each op handler is a method of
the collaborator of its area; ``handlers`` maps op names to them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmcache.utils import init_logger
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.config import MPServerConfig
from lmcache.v1.multiprocess.engine.host_copy import HostKVCopier
from lmcache.v1.multiprocess.engine.instances import InstanceRegistry
from lmcache.v1.multiprocess.engine.janitor import Janitor
from lmcache.v1.multiprocess.engine.layouts import LayoutTable
from lmcache.v1.multiprocess.engine.parts import EngineParts
from lmcache.v1.multiprocess.engine.read_path import ReadPath
from lmcache.v1.multiprocess.engine.records import (
    BOOKKEEPING_OPS,
    ENGINE_DRIVEN,
    LMCACHE_DRIVEN,
    Instance,
    RequestContext,
)
from lmcache.v1.multiprocess.engine.session_keys import SessionKeys
from lmcache.v1.multiprocess.engine.write_path import WritePath
from lmcache.v1.multiprocess.kv_event_publisher import KVEventsConfig, ZmqKVEventPublisher
from lmcache.v1.multiprocess.kv_events import KVEventLog, KVEventStreams
from lmcache.v1.multiprocess.metrics import ServerMetrics
from lmcache.v1.multiprocess.protocol import ErrorCode, RequestError
from lmcache.v1.multiprocess.storage_bridge import StorageBridge
from lmcache.v1.platform.base.ipc_wrapper import dtype_name

logger = init_logger(__name__)


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
        self.layouts = LayoutTable()
        self.session_keys = SessionKeys(config, storage, metrics, self.layouts)
        self.registry = InstanceRegistry(
            config,
            storage,
            metrics,
            self.layouts,
            self.session_keys,
            shm_name=shm_name,
            shm_pool_size=shm_pool_size,
            shm_disabled_reason=shm_disabled_reason,
        )
        self.copier = HostKVCopier(metrics)
        parts = EngineParts(
            config, storage, metrics, self.registry, self.layouts, self.session_keys, self.copier
        )
        self.write_path = WritePath(parts)
        self.read_path = ReadPath(parts)
        self.janitor = Janitor(config, metrics, self.registry, self.session_keys)
        # The tables others read: the registered workers by id, the sessions.
        self.instances: dict[int, Instance] = self.registry.instances
        self.sessions = self.session_keys.sessions
        self.features = list(P.OFFERED_FEATURES)
        self.kv_events = self._build_kv_events(config)
        self.block_allocation_reports = 0
        keys, registry = self.session_keys, self.registry
        writes, reads = self.write_path, self.read_path
        self.handlers: dict[str, Callable[..., Any]] = {
            "register_kv_cache": registry.register_kv_cache,
            "unregister_kv_cache": registry.unregister_instance,
            "register_kv_cache_engine_driven_context": registry.register_engine_driven,
            "unregister_kv_cache_engine_driven_context": registry.unregister_instance,
            "store": writes.store,
            "retrieve": reads.retrieve,
            "lookup": keys.lookup,
            "query_prefetch_status": keys.query_prefetch_status,
            "wait_prefetch_status": keys.wait_prefetch_status,
            "free_lookup_locks": keys.free_lookup_locks,
            "end_session": keys.end_session,
            "prepare_store": writes.prepare_store,
            "commit_store": writes.commit_store,
            "prepare_retrieve": reads.prepare_retrieve,
            "commit_retrieve": reads.commit_retrieve,
            "clear": self.clear,
            "get_chunk_size": lambda ctx: self.cs,
            "ping": registry.ping,
            "report_block_allocation": self.report_block_allocation,
            "noop": lambda ctx: "OK",
            "get_experimental": lambda ctx: self.experimental(),
            "subscribe_kv_events": self.subscribe_kv_events,
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

    # ------------------------------------------------------------------ KV events
    def _build_kv_events(self, config: MPServerConfig) -> KVEventStreams | None:
        """The KV event log, fed by every storage tier and bound to each store's tokens,
        and its streams (docs/design/protocol.md#kv-events); None when it is off."""
        log = KVEventLog(config.kv_event_log_size, self.cs)
        if not log.enabled:
            return None
        if not self.storage.register_key_listener(log):
            logger.warning("this storage engine reports no stored keys: KV events are off")
            return None
        pub_config = KVEventsConfig.parse(config.kv_events_config)
        publisher = ZmqKVEventPublisher(pub_config) if pub_config.enabled else None
        streams = KVEventStreams(log, publisher)
        self.session_keys.on_store = log.bind_tokens
        self.registry.on_drop = streams.drop_instance
        return streams

    def experimental(self) -> list[str]:
        """``get_experimental``: our negotiable features, plus 0.5.6's ``kv_event_stream``
        capability while the KV event log is on."""
        extra = [P.KV_EVENT_CAPABILITY] if self.kv_events is not None else []
        return list(self.features) + extra

    def subscribe_kv_events(
        self,
        ctx: RequestContext,
        instance_id: int,
        model_name: str,
        cursor: int,
        max_events: int,
    ) -> Any:
        """0.5.6's event stream: batches of ``model_name``'s records after ``cursor``, one
        per ack; a server without the log answers one ``enabled=False`` batch and ends.
        Tails' records go only to peers that negotiated ``partial_chunk``."""
        if self.kv_events is None:
            ctx.defer()
            ctx.send(P.KVEventBatch(enabled=False, incarnation=0, next_cursor=0, lost=False))
            ctx.send(None)
            return None
        try:
            self.kv_events.subscribe(
                (ctx.peer, ctx.uid),
                ctx.send,
                instance_id,
                model_name,
                cursor,
                max_events,
                tails=P.FEATURE_PARTIAL_CHUNK in ctx.features,
            )
        except ValueError as exc:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc
        ctx.defer()
        return None

    def stream_control(self, peer: bytes, uid: bytes, action: bytes) -> None:
        """A stream control frame (``ack``/``cancel``) of ``peer``'s stream ``uid``."""
        if self.kv_events is not None:
            self.kv_events.control((peer, uid), action)

    def kv_events_status(self) -> dict[str, Any]:
        """``/status``'s ``kv_events`` block (0.5.6's fields)."""
        if self.kv_events is None:
            return {"enabled": False}
        return self.kv_events.log.status(self.kv_events.subscribers)

    def kv_events_log_depth(self) -> int:
        return 0 if self.kv_events is None else self.kv_events.log.depth

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self.kv_events is not None:
            self.kv_events.start()
        self.janitor.start()

    def stop(self) -> None:
        if self.kv_events is not None:
            self.kv_events.stop()
        self.session_keys.stop()
        self.janitor.stop()
        self.copier.stop()
        self.registry.drop_all(reason="shutdown")

    # ------------------------------------------------------------------ for the HTTP API
    def copy_host_kv(self, inst: Instance, copy: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``copy(inst.kv_caches, *args, **kw)`` where the server's own KV copies run
        (``HostKVCopier.run``)."""
        return self.copier.run(inst, copy, *args, **kw)

    def clean_period(self) -> float:
        return self.janitor.clean_period()

    def reap_period(self) -> float:
        return self.janitor.reap_period()

    def clean_once(self) -> None:
        self.janitor.clean_once()

    def reap_once(self) -> list[int]:
        return self.janitor.reap_once()

    # ------------------------------------------------------------------ maintenance
    def clear(self, ctx: RequestContext, force: bool = False) -> None:
        self.storage.clear(bool(force))
        return None

    def report_block_allocation(
        self,
        ctx: RequestContext,
        instance_id: Any = None,
        model_name: Any = None,
        records: Any = None,
    ) -> None:
        self.block_allocation_reports += 1
        self.metrics.inc("lmcache_mp_report_block_allocation")
        return None

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        gpu: dict[str, dict[str, Any]] = {}
        non_cuda: dict[str, dict[str, Any]] = {}
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
                for (m, ws), lay in self.layouts.items()
            },
        }
