"""HTTP admin API of ``lmcache server`` (spec/protocol.md 11): FastAPI, loopback by default.

``build_app(runtime)`` returns the app; the CLI serves it with uvicorn. Routes, status codes
and JSON shapes are LMCache 0.5.6's (docs/compat.md "HTTP API" lists every route and the
few intended differences); every JSON route declares its pydantic response model
(http_models.py) so the shapes cannot drift. ``http_guard.AdminGuard`` sits in front:
loopback Host check, JSON-only state-changing requests, a body-size cap. No endpoint
executes code (``/run_script`` always answers 404).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import sys
import threading
import time
import traceback
from importlib import metadata
from typing import Any

from fastapi import Body, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from lmcache.utils import init_logger
from lmcache.v1.multiprocess import http_models as M
from lmcache.v1.multiprocess.http_guard import AdminGuard, max_body_bytes_from_env

logger = init_logger(__name__)

MAX_DELETE_BATCH = 10_000  # keys per DELETE /cache/objects (0.5.6's cap)
MAX_PREFETCH_TOKENS = 1_000_000  # token ids per POST /cache/prefetches (0.5.6's cap)
MAX_TRACKED_PREFETCHES = 4096  # submitted prefetches remembered until their status is read
ENGINE_TYPE = "MPCacheServer"  # what 0.5.6 reports (its engine's class name)
_GB = 1024**3
# 0.5.6's URL stand-in for the empty (anonymous) cache_salt in /quota/{cache_salt}.
DEFAULT_SALT = "_default"
_LEVELS = ("critical", "high", "medium", "low")


def _version() -> str:
    try:
        return metadata.version("lmcache-core")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_app(runtime: Any, *, max_body_bytes: int | None = None) -> Any:
    """The admin API for ``runtime``, wrapped in ``AdminGuard`` (an ASGI app).

    ``runtime.http_host`` (the bound address) decides whether the Host check is on."""
    app = _build_routes(runtime)
    return AdminGuard(
        app,
        bound_host=str(getattr(runtime, "http_host", "127.0.0.1") or "127.0.0.1"),
        max_body_bytes=max_body_bytes or max_body_bytes_from_env(),
    )


def _build_routes(runtime: Any) -> FastAPI:
    app = FastAPI(title="LMCache HTTP API", docs_url=None, redoc_url=None, openapi_url=None)
    engine = runtime.engine
    storage = runtime.storage
    prefetches: dict[str, dict[str, Any]] = {}
    prefetch_seq = iter(range(1, sys.maxsize))

    # ------------------------------------------------------------------ info
    @app.get("/", response_model=M.RootResponse)
    def root() -> Any:
        return {"status": "ok", "service": "LMCache HTTP API"}

    @app.get("/healthcheck", response_model=M.HealthResponse, response_model_exclude_none=True)
    def healthcheck() -> Any:
        health = runtime.health()
        if health.healthy:
            return {"status": "healthy"}
        return JSONResponse(
            status_code=503, content={"status": "unhealthy", "reason": health.reason}
        )

    @app.get("/status", response_model=M.StatusResponse)
    def status() -> Any:
        sm = storage.status()
        if "error" in sm:  # the storage manager could not report (0.5.6: 503 {"error"})
            return _error(503, f"storage status unavailable: {sm['error']}")
        return _status(runtime, sm)

    @app.get("/version", response_model=str)
    @app.get("/lmc_version", response_model=str)
    def version() -> Any:
        return _version()

    @app.get("/commit_id", response_model=str)
    def commit_id() -> Any:
        return os.environ.get("LMCACHE_COMMIT_ID", "unknown")

    # ---------------------------------------------------------------- config
    @app.get("/config", response_model=M.ConfigResponse)
    def config() -> Any:
        sc = runtime.storage_config
        return {
            "mp": _json_safe(vars(runtime.config)),
            "storage_manager": sc.to_dict() if hasattr(sc, "to_dict") else {},
            "observability": {"enabled": True, "metrics_enabled": runtime.metrics.enabled},
            "http": {"http_host": runtime.http_host, "http_port": runtime.http_port},
            "coordinator": {"url": ""},  # no coordinator support: never registered
        }

    @app.get("/config/adapters", response_model=M.AdaptersResponse)
    def config_adapters() -> Any:
        return {
            "adapters": [
                {
                    "index": i,
                    "type_name": slot.type_name,
                    "tier": "l2",
                    "primary": i == 0,
                    "reconfigurable": False,
                    "affinity_tag": slot.affinity_tag,
                }
                for i, slot in enumerate(_slots(runtime))
            ]
        }

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
        engine.lookup(RequestContext(b"http", frozenset(), lambda v: None), key)
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
        hit = engine._consume(session) or 0
        engine.end_session(None, request_id)
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
            result = engine._copy_host_kv(
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

    # --------------------------------------------------------- observability
    @app.get("/metrics")
    def metrics() -> Response:
        return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/metrics/reset", response_class=PlainTextResponse)
    def metrics_reset() -> Any:
        runtime.metrics.reset()
        return "ok"

    @app.get("/env", response_class=PlainTextResponse)
    def env() -> Any:
        return json.dumps(masked_environ(os.environ), indent=2, sort_keys=True)

    @app.get("/loglevel", response_class=PlainTextResponse)
    def loglevel(logger_name: str | None = None, level: str | None = None) -> Any:
        return _loglevel(logger_name, level)

    @app.get("/threads", response_class=PlainTextResponse)
    def threads(name: str | None = None, thread_id: int | None = None) -> Any:
        return _threads_text(name, thread_id)

    @app.get("/periodic-threads", response_model=M.PeriodicThreadsResponse)
    def periodic_threads(
        level: str | None = None, running_only: bool = False, active_only: bool = False
    ) -> Any:
        loops = _periodic(runtime)
        if level:
            if level.lower() not in _LEVELS:
                return JSONResponse(
                    status_code=400,
                    content={
                        "error": f"Invalid level: {level}. Valid values: critical, high, "
                        "medium, low"
                    },
                )
            shown = [t for t in loops if t["level"] == level.lower()]
        else:
            shown = loops
        if running_only:
            shown = [t for t in shown if t["is_running"]]
        if active_only:
            shown = [t for t in shown if t["is_active"]]
        return {"summary": _summary(loops), "threads": shown}

    @app.get("/periodic-threads-health", response_model=M.PeriodicThreadsHealth)
    def periodic_threads_health() -> Any:
        bad = [
            {
                "name": t["name"],
                "level": t["level"],
                "last_run_ago": t["last_run_ago"],
                "interval": t["interval"],
            }
            for t in _periodic(runtime)
            if t["level"] in ("critical", "high") and t["is_running"] and not t["is_active"]
        ]
        return {"healthy": not bad, "unhealthy_count": len(bad), "unhealthy_threads": bad}

    @app.get("/periodic-threads/{thread_name}", response_model=M.PeriodicThreadStatus)
    def periodic_thread(thread_name: str) -> Any:
        for t in _periodic(runtime):
            if t["name"] == thread_name:
                return t
        return JSONResponse(status_code=404, content={"error": f"Thread not found: {thread_name}"})

    @app.post("/run_script", response_class=PlainTextResponse)
    def run_script() -> Any:
        return PlainTextResponse(
            "/run_script is never provided by this server (it would execute caller-supplied "
            "code); use the other admin routes",
            status_code=404,
        )

    # ----------------------------------------------------------------- quota
    quotas = storage.sm.quota_manager

    @app.put("/quota/{cache_salt}", response_model=M.QuotaSet)
    async def set_quota(cache_salt: str, request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "invalid JSON body")
        if not isinstance(body, dict) or "limit_gb" not in body:
            return _error(400, "body must be {'limit_gb': <float>}")
        try:
            limit_gb = float(body["limit_gb"])
        except (TypeError, ValueError):
            return _error(400, "limit_gb must be numeric")
        if not math.isfinite(limit_gb):
            return _error(400, "limit_gb must be finite")
        if limit_gb < 0:
            return _error(400, "limit_gb must be non-negative")
        salt = _salt(cache_salt)
        try:
            quotas.set_quota(salt, int(limit_gb * _GB))
        except ValueError as exc:
            return _error(400, str(exc))
        return {"cache_salt": _salt_path(salt), "limit_gb": limit_gb, "status": "ok"}

    @app.get("/quota/{cache_salt}", response_model=M.QuotaInfo)
    def get_quota(cache_salt: str) -> Any:
        salt = _salt(cache_salt)
        usage = storage.sm.get_usage_bytes_by_cache_salt().get(salt, 0)
        return {
            "cache_salt": _salt_path(salt),
            "limit_gb": quotas.get_limit_bytes(salt) / _GB,
            "current_usage_gb": usage / _GB,
            "exists": salt in quotas.list_quotas(),
        }

    @app.delete("/quota/{cache_salt}", response_model=M.QuotaDeleted)
    def delete_quota(cache_salt: str) -> Any:
        salt = _salt(cache_salt)
        removed = quotas.delete_quota(salt)
        return {"cache_salt": _salt_path(salt), "status": "removed" if removed else "not_found"}

    @app.get("/quota", response_model=M.QuotaList)
    def list_quotas() -> Any:
        usage = storage.sm.get_usage_bytes_by_cache_salt()
        return {
            "users": {
                _salt_path(salt): {
                    "limit_gb": limit / _GB,
                    "current_usage_gb": usage.get(salt, 0) / _GB,
                }
                for salt, limit in quotas.list_quotas().items()
            }
        }

    # ----------------------------------------------------------- reconfigure
    # No L2 adapter of ours can be reconfigured at run time and L1 is never Device-DAX:
    # the status routes answer 0.5.6's "nothing reconfigurable" shapes, the operations
    # 0.5.6's errors for that state (docs/compat.md).
    @app.get("/reconfigure/{backend}/l2/status", response_model=M.ReconfigureStatus)
    def reconfigure_status(backend: str) -> Any:
        name = backend.strip().lower()
        if not name:
            return _error(400, "backend must be non-empty")
        return {"enabled": False, "backend": name, "num_adapters": 0, "adapters": []}

    @app.post("/reconfigure/{backend}/l2/{operation}", response_model=M.ErrorResponse)
    def reconfigure_backend(backend: str, operation: str, body: Any = Body(None)) -> Any:
        name = backend.strip().lower()
        if not name:
            return _error(400, "backend must be non-empty")
        if any(s.type_name == name for s in _slots(runtime)):
            return _error(409, f"{name} adapters cannot be reconfigured at run time")
        return _error(404, f"{name} adapter not found")

    _no_dax = "L1 is not Device-DAX backed (--l1-devdax-path not set)"

    @app.get("/reconfigure/dax/l1/status", response_model=M.ErrorResponse)
    def l1_dax_status() -> Any:
        return _error(409, _no_dax)

    @app.post("/reconfigure/dax/l1/add", response_model=M.ErrorResponse)
    @app.post("/reconfigure/dax/l1/remove", response_model=M.ErrorResponse)
    def l1_dax_change(body: Any = Body(None)) -> Any:
        return _error(409, _no_dax)

    return app


def _error(status_code: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status_code, content={"error": message})


def _salt(path_salt: str) -> str:
    return "" if path_salt == DEFAULT_SALT else path_salt


def _salt_path(salt: str) -> str:
    return DEFAULT_SALT if salt == "" else salt


# ---------------------------------------------------------------------- /status


def _status(runtime: Any, sm: dict[str, Any]) -> dict[str, Any]:
    engine, cfg = runtime.engine, runtime.config
    es = engine.status()
    health = runtime.health(sm)
    return {
        "is_healthy": health.healthy,
        "unhealthy_reasons": health.reasons,  # ours: one line per cause
        "engine_type": ENGINE_TYPE,
        "chunk_size": cfg.chunk_size,
        "hash_algorithm": cfg.hash_algorithm,
        **es,
        "storage_manager": sm,
        "kv_events": {"enabled": False},  # no KV event stream (docs/compat.md)
        # ours (extensions): what the old /status showed at the top level
        "l1": {
            "memory_used_bytes": sm["l1_usage"][0],
            "memory_total_bytes": sm["l1_usage"][1],
        },
        "l1_size_bytes": _l1_size(runtime),
        "eviction_policy": _eviction_policy(runtime),
        "transfer_modes": cfg.transfer_modes,
        "engine_driven": {
            "shm_enabled": bool(engine.shm_name),
            "shm_name": engine.shm_name,
            "pool_size": engine.shm_pool_size,
            "shm_disabled_reason": engine.shm_disabled_reason,
        },
        "features": list(engine.features),
    }


def _l1_size(runtime: Any) -> int:
    try:
        return int(runtime.storage_config.l1_manager_config.memory_config.size_in_bytes)
    except AttributeError:
        return 0


def _eviction_policy(runtime: Any) -> str:
    try:
        return runtime.storage_config.eviction_config.eviction_policy
    except AttributeError:
        return ""


# --------------------------------------------------------------------- adapters


def _slots(runtime: Any) -> list[Any]:
    registry = getattr(runtime.storage.sm, "registry", None)
    return list(registry.slots()) if registry is not None else []


def _resolve_adapter(runtime: Any, selector: str | None) -> Any:
    """The adapter slot a request names: 0.5.6's ``type_name``, or (ours) its index;
    none = the primary (first) adapter."""
    slots = _slots(runtime)
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


def _json_safe(value: Any) -> Any:
    """A config value as JSON (tuples/sets as lists, anything else odd as its str)."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "__dict__"):
        return _json_safe(vars(value))
    return str(value)


