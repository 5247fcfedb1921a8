"""``InstanceRegistry``: the registered workers of both transfer modes (their register and
unregister ops, liveness pings), their staged transfers when they go, and the layouts they
acquire."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from lmcache.utils import init_logger
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.config import MPServerConfig
from lmcache.v1.multiprocess.engine.layouts import LayoutTable
from lmcache.v1.multiprocess.engine.records import (
    ENGINE_DRIVEN,
    LMCACHE_DRIVEN,
    MODE_FIX,
    Instance,
    RequestContext,
    close_all,
    kv_device,
    request_dtype,
)
from lmcache.v1.multiprocess.engine.session_keys import SessionKeys
from lmcache.v1.multiprocess.kv_copy import kv_geometry
from lmcache.v1.multiprocess.metrics import ServerMetrics
from lmcache.v1.multiprocess.protocol import ErrorCode, RequestError
from lmcache.v1.multiprocess.storage_bridge import StorageBridge
from lmcache.v1.platform.base.ipc_wrapper import dtype_name

logger = init_logger(__name__)


class InstanceRegistry:
    """Registered workers by instance id; registrations and removals change the table under
    its lock, requests read it without (single dict operations)."""

    def __init__(
        self,
        config: MPServerConfig,
        storage: StorageBridge,
        metrics: ServerMetrics,
        layouts: LayoutTable,
        session_keys: SessionKeys,
        *,
        shm_name: str = "",
        shm_pool_size: int = 0,
        shm_disabled_reason: str = "",
    ) -> None:
        self.config = config
        self.cs = config.chunk_size
        self.storage = storage
        self.metrics = metrics
        self.layouts = layouts
        self.session_keys = session_keys
        self.shm_name = shm_name
        self.shm_pool_size = shm_pool_size
        self.shm_disabled_reason = shm_disabled_reason
        self.instances: dict[int, Instance] = {}
        self._lock = threading.Lock()
        # Told the id of a worker that left (unregistered, reaped, shutdown); not on re-register.
        self.on_drop: Callable[[int], None] | None = None

    # ------------------------------------------------------------------ lookups of requests
    def require(self, instance_id: int, mode: str) -> Instance:
        """The instance a transfer names, registered for ``mode`` (``RequestError``
        NOT_REGISTERED otherwise); the request counts as a liveness signal."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.mode != mode:
            raise RequestError(
                ErrorCode.NOT_REGISTERED,
                f"instance {instance_id} is not registered for {mode} transfers; re-register it",
            )
        inst.last_seen = time.monotonic()
        return inst

    def lmcache_driven(self, instance_id: int, submitted_metric: str) -> Instance | None:
        """The lmcache_driven instance ``instance_id`` (None if there is none), counting the
        request in ``submitted_metric`` either way."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.mode != LMCACHE_DRIVEN:
            self.metrics.inc(submitted_metric, device="unknown")
            return None
        self.metrics.inc(submitted_metric, device=kv_device(inst))
        inst.last_seen = time.monotonic()
        return inst

    def require_mode(self, mode: str) -> None:
        """``RequestError`` MODE_NOT_ENABLED unless this server takes ``mode`` transfers."""
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

    def all(self) -> list[Instance]:
        """A snapshot of the registered instances."""
        return list(self.instances.values())

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
                f"{dtype_name(dtype)}), more than the whole L1 ({total} bytes): check the "
                f"registered layout, or start the server with --l1-size-gb of at least "
                f"{-(-nbytes // (1 << 30))} (or a smaller --chunk-size)",
            )

    # ------------------------------------------------------------------ registration
    def register_engine_driven(
        self, ctx: RequestContext, payload: P.RegisterEngineDrivenContextPayload
    ) -> dict[str, Any]:
        self.require_mode(ENGINE_DRIVEN)
        dtype = request_dtype(payload.dtype_str)
        slots = payload.num_physical_slots or self.cs
        shape: tuple[int, ...]
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
                    "dtype": dtype_name(dtype),
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
            dtype_name(dtype),
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
    ) -> None:
        self.require_mode(LMCACHE_DRIVEN)
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
            close_all(wrappers)
            raise
        except Exception as exc:
            close_all(wrappers)
            logger.error("register_kv_cache for instance %d failed: %s", instance_id, exc)
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT, f"cannot open the KV cache: {exc}"
            ) from exc
        cache_context = _open_cache_context(
            instance_id, wrappers, tensors, self.cs, layout_hints, engine_group_infos
        )
        if self.cs % geo.block_size:
            _close_cache_context(cache_context)
            close_all(wrappers)
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                f"chunk_size {self.cs} is not a multiple of the block size {geo.block_size}",
            )
        shape = geo.chunk_shape(self.cs)
        try:
            self._check_chunk_fits(shape, geo.dtype)
        except RequestError:
            _close_cache_context(cache_context)
            close_all(wrappers)
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
                    "dtype": dtype_name(geo.dtype),
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
            self.drop(inst.instance_id, reason="re-registered")
        self.layouts.acquire(inst.layout_key, shape, dtype, int(inst.meta.get("block_size") or 0))
        with self._lock:
            self.instances[inst.instance_id] = inst

    def unregister_instance(self, ctx: RequestContext | None, instance_id: int) -> None:
        self.drop(instance_id, reason="unregistered")
        return None

    def drop(self, instance_id: int, reason: str) -> Instance | None:
        """Remove a worker: its unfinished stores are aborted, its pending SHM reads released
        (after their lease), its KV cache handles closed and its layout released."""
        with self._lock:
            inst = self.instances.pop(instance_id, None)
        if inst is None:
            return None
        self.release_staging(inst)
        if inst.cache_context is not None:
            try:
                inst.cache_context.close()
            except Exception:
                pass
        inst.kv_caches = []
        close_all(inst.wrappers)
        self.layouts.release(inst.layout_key)
        logger.info("Instance %d (%s) removed: %s", instance_id, inst.mode, reason)
        if self.on_drop is not None and reason != "re-registered":
            self.on_drop(instance_id)
        return inst

    def drop_all(self, reason: str) -> None:
        for instance_id in list(self.instances):
            self.drop(instance_id, reason)

    def release_staging(self, inst: Instance) -> tuple[int, int]:
        """Abort the unfinished stores of ``inst`` (never admit half-written data, 9.2) and
        release its pending SHM reads once their lease ends; (stores, reads) released."""
        with inst.lock:
            if not inst.reservations and not inst.pending_reads:
                return 0, 0
            reservations, inst.reservations = inst.reservations, {}
            reads, inst.pending_reads = inst.pending_reads, {}
        for res in reservations.values():
            self.storage.abort_write(list(res.objs))
        self.session_keys.release_after_lease(list(reads.values()))
        return len(reservations), len(reads)

    def abort_stale_reservations(self, cutoff: float) -> None:
        """Abort the unfinished stores reserved before ``cutoff`` (monotonic time)."""
        for inst in self.all():
            with inst.lock:
                old = [k for k, r in inst.reservations.items() if r.created < cutoff]
                gone = [inst.reservations.pop(k) for k in old]
            for r in gone:
                self.storage.abort_write(list(r.objs))

    def silent(self, now: float, pinged_limit: float, unpinged_limit: float) -> list[int]:
        """The ids of instances without a liveness signal for longer than their limit: a
        worker that ever pinged gets ``pinged_limit`` seconds, one that never did
        ``unpinged_limit`` (a limit of 0 never expires)."""
        victims = []
        with self._lock:
            for inst in self.instances.values():
                limit = pinged_limit if inst.pinged else unpinged_limit
                if limit > 0 and now - inst.last_seen > limit:
                    victims.append(inst.instance_id)
        return victims

    def ping(self, ctx: RequestContext, instance_id: int | None = None) -> bool:
        if instance_id is not None:
            inst = self.instances.get(instance_id)
            if inst is not None:
                inst.last_seen = time.monotonic()
                inst.pinged = True
        return True


def _open_cache_context(
    instance_id: int,
    wrappers: list[Any],
    tensors: list[Any],
    chunk_size: int,
    layout_hints: dict | None,
    engine_group_infos: list | None,
) -> Any:
    """Check 4 of docs/design/platform.md#lmcache-driven-checks: the device's cache context, then
    event IPC on its device.

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
        close_all(wrappers)
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
