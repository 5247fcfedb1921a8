"""Prefetch controller: L2 -> L1 (docs/design/storage-engine.md#prefetch-controller).

Requests run on a pool of ``max_in_flight`` worker threads (the in-flight cap). A single
poller thread watches every adapter's lookup and load fds and hands results to the waiting
request by ``(adapter_index, task_id)``. Each request: lock L1 hits, look up the remaining
keys in every live adapter in parallel, plan (prefix fold, sliding-window aware, or "full"),
reserve staging buffers, load, admit, fold again and publish a ``PrefetchResult``.

Deadlines (IMPROVE): a lookup or load past its deadline is a miss; its late result is
cleaned up by the poller (unlock found keys; delete staging, unpin, unlock). Three expiries in
a row suspend an adapter from prefetch for 30 s.

Why one module of ~780 lines: ``PrefetchController`` and ``_RequestRun`` (one request's
lookup, plan, reserve and load steps) share the waiter table and the adapter slots under
the controller's lock (``_RequestRun`` takes ``ctl._mu`` and fills ``ctl._waiters``);
together, that lock's rules stay in one file. The seam if it grows: ``_RequestRun`` into
a module of its own, with the waiter table behind methods of the controller.
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from lmcache.lmcache_native import Bitmap, fold_grouped, unfold_grouped
from lmcache.utils import RateLimitedLog, init_logger
from lmcache.v1.distributed.adapter_poll import POLL_MS, AdapterFdPoller, FdTarget, run_poll_loop
from lmcache.v1.distributed.adapter_registry import AdapterRegistry, AdapterSlot, submit_lookup
from lmcache.v1.distributed.api import (
    LockMode,
    ObjectKey,
    PrefetchHandle,
    PrefetchResult,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.internal_api import L1Error
from lmcache.v1.distributed.l2_adapters.health import failure_cause
from lmcache.v1.distributed.storage_policies import PrefetchPolicy
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform.event_notifier import create_event_notifier

logger = init_logger(__name__)
# Failed loads of one adapter: the first at once, then one line (with a count) per 30 s.
_failure_log = RateLimitedLog(logger, interval=30.0)

__all__ = ["PrefetchController"]

SUSPEND_AFTER_EXPIRIES = 3
SUSPEND_SECONDS = 30.0


@dataclass
class _Waiter:
    kind: str  # "lookup" | "load"
    event: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    late: Callable[[Any], None] | None = None  # set when the requester gave up


@dataclass
class _Request:
    rid: int
    spec: PrefetchTaskSpec
    external_id: str
    skip_l2: bool
    done: threading.Event = field(default_factory=threading.Event)
    result: PrefetchResult | None = None
    aborted: bool = False


class PrefetchController:
    def __init__(
        self,
        l1s: list[Any],
        registry: AdapterRegistry,
        policy: PrefetchPolicy,
        max_in_flight: int = 8,
        lookup_timeout_s: float = 30.0,
        load_timeout_s: float = 60.0,
    ) -> None:
        self.l1s = l1s
        self.registry = registry
        self.policy = policy
        self.max_in_flight = max(1, int(max_in_flight))
        self.lookup_timeout_s = float(lookup_timeout_s)
        self.load_timeout_s = float(load_timeout_s)
        self._ids = itertools.count(1)
        self._mu = threading.Lock()
        self._requests: dict[int, _Request] = {}
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._waiters: dict[tuple[int, int], _Waiter] = {}
        self._expiries: dict[int, int] = {}
        self._suspended_until: dict[int, float] = {}
        self._inflight_by_adapter: dict[int, int] = {}
        self._running = 0
        self._control = create_event_notifier()
        self._stop = threading.Event()
        self.stats = {
            "requests": 0,
            "lookup_requests": 0,
            "load_tasks": 0,
            "loaded_keys": 0,
            "failed_keys": 0,
            "expired_lookups": 0,
            "expired_loads": 0,
            "aborted": 0,
            "lookup_keys": 0,
            "load_keys": 0,
        }
        self.loaded_tasks_by_adapter: dict[str, int] = {}  # by type name
        # (adapter type, GB/s) of finished load tasks, submit to completion; metrics drain it
        self.load_throughput: collections.deque[tuple[str, float]] = collections.deque(maxlen=4096)
        # keys found in L2 that did not load, by (reason, model name)
        self.failed_keys_by: collections.Counter[tuple[str, str]] = collections.Counter()
        self._poller = threading.Thread(target=self._poll_loop, name="prefetch-poller", daemon=True)
        self._poller.start()
        self._workers = [
            threading.Thread(target=self._worker, name=f"prefetch-worker-{i}", daemon=True)
            for i in range(self.max_in_flight)
        ]
        for w in self._workers:
            w.start()

    # --- public ----------------------------------------------------------------------------------

    def submit(
        self, spec: PrefetchTaskSpec, external_request_id: str = "", skip_l2: bool = False
    ) -> PrefetchHandle:
        windows = [g.sliding_window_size for g in spec.key_groups]
        total = sum(len(g.keys) for g in spec.key_groups)
        if spec.fetching_policy == "full" and any(w > 0 for w in windows):
            raise ValueError("fetching_policy 'full' does not support sliding windows")
        if total == 0:
            return PrefetchHandle(-1, external_request_id, 0, time.time(), windows)
        rid = next(self._ids)
        # With no L2 adapter to ask, a request is served from L1 alone either way.
        skip_l2 = skip_l2 or not self.registry.any_serving()
        req = _Request(rid, spec, external_request_id, skip_l2)
        with self._mu:
            self._requests[rid] = req
        self.stats["requests"] += 1
        handle = PrefetchHandle(rid, external_request_id, total, time.time(), windows)
        logger.debug(
            "prefetch %d (%s) submitted: %d rows x %d chunks, policy=%s, lock=%s, skip_l2=%s",
            rid,
            external_request_id,
            len(spec.key_groups),
            spec.num_chunks,
            spec.fetching_policy,
            spec.lock_mode.value,
            skip_l2,
        )
        if skip_l2:
            self._run(req)  # served synchronously from L1
        else:
            self._queue.put(req)
        return handle

    def lookup_l1_now(self, rows: list[list[ObjectKey]], readers: int) -> int | None:
        """A prefix lookup served at once from the single L1, without a request object, when
        ``submit`` would serve it from L1 alone too (one L1; no L2 adapter, or every key
        resident): the hit prefix, read-locked ``readers`` times. None when it needs the
        full path."""
        if len(self.l1s) != 1:
            return None
        l1 = self.l1s[0]
        if self.registry.any_serving() and not l1.contains_all(k for row in rows for k in row):
            return None
        self.stats["requests"] += 1
        return l1.reserve_read_prefix(rows, readers)

    def query(self, handle: PrefetchHandle) -> PrefetchResult | None:
        """The result once; None while running (and after it was returned)."""
        if handle.prefetch_request_id == -1:
            return PrefetchResult([], [], [], None, [])
        with self._mu:
            req = self._requests.get(handle.prefetch_request_id)
            if req is None or not req.done.is_set():
                return None
            del self._requests[handle.prefetch_request_id]
            return req.result

    def wait(self, handle: PrefetchHandle, timeout: float | None = None) -> bool:
        if handle.prefetch_request_id == -1:
            return True
        with self._mu:
            req = self._requests.get(handle.prefetch_request_id)
        if req is None:
            return False
        return req.done.wait(timeout)

    def inflight_for(self, adapter_index: int) -> int:
        with self._mu:
            return self._inflight_by_adapter.get(adapter_index, 0)

    def is_suspended(self, adapter_index: int) -> bool:
        with self._mu:
            return self._suspended_until.get(adapter_index, 0.0) > time.monotonic()

    # --- worker pool -------------------------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            req = self._queue.get()
            if req is None:
                return
            with self._mu:
                self._running += 1
            try:
                self._run(req)
            finally:
                with self._mu:
                    self._running -= 1

    def _run(self, req: _Request) -> None:
        try:
            req.result = _all_miss(req.spec) if req.aborted else _RequestRun(self, req).execute()
        except Exception:
            logger.exception("prefetch %d failed; reporting all-miss", req.rid)
            self.stats["aborted"] += 1
            req.result = _all_miss(req.spec)
        logger.debug("prefetch %d done: %d hit keys", req.rid, req.result.num_hit_keys())
        with self._mu:
            req.done.set()
            release = req.aborted
        if release:
            self._release_result(req)

    def abort(self, handle: PrefetchHandle) -> bool:
        """Client abort: the request's locks are released (now, or when it finishes) and its
        result is dropped. Returns False for an unknown or already collected request."""
        with self._mu:
            req = self._requests.pop(handle.prefetch_request_id, None)
            if req is None:
                return False
            req.aborted = True
            finished = req.done.is_set()
        self.stats["aborted"] += 1
        if finished:
            self._release_result(req)
        return True

    def _release_result(self, req: _Request) -> None:
        """Release the read locks a finished request holds on its hit cells."""
        res, req.result = req.result, _all_miss(req.spec)
        if res is None or req.spec.lock_mode is LockMode.NO_LOCK:
            return
        by_l1: dict[int, list[ObjectKey]] = {}
        for r, bm in enumerate(res.hit_cells):
            for c in bm.get_indices_list():
                owner = res.l1_owners[r][c] if res.l1_owners else 0
                by_l1.setdefault(max(0, owner), []).append(req.spec.key_groups[r].keys[c])
        for li, keys in by_l1.items():
            self.l1s[li].finish_read(keys, req.spec.num_kv_readers)

    # --- waiting on adapters ------------------------------------------------------------------------

    def _adapter_busy(self, idx: int, delta: int) -> None:
        with self._mu:
            self._inflight_by_adapter[idx] = self._inflight_by_adapter.get(idx, 0) + delta

    def submit_and_wait(
        self,
        slot: AdapterSlot,
        kind: str,
        fn: Callable[[], int],
        timeout_s: float,
        on_late: Callable[[Any], None],
    ) -> Any:
        """Submit with ``fn`` and wait for the result. Returns None on deadline (``on_late``
        then receives the result when it arrives) or when the submit raised."""
        w = _Waiter(kind)
        self._adapter_busy(slot.index, +1)
        try:
            with self._mu:  # the poller queries under this lock: no result can slip by
                task_id = fn()
                self._waiters[(slot.index, int(task_id))] = w
        except Exception:
            self._adapter_busy(slot.index, -1)
            logger.exception(
                "L2 adapter #%d (%s) submit (%s) raised", slot.index, slot.type_name, kind
            )
            return None
        self._control.notify()
        got = w.event.wait(timeout_s if timeout_s > 0 else None)
        with self._mu:
            if not got and not w.event.is_set():
                w.late = on_late
                self._note_expiry(slot, kind)
                return None
            self._expiries[slot.index] = 0
        self._adapter_busy(slot.index, -1)
        return w.result

    def _note_expiry(self, slot: AdapterSlot, kind: str) -> None:
        # called with self._mu held
        self.stats["expired_lookups" if kind == "lookup" else "expired_loads"] += 1
        n = self._expiries.get(slot.index, 0) + 1
        self._expiries[slot.index] = n
        logger.warning(
            "L2 adapter #%d (%s) %s missed its deadline (%d in a row)",
            slot.index,
            slot.type_name,
            kind,
            n,
        )
        if n >= SUSPEND_AFTER_EXPIRIES:
            self._suspended_until[slot.index] = time.monotonic() + SUSPEND_SECONDS
            self._expiries[slot.index] = 0
            logger.error(
                "L2 adapter #%d (%s) suspended from prefetch for %.0f s",
                slot.index,
                slot.type_name,
                SUSPEND_SECONDS,
            )

    def _poll_loop(self) -> None:
        poller = AdapterFdPoller(self.registry, (self._control,), {1: "lookup", 2: "load"})
        run_poll_loop(self._stop, poller, self._poll_step, "prefetch poller")

    def _poll_step(self, targets: set[FdTarget] | None) -> None:
        if not targets:  # timed out or only woken: check every task waited on
            with self._mu:
                targets = {(i, w.kind) for (i, _t), w in self._waiters.items()}
        self._deliver(targets)

    def _deliver(self, targets: set[tuple[int, str]]) -> None:
        late_calls: list[tuple[Callable[[Any], None], Any, int]] = []
        with self._mu:
            for (idx, tid), w in list(self._waiters.items()):
                if (idx, w.kind) not in targets:
                    continue
                slot = self.registry.get(idx)
                if slot is None:
                    continue
                try:
                    if w.kind == "lookup":
                        res = slot.adapter.query_lookup_and_lock_result(tid)
                    else:
                        res = slot.adapter.query_load_result(tid)
                except Exception:
                    logger.exception("L2 adapter #%d query (%s) raised", idx, w.kind)
                    res = Bitmap(0)
                if res is None:
                    continue
                del self._waiters[(idx, tid)]
                w.result = res
                if w.late is not None:
                    late_calls.append((w.late, res, idx))
                w.event.set()
        for fn, res, idx in late_calls:
            try:
                fn(res)
            except Exception:
                logger.exception("late-result cleanup failed")
            self._adapter_busy(idx, -1)

    # --- lifecycle ---------------------------------------------------------------------------------

    def report_status(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._mu:
            suspended = [i for i, t in self._suspended_until.items() if t > now]
            pending = sum(1 for r in self._requests.values() if not r.done.is_set())
            return {
                "max_in_flight": self.max_in_flight,
                "running_requests": self._running,
                "queued_requests": self._queue.qsize(),
                "pending_results": pending,
                # 0.5.6's names: its lookup/load phases are one step here
                "thread_alive": self._poller.is_alive(),
                "submission_queue_size": self._queue.qsize(),
                "pending_queue_size": self._queue.qsize(),
                "in_flight_request_count": self._running,
                "lookup_phase_count": self._running,
                "load_phase_count": len(self._waiters),
                "completed_results_count": len(self._requests) - pending,
                **self.registry.counts(),
                "waiting_adapter_tasks": len(self._waiters),
                "suspended_adapters": suspended,
                "lookup_timeout_seconds": self.lookup_timeout_s,
                "load_timeout_seconds": self.load_timeout_s,
                **self.stats,
                "load_tasks_completed_by_adapter": dict(self.loaded_tasks_by_adapter),
                "failed_keys_by_reason_and_model": [
                    [reason, model, n] for (reason, model), n in self.failed_keys_by.items()
                ],
                "is_healthy": self._poller.is_alive() and not suspended,
            }

    def close(self) -> None:
        self._stop.set()
        for _ in self._workers:
            self._queue.put(None)
        self._control.notify()
        for w in self._workers:
            w.join(timeout=2)
        self._poller.join(timeout=POLL_MS / 1000.0 + 2)
        with self._mu:
            for w in self._waiters.values():
                w.event.set()
            self._waiters.clear()
            for req in self._requests.values():
                if not req.done.is_set():
                    req.result = _all_miss(req.spec)
                    req.done.set()
        self._control.close()


def _all_miss(spec: PrefetchTaskSpec) -> PrefetchResult:
    n = spec.num_chunks
    rows = len(spec.key_groups)
    return PrefetchResult(
        [Bitmap(n) for _ in range(rows)],
        [Bitmap(n) for _ in range(rows)],
        [Bitmap(n) for _ in range(rows)],
        [Bitmap(n) for _ in range(rows)] if spec.fetching_policy == "full" else None,
        [[-1] * n for _ in range(rows)],
    )


class _RequestRun:
    """One request's state: which L1 or adapter holds and locks each cell (row, col)."""

    def __init__(self, ctl: PrefetchController, req: _Request) -> None:
        self.ctl = ctl
        self.req = req
        self.spec = req.spec
        self.rows = len(self.spec.key_groups)
        self.cols = self.spec.num_chunks
        self.windows = [g.sliding_window_size for g in self.spec.key_groups]
        self.readers = self.spec.num_kv_readers
        self.tag = f"prefetch:{req.rid}"
        self.keys = [g.keys for g in self.spec.key_groups]
        # (row, col) -> L1 index holding a read lock we took
        self.l1_locked: dict[tuple[int, int], int] = {}
        # adapter index -> set of cells it found and locked
        self.l2_found: dict[int, set[tuple[int, int]]] = {}
        # cells loaded from L2 and read-locked in L1: cell -> L1 index
        self.l2_loaded: dict[tuple[int, int], int] = {}
        self.l1_from_lookup: set[tuple[int, int]] = set()

    def key(self, cell: tuple[int, int]) -> ObjectKey:
        return self.keys[cell[0]][cell[1]]

    # 1. lookup ----------------------------------------------------------------------------------------
    def _lock_l1(self) -> None:
        cells = [(r, c) for r in range(self.rows) for c in range(self.cols)]
        for li, l1 in enumerate(self.ctl.l1s):
            todo = [cell for cell in cells if cell not in self.l1_locked]
            if not todo:
                break
            res = l1.reserve_read([self.key(c) for c in todo], self.readers)
            for cell in todo:
                err, _obj = res.get(self.key(cell), (L1Error.KEY_NOT_EXIST, None))
                if err is L1Error.SUCCESS:
                    if cell in self.l1_locked:  # duplicate key in the request
                        l1.finish_read([self.key(cell)], self.readers)
                        continue
                    self.l1_locked[cell] = li
        self.l1_from_lookup = set(self.l1_locked)

    def _live_slots(self) -> list[AdapterSlot]:
        return [
            s
            for s in self.ctl.registry.slots(include_draining=False)
            if not self.ctl.is_suspended(s.index)
        ]

    def _lookup_l2(self) -> None:
        missing = [
            (r, c)
            for r in range(self.rows)
            for c in range(self.cols)
            if (r, c) not in self.l1_locked
        ]
        if not missing or self.req.skip_l2:
            return
        slots = self._live_slots()
        if not slots:
            return
        keys = [self.key(c) for c in missing]
        layouts = {g.object_group_id: g.layout_desc for g in self.spec.key_groups}
        self.ctl.stats["lookup_requests"] += 1
        self.ctl.stats["lookup_keys"] += len(keys)
        results: dict[int, Any] = {}
        threads = []

        def one(slot: AdapterSlot) -> None:
            def late(bm: Any) -> None:
                found = bm.gather(keys) if isinstance(bm, Bitmap) else []
                if found:
                    slot.adapter.submit_unlock(found)

            results[slot.index] = self.ctl.submit_and_wait(
                slot,
                "lookup",
                lambda: submit_lookup(slot.adapter, keys, layouts),
                self.ctl.lookup_timeout_s,
                late,
            )

        for slot in slots[1:]:
            t = threading.Thread(target=one, args=(slot,), daemon=True)
            t.start()
            threads.append(t)
        one(slots[0])
        for t in threads:
            t.join()
        for slot in slots:
            bm = results.get(slot.index)
            if not isinstance(bm, Bitmap):
                continue
            self.l2_found[slot.index] = {
                missing[i] for i in bm.get_indices_list() if i < len(missing)
            }

    # 2. plan -------------------------------------------------------------------------------------------------
    def _rows_bitmaps(self, cells: Iterable[tuple[int, int]]) -> list[Bitmap]:
        bits = [0] * self.rows
        for r, c in cells:
            bits[r] |= 1 << c
        return [Bitmap.from_int(self.cols, b) for b in bits]

    def _target(self, available: set[tuple[int, int]]) -> set[tuple[int, int]]:
        if self.spec.fetching_policy == "full":
            return set(available)
        folded = fold_grouped(self._rows_bitmaps(available), self.windows)
        hit = folded.highest_set_bit()
        needed = unfold_grouped(max(0, hit), self.cols, self.windows)
        return {(r, c) for r, bm in enumerate(needed) for c in bm.get_indices_list()}

    def _plan(self) -> dict[int, set[tuple[int, int]]]:
        available = set(self.l1_locked)
        for cells in self.l2_found.values():
            available |= cells
        target = self._target(available)
        assign: dict[int, set[tuple[int, int]]] = {}
        for cell in target:
            if cell in self.l1_locked:
                continue
            holders = sorted(i for i, cells in self.l2_found.items() if cell in cells)
            owner = self.ctl.policy.choose_owner([], holders)
            if owner is not None:
                assign.setdefault(owner[1], set()).add(cell)
        # release what the plan does not use
        self._release_l1({c for c in self.l1_locked if c not in target})
        for idx, cells in self.l2_found.items():
            unused = cells - assign.get(idx, set())
            self._unlock_l2(idx, unused)
            self.l2_found[idx] = cells & assign.get(idx, set())
        return assign

    def _release_l1(self, cells: set[tuple[int, int]]) -> None:
        by_l1: dict[int, list[ObjectKey]] = {}
        for cell in cells:
            li = self.l1_locked.pop(cell, None)
            if li is None:
                li = self.l2_loaded.pop(cell, None)
            if li is not None:
                by_l1.setdefault(li, []).append(self.key(cell))
        for li, keys in by_l1.items():
            self.ctl.l1s[li].finish_read(keys, self.readers)

    def _unlock_l2(self, idx: int, cells: set[tuple[int, int]]) -> None:
        if not cells:
            return
        slot = self.ctl.registry.get(idx)
        if slot is not None:
            try:
                slot.adapter.submit_unlock([self.key(c) for c in cells])
            except Exception:
                logger.exception("L2 adapter #%d submit_unlock raised", idx)

    # 3. reserve + load ---------------------------------------------------------------------------------------
    def _retain(self) -> bool:
        return self.spec.lock_mode is LockMode.NO_LOCK or self.ctl.policy.plan_l1_retention()

    def _reserve(self, idx: int, cells: set[tuple[int, int]]) -> dict[tuple[int, int], MemoryObj]:
        slot = self.ctl.registry.get(idx)
        li = slot.l1_index if slot is not None else 0
        l1 = self.ctl.l1s[li]
        tmp = not self._retain()
        out: dict[tuple[int, int], MemoryObj] = {}
        by_row: dict[int, list[tuple[int, int]]] = {}
        for cell in sorted(cells):
            by_row.setdefault(cell[0], []).append(cell)
        for r, rcells in by_row.items():
            keys = [self.key(c) for c in rcells]
            res = l1.reserve_write(
                keys, [tmp] * len(keys), self.spec.key_groups[r].layout_desc, self.tag
            )
            for cell in rcells:
                err, obj = res.get(self.key(cell), (L1Error.OUT_OF_MEMORY, None))
                if err is L1Error.SUCCESS and obj is not None:
                    out[cell] = obj
        return out

    def _load_all(self, assign: dict[int, set[tuple[int, int]]]) -> None:
        staged: dict[int, dict[tuple[int, int], MemoryObj]] = {}
        for idx, cells in assign.items():
            staged[idx] = self._reserve(idx, cells)
        failed = {c for idx, cells in assign.items() for c in cells if c not in staged[idx]}
        if failed:
            # re-plan on what we can still serve; drop staging the new plan does not use
            available = set(self.l1_locked) | {c for s in staged.values() for c in s}
            target = self._target_after_failure(available, failed)
            self._release_l1({c for c in self.l1_locked if c not in target})
            for idx in list(staged):
                slot = self.ctl.registry.get(idx)
                l1 = self.ctl.l1s[slot.l1_index if slot else 0]
                drop = {c for c in staged[idx] if c not in target}
                if drop:
                    l1.finish_write_and_delete([self.key(c) for c in drop], self.tag)
                    for c in drop:
                        del staged[idx][c]
                self._unlock_l2(idx, assign[idx] - set(staged[idx]))
                assign[idx] = set(staged[idx])
        threads = []
        for idx, objs in staged.items():
            if not objs:
                continue
            t = threading.Thread(target=self._load_one, args=(idx, objs), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()

    def _target_after_failure(
        self, available: set[tuple[int, int]], failed: set[tuple[int, int]]
    ) -> set[tuple[int, int]]:
        if self.spec.fetching_policy == "full":
            bad_cols = {c for _r, c in failed}
            return {cell for cell in available if cell[1] not in bad_cols}
        return self._target(available)

    def _load_one(self, idx: int, objs: dict[tuple[int, int], MemoryObj]) -> None:
        slot = self.ctl.registry.get(idx)
        if slot is None:
            return
        l1i = slot.l1_index
        l1 = self.ctl.l1s[l1i]
        cells = sorted(objs)
        keys = [self.key(c) for c in cells]
        buffers = [objs[c] for c in cells]
        l1.pin_objects(buffers)
        self.ctl.stats["load_tasks"] += 1
        self.ctl.stats["load_keys"] += len(keys)
        tag = self.tag
        cleaned = threading.Event()
        cleanup_lock = threading.Lock()
        submitted = time.monotonic()

        def late(_bm: Any) -> None:
            # the request already counted these cells as misses; runs once
            with cleanup_lock:
                if cleaned.is_set():
                    return
                cleaned.set()
            l1.finish_write_and_delete(keys, tag)
            l1.unpin_objects(buffers)
            slot.adapter.submit_unlock(keys)

        bm = self.ctl.submit_and_wait(
            slot,
            "load",
            lambda: slot.adapter.submit_load_task(keys, buffers),
            self.ctl.load_timeout_s,
            late,
        )
        if not isinstance(bm, Bitmap):
            # deadline passed (the poller runs late() when the result arrives) or submit raised
            with self.ctl._mu:
                waiting = any(w.late is late for w in self.ctl._waiters.values())
            if not waiting:
                late(None)
            self.ctl.stats["failed_keys"] += len(keys)
            self.ctl.failed_keys_by.update(("timeout", k.model_name) for k in keys)
            return
        done = self.ctl.loaded_tasks_by_adapter
        done[slot.type_name] = done.get(slot.type_name, 0) + 1
        ok = [c for i, c in enumerate(cells) if i < bm.size() and bm.test(i)]
        elapsed = time.monotonic() - submitted
        nbytes = sum(int(objs[c].get_size()) for c in ok)
        if elapsed > 0 and nbytes:
            self.ctl.load_throughput.append((slot.type_name, nbytes / elapsed / 1e9))
        bad = [c for c in cells if c not in set(ok)]
        if ok:
            res = l1.finish_write_and_reserve_read([self.key(c) for c in ok], self.readers, tag)
            for c in ok:
                if res[self.key(c)][0] is L1Error.SUCCESS:
                    self.l2_loaded[c] = l1i
        if bad:
            l1.finish_write_and_delete([self.key(c) for c in bad], tag)
            self.ctl.failed_keys_by.update(("not_found", self.key(c).model_name) for c in bad)
            _failure_log.warning(
                ("load", idx),
                "L2 load of %d of %d keys from adapter #%d (%s) failed (counted as misses): %s",
                len(bad),
                len(cells),
                idx,
                slot.type_name,
                failure_cause(slot.adapter),
            )
        l1.unpin_objects(buffers)
        slot.adapter.submit_unlock(keys)
        self.ctl.stats["loaded_keys"] += len(ok)
        self.ctl.stats["failed_keys"] += len(bad)

    # 4. finish ----------------------------------------------------------------------------------------------
    def _l1_only(self) -> bool:
        """A request the L1 alone serves with plain prefix semantics (no L2, one L1, no
        sliding windows, prefix policy): the common lookup, answered without cell sets."""
        return (
            self.req.skip_l2
            and len(self.ctl.l1s) == 1
            and self.spec.fetching_policy != "full"
            and all(w <= 0 for w in self.windows)
        )

    def _execute_l1_only(self) -> PrefetchResult:
        keep_locks = self.spec.lock_mode is not LockMode.NO_LOCK
        hit = self.ctl.l1s[0].reserve_read_prefix(self.keys, self.readers, keep_locks)
        hits = [Bitmap(self.cols, hit) for _ in range(self.rows)]
        return PrefetchResult(
            hits,
            [bm.copy() for bm in hits],
            [Bitmap(self.cols) for _ in range(self.rows)],
            None,
            [[0] * hit + [-1] * (self.cols - hit) for _ in range(self.rows)],
        )

    def execute(self) -> PrefetchResult:
        if self._l1_only():
            return self._execute_l1_only()
        try:
            self._lock_l1()
            self._lookup_l2()
            assign = self._plan()
            if assign:
                self._load_all(assign)
        except Exception:
            self._abort()
            raise
        locked = set(self.l1_locked) | set(self.l2_loaded)
        hit = self._target(locked) & locked
        if self.spec.lock_mode is LockMode.NO_LOCK:
            self._release_l1(set(locked))
        else:
            self._release_l1(locked - hit)
        owners = [[-1] * self.cols for _ in range(self.rows)]
        from_l1: list[tuple[int, int]] = []
        from_l2: list[tuple[int, int]] = []
        touched: dict[int, list[ObjectKey]] = {}
        for cell in hit:
            if cell in self.l1_from_lookup:
                from_l1.append(cell)
                li = self.l1_locked.get(cell, 0)
            else:
                from_l2.append(cell)
                li = self.l2_loaded.get(cell, 0)
            owners[cell[0]][cell[1]] = li
            touched.setdefault(li, []).append(self.key(cell))
        hit_rows = self._rows_bitmaps(hit)
        l1_hits = self._rows_bitmaps(from_l1)
        l2_hits = self._rows_bitmaps(from_l2)
        for li, keys in touched.items():
            self.ctl.l1s[li].touch_keys(keys)
        found = None
        if self.spec.fetching_policy == "full":
            found = self._rows_bitmaps(
                set(self.l1_from_lookup)
                | {c for cells in self.l2_found.values() for c in cells}
                | set(self.l2_loaded)
            )
        return PrefetchResult(hit_rows, l1_hits, l2_hits, found, owners)

    def _abort(self) -> None:
        self._release_l1(set(self.l1_locked) | set(self.l2_loaded))
        for idx, cells in self.l2_found.items():
            self._unlock_l2(idx, cells)
        self.l2_found.clear()
