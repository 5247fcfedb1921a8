"""Helpers the admin API's route modules share."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


def _error(status_code: int, message: str) -> JSONResponse:
    return JSONResponse(status_code=status_code, content={"error": message})


def _slots(runtime: Any) -> list[Any]:
    registry = getattr(runtime.storage.sm, "registry", None)
    return list(registry.slots()) if registry is not None else []
