"""Eviction policies, the L1 and L2 eviction controllers and the quota manager
(docs/design/storage-engine.md#eviction).

Policies only order keys; controllers decide how much to free. Amounts are in bytes
(IMPROVE, docs/design/storage-engine.md#eviction-fixes): keys are taken in policy order until
``ratio x used bytes`` are freed (at least one key). Every controller cycle runs under a try/except;
errors are logged at most once per 60 s per message and counted, three failing cycles in a row mark
the controller unhealthy, and ``ensure_running()`` restarts a dead thread.
"""

from __future__ import annotations

import enum
import threading
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from lmcache.utils import RateLimitedLog, init_logger
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.config import EvictionConfig
from lmcache.v1.distributed.internal_api import L1ManagerListener, L2AdapterListener

logger = init_logger(__name__)

__all__ = [
    "ARCEvictionPolicy",
    "EvictionAction",
    "EvictionDestination",
    "EvictionPolicy",
    "IsolatedLRUEvictionPolicy",
    "L1EvictionController",
    "L2EvictionController",
    "LRUEvictionPolicy",
    "NoopEvictionPolicy",
    "QuotaManager",
    "create_eviction_policy",
]

KeyFilter = Callable[[ObjectKey], bool]


class EvictionDestination(enum.Enum):
    DISCARD = "discard"
    L2_CACHE = "l2_cache"


@dataclass
class EvictionAction:
    destination: EvictionDestination
    keys: list[ObjectKey]


class EvictionPolicy:
    """Tracks keys and yields them in eviction order. Thread-safe."""

    support_isolation = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._destinations: list[EvictionDestination] = []

    def register_eviction_destination(self, dest: EvictionDestination) -> None:
        if dest is EvictionDestination.L2_CACHE:
            logger.info("eviction destination L2_CACHE is treated as DISCARD")
        self._destinations.append(dest)

    def on_keys_reserved(self, keys: list[ObjectKey]) -> None:
        pass

    def on_keys_created(self, keys: list[ObjectKey]) -> None:
        pass

    def on_keys_touched(self, keys: list[ObjectKey]) -> None:
        pass

    def on_keys_removed(self, keys: list[ObjectKey]) -> None:
        pass

    def candidates(
        self, key_eligible_filter: KeyFilter | None = None, cache_salt: str | None = None
    ) -> list[ObjectKey]:
        """All tracked keys in eviction order (a snapshot)."""
        return []

    def num_tracked(self) -> int:
        return 0

    def get_eviction_actions(
        self,
        expected_ratio: float,
        key_eligible_filter: KeyFilter | None = None,
        cache_salt: str | None = None,
    ) -> list[EvictionAction]:
        """0.5.6 key-count form; the controllers use byte amounts via ``candidates``."""
        cands = self.candidates(None, cache_salt)
        n = max(1, int(expected_ratio * len(cands))) if cands else 0
        chosen = [k for k in cands if key_eligible_filter is None or key_eligible_filter(k)][:n]
        if not chosen:
            return []
        return [EvictionAction(EvictionDestination.DISCARD, chosen)]

    def capture(self) -> Any:
        return self.candidates()

    def restore(self, state: Any) -> None:
        self.on_keys_created(list(reversed(list(state))))


class NoopEvictionPolicy(EvictionPolicy):
    """Tracks nothing, never evicts (buffer-only mode with --l2-store-policy skip_l1)."""


def _filtered(keys: Iterable[ObjectKey], f: KeyFilter | None) -> list[ObjectKey]:
    return [k for k in keys if f is None or f(k)]


