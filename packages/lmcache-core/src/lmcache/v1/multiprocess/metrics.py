"""Prometheus metrics of the MP server (docs/design/protocol.md#http-metrics): LMCache 0.5.6's names
and label sets, so a dashboard built on 0.5.6 keeps working, plus series of our own.

0.5.6 exports OpenTelemetry instruments through Prometheus; what a scrape shows is
``<name>_<unit>_total{labels}``. We keep the same series without OpenTelemetry: counters
and gauges live in one dict per kind (a dict update per bump, rendered by a collector at
scrape time), histograms are prometheus_client's. A label set is fixed per metric except
``cache_salt`` on the L1 chunk counters, which 0.5.6 adds only for salted keys.

One ``ServerMetrics`` per server owns its own ``CollectorRegistry`` (tests run several
servers in one process); ``reset()`` empties it for ``POST /metrics/reset``. As 0.5.6's
default registry does, it carries prometheus_client's process, garbage-collector and
platform (``python_info``) metrics, and ``target_info`` with the OpenTelemetry resource
labels (``service_instance_id`` = ``--instance-id``).
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable, Iterator
from importlib import metadata

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

LOOKUP = ("cache_salt", "model_name")

# name -> (help, label names, label names added only when non-empty)
_COUNTERS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    # lookups (0.5.6)
    "lmcache_mp_lookup_requested_tokens": ("tokens asked for by lookups", LOOKUP, ()),
    "lmcache_mp_lookup_hit_tokens": ("tokens found by lookups (contiguous prefix)", LOOKUP, ()),
    "lmcache_mp_lookup_hit_l1_tokens": ("lookup hit tokens L1 already held", LOOKUP, ()),
    "lmcache_mp_lookup_hit_l2_tokens": ("lookup hit tokens loaded from L2", LOOKUP, ()),
    "lmcache_mp_lookup_hit_l1_keys": ("lookup hit keys L1 already held", LOOKUP, ()),
    "lmcache_mp_lookup_hit_l2_keys": ("lookup hit keys loaded from L2", LOOKUP, ()),
    "lmcache_mp_lookups_requests": ("completed lookups", LOOKUP, ()),
    # ours: of lookup_hit_tokens, the tokens of partial_chunk tails (peers with the feature)
    "lmcache_mp_lookup_hit_tail_tokens": (
        "lookup hit tokens found in partial-chunk tails (part of lookup_hit_tokens)",
        LOOKUP,
        (),
    ),
    "lmcache_mp_lookup_early_exit_requests": (
        "lookups answered without a cache probe, by reason",
        (*LOOKUP, "reason"),
        (),
    ),
    # transfers (0.5.6 counts lmcache_driven transfers; we count engine_driven ones too)
    "lmcache_mp_num_submitted_stores": ("store transfers started", ("device",), ()),
    "lmcache_mp_num_finished_stores": ("store transfers finished", ("device",), ()),
    "lmcache_mp_num_submitted_retrieves": ("retrieve transfers started", ("device",), ()),
    "lmcache_mp_num_finished_retrieves": ("retrieve transfers finished", ("device",), ()),
    # ours: FEATURE_RETRIEVE_DEADLINE
    "lmcache_mp_num_late_retrieves_skipped": (
        "retrieves not copied because they reached the server after the worker's deadline",
        ("device",),
        (),
    ),
    "lmcache_mp_num_chunks_loaded": (
        "chunks handed to engines",
        ("cache_salt", "model_name", "worker_id"),
        (),
    ),
    # L1 (0.5.6)
    "lmcache_mp_l1_read_chunks": ("chunks read from L1", ("l1_tag",), ("cache_salt",)),
    "lmcache_mp_l1_write_chunks": ("chunks written to L1", ("l1_tag",), ("cache_salt",)),
    "lmcache_mp_l1_evicted_chunks": ("chunks evicted from L1", ("l1_tag",), ("cache_salt",)),
    "lmcache_mp_l1_read_failure_chunks": (
        "L1 reads that failed after a lookup",
        ("during", "reason", "model_name"),
        (),
    ),
    "lmcache_mp_l1_allocation_failure_chunks": (
        "chunks L1 could not allocate",
        ("during", "model_name"),
        (),
    ),
    "lmcache_mp_l1_eviction_loop_ticks": ("L1 eviction loop iterations", (), ()),
    "lmcache_mp_l1_eviction_loop_triggered": ("L1 eviction loop iterations that evicted", (), ()),
    # L2 (0.5.6; fed from the storage layer's totals at each scrape)
    "lmcache_mp_l2_store_submitted_requests": ("L2 store tasks submitted", (), ()),
    "lmcache_mp_l2_store_submitted_objects_chunks": ("chunks submitted for L2 store", (), ()),
    "lmcache_mp_l2_store_completed_requests": ("L2 store tasks completed", ("l2_name",), ()),
    "lmcache_mp_l2_store_completed_objects_chunks": ("chunks stored to L2", (), ()),
    "lmcache_mp_l2_load_completed_requests": ("L2 load tasks completed", ("l2_name",), ()),
    "lmcache_mp_l2_prefetch_lookup_requests": ("L2 prefetch lookups", (), ()),
    "lmcache_mp_l2_prefetch_lookup_objects_chunks": ("chunks looked up in L2", (), ()),
    "lmcache_mp_l2_prefetch_load_submitted_requests": ("L2 load tasks submitted", (), ()),
    "lmcache_mp_l2_prefetch_load_submitted_objects_chunks": ("chunks asked of L2", (), ()),
    "lmcache_mp_l2_prefetch_load_completed_chunks": ("chunks loaded from L2", (), ()),
    "lmcache_mp_l2_prefetch_failure_chunks": (
        "chunks found in L2 that did not load",
        ("reason", "model_name"),
        (),
    ),
    "lmcache_mp_l2_evicted_objects_chunks": ("chunks evicted from L2", (), ()),
    # ours: loads an adapter's serde refused (corrupt, truncated, wrong key): misses
    "lmcache_mp_l2_serde_rejected_chunks": (
        "L2 objects a serde rejected on load (served as misses)",
        ("l2_name", "serde"),
        (),
    ),
    # internals (0.5.6; 0 where we have no such queue)
    "lmcache_mp_event_bus_dropped_events": ("dropped events (no event bus: 0)", (), ()),
    "lmcache_mp_timeouts": ("timed out waits", ("exception_type",), ()),
    # ours
    "lmcache_mp_request_errors": ("failed requests", ("op", "code"), ()),
    "lmcache_mp_l2_store_failed_requests": ("L2 store tasks that failed (some key)", (), ()),
    "lmcache_mp_l2_store_failed_objects_chunks": ("chunks an L2 store did not store", (), ()),
    "lmcache_mp_rejected_payloads": ("rejected commit payloads", ("reason",), ()),
    "lmcache_mp_reaped_instances": ("instances removed by the reaper", ("mode",), ()),
    "lmcache_mp_sessions_evicted": ("sessions ended because the table was full", (), ()),
    "lmcache_mp_reclaimed_staging": (
        "unfinished stores and SHM reads of silent workers released",
        (),
        (),
    ),
    "lmcache_mp_report_block_allocation": ("report_block_allocation calls", (), ()),
}

# name -> (help, label names)
_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "lmcache_mp_active_prefetch_jobs": ("prefetch jobs in flight", ()),
    "lmcache_mp_active_p2p_lookup_jobs": ("p2p lookups in flight (p2p is not provided: 0)", ()),
    "lmcache_mp_l1_memory_usage_bytes": ("L1 bytes in use", ("backend", "l1_tag")),
    "lmcache_mp_l1_usage_ratio": ("L1 used / total", ("backend", "l1_tag")),
    "lmcache_mp_l1_staging_bytes": ("L1 bytes in write reservations", ("backend", "l1_tag")),
    "lmcache_mp_l2_store_adapters": ("L2 adapters storing, by state", ("l1_tag", "state")),
    "lmcache_mp_l2_prefetch_adapters": ("L2 adapters prefetching, by state", ("state",)),
    "lmcache_mp_l2_usage_bytes": ("bytes an L2 adapter holds", ("l2_name",)),
    "lmcache_mp_event_bus_queue_depth": ("event bus depth (no event bus: 0)", ()),
    "lmcache_mp_event_bus_drain_lag_seconds": ("event bus lag (no event bus: 0)", ()),
    "lmcache_mp_kv_events_log_depth": (
        "records in the KV event log (--kv-event-log-size caps it)",
        (),
    ),
    "lmcache_mp_shm_enabled": ("1 when the engine-driven SHM pool is in use", ()),
    "lmcache_mp_gc_frozen_objects": (
        "objects alive at start-up, left out of garbage collection",
        (),
    ),
}

# 0.5.6's throughput buckets (GB/s).
_GBPS_BUCKETS = (0, 5, 10, 25, 50, 75, 100, 250, 500, 750, 1000, 2500, 5000, 7500, 10000)
# 0.5.6's lifecycle buckets (seconds).
_LIFECYCLE_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400)
_HISTOGRAMS: dict[str, tuple[str, tuple[str, ...], tuple[float, ...] | None]] = {
    "lmcache_mp_l0_l1_store_throughput_GB_per_second": (
        "engine->L1 store throughput per request (GB/s)",
        ("device", "engine_id", "model_name"),
        _GBPS_BUCKETS,
    ),
    "lmcache_mp_l0_l1_load_throughput_GB_per_second": (
        "L1->engine load throughput per request (GB/s)",
        ("device", "engine_id", "model_name"),
        _GBPS_BUCKETS,
    ),
    "lmcache_mp_l2_store_throughput_GB_per_second": (
        "L1->L2 store throughput per task, submit to completion (GB/s)",
        ("l2_name",),
        _GBPS_BUCKETS,
    ),
    "lmcache_mp_l2_load_throughput_GB_per_second": (
        "L2->L1 load throughput per task, submit to completion (GB/s)",
        ("l2_name",),
        _GBPS_BUCKETS,
    ),
    **{
        f"lmcache_mp_l1_chunk_{name}_seconds": (doc, ("l1_tag",), _LIFECYCLE_BUCKETS)
        for name, doc in (
            ("lifetime", "time a sampled chunk spent in L1, written to gone"),
            ("idle_before_evict", "time a sampled chunk sat unused before it left L1"),
            ("reuse_gap", "time between two uses (write or read) of a sampled chunk"),
            ("evict_reuse_gap", "time from a sampled chunk leaving L1 to its next write (<= 300)"),
        )
    },
    # ours: phase = the transfer op (store, retrieve, prepare_store, commit_store, ...)
    "lmcache_mp_transfer_phase_seconds": ("server time per transfer op", ("phase",), None),
}

# Series shown from start-up, before anything happened (0.5.6 shows the first two then).
_ALWAYS: dict[str, dict[str, str]] = {
    "lmcache_mp_l1_eviction_loop_ticks": {},
    "lmcache_mp_event_bus_dropped_events": {},
    "lmcache_mp_l1_evicted_chunks": {"l1_tag": "_default"},
}

Labels = tuple[tuple[str, str], ...]


def _version() -> str:
    try:
        return metadata.version("lmcache-core")
    except metadata.PackageNotFoundError:
        return "unknown"


class _Series:
    """Values of one kind (counter or gauge) keyed by (name, sorted labels)."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, Labels], float] = {}
        self.lock = threading.Lock()

    def snapshot(self) -> dict[str, list[tuple[Labels, float]]]:
        with self.lock:
            items = list(self.values.items())
        out: dict[str, list[tuple[Labels, float]]] = {}
        for (name, labels), v in items:
            out.setdefault(name, []).append((labels, v))
        return out


