"""HTTP admin API of ``lmcache server`` (docs/design/protocol.md#http-metrics): FastAPI, loopback by
default.

``build_app(runtime)`` returns the app; the CLI serves it with uvicorn. Routes, status codes
and JSON shapes are LMCache 0.5.6's (docs/compat.md "HTTP API" lists every route and the
few intended differences); every JSON route declares its pydantic response model
(http_models.py) so the shapes cannot drift. ``http_guard.AdminGuard`` sits in front:
loopback Host check, JSON-only state-changing requests, a body-size cap. No endpoint
executes code (``/run_script`` always answers 404).

One module per area adds its routes to the app: ``info``, ``config``, ``cache`` (objects,
prefetches, clear, checksums), ``metrics``, ``debug`` (env, log levels, threads,
periodic threads), ``quota`` (quotas, reconfigure). They register on the app itself, not
on included ``APIRouter``s: FastAPI 0.141 keeps an included router as one nested entry of
``app.routes``, and the route table must stay listable (tests/compat compares it with
0.5.6's).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from lmcache.v1.multiprocess.http_api.cache import (
    MAX_DELETE_BATCH,
    MAX_PREFETCH_TOKENS,
    MAX_TRACKED_PREFETCHES,
    add_cache_routes,
)
from lmcache.v1.multiprocess.http_api.checksums import block_checksums, compress_ranges
from lmcache.v1.multiprocess.http_api.config import add_config_routes
from lmcache.v1.multiprocess.http_api.debug import (
    MASK,
    add_debug_routes,
    is_secret_name,
    mask_value,
    masked_environ,
)
from lmcache.v1.multiprocess.http_api.info import ENGINE_TYPE, add_info_routes
from lmcache.v1.multiprocess.http_api.metrics import add_metrics_routes
from lmcache.v1.multiprocess.http_api.quota import DEFAULT_SALT, add_quota_routes
from lmcache.v1.multiprocess.http_guard import AdminGuard, max_body_bytes_from_env

__all__ = [
    "DEFAULT_SALT",
    "ENGINE_TYPE",
    "MASK",
    "MAX_DELETE_BATCH",
    "MAX_PREFETCH_TOKENS",
    "MAX_TRACKED_PREFETCHES",
    "block_checksums",
    "build_app",
    "compress_ranges",
    "is_secret_name",
    "mask_value",
    "masked_environ",
]


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
    for add_routes in (
        add_info_routes,
        add_config_routes,
        add_cache_routes,
        add_metrics_routes,
        add_debug_routes,
        add_quota_routes,
    ):
        add_routes(app, runtime)
    return app
