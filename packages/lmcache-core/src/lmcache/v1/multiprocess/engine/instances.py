"""Worker registration of ``CacheEngine``: both transfer modes' register/unregister ops,
the shared layouts, liveness pings, and the release of a dropped worker's pending reads."""

from __future__ import annotations

import time
from typing import Any

import torch

from lmcache.utils import init_logger
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.engine.state import (
    ENGINE_DRIVEN,
    LMCACHE_DRIVEN,
    MODE_FIX,
    Instance,
    Layout,
    PendingRead,
    RequestContext,
    close_all,
    dtype_name,
    request_dtype,
)
from lmcache.v1.multiprocess.protocol import ErrorCode, RequestError

logger = init_logger(__name__)


class InstancesMixin:
    """Part of ``CacheEngine`` (its state is set in ``CacheEngine.__init__``)."""

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
                f"{dtype_name(dtype)}), more than the whole L1 ({total} bytes): check the "
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
        dtype = request_dtype(payload.dtype_str)
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
        close_all(inst.wrappers)
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
