"""``lmcache describe {kvcache,engine}``: what a running service holds, in one report.

``kvcache`` reads the MP server's ``/status`` (default ``http://localhost:8080``): health,
chunk size, L1 capacity and use, eviction policy, cached objects, sessions, one section per
registered model (``models``) and its kernel groups (``kernel_groups``), one per L2 adapter
(``l2_adapters``). ``engine`` reads an OpenAI server's ``/v1/models``, ``/health`` and
``/metrics`` (default ``http://localhost:8000``). The entries and their JSON keys are
LMCache 0.5.6's.
"""

from __future__ import annotations

import argparse
from typing import Any

from lmcache.cli.report import Report, add_output_args

GIB = 1024**3

# (key in a kernel group of /status, label), in the order 0.5.6 prints them.
_KERNEL_GROUP_FIELDS = (
    ("kernel_group_idx", "Kernel group index"),
    ("engine_group_idx", "Engine group index"),
    ("object_group_idx", "Object group index"),
    ("num_layers", "Num layers"),
    ("tokens_per_block", "Tokens per block"),
    ("slots_per_block", "Slots per block"),
    ("dtype", "Dtype"),
    ("is_mla", "MLA"),
    ("attention_backend", "Attention backend"),
    ("engine_kv_shape", "Engine KV shape"),
    ("engine_kv_concrete_shape", "Engine KV tensor shape"),
)

_LAYOUT_FIELDS = (
    ("num_layers", "Num layers"),
    ("num_blocks", "Num blocks"),
    ("cache_size_per_token", "Cache size per token (bytes)"),
)
_ADAPTER_FIELDS = (
    ("backend", "Backend"),
    ("base_path", "Base path"),
    ("stored_object_count", "Stored objects"),
)


def _add_present(section: Any, source: dict[str, Any], fields: Any) -> None:
    """One entry per (key, label) of ``fields`` that ``source`` has."""
    for key, label in fields:
        if key in source:
            section.add(key, label, source[key])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=("kvcache", "engine"), help="what to describe")
    parser.add_argument(
        "--url",
        default=None,
        help="server URL (default: http://localhost:8080 for kvcache, "
        "http://localhost:8000 for engine)",
    )
    add_output_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lmcache.cli.http_client import DEFAULT_URLS, base_url, call

    url = base_url(args.url or DEFAULT_URLS[args.target])
    if args.target == "engine":
        return _describe_engine(args, url)
    describe_kvcache(call("GET", f"{url}/status"), url).emit(args)
    return 0


def describe_kvcache(status: dict[str, Any], url: str) -> Report:
    """The ``describe kvcache`` report of one ``/status`` reply."""
    sm = _dict(status.get("storage_manager"))
    l1 = _dict(sm.get("l1_manager"))
    report = Report("LMCache KV Cache Service", width=50)
    report.add("health", "Health", _health(status.get("is_healthy")))
    report.add("url", "URL", url)
    report.add("engine_type", "Engine type", status.get("engine_type"))
    report.add("chunk_size", "Chunk size", status.get("chunk_size"))
    total, used, ratio = (
        l1.get("memory_total_bytes"),
        l1.get("memory_used_bytes"),
        l1.get("memory_usage_ratio"),
    )
    report.add(
        "l1_capacity_gb", "L1 capacity (GB)", None if total is None else round(total / GIB, 2)
    )
    report.add(
        "l1_used_gb",
        "L1 used (GB)",
        None if used is None or ratio is None else f"{used / GIB:.2f} ({ratio * 100:.1f}%)",
    )
    # 0.5.6's describe reads storage_manager.eviction_controller, which its own /status no
    # longer fills (N/A there); the policy lives in l1_eviction_controller.
    evict = _dict(sm.get("l1_eviction_controller")) or _dict(sm.get("eviction_controller"))
    report.add("eviction_policy", "Eviction policy", evict.get("eviction_policy"))
    report.add("cached_objects", "Cached objects", l1.get("total_object_count"))
    report.add("active_sessions", "Active sessions", status.get("active_sessions"))
    _add_models(report, status)
    _add_l2_adapters(report, sm.get("l2_adapters") or [])
    return report


