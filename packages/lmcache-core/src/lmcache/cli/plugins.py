"""``lmcache plugins [--json]``: what this environment can load.

Lists every device backend (built-in or entry point, with its distribution), whether it
is available on this host (``available``: its ``is_available()``; the CPU backend answers
False and is marked ``fallback`` instead) and which one is selected and why; every device plugin that
failed to load, with the reason; and the L2 adapter types with their failures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
from typing import Any

from lmcache_namespace_guard import check_namespace

from lmcache.cli.errors import CLIError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.set_defaults(func=run)


def _selection(dd: Any, registry: Any) -> dict[str, Any]:
    """Which backend detection picks, and why; detection errors are reported, not raised."""
    explicit = os.environ.get(dd.DEVICE_BACKEND_ENV_VAR, "").strip().lower()
    wanted = os.environ.get(dd.DEVICE_TYPE_ENV_VAR, "").strip().lower()
    try:
        _module, device_type, backend = registry.detect()
    except Exception as exc:
        return {"backend": None, "device_type": None, "reason": f"detection failed: {exc}"}
    if backend is None:
        reason = (
            "no accelerator backend is available; the built-in CPU fallback is used"
            if device_type == "cpu"
            else "detected without a registered backend"
        )
        return {
            "backend": "cpu" if device_type == "cpu" else None,
            "device_type": device_type,
            "reason": reason,
        }
    if explicit:
        reason = f"LMCACHE_DEVICE_BACKEND={explicit}"
    elif wanted and wanted == device_type:
        reason = f"DEVICE_TYPE={wanted} and it is the only available backend of that type"
    else:
        reason = "auto-detected: the first available device type"
    return {"backend": backend, "device_type": device_type, "reason": reason}


def collect() -> dict[str, Any]:
    try:
        from lmcache.v1.platform import _device_detect as dd
    except ImportError as exc:  # torch-free environments still list what they can
        raise CLIError(f"the device platform cannot be imported: {exc}") from None

    notes: list[str] = []
    registry = dd.default_device_registry()
    sources = registry.sources()
    selected = _selection(dd, registry)
    backends = []
    for name, spec in registry.backends().items():
        src = sources.get(name)
        backends.append(
            {
                "name": name,
                "device_type": spec.device_type,
                "spec": f"{type(spec).__module__}:{type(spec).__qualname__}",
                "source": src.kind if src else "unknown",
                "entry_point": src.value if src and src.value else None,
                "distribution": (src.distribution if src and src.distribution else "lmcache-core")
                if src and src.kind != "test"
                else None,
                "version": src.version if src and src.version else None,
                # The spec's own answer (cpu: False, docs/design/platform.md#cpu-device); the CPU
                # backend is the fallback used when nothing else is available, reported separately.
                "available": registry.is_available(spec),
                "fallback": name == "cpu",
                "selected": name == selected.get("backend"),
            }
        )
    failed = [{"name": n, "value": v, "reason": r} for n, v, r in registry.failed_plugins()]

    l2_types: list[dict[str, Any]] = []
    l2_failed: list[dict[str, str]] = []
    try:
        registry_module = importlib.import_module("lmcache.v1.distributed.l2_adapters.registry")
        l2_registry = registry_module.default_l2_adapter_registry()
        l2_types = [dict(t) for t in l2_registry.describe()]
        l2_failed = [
            {"name": n, "value": v, "reason": r} for n, v, r in l2_registry.failed_plugins()
        ]
    except Exception as exc:
        notes.append(f"L2 adapter types unavailable: {type(exc).__name__}: {exc}")
    namespace = check_namespace()
    return {
        "namespace": {
            "ok": namespace.ok,
            "problems": namespace.problems,
            "repair": namespace.repair_commands(),
        },
        "device_backends": backends,
        "selected_device": selected,
        "failed_device_plugins": failed,
        "l2_adapter_types": l2_types,
        "failed_l2_adapter_plugins": l2_failed,
        "notes": notes,
    }


def _source_text(b: dict[str, Any]) -> str:
    if b["source"] == "entry point":
        dist = b["distribution"] or "?"
        ver = f" {b['version']}" if b["version"] else ""
        return f"entry point {b['entry_point']} ({dist}{ver})"
    return b["source"]


def _print_list(title: str, lines: list[str], empty: str) -> None:
    print(title)
    for line in lines or [empty]:
        print(f"  {line}")


def _failure_lines(failures: list[dict[str, Any]]) -> list[str]:
    return [f"{f['name']} = {f['value']}: {f['reason']}" for f in failures]


def _l2_type_line(t: dict[str, Any]) -> str:
    aliases = f" (aliases: {', '.join(t.get('aliases') or [])})" if t.get("aliases") else ""
    origin = t.get("source", "?")
    if t.get("distribution"):
        origin += f", {t['distribution']}" + (f" {t['version']}" if t.get("version") else "")
    return f"{t.get('name')}{aliases}: {origin}"


def _print_text(report: dict[str, Any]) -> None:
    namespace = report["namespace"]
    state = "intact" if namespace["ok"] else "TAKEN OVER (see the problems below)"
    print(f"Namespace lmcache: {state}")
    for problem in namespace["problems"]:
        print(f"  - {problem}")
    for command in namespace["repair"]:
        print(f"  repair: {command}")
    print()
    print("Device backends (entry-point group lmcache.device_plugins):")
    rows = [("BACKEND", "DEVICE_TYPE", "AVAILABLE", "SELECTED", "SOURCE")]
    for b in report["device_backends"]:
        avail = "fallback" if b["fallback"] else ("yes" if b["available"] else "no")
        rows.append(
            (b["name"], b["device_type"], avail, "*" if b["selected"] else "", _source_text(b))
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print(
            "  " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=False)) + "  " + r[4]
        )
    sel = report["selected_device"]
    print(f"Selected: {sel.get('backend') or '<none>'} ({sel['reason']})")
    print()
    _print_list("Failed device plugins:", _failure_lines(report["failed_device_plugins"]), "(none)")
    print()
    _print_list(
        "L2 adapter types (entry-point group lmcache.l2_adapters):",
        [_l2_type_line(t) for t in report["l2_adapter_types"]],
        "(none listed)",
    )
    if report["failed_l2_adapter_plugins"]:
        _print_list(
            "Failed L2 adapter plugins:", _failure_lines(report["failed_l2_adapter_plugins"]), ""
        )
    for note in report["notes"]:
        print(f"note: {note}")


def run(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        _print_text(report)
    return 0
