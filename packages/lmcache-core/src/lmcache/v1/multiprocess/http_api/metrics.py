"""Metrics routes: /metrics, /metrics/reset."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response


def add_metrics_routes(app: FastAPI, runtime: Any) -> None:
    @app.get("/metrics")
    def metrics() -> Response:
        return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/metrics/reset", response_class=PlainTextResponse)
    def metrics_reset() -> Any:
        runtime.metrics.reset()
        return "ok"
