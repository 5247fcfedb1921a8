"""Quota routes (/quota, /quota/{cache_salt}) and the /reconfigure routes."""

from __future__ import annotations

import math
from typing import Any

from fastapi import Body, FastAPI, Request

from lmcache.v1.multiprocess import http_models as M
from lmcache.v1.multiprocess.http_api.common import adapter_slots, error_response

_GB = 1024**3
# 0.5.6's URL stand-in for the empty (anonymous) cache_salt in /quota/{cache_salt}.
DEFAULT_SALT = "_default"


def add_quota_routes(app: FastAPI, runtime: Any) -> None:
    storage = runtime.storage

    # ----------------------------------------------------------------- quota
    quotas = storage.sm.quota_manager

    @app.put("/quota/{cache_salt}", response_model=M.QuotaSet)
    async def set_quota(cache_salt: str, request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "invalid JSON body")
        if not isinstance(body, dict) or "limit_gb" not in body:
            return error_response(400, "body must be {'limit_gb': <float>}")
        try:
            limit_gb = float(body["limit_gb"])
        except (TypeError, ValueError):
            return error_response(400, "limit_gb must be numeric")
        if not math.isfinite(limit_gb):
            return error_response(400, "limit_gb must be finite")
        if limit_gb < 0:
            return error_response(400, "limit_gb must be non-negative")
        salt = _salt(cache_salt)
        try:
            quotas.set_quota(salt, int(limit_gb * _GB))
        except ValueError as exc:
            return error_response(400, str(exc))
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
            return error_response(400, "backend must be non-empty")
        return {"enabled": False, "backend": name, "num_adapters": 0, "adapters": []}

    @app.post("/reconfigure/{backend}/l2/{operation}", response_model=M.ErrorResponse)
    def reconfigure_backend(backend: str, operation: str, body: Any = Body(None)) -> Any:
        name = backend.strip().lower()
        if not name:
            return error_response(400, "backend must be non-empty")
        if any(s.type_name == name for s in adapter_slots(runtime)):
            return error_response(409, f"{name} adapters cannot be reconfigured at run time")
        return error_response(404, f"{name} adapter not found")

    _no_dax = "L1 is not Device-DAX backed (--l1-devdax-path not set)"

    @app.get("/reconfigure/dax/l1/status", response_model=M.ErrorResponse)
    def l1_dax_status() -> Any:
        return error_response(409, _no_dax)

    @app.post("/reconfigure/dax/l1/add", response_model=M.ErrorResponse)
    @app.post("/reconfigure/dax/l1/remove", response_model=M.ErrorResponse)
    def l1_dax_change(body: Any = Body(None)) -> Any:
        return error_response(409, _no_dax)


def _salt(path_salt: str) -> str:
    return "" if path_salt == DEFAULT_SALT else path_salt


def _salt_path(salt: str) -> str:
    return DEFAULT_SALT if salt == "" else salt
