"""Service info routes: /, /healthcheck, /status, /version, /lmc_version, /commit_id."""

from __future__ import annotations

import os
from importlib import metadata
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from lmcache.v1.multiprocess import http_models as M
from lmcache.v1.multiprocess.http_api.common import error_response

ENGINE_TYPE = "MPCacheServer"  # what 0.5.6 reports (its engine's class name)


def _version() -> str:
    try:
        return metadata.version("lmcache-core")
    except metadata.PackageNotFoundError:
        return "unknown"


def add_info_routes(app: FastAPI, runtime: Any) -> None:
    storage = runtime.storage

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
            return error_response(503, f"storage status unavailable: {sm['error']}")
        return _status(runtime, sm)

    @app.get("/version", response_model=str)
    @app.get("/lmc_version", response_model=str)
    def version() -> Any:
        return _version()

    @app.get("/commit_id", response_model=str)
    def commit_id() -> Any:
        return os.environ.get("LMCACHE_COMMIT_ID", "unknown")


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
        "kv_events": engine.kv_events_status(),
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