class _Collector:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        counters = self.m._counters.snapshot()
        for name, (doc, _labels, _optional) in _COUNTERS.items():
            series = counters.get(name) or []
            if not series and name in _ALWAYS:
                series = [(tuple(sorted(_ALWAYS[name].items())), 0.0)]
            if series:
                fam = Metric(name, doc, "counter")
                for labels, v in sorted(series):
                    fam.add_sample(f"{name}_total", dict(labels), v)
                yield fam
        gauges = self.m._gauges.snapshot()
        for name, (doc, _labels) in _GAUGES.items():
            if name in gauges:
                fam = Metric(name, doc, "gauge")
                for labels, v in sorted(gauges[name]):
                    fam.add_sample(name, dict(labels), v)
                yield fam


class ServerMetrics:
    def __init__(self, instance_id: str, enabled: bool = True) -> None:
        self.instance_id = instance_id
        self.enabled = enabled
        self._render_lock = threading.Lock()
        self._gauge_sources: list[Callable[[ServerMetrics], None]] = []
        self._build()

    def _build(self) -> None:
        self._counters = _Series()
        self._gauges = _Series()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.set_target_info(
            {
                "service_instance_id": self.instance_id,
                "service_name": os.environ.get("OTEL_SERVICE_NAME", "unknown_service"),
                "telemetry_sdk_language": "python",
                "telemetry_sdk_name": "lmcache",
                "telemetry_sdk_version": _version(),
            }
        )
        self.registry.register(_Collector(self))
        self.histograms = {
            n: Histogram(
                n,
                doc,
                labelnames=labels,
                registry=self.registry,
                **({"buckets": buckets} if buckets else {}),
            )
            for n, (doc, labels, buckets) in _HISTOGRAMS.items()
        }
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)

    def add_gauge_source(self, fn: Callable[[ServerMetrics], None]) -> None:
        """``fn(metrics)`` refreshes gauges (and storage-fed counters) before each scrape."""
        self._gauge_sources.append(fn)

    @staticmethod
    def _key(name: str, labels: dict[str, str]) -> tuple[str, Labels]:
        doc_labels = _COUNTERS.get(name)
        if doc_labels is None:
            raise KeyError(f"unknown counter {name!r}")
        _doc, required, optional = doc_labels
        given = labels.keys()
        if not set(required) <= given <= set(required) | set(optional):
            raise ValueError(
                f"counter {name!r} takes the labels {list(required)}"
                + (f" (and {list(optional)} when set)" if optional else "")
                + f", got {sorted(given)}"
            )
        items = tuple(sorted((k, str(v)) for k, v in labels.items() if k in required or v))
        return name, items

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        self.inc_many({name: amount}, **labels)

    def inc_many(self, amounts: dict[str, float], **labels: str) -> None:
        """``inc`` of several counters that take the same labels; nothing counts if one
        of them is unknown, takes other labels, or would shrink."""
        if not self.enabled:
            return
        keys = [(self._key(name, labels), amount) for name, amount in amounts.items()]
        for (name, _labels), amount in keys:
            if amount < 0:
                raise ValueError(f"counter {name!r} cannot take {amount}: counters only grow")
        with self._counters.lock:
            values = self._counters.values
            for key, amount in keys:  # a 0 still shows the series, as in 0.5.6
                values[key] = values.get(key, 0.0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        if not self.enabled:
            return
        _doc, names = _GAUGES[name]
        if set(labels) != set(names):
            raise ValueError(f"gauge {name!r} takes the labels {list(names)}, got {sorted(labels)}")
        key = (name, tuple(sorted((k, str(v)) for k, v in labels.items())))
        with self._gauges.lock:
            self._gauges.values[key] = float(value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        if self.enabled:
            h = self.histograms[name]
            (h.labels(**labels) if labels else h).observe(value)

    def value(self, name: str, **labels: str) -> float:
        """A counter's total over the series whose labels include ``labels`` (tests, /status)."""
        if name not in _COUNTERS:
            raise KeyError(f"unknown counter {name!r}")
        want = {(k, str(v)) for k, v in labels.items()}
        with self._counters.lock:
            return sum(
                v for (n, lbl), v in self._counters.values.items() if n == name and want <= set(lbl)
            )

    def render(self) -> bytes:
        self.set("lmcache_mp_gc_frozen_objects", gc.get_freeze_count())
        for fn in self._gauge_sources:
            try:
                fn(self)
            except Exception:
                pass
        with self._render_lock:
            return generate_latest(self.registry)

    def reset(self) -> None:
        with self._render_lock:
            self._build()
