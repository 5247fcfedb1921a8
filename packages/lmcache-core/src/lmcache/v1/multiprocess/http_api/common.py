"""Helpers the admin API's route modules share."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


def error_response(status_code: int, message: str) -> JSONResponse:
    """The admin API's error reply: ``{"error": message}`` with ``status_code``."""
    return JSONResponse(status_code=status_code, content={"error": message})


def adapter_slots(runtime: Any) -> list[Any]:
    """The L2 adapter slots of the server's storage manager (none without a registry)."""
    registry = getattr(runtime.storage.sm, "registry", None)
    return list(registry.slots()) if registry is not None else []