# -------------------------------------------------------------------- checksums


def block_checksums(
    kv_caches: list[Any],
    layout_hints: dict[str, Any] | None,
    block_ids: list[int],
    blocks_per_chunk: int,
    layerwise: bool,
) -> dict[str, Any]:
    """MD5 digests of the paged KV blocks ``block_ids``, ``blocks_per_chunk`` per chunk.

    A chunk's digest covers, layer after layer, that layer's blocks of the chunk taken along
    its block axis (bfloat16 hashed as float32); with ``layerwise`` each layer gets its own
    list under ``"layer_<i>"``. These are the digests 0.5.6's ``/cache/checksums`` and its
    bench client compute, so digests from either server compare equal for equal KV data."""
    import torch

    from lmcache.v1.multiprocess.transfer_context.base import kv_geometry

    axis = kv_geometry(kv_caches, layout_hints).block_axis
    n = len(block_ids)
    bounds = [(s, min(s + blocks_per_chunk, n)) for s in range(0, n, blocks_per_chunk)]
    per_layer = []
    for kv in kv_caches:
        idx = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
        blocks = kv.index_select(axis, idx).cpu()
        if blocks.dtype == torch.bfloat16:
            blocks = blocks.to(torch.float32)
        per_layer.append(blocks)

    def chunk_bytes(blocks: Any, s: int, e: int) -> bytes:
        return blocks.narrow(axis, s, e - s).contiguous().view(torch.uint8).numpy().tobytes()

    if layerwise:
        sums: Any = {
            f"layer_{li}": [hashlib.md5(chunk_bytes(b, s, e)).hexdigest() for s, e in bounds]
            for li, b in enumerate(per_layer)
        }
    else:
        sums = []
        for s, e in bounds:
            md5 = hashlib.md5()
            for b in per_layer:
                md5.update(chunk_bytes(b, s, e))
            sums.append(md5.hexdigest())
    return {
        "status": "success",
        "chunk_size": blocks_per_chunk,
        "num_chunks": len(bounds),
        "chunk_checksums": sums,
        "layerwise": layerwise,
    }


