"""Cache routes: /cache/objects, /cache/prefetches, /cache/clear, /cache/checksums."""

from __future__ import annotations

import sys
from typing import Any

from fastapi import FastAPI, HTTPException, Query

from lmcache.utils import init_logger
from lmcache.v1.multiprocess import http_models as M
from lmcache.v1.multiprocess.http_api.checksums import block_checksums, compress_ranges
from lmcache.v1.multiprocess.http_api.common import adapter_slots

logger = init_logger(__name__)

MAX_DELETE_BATCH = 10_000  # keys per DELETE /cache/objects (0.5.6's cap)
MAX_PREFETCH_TOKENS = 1_000_000  # token ids per POST /cache/prefetches (0.5.6's cap)
MAX_TRACKED_PREFETCHES = 4096  # submitted prefetches remembered until their status is read


def add_cache_routes(app: FastAPI, runtime: Any) -> None:
    engine = runtime.engine
    storage = runtime.storage
    prefetches: dict[str, dict[str, Any]] = {}
    prefetch_seq = iter(range(1, sys.maxsize))

    # --------------------------------------------------------------- objects
    @app.get("/cache/objects", response_model=M.ObjectsPage)
    def list_objects(
        tier: M.Tier = M.Tier.L2,
        adapter: str | None = Query(default=None),
        model_name: str | None = Query(default=None),
        page_size: int = Query(default=500, ge=1, le=5000),
        page_token: str | None = Query(default=None),
    ) -> Any:
        if tier != M.Tier.L2:
            raise HTTPException(400, f"tier {tier.value!r} not supported; only 'l2'")
        slot = _resolve_adapter(runtime, adapter)
        try:
            page = slot.adapter.list_l2_keys(
                model_name=model_name, page_size=page_size, cursor=page_token
            )
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        except NotImplementedError as exc:
            raise HTTPException(
                503, f"L2 adapter {slot.type_name!r} does not support listing: {exc}"
            ) from None
        return {
            "adapter": slot.type_name,
            "shared": _shared(slot),
            "entries": [
                {"key": e.key.to_encoded_object_key().to_dict(), "size_bytes": e.size_bytes}
                if hasattr(e.key, "to_encoded_object_key")
                else {"key": _as_dict(e.key), "size_bytes": e.size_bytes}
                for e in page.entries
            ],
            "next_page_token": page.next_page_token,
        }

    @app.delete(
        "/cache/objects", response_model=M.DeleteObjectsResponse, response_model_exclude_none=True
    )
    def delete_objects(body: M.DeleteObjectsRequest) -> Any:
        from lmcache.v1.distributed.api import EncodedObjectKey

        if len(body.keys) > MAX_DELETE_BATCH:
            raise HTTPException(
                400,
                f"too many keys in a single request (limit={MAX_DELETE_BATCH}, "
                f"got={len(body.keys)})",
            )
        keys = []
        for i, k in enumerate(body.keys):
            try:
                keys.append(EncodedObjectKey(**k.model_dump()).to_object_key())
            except ValueError as exc:
                raise HTTPException(400, f"keys[{i}]: {exc}") from None
        deleted = skipped = 0
        result: dict[str, Any] = {"ok": True}
        if body.tier in (M.Tier.L1, M.Tier.ALL):
            d, s = storage.sm.delete_l1_keys(keys, body.force)
            deleted, skipped = deleted + int(d), skipped + int(s)
        if body.tier in (M.Tier.L2, M.Tier.ALL):
            slot = _resolve_adapter(runtime, body.adapter)
            try:
                slot.adapter.delete(keys)
                deleted += len(keys)
            except Exception as exc:  # a structured failure, as 0.5.6 reports it
                result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"deleted": deleted, "skipped": skipped, **result}

    # ------------------------------------------------------------- prefetch
    @app.post(
        "/cache/prefetches",
        status_code=202,
        response_model=M.PrefetchSubmitted,
        response_model_exclude_none=True,
    )
    def submit_prefetch(body: M.PrefetchRequest) -> Any:
        from lmcache.v1.multiprocess import protocol as P
        from lmcache.v1.multiprocess.engine import RequestContext

        if body.source_tier != M.Tier.L2 or body.target_tier != M.Tier.L1:
            raise HTTPException(
                400,
                f"unsupported prefetch direction {body.source_tier.value!r}->"
                f"{body.target_tier.value!r}; only 'l2'->'l1'",
            )
        if len(body.token_ids) > MAX_PREFETCH_TOKENS:
            raise HTTPException(
                400,
                f"too many token_ids (limit={MAX_PREFETCH_TOKENS}, got={len(body.token_ids)})",
            )
        if (body.model_name, body.world_size) not in engine.layouts:
            raise HTTPException(
                503,
                f"no layout registered for model_name={body.model_name!r} "
                f"world_size={body.world_size}; the model has not allocated KV cache on this "
                "node yet",
            )
        chunks = len(body.token_ids) // engine.cs
        if chunks == 0:
            return {"chunks": 0, "status": "noop"}
        key = P.IPCCacheServerKey(
            model_name=body.model_name,
            world_size=body.world_size,
            worker_id=None,
            token_ids=list(body.token_ids),
            start=0,
            end=chunks * engine.cs,
            request_id=f"http-prefetch-{next(prefetch_seq)}",
            cache_salt=body.cache_salt,
            num_kv_readers=1,
        )
        try:
            P.validate_key(key, chunk_aligned=False, chunk_size=engine.cs)
        except (ValueError, TypeError) as exc:
            raise HTTPException(400, str(exc)) from None
        engine.session_keys.lookup(RequestContext(b"http", frozenset(), lambda v: None), key)
        while len(prefetches) >= MAX_TRACKED_PREFETCHES:  # never polled: forget the oldest
            prefetches.pop(next(iter(prefetches)))
        prefetches[key.request_id] = {"total": chunks * body.world_size, "ws": body.world_size}
        return {"request_id": key.request_id, "chunks": chunks, "status": "submitted"}

    @app.get(
        "/cache/prefetches/{request_id}",
        response_model=M.PrefetchStatus,
        response_model_exclude_none=True,
    )
    def prefetch_status(request_id: str) -> Any:
        info = prefetches.get(request_id)
        if info is None:
            raise HTTPException(
                404,
                f"unknown prefetch request_id={request_id!r} "
                "(already completed or never submitted)",
            )
        session = engine.sessions.get(request_id)
        if session is not None and session.job is not None and not session.job.is_done:
            return {"request_id": request_id, "status": "pending"}
        # Completed: reported once, then forgotten (as 0.5.6 does).
        del prefetches[request_id]
        hit = engine.session_keys.consume(session) or 0
        engine.session_keys.end_session(None, request_id)
        return {
            "request_id": request_id,
            "status": "completed",
            "found_keys": hit * info["ws"],
            "total_keys": info["total"],
        }

    # ----------------------------------------------------------- diagnostics
    @app.post("/cache/clear", response_model=M.ClearResponse)
    def clear(body: M.ClearRequest | None = None) -> Any:
        body = body or M.ClearRequest()
        if body.tier != M.Tier.L1:
            raise HTTPException(400, f"tier {body.tier.value!r} not supported; only 'l1'")
        storage.clear(body.force)
        logger.info("cache cleared via the HTTP API (force=%s)", body.force)
        return {"status": "ok", "cleared": {"tier": "l1"}}

    @app.post("/cache/checksums", response_model=M.ChecksumResponse)
    def checksums(body: M.ChecksumRequest) -> Any:
        inst = engine.instances.get(body.instance_id)
        if inst is None or inst.mode != "lmcache_driven":
            raise HTTPException(404, f"instance_id {body.instance_id} not registered")
        if not body.block_ids:
            raise HTTPException(400, "block_ids is required")
        if body.chunk_size <= 0:
            raise HTTPException(400, "chunk_size must be positive")
        if not inst.kv_caches:
            raise HTTPException(404, "kv_caches empty")
        try:
            result = engine.copy_host_kv(
                inst,
                block_checksums,
                inst.layout_hints,
                body.block_ids,
                body.chunk_size,
                body.layerwise,
            )
        except (ValueError, IndexError) as exc:
            raise HTTPException(400, f"cannot checksum these blocks: {exc}") from None
        return {**result, "block_id_ranges": compress_ranges(body.block_ids)}


def _resolve_adapter(runtime: Any, selector: str | None) -> Any:
    """The adapter slot a request names: 0.5.6's ``type_name``, or (ours) its index;
    none = the primary (first) adapter."""
    slots = adapter_slots(runtime)
    if not slots:
        raise HTTPException(503, "no L2 adapters configured")
    if selector is None:
        return slots[0]
    for slot in slots:
        if slot.type_name == selector:
            return slot
    if selector.isdigit() and int(selector) < len(slots):
        return slots[int(selector)]
    raise HTTPException(404, f"no L2 adapter with type_name={selector!r}")


def _shared(slot: Any) -> bool:
    return bool(getattr(slot.config, "shared", False) or getattr(slot.adapter, "_shared", False))


def _as_dict(key: Any) -> Any:
    import dataclasses

    return dataclasses.asdict(key) if dataclasses.is_dataclass(key) else key