class LRUEvictionPolicy(EvictionPolicy):
    def __init__(self) -> None:
        super().__init__()
        self._order: OrderedDict[ObjectKey, None] = OrderedDict()

    def on_keys_reserved(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            for k in reversed(keys):
                if k not in self._order:
                    self._order[k] = None

    def on_keys_created(self, keys: list[ObjectKey]) -> None:
        # reverse: a prompt's later chunks become older and leave first; prefixes survive
        with self._lock:
            for k in reversed(keys):
                self._order[k] = None
                self._order.move_to_end(k)

    def on_keys_touched(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            move = self._order.move_to_end
            for k in reversed(keys):
                try:
                    move(k)
                except KeyError:  # not tracked (yet): nothing to refresh
                    pass

    def on_keys_removed(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            for k in keys:
                self._order.pop(k, None)

    def candidates(
        self, key_eligible_filter: KeyFilter | None = None, cache_salt: str | None = None
    ) -> list[ObjectKey]:
        with self._lock:
            snap = list(self._order)
        if cache_salt is not None:
            snap = [k for k in snap if k.cache_salt == cache_salt]
        return _filtered(snap, key_eligible_filter)

    def num_tracked(self) -> int:
        with self._lock:
            return len(self._order)


class IsolatedLRUEvictionPolicy(LRUEvictionPolicy):
    """One LRU per cache_salt: the global recency order, filtered by salt when asked.
    Without a salt it evicts in global recency order (IMPROVE: 0.5.6 raised, killing the
    eviction thread)."""

    support_isolation = True

    def salts(self) -> set[str]:
        return {k.cache_salt for k in self.candidates()}


class ARCEvictionPolicy(EvictionPolicy):
    """Adaptive replacement: T1 (seen once), T2 (seen again), ghosts B1/B2, target p.

    Capacity is the largest resident count seen. Ties (|T1| == p) evict from T1."""

    def __init__(self) -> None:
        super().__init__()
        self.t1: OrderedDict[ObjectKey, None] = OrderedDict()
        self.t2: OrderedDict[ObjectKey, None] = OrderedDict()
        self.b1: OrderedDict[ObjectKey, None] = OrderedDict()
        self.b2: OrderedDict[ObjectKey, None] = OrderedDict()
        self.p = 0.0
        self.capacity = 0
        self._reserved_only: set[ObjectKey] = set()

    def _trim_ghosts(self) -> None:
        c = max(1, self.capacity)
        while len(self.b1) + len(self.b2) > c:
            victim = self.b1 if len(self.b1) >= len(self.b2) and self.b1 else self.b2
            victim.popitem(last=False)

    def on_keys_reserved(self, keys: list[ObjectKey]) -> None:
        # a reservation is tracked (so an abandoned one can be evicted) but is not an access:
        # its creation must not count as a second reference
        with self._lock:
            for k in reversed(keys):
                if k not in self.t1 and k not in self.t2:
                    self.t1[k] = None
                    self._reserved_only.add(k)

    def on_keys_created(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            for k in reversed(keys):
                if k in self._reserved_only:
                    self._reserved_only.discard(k)
                    self.t1.move_to_end(k)
                    continue
                if k in self.t1:
                    del self.t1[k]
                    self.t2[k] = None
                elif k in self.t2:
                    self.t2.move_to_end(k)
                elif k in self.b1:
                    self.p = min(
                        float(self.capacity), self.p + max(len(self.b2) / max(1, len(self.b1)), 1.0)
                    )
                    del self.b1[k]
                    self.t2[k] = None
                elif k in self.b2:
                    self.p = max(0.0, self.p - max(len(self.b1) / max(1, len(self.b2)), 1.0))
                    del self.b2[k]
                    self.t2[k] = None
                else:
                    self.t1[k] = None
            self.capacity = max(self.capacity, len(self.t1) + len(self.t2))
            self._trim_ghosts()

    def on_keys_touched(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            for k in reversed(keys):
                if k in self.t1:
                    del self.t1[k]
                    self.t2[k] = None
                elif k in self.t2:
                    self.t2.move_to_end(k)

    def on_keys_removed(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            for k in keys:
                if k in self._reserved_only:  # an abandoned reservation leaves no ghost
                    self._reserved_only.discard(k)
                    self.t1.pop(k, None)
                    continue
                if k in self.t1:
                    del self.t1[k]
                    self.b1[k] = None
                elif k in self.t2:
                    del self.t2[k]
                    self.b2[k] = None
            self._trim_ghosts()

    def candidates(
        self, key_eligible_filter: KeyFilter | None = None, cache_salt: str | None = None
    ) -> list[ObjectKey]:
        with self._lock:
            if len(self.t1) >= self.p and self.t1:
                order = list(self.t1) + list(self.t2)
            else:
                order = list(self.t2) + list(self.t1)
        if cache_salt is not None:
            order = [k for k in order if k.cache_salt == cache_salt]
        return _filtered(order, key_eligible_filter)

    def num_tracked(self) -> int:
        with self._lock:
            return len(self.t1) + len(self.t2)


_POLICIES: dict[str, type[EvictionPolicy]] = {
    "LRU": LRUEvictionPolicy,
    "ARC": ARCEvictionPolicy,
    "IsolatedLRU": IsolatedLRUEvictionPolicy,
    "noop": NoopEvictionPolicy,
}


def create_eviction_policy(name: str) -> EvictionPolicy:
    try:
        policy = _POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"eviction.eviction_policy must be 'LRU', 'ARC', 'IsolatedLRU', or 'noop', got {name!r}"
        ) from None
    policy.register_eviction_destination(EvictionDestination.DISCARD)
    return policy


def pick_by_bytes(
    candidates: Iterable[ObjectKey], size_of: Callable[[ObjectKey], int], target: float
) -> list[ObjectKey]:
    """Keys in order until ``target`` bytes are covered; at least one key."""
    out, freed = [], 0
    for k in candidates:
        out.append(k)
        freed += max(0, size_of(k))
        if freed >= target:
            break
    return out


class _GuardedLoop:
    """A daemon thread running ``run_once`` every interval, guarded and restartable."""

    name = "eviction"

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.cycles = 0
        self.errors = 0
        self.consecutive_errors = 0
        self._failures = RateLimitedLog(logger, interval=60.0)  # per distinct error
        self.restarts = 0
        # the last cycle, for /periodic-threads: wall-clock start, duration, error ("" = none)
        self.last_run_time: float | None = None
        self.last_duration_ms = 0.0
        self.last_error = ""

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def ensure_running(self) -> None:
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            logger.warning("%s thread died; restarting it", self.name)
            self.restarts += 1
            self.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.cycle()

    def cycle(self) -> None:
        self.last_run_time = time.time()
        t0 = time.perf_counter()
        try:
            self.run_once()
            self.cycles += 1
            self.consecutive_errors = 0
            self.last_error = ""
        except Exception as exc:
            self.errors += 1
            self.consecutive_errors += 1
            msg = f"{type(exc).__name__}: {exc}"
            self.last_error = msg
            self._failures.error(
                msg, "%s cycle failed: %s\n%s", self.name, msg, traceback.format_exc()
            )
        finally:
            self.last_duration_ms = (time.perf_counter() - t0) * 1000.0

    def run_once(self) -> None:
        raise NotImplementedError

    @property
    def is_healthy(self) -> bool:
        return self.consecutive_errors < 3

    def cycle_counts(self) -> dict[str, int]:
        """The loop's counters, as ``report_status`` shows them under "eviction"."""
        return {k: getattr(self, k) for k in ("cycles", "errors", "consecutive_errors", "restarts")}

    @property
    def thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 2)


class L1EvictionController(_GuardedLoop, L1ManagerListener):
    """Bridges L1 events into a policy and evicts when usage passes the watermark."""

    name = "l1-eviction"

    def __init__(self, l1: Any, config: EvictionConfig, interval_s: float = 1.0) -> None:
        _GuardedLoop.__init__(self, interval_s)
        self.l1 = l1
        self.config = config
        self.policy = create_eviction_policy(config.eviction_policy)
        self.evicted_keys = 0
        self.triggered = 0
        l1.register_listener(self)
        if config.eviction_policy != "noop":
            l1.set_eviction_candidate_source(lambda: self.policy.candidates())

    # listener bridge (called inside the L1 lock: record only)
    def on_l1_keys_reserved_write(self, keys: list[ObjectKey]) -> None:
        self.policy.on_keys_reserved(keys)

    def on_l1_keys_write_finished(self, keys: list[ObjectKey]) -> None:
        self.policy.on_keys_created(keys)

    def on_l1_keys_finish_write_and_reserve_read(self, keys: list[ObjectKey]) -> None:
        self.policy.on_keys_created(keys)

    def on_l1_keys_accessed(self, keys: list[ObjectKey]) -> None:
        self.policy.on_keys_touched(keys)

    def on_l1_keys_deleted_by_manager(self, keys: list[ObjectKey]) -> None:
        self.policy.on_keys_removed(keys)

    def run_once(self) -> None:
        used, total = self.l1.get_memory_usage()
        if total <= 0 or used / total < self.config.trigger_watermark:
            return
        self.triggered += 1
        target = self.config.eviction_ratio * used
        cands = self.policy.candidates(self.l1.is_key_evictable)
        if not cands:
            return
        victims = pick_by_bytes(cands, self.l1.get_key_size, target)
        res = self.l1.delete(victims)
        self.evicted_keys += sum(1 for e in res.values() if e.name == "SUCCESS")

    def report_status(self) -> dict[str, Any]:
        return {
            "policy": self.config.eviction_policy,
            "eviction_policy": self.config.eviction_policy,
            "thread_alive": self.thread_alive,
            "trigger_watermark": self.config.trigger_watermark,
            "eviction_ratio": self.config.eviction_ratio,
            "tracked_keys": self.policy.num_tracked(),
            "evicted_keys": self.evicted_keys,
            "triggered_cycles": self.triggered,
            "eviction": self.cycle_counts(),
            "is_healthy": self.is_healthy,
        }


class QuotaManager:
    """Per-cache_salt byte limits for L2 eviction. An unregistered salt's limit is the
    default limit: 0 (allowlist) unless ``set_default_limit_bytes`` changed it (None = exempt)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._quotas: dict[str, int] = {}
        self._default: int | None = 0

    def set_quota(self, cache_salt: str, limit_bytes: int) -> None:
        if int(limit_bytes) < 0:
            raise ValueError(f"quota limit must be >= 0 bytes (got {limit_bytes})")
        with self._lock:
            self._quotas[cache_salt] = int(limit_bytes)

    def delete_quota(self, cache_salt: str) -> bool:
        with self._lock:
            return self._quotas.pop(cache_salt, None) is not None

    def get_limit_bytes(self, cache_salt: str) -> int:
        with self._lock:
            return self._quotas.get(cache_salt, 0)

    def set_default_limit_bytes(self, limit: int | None) -> None:
        with self._lock:
            self._default = None if limit is None else int(limit)

    def get_default_limit_bytes(self) -> int | None:
        with self._lock:
            return self._default

    def effective_limit_bytes(self, cache_salt: str) -> int | None:
        with self._lock:
            if cache_salt in self._quotas:
                return self._quotas[cache_salt]
            return self._default

    def list_quotas(self) -> dict[str, int]:
        with self._lock:
            return dict(self._quotas)


class _L2Tracker(L2AdapterListener):
    """Feeds one adapter's notifications into its policy and remembers sizes."""

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.sizes: dict[ObjectKey, int] = {}
        self._lock = threading.Lock()

    def on_l2_keys_stored(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        with self._lock:
            for k, s in zip(keys, sizes, strict=False):
                if s > 0 or k not in self.sizes:
                    self.sizes[k] = int(s)
        self.policy.on_keys_created(keys)

    def on_l2_keys_accessed(self, keys: list[ObjectKey]) -> None:
        self.policy.on_keys_touched(keys)

    def on_l2_keys_deleted(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            for k in keys:
                self.sizes.pop(k, None)
        self.policy.on_keys_removed(keys)

    def size_of(self, key: ObjectKey) -> int:
        with self._lock:
            return self.sizes.get(key, 0)


@dataclass
class _L2Entry:
    index: int
    adapter: Any
    config: EvictionConfig
    tracker: _L2Tracker


class L2EvictionController(_GuardedLoop):
    name = "l2-eviction"

    def __init__(self, quota_manager: QuotaManager | None = None, interval_s: float = 1.0) -> None:
        super().__init__(interval_s)
        self.quota_manager = quota_manager
        self._entries: dict[int, _L2Entry] = {}
        self._lock = threading.Lock()
        self.evicted_keys = 0

    def add_adapter(self, index: int, adapter: Any, config: EvictionConfig) -> bool:
        """Track an adapter with an eviction block. Returns False when it is gated off."""
        policy = create_eviction_policy(config.eviction_policy)
        if not policy.support_isolation and not adapter.supports_global_eviction:
            logger.warning(
                "L2 adapter #%d: eviction policy %s needs a capacity (max_capacity > 0); "
                "eviction disabled for it",
                index,
                config.eviction_policy,
            )
            return False
        tracker = _L2Tracker(policy)
        adapter.register_listener(tracker)
        with self._lock:
            self._entries[index] = _L2Entry(index, adapter, config, tracker)
        return True

    def remove_adapter(self, index: int) -> None:
        with self._lock:
            self._entries.pop(index, None)

    def run_once(self) -> None:
        with self._lock:
            entries = list(self._entries.values())
        for e in entries:
            self._evict_adapter(e)

    def _evict_adapter(self, e: _L2Entry) -> None:
        policy = e.tracker.policy
        usage = e.adapter.get_usage()
        cfg = e.config
        victims: list[ObjectKey] = []
        if policy.support_isolation and self.quota_manager is not None:
            for salt, used in usage.bytes_by_cache_salt.items():
                limit = self.quota_manager.effective_limit_bytes(salt)
                if limit is None:
                    continue  # exempt
                if used < cfg.trigger_watermark * limit and limit > 0:
                    continue
                ratio = 1.0 if limit == 0 else cfg.eviction_ratio
                cands = policy.candidates(None, salt)
                victims += pick_by_bytes(cands, e.tracker.size_of, ratio * used)
        else:
            frac = usage.usage_fraction
            if frac < 0 or frac < cfg.trigger_watermark:
                return
            cands = policy.candidates()
            victims = pick_by_bytes(
                cands, e.tracker.size_of, cfg.eviction_ratio * usage.total_bytes_used
            )
        if victims:
            before = len(e.tracker.sizes)
            e.adapter.delete(victims)
            self.evicted_keys += max(0, before - len(e.tracker.sizes))

    def report_status(self) -> dict[str, Any]:
        with self._lock:
            adapters = [
                {
                    "adapter_index": i,
                    "policy": e.config.eviction_policy,
                    "tracked_keys": e.tracker.policy.num_tracked(),
                }
                for i, e in self._entries.items()
            ]
        return {
            "adapters": adapters,
            "thread_alive": self.thread_alive,
            "evicted_keys": self.evicted_keys,
            "eviction": self.cycle_counts(),
            "is_healthy": self.is_healthy,
        }