def compress_ranges(ids: list[int]) -> list[int | list[int]]:
    """Runs of 3+ consecutive ids as ``[first, last]``, the rest as they are, order kept:
    ``[1, 2, 3, 4, 7, 8] -> [[1, 4], 7, 8]``."""
    out: list[int | list[int]] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        if j - i >= 2:
            out.append([ids[i], ids[j]])
        else:
            out.extend(ids[i : j + 1])
        i = j + 1
    return out


# -------------------------------------------------------------------------- /env

MASK = "***"
# A name is secret when one of its words (split at _ . -) is, or contains, one of these.
_SECRET_WORDS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL")
# ... or is one of these (PAT as a word: GITHUB_PAT is secret, PATH is not), or ends in AUTH.
_SECRET_EXACT = frozenset({"PAT", "AUTHORIZATION", "COOKIE", "SIG", "SIGNATURE", "DSN"})
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s]+)@")
_SECRET_PARAM = re.compile(
    r"(?P<name>[?&;](?:[^=&;\s]*(?:token|key|secret|password|passwd|sig|signature|auth|"
    r"credential)[^=&;\s]*)=)(?P<value>[^&;\s]+)",
    re.IGNORECASE,
)


def is_secret_name(name: str) -> bool:
    words = [w for w in re.split(r"[_.\-]", name.upper()) if w]
    return any(
        w in _SECRET_EXACT or w.endswith("AUTH") or any(s in w for s in _SECRET_WORDS)
        for w in words
    )


