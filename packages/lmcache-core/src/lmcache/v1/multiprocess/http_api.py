"""HTTP admin API of ``lmcache server`` (spec/protocol.md 11): FastAPI, loopback by default.

No endpoint executes code (there is no ``/run_script``). ``build_app(runtime)`` returns
the app; the CLI serves it with uvicorn.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import os
import threading
import time
from importlib import metadata
from typing import Any

from fastapi import Body, FastAPI, HTTPException, Query
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from lmcache.utils import init_logger

logger = init_logger(__name__)

_MASK = ("KEY", "SECRET", "TOKEN", "PASSWORD")


def _version() -> str:
    try:
        return metadata.version("lmcache-core")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_app(runtime: Any) -> FastAPI:
    app = FastAPI(title="LMCache HTTP API", docs_url=None, redoc_url=None)
    engine = runtime.engine
    storage = runtime.storage
    prefetches: dict[str, dict[str, Any]] = {}
    prefetch_ids = itertools.count(1)

    @app.get("/")
    def root() -> dict[str, str]:
        return {"status": "ok", "service": "LMCache HTTP API"}

    @app.get("/healthcheck")
    def healthcheck() -> Any:
        health = runtime.health()
        if health.healthy:
            return {"status": "healthy"}
        return JSONResponse(
            status_code=503, content={"status": "unhealthy", "reason": health.reason}
        )

    @app.get("/status")
    def status() -> dict[str, Any]:
        cfg = runtime.config
        sm = storage.status()
        used, total = storage.memory_usage()
        health = runtime.health(sm)
        return {
            "is_healthy": health.healthy,
            "unhealthy_reasons": health.reasons,
            "engine_type": "default",
            "chunk_size": cfg.chunk_size,
            "hash_algorithm": cfg.hash_algorithm,
            **engine.status(),
            "storage_manager": sm,
            "l1": {"memory_used_bytes": used, "memory_total_bytes": total},
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

    @app.get("/version")
    @app.get("/lmc_version")
    def version() -> str:
        return _version()

    @app.get("/commit_id")
    def commit_id() -> str:
        return os.environ.get("LMCACHE_COMMIT_ID", "unknown")

    @app.get("/config")
    def config() -> dict[str, Any]:
        sc = runtime.storage_config
        return {
            "mp": vars(runtime.config).copy(),
            "storage_manager": sc.to_dict() if hasattr(sc, "to_dict") else {},
            "observability": {"metrics_enabled": runtime.metrics.enabled},
            "http": {"host": runtime.http_host, "port": runtime.http_port},
            "coordinator": None,
        }

    @app.get("/config/adapters")
    def config_adapters() -> dict[str, Any]:
        return {"adapters": _adapters(runtime)}

    @app.get("/cache/objects")
    def list_objects(
        tier: str = "l2",
        adapter: int | None = None,
        model_name: str | None = None,
        page_size: int = Query(1000, ge=1, le=5000),
        page_token: str | None = None,
    ) -> dict[str, Any]:
        if tier != "l2":
            raise HTTPException(
                400, f"tier {tier!r} cannot be listed; only tier=l2 supports listing"
            )
        adapters = _adapter_objects(runtime)
        if not adapters:
            raise HTTPException(503, "no L2 adapter is configured; start with --l2-adapter")
        idx = adapter or 0
        if not 0 <= idx < len(adapters):
            raise HTTPException(400, f"adapter index {idx} out of range (0..{len(adapters) - 1})")
        a = adapters[idx]
        try:
            page = a.list_l2_keys(model_name=model_name, page_size=page_size, cursor=page_token)
        except NotImplementedError as exc:
            raise HTTPException(501, str(exc)) from None
        entries = [
            {
                "key": _key_json(e.key),
                "size_bytes": e.size_bytes,
            }
            for e in page.entries
        ]
        return {
            "adapter": idx,
            "shared": bool(getattr(a, "_shared", False)),
            "entries": entries,
            "next_page_token": page.next_page_token,
        }

    @app.delete("/cache/objects")
    def delete_objects(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        from lmcache.v1.distributed.api import EncodedObjectKey

        tier = body.get("tier", "l2")
        force = bool(body.get("force", False))
        try:
            keys = [EncodedObjectKey(**k).to_object_key() for k in body.get("keys", [])]
        except Exception as exc:
            raise HTTPException(400, f"bad keys: {exc}") from exc
        deleted = skipped = 0
        if tier in ("l1", "all"):
            d, s = runtime.storage.sm.delete_l1_keys(keys, force)
            deleted, skipped = deleted + _n(d), skipped + _n(s)
        if tier in ("l2", "all"):
            adapters = _adapter_objects(runtime)
            if not adapters and tier == "l2":
                raise HTTPException(503, "no L2 adapter is configured")
            for a in adapters:
                try:
                    a.delete(keys)
                    deleted += len(keys)
                except Exception:
                    skipped += len(keys)
        return {"deleted": deleted, "skipped": skipped, "ok": True}

    @app.post("/cache/prefetches", status_code=202)
    def submit_prefetch(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        from lmcache.v1.multiprocess import protocol as P

        try:
            key = P.IPCCacheServerKey(
                model_name=body["model_name"],
                world_size=int(body.get("world_size", 1)),
                worker_id=None,
                token_ids=list(body["token_ids"]),
                start=0,
                end=len(body["token_ids"]),
                request_id=f"http-prefetch-{next(prefetch_ids)}",
                cache_salt=body.get("cache_salt", ""),
                num_kv_readers=1,
            )
            P.validate_key(key, chunk_aligned=False, chunk_size=engine.cs)
        except Exception as exc:
            raise HTTPException(400, f"bad prefetch request: {exc}") from exc
        from lmcache.v1.multiprocess.engine import RequestContext

        ctx = RequestContext(b"http", frozenset(), lambda v: None)
        engine.lookup(ctx, key)
        total = (key.end // engine.cs) * key.world_size
        prefetches[key.request_id] = {
            "request_id": key.request_id,
            "total": total,
            "ws": key.world_size,
        }
        return {"id": key.request_id}

    @app.get("/cache/prefetches/{pid}")
    def prefetch_status(pid: str) -> dict[str, Any]:
        info = prefetches.get(pid)
        if info is None:
            raise HTTPException(404, f"unknown prefetch id {pid!r}")
        if "found" not in info:
            session = engine.sessions.get(pid)
            if session is not None and session.job is not None and not session.job.is_done:
                return {"id": pid, "status": "pending"}
            hit = engine._consume(session) or 0
            info["found"] = hit * info["ws"]
            engine.end_session(None, pid)
        return {"id": pid, "status": "completed", "found": info["found"], "total": info["total"]}

    @app.post("/cache/clear")
    def clear(body: dict[str, Any] | None = Body(None)) -> dict[str, Any]:
        body = body or {}
        tier = body.get("tier", "l1")
        if tier != "l1":
            raise HTTPException(400, f"only tier 'l1' can be cleared (got {tier!r})")
        storage.clear(bool(body.get("force", False)))
        return {"ok": True, "tier": "l1"}

    @app.post("/cache/checksums")
    def checksums(body: dict[str, Any] = Body(...)) -> dict[str, Any]:
        from lmcache.v1.multiprocess.transfer_context.base import gather_paged_kv_to_cpu

        inst = engine.instances.get(int(body.get("instance_id", -1)))
        if inst is None or not inst.kv_caches:
            raise HTTPException(404, "unknown lmcache_driven instance_id")
        bpc = int(body.get("chunk_size", 1))
        ids = list(body.get("block_ids", []))
        sums = []
        for i in range(0, len(ids), bpc):
            chunk = gather_paged_kv_to_cpu(
                inst.kv_caches, ids[i : i + bpc], bpc, inst.layout_hints
            )[0]
            sums.append(
                hashlib.md5(
                    chunk.contiguous().view(-1).view(dtype=_u8()).numpy().tobytes()
                ).hexdigest()
            )
        return {"checksums": sums}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/metrics/reset")
    def metrics_reset() -> dict[str, bool]:
        runtime.metrics.reset()
        return {"ok": True}

    @app.get("/env")
    def env() -> dict[str, str]:
        return {
            k: ("***" if any(m in k.upper() for m in _MASK) else v) for k, v in os.environ.items()
        }

    @app.get("/loglevel")
    def loglevel() -> dict[str, str]:
        return {"level": logging.getLevelName(logging.getLogger("lmcache").level)}

    @app.get("/threads")
    def threads() -> dict[str, Any]:
        return {
            "threads": [
                {"name": t.name, "daemon": t.daemon, "alive": t.is_alive()}
                for t in threading.enumerate()
            ]
        }

    def _periodic() -> list[dict[str, Any]]:
        return [
            {"name": t.name, "alive": t.is_alive()}
            for t in threading.enumerate()
            if t.name.startswith(("mp-", "mq-"))
        ]

    @app.get("/periodic-threads")
    def periodic_threads() -> dict[str, Any]:
        return {"threads": _periodic(), "time": time.time()}

    @app.get("/periodic-threads-health")
    def periodic_threads_health() -> dict[str, Any]:
        ts = _periodic()
        return {"healthy": all(t["alive"] for t in ts), "threads": ts}

    @app.get("/periodic-threads/{name}")
    def periodic_thread(name: str) -> dict[str, Any]:
        for t in _periodic():
            if t["name"] == name:
                return t
        raise HTTPException(404, f"no periodic thread named {name!r}")

    @app.post("/run_script")
    def run_script() -> PlainTextResponse:
        return PlainTextResponse("/run_script is never provided by this server", status_code=404)

    return app


def _u8():
    import torch

    return torch.uint8


def _n(v: Any) -> int:
    return len(v) if hasattr(v, "__len__") else int(v or 0)


def _adapter_objects(runtime: Any) -> list[Any]:
    getter = getattr(runtime.storage.sm, "get_l2_adapters", None)
    return list(getter()) if getter is not None else []


def _adapters(runtime: Any) -> list[dict[str, Any]]:
    return [
        {"index": i, "type": getattr(a, "backend_name", type(a).__name__), "reconfigurable": False}
        for i, a in enumerate(_adapter_objects(runtime))
    ]


def _l1_size(runtime: Any) -> int:
    try:
        return int(runtime.storage_config.l1_manager_config.memory_config.size_in_bytes)
    except AttributeError:
        return 0


def _eviction_policy(runtime: Any) -> str:
    sc = runtime.storage_config
    try:
        return sc.eviction_config.eviction_policy
    except AttributeError:
        return ""


def _key_json(key: Any) -> Any:
    """An L2 listing key as JSON (ObjectKeys in their hex-encoded form)."""
    from lmcache.v1.distributed.api import ObjectKey

    if isinstance(key, ObjectKey):
        return key.to_encoded_object_key().to_dict()
    return dataclasses.asdict(key) if dataclasses.is_dataclass(key) else key
