"""Debug routes: /env, /loglevel, /threads, /periodic-threads*, and the /run_script
that always answers 404."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
import time
import traceback
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse

from lmcache.v1.multiprocess import http_models as M

_LEVELS = ("critical", "high", "medium", "low")


def add_debug_routes(app: FastAPI, runtime: Any) -> None:
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