def mask_value(value: str) -> str:
    """``value`` with URL credentials masked: ``redis://u:p@h`` -> ``redis://***@h`` and
    ``?token=abc`` -> ``?token=***``."""
    value = _USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", value)
    return _SECRET_PARAM.sub(lambda m: f"{m['name']}{MASK}", value)


def masked_environ(environ: Any) -> dict[str, str]:
    return {k: MASK if is_secret_name(k) else mask_value(v) for k, v in environ.items()}


# ------------------------------------------------------- /loglevel and /threads


def _loglevel(logger_name: str | None, level: str | None) -> PlainTextResponse:
    if not logger_name and not level:
        lines = ["=== Loggers and Levels ==="]
        for name, lg in list(logging.Logger.manager.loggerDict.items()):
            if isinstance(lg, logging.Logger):
                lines.append(f"{name}: {logging.getLevelName(lg.level)}")
        return PlainTextResponse("\n".join(lines) + "\n")
    if not logger_name:
        return PlainTextResponse("logger_name is required to set a level", status_code=400)
    target = logging.getLogger(logger_name)
    if not level:
        return PlainTextResponse(f"{logger_name}: {logging.getLevelName(target.level)}")
    value = logging.getLevelName(level.upper())
    if not isinstance(value, int):
        return PlainTextResponse(f"Invalid log level: {level}", status_code=400)
    target.setLevel(value)
    for handler in target.handlers:
        handler.setLevel(value)
    return PlainTextResponse(f"Set {logger_name} level to {level.upper()} (including all handlers)")


