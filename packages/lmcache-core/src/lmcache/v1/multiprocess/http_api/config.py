"""Config routes: /config, /config/adapters."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from lmcache.v1.multiprocess import http_models as M
from lmcache.v1.multiprocess.http_api.common import adapter_slots


def add_config_routes(app: FastAPI, runtime: Any) -> None:
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
                for i, slot in enumerate(adapter_slots(runtime))
            ]
        }


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