def _add_models(report: Report, status: dict[str, Any]) -> None:
    """One ``models`` entry per (model, world size), then its kernel groups. Workers that
    registered without a device layout (engine-driven, CPU) are listed from
    ``non_cuda_context_meta`` after the others; 0.5.6's describe leaves them out."""
    models: dict[tuple[str, int], dict[str, Any]] = {}
    for meta_key in ("cache_context_meta", "non_cuda_context_meta"):
        for worker_id, meta in _dict(status.get(meta_key)).items():
            if not isinstance(meta, dict) or "model_name" not in meta:
                continue
            entry = models.setdefault(
                (meta["model_name"], meta.get("world_size")),
                {"ids": [], "layout": meta.get("kv_cache_layout")},
            )
            if str(worker_id) not in entry["ids"]:
                entry["ids"].append(str(worker_id))
    for idx, ((model, world_size), entry) in enumerate(models.items()):
        sec = report.section(f"model_{idx}", f"Model: {model}", group="models")
        sec.add("model", "Model", model)
        sec.add("world_size", "World size", world_size)
        sec.add("gpu_ids", "GPU IDs", ", ".join(entry["ids"]))
        layout = entry["layout"] or {}
        _add_present(sec, layout, _LAYOUT_FIELDS)
        for group in layout.get("kernel_groups") or []:
            kg = report.section(
                f"model_{idx}_kg_{group.get('kernel_group_idx')}",
                f"Kernel group {group.get('kernel_group_idx')} ({model})",
                group="kernel_groups",
            )
            kg.add("model", "Model", model)
            _add_present(kg, group, _KERNEL_GROUP_FIELDS)


def _add_l2_adapters(report: Report, adapters: list[Any]) -> None:
    for idx, adapter in enumerate(a for a in adapters if isinstance(a, dict)):
        kind = adapter.get("type", "Unknown")
        sec = report.section(f"l2_{idx}", f"L2: {kind}", group="l2_adapters")
        sec.add("type", "Type", kind)
        sec.add("health", "Health", _health(adapter.get("is_healthy")))
        _add_present(sec, adapter, _ADAPTER_FIELDS)
        cap, used = adapter.get("max_capacity_bytes"), adapter.get("current_size_bytes")
        if cap is not None and used is not None:
            pct = used / cap * 100 if cap > 0 else 0.0
            sec.add("used", "Used", f"{_bytes(used)} / {_bytes(cap)} ({pct:.1f}%)")
        size, free = adapter.get("pool_size"), adapter.get("pool_free_slots")
        if size is not None and free is not None:
            pct = (size - free) / size * 100 if size > 0 else 0.0
            sec.add("pool_used", "Pool used", f"{size - free} / {size} ({pct:.1f}%)")


def _describe_engine(args: argparse.Namespace, url: str) -> int:
    from lmcache.cli.http_client import call, get_text

    models = _dict(call("GET", f"{url}/v1/models")).get("data") or []
    first = models[0] if models and isinstance(models[0], dict) else {}
    healthy = get_text(f"{url}/health") is not None
    report = Report("Inference Engine", width=50)
    report.add("model", "Model", first.get("id"))
    report.add("max_context", "Max context (tokens)", first.get("max_model_len"))
    report.add("status", "Status", _health(healthy))
    report.add(
        "running_requests", "Running requests", _running_requests(get_text(f"{url}/metrics"))
    )
    report.emit(args)
    return 0


def _running_requests(text: str | None) -> int | None:
    """Sum of vLLM's ``vllm:num_requests_running`` samples, or None when absent."""
    if text is None:
        return None
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith("vllm:num_requests_running"):
            continue
        name, _, rest = line.partition(" ") if "{" not in line else line.partition("} ")
        if name.split("{")[0] != "vllm:num_requests_running":
            continue
        try:
            total += float(rest.split()[0])
            found = True
        except (ValueError, IndexError):
            return None
    return int(total) if found else None


def _health(flag: Any) -> str | None:
    return None if flag is None else ("OK" if flag else "UNHEALTHY")


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1024**3), ("MB", 1024**2), ("KB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
