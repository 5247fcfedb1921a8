"""Prometheus metrics of the MP server (spec/protocol.md 12), names as in LMCache 0.5.6.

One ``ServerMetrics`` per server owns its own ``CollectorRegistry`` (so tests can run
several servers in one process); ``reset()`` rebuilds it for ``POST /metrics/reset``.
prometheus_client appends ``_total`` to counter names. Like 0.5.6's default registry, it
also carries prometheus_client's process (``process_*``) and garbage-collector
(``python_gc_*``) metrics.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
    generate_latest,
)

_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lmcache_mp_lookup_requested_tokens": ("tokens asked for by lookups", ()),
    "lmcache_mp_lookup_hit_tokens": ("tokens found by lookups", ()),
    "lmcache_mp_lookup_hit_l1_tokens": ("lookup hit tokens served from L1", ()),
    "lmcache_mp_lookup_hit_l2_tokens": ("lookup hit tokens loaded from L2", ()),
    "lmcache_mp_lookup_hit_l1_keys": ("lookup hit keys in L1", ()),
    "lmcache_mp_lookup_hit_l2_keys": ("lookup hit keys in L2", ()),
    "lmcache_mp_lookups_requests": ("lookup requests", ()),
    "lmcache_mp_lookup_early_exit_requests": ("lookups answered without a prefetch", ("reason",)),
    "lmcache_mp_num_submitted_stores": ("store requests submitted", ()),
    "lmcache_mp_num_finished_stores": ("store requests finished", ()),
    "lmcache_mp_num_submitted_retrieves": ("retrieve requests submitted", ()),
    "lmcache_mp_num_finished_retrieves": ("retrieve requests finished", ()),
    "lmcache_mp_num_chunks_loaded": ("chunks handed to engines", ()),
    "lmcache_mp_l1_read_chunks": ("chunks read from L1", ()),
    "lmcache_mp_l1_write_chunks": ("chunks written to L1", ()),
    "lmcache_mp_l1_evicted_chunks": ("chunks evicted from L1", ()),
    "lmcache_mp_l1_read_failure_chunks": ("chunks that could not be read", ()),
    "lmcache_mp_l1_allocation_failure_chunks": ("chunks L1 could not allocate", ()),
    "lmcache_mp_l1_eviction_loop_ticks": ("L1 eviction loop ticks", ()),
    "lmcache_mp_l1_eviction_loop_triggered": ("L1 eviction loop triggers", ()),
    "lmcache_mp_l2_evicted_objects_chunks": ("chunks evicted from L2", ()),
    "lmcache_mp_event_bus_dropped_events": ("dropped events (no event bus: 0)", ()),
    "lmcache_mp_timeouts": ("timed out waits", ()),
    "lmcache_mp_request_errors": ("failed requests", ("op", "code")),
    "lmcache_mp_rejected_payloads": ("rejected commit payloads", ("reason",)),
    "lmcache_mp_reaped_instances": ("instances removed by the reaper", ("mode",)),
    "lmcache_mp_sessions_evicted": ("sessions ended because the table was full", ()),
    "lmcache_mp_reclaimed_staging": (
        "unfinished stores and SHM reads of silent workers released",
        (),
    ),
    "lmcache_mp_report_block_allocation": ("report_block_allocation calls", ()),
}

_UNLABELLED = frozenset(n for n, (_, labels) in _COUNTERS.items() if not labels)


def _bad_increment(name: str, amount: float) -> ValueError:
    return ValueError(
        f"counter {name!r} cannot take {amount}: counters only grow, and inc_many takes "
        "unlabelled counters (pass labels to inc for the others)"
    )


_GAUGES: dict[str, str] = {
    "lmcache_mp_active_prefetch_jobs": "prefetch jobs in flight",
    "lmcache_mp_active_p2p_lookup_jobs": "p2p lookups in flight (p2p is not built: 0)",
    "lmcache_mp_l1_memory_usage_bytes": "L1 bytes in use",
    "lmcache_mp_l1_usage_ratio": "L1 used / total",
    "lmcache_mp_l1_staging_bytes": "L1 bytes in write reservations",
    "lmcache_mp_event_bus_queue_depth": "event bus depth (no event bus: 0)",
    "lmcache_mp_event_bus_drain_lag_seconds": "event bus lag (no event bus: 0)",
    "lmcache_mp_kv_events_log_depth": "KV event log depth (not built: 0)",
    "lmcache_mp_shm_enabled": "1 when the engine-driven SHM pool is in use",
    "lmcache_mp_gc_frozen_objects": "objects alive at start-up, left out of garbage collection",
}

_HISTOGRAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lmcache_mp_l0_l1_store_throughput": ("engine->L1 store throughput (GB/s)", ()),
    "lmcache_mp_l0_l1_load_throughput": ("L1->engine load throughput (GB/s)", ()),
    # phase = the transfer op: store, retrieve, prepare_store, commit_store, ...
    "lmcache_mp_transfer_phase_seconds": ("server time per transfer op", ("phase",)),
}


class ServerMetrics:
    def __init__(self, instance_id: str, enabled: bool = True) -> None:
        self.instance_id = instance_id
        self.enabled = enabled
        self._lock = threading.Lock()
        self._gauge_sources: list[Callable[[ServerMetrics], None]] = []
        self._pending: dict[str, float] = {}
        self._pending_lock = threading.Lock()
        self._build()

    def _build(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.set_target_info({"service_instance_id": self.instance_id})
        self.counters = {
            n: Counter(n, doc, labelnames=labels, registry=self.registry)
            for n, (doc, labels) in _COUNTERS.items()
        }
        self.gauges = {n: Gauge(n, doc, registry=self.registry) for n, doc in _GAUGES.items()}
        self.histograms = {
            n: Histogram(n, doc, labelnames=labels, registry=self.registry)
            for n, (doc, labels) in _HISTOGRAMS.items()
        }
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)

    def add_gauge_source(self, fn: Callable[[ServerMetrics], None]) -> None:
        """``fn(metrics)`` refreshes gauges right before each scrape."""
        self._gauge_sources.append(fn)

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        if not self.enabled or amount == 0:
            return
        if labels or name not in _UNLABELLED:
            c = self.counters[name]  # an unknown name or missing labels raise here
            (c.labels(**labels) if labels else c).inc(amount)
            return
        if amount < 0:
            raise _bad_increment(name, amount)
        with self._pending_lock:
            self._pending[name] = self._pending.get(name, 0) + amount

    def inc_many(self, amounts: dict[str, float]) -> None:
        """``inc`` of several unlabelled counters at once. They add up here and reach
        prometheus when read (``render``, ``value``): a lookup bumps seven, and a dict
        update costs a fraction of a prometheus call."""
        if not self.enabled:
            return
        if not amounts.keys() <= _UNLABELLED or min(amounts.values(), default=0) < 0:
            name = next(n for n, a in amounts.items() if n not in _UNLABELLED or a < 0)
            raise _bad_increment(name, amounts[name])
        with self._pending_lock:
            pending = self._pending
            for name, amount in amounts.items():
                if amount:
                    pending[name] = pending.get(name, 0) + amount

    def _publish_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for name, amount in pending.items():
            self.counters[name].inc(amount)

    def set(self, name: str, value: float) -> None:
        if self.enabled:
            self.gauges[name].set(value)

    def observe(self, name: str, value: float, **labels: str) -> None:
        if self.enabled:
            h = self.histograms[name]
            (h.labels(**labels) if labels else h).observe(value)

    def value(self, name: str, **labels: str) -> float:
        """Current counter value (tests and /status)."""
        c = self.counters[name]
        if labels:
            return c.labels(**labels)._value.get()
        self._publish_pending()
        return c._value.get()

    def render(self) -> bytes:
        self.set("lmcache_mp_gc_frozen_objects", gc.get_freeze_count())
        for fn in self._gauge_sources:
            try:
                fn(self)
            except Exception:
                pass
        with self._lock:
            self._publish_pending()
            return generate_latest(self.registry)

    def reset(self) -> None:
        with self._lock:
            with self._pending_lock:
                self._pending = {}
            self._build()