def _threads_text(name: str | None, thread_id: int | None) -> str:
    frames = sys._current_frames()
    shown = [
        t
        for t in threading.enumerate()
        if (not name or name.lower() in t.name.lower()) and (not thread_id or t.ident == thread_id)
    ]
    parts = []
    for t in shown:
        frame = frames.get(t.ident) if t.ident is not None else None
        stack = "Stack trace:\n" + "".join(traceback.format_stack(frame)) if frame else ""
        parts.append(f"Thread: {t}\n{stack or 'No stack trace available'}")
    return "\n\n".join(parts) + f"\n\n\n=== Thread Summary ===\nTotal threads: {len(shown)}\n"


# ------------------------------------------------------------ /periodic-threads


def _periodic(runtime: Any) -> list[dict[str, Any]]:
    """Our loops that run on a fixed interval, in 0.5.6's periodic-thread shape.

    The eviction loops count their cycles; the engine's session cleaner and reaper report
    liveness only (``total_runs`` 0, ``last_run_time`` None)."""
    now = time.time()
    sm = runtime.storage.sm
    loops: list[dict[str, Any]] = []
    controllers = list(getattr(sm, "l1_eviction_controllers", []))
    for i, ctl in enumerate(controllers):
        tag = getattr(getattr(ctl, "l1", None), "tag", str(i))
        name = ctl.name if len(controllers) == 1 else f"{ctl.name}-{tag}"
        loops.append(_guarded_loop(ctl, name, "high", now))
    l2 = getattr(sm, "l2_eviction_controller", None)
    if l2 is not None:
        loops.append(_guarded_loop(l2, l2.name, "high", now))
    engine = runtime.engine
    alive = {t.name for t in threading.enumerate() if t.is_alive()}
    for name, interval in (
        ("mp-session-cleaner", engine.clean_period()),
        ("mp-reaper", engine.reap_period()),
    ):
        if interval:
            loops.append(_loop_entry(name, "medium", interval, name in alive, 0, 0, None, now))
    return loops


def _guarded_loop(ctl: Any, name: str, level: str, now: float) -> dict[str, Any]:
    runs = int(ctl.cycles) + int(ctl.errors)
    entry = _loop_entry(
        name,
        level,
        float(ctl.interval_s),
        bool(ctl.thread_alive),
        runs,
        int(ctl.errors),
        ctl.last_run_time,
        now,
    )
    if ctl.last_run_time is not None:
        entry["last_summary"] = {
            "timestamp": ctl.last_run_time,
            "duration_ms": ctl.last_duration_ms,
            "success": not ctl.last_error,
            "message": ctl.last_error or f"cycle {runs} done",
            "extra_info": {},
        }
    return entry


def _loop_entry(
    name: str,
    level: str,
    interval: float,
    running: bool,
    runs: int,
    failed: int,
    last: float | None,
    now: float,
) -> dict[str, Any]:
    # Active: it ran within three intervals (or has not had its first turn yet).
    ago = None if last is None else max(0.0, now - last)
    active = running and (ago is None or ago <= 3 * interval + 1.0)
    return {
        "name": name,
        "level": level,
        "interval": interval,
        "init_wait": 0.0,
        "is_running": running,
        "is_active": active,
        "last_run_time": last,
        "last_run_ago": ago,
        "total_runs": runs,
        "failed_runs": failed,
        "success_rate": 100.0 * (runs - failed) / runs if runs else 100.0,
        "last_summary": None,
    }


def _summary(loops: list[dict[str, Any]]) -> dict[str, Any]:
    def counts(ts: list[dict[str, Any]]) -> dict[str, int]:
        return {
            "total": len(ts),
            "running": sum(1 for t in ts if t["is_running"]),
            "active": sum(1 for t in ts if t["is_active"]),
        }

    overall = counts(loops)
    return {
        "total_count": overall["total"],
        "running_count": overall["running"],
        "active_count": overall["active"],
        "by_level": {lv: counts([t for t in loops if t["level"] == lv]) for lv in _LEVELS},
    }
