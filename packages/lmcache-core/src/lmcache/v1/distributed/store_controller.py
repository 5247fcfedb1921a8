"""Store controller: L1 -> L2 write-behind (docs/design/storage-engine.md#store-controller).

A listener on ``on_l1_keys_write_finished`` (called inside the L1 lock) only queues keys and
signals. The loop thread polls {listener fd, control fd, each adapter's store fd}, routes
pending keys through the store policy, pins them in L1 (a read lock plus the transfer pin of
docs/design/storage-engine.md#buffer-safety) and submits one task per (adapter, key group). At most
``max_in_flight_per_adapter`` tasks run per adapter; extra keys wait unpinned. On completion pins
are released and, on success, ``select_l1_deletions`` keys are deleted from L1 once no other adapter
still stores them.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any

from lmcache.utils import RateLimitedLog, init_logger
from lmcache.v1.distributed.adapter_poll import POLL_MS, AdapterFdPoller, FdTarget, run_poll_loop
from lmcache.v1.distributed.adapter_registry import AdapterRegistry, AdapterSlot
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.internal_api import L1Error, L1ManagerListener, L2StoreResult
from lmcache.v1.distributed.l2_adapters.health import failure_cause
from lmcache.v1.distributed.storage_policies import StorePolicy
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform.event_notifier import create_event_notifier

logger = init_logger(__name__)
# Failed stores of one adapter: the first at once, then one line (with a count) per 30 s.
_failure_log = RateLimitedLog(logger, interval=30.0)

__all__ = ["StoreController"]

MAX_IN_FLIGHT_PER_ADAPTER = 32
MAX_KEYS_PER_TASK = 256


@dataclass
class _Task:
    adapter_index: int
    task_id: int
    keys: list[ObjectKey]
    objs: list[MemoryObj]
    submit_time: float


class StoreController(L1ManagerListener):
    def __init__(
        self,
        l1: Any,
        registry: AdapterRegistry,
        policy: StorePolicy,
        l1_index: int = 0,
        max_in_flight_per_adapter: int = MAX_IN_FLIGHT_PER_ADAPTER,
    ) -> None:
        self.l1 = l1
        self.l1_index = l1_index
        self.registry = registry
        self.policy = policy
        self.max_in_flight = max_in_flight_per_adapter
        self._mu = threading.Lock()
        self._incoming: deque[ObjectKey] = deque()
        self._per_adapter: dict[int, deque[ObjectKey]] = defaultdict(deque)
        self._inflight: dict[tuple[int, int], _Task] = {}
        self._key_refs: dict[ObjectKey, int] = defaultdict(int)
        self._delete_after: set[ObjectKey] = set()
        self._legacy_warned: set[int] = set()
        self._wake = create_event_notifier()
        self._control = create_event_notifier()
        self._stop = threading.Event()
        self.stats = {
            "submitted_tasks": 0,
            "submitted_keys": 0,
            "completed_tasks": 0,
            "failed_tasks": 0,
            "failed_keys": 0,
            "stored_bytes": 0,
            "skipped_keys": 0,
            "completed_keys": 0,
        }
        self.completed_tasks_by_adapter: dict[str, int] = defaultdict(int)  # by type name
        # (adapter type, GB/s) of finished store tasks, submit to completion; metrics drain it
        self.throughput: deque[tuple[str, float]] = deque(maxlen=4096)
        l1.register_listener(self)
        self._thread = threading.Thread(
            target=self._loop, name=f"store-controller-{l1_index}", daemon=True
        )
        self._thread.start()

    # --- listener (inside the L1 lock: record and signal only) --------------------------------------

    def on_l1_keys_write_finished(self, keys: list[ObjectKey]) -> None:
        # With no L2 adapter there is nowhere to store them: waking this loop per commit
        # would only cost a thread switch (and a GIL hand-off) on every store.
        if not keys or not len(self.registry):
            return
        with self._mu:
            self._incoming.extend(keys)
        self._wake.notify()

    # --- control -------------------------------------------------------------------------------------

    def kick(self) -> None:
        """Wake the loop (adapter set changed, shutdown)."""
        self._control.notify()

    def inflight_for(self, adapter_index: int) -> int:
        with self._mu:
            return sum(1 for (i, _t) in self._inflight if i == adapter_index)

    def pending_count(self) -> int:
        with self._mu:
            return len(self._incoming) + sum(len(q) for q in self._per_adapter.values())

    def idle(self) -> bool:
        with self._mu:
            return not self._inflight and not self._incoming and not any(self._per_adapter.values())

    # --- loop -----------------------------------------------------------------------------------------

    def _loop(self) -> None:
        poller = AdapterFdPoller(self.registry, (self._wake, self._control), {0: "store"})
        run_poll_loop(self._stop, poller, self._step, "store controller loop")

    def _step(self, targets: set[FdTarget] | None) -> None:
        if self._stop.is_set():
            return
        if targets is None:  # timed out: check every adapter with work in flight
            with self._mu:
                signalled = {i for (i, _t) in self._inflight}
        else:
            signalled = {i for i, _kind in targets}
        self._collect(signalled)
        self._route_incoming()
        self._dispatch()

    def _collect(self, adapter_indexes: set[int]) -> None:
        for idx in adapter_indexes:
            slot = self.registry.get(idx)
            if slot is None:
                continue
            try:
                done = slot.adapter.pop_completed_store_tasks() or {}
            except Exception:
                logger.exception("L2 adapter #%d pop_completed_store_tasks raised", idx)
                continue
            for task_id, raw in done.items():
                with self._mu:
                    task = self._inflight.pop((idx, task_id), None)
                if task is None:
                    logger.warning("L2 adapter #%d completed unknown store task %s", idx, task_id)
                    continue
                result, legacy = L2StoreResult.normalise(raw, task.objs)
                if legacy and idx not in self._legacy_warned:
                    self._legacy_warned.add(idx)
                    logger.warning(
                        "L2 adapter #%d (%s) returned %r from a store instead of L2StoreResult; "
                        "normalised (update the plugin)",
                        idx,
                        slot.type_name,
                        raw,
                    )
                self._finish_task(task, result, slot)

    def _finish_task(self, task: _Task, result: L2StoreResult, slot: AdapterSlot | None) -> None:
        self._release(task.keys, task.objs)
        name = slot.type_name if slot else "?"
        if result.is_successful():
            self.stats["completed_tasks"] += 1
            self.stats["completed_keys"] += len(task.keys)
            self.stats["stored_bytes"] += result.bytes_transferred()
            self.completed_tasks_by_adapter[name] += 1
            elapsed = time.monotonic() - task.submit_time
            if elapsed > 0 and result.bytes_transferred():
                self.throughput.append((name, result.bytes_transferred() / elapsed / 1e9))
            logger.debug(
                "L2 store task %d on adapter #%d (%s) done: %d keys, %d bytes",
                task.task_id,
                task.adapter_index,
                name,
                len(task.keys),
                result.bytes_transferred(),
            )
            deletions = self.policy.select_l1_deletions(task.keys)
            with self._mu:
                self._delete_after.update(deletions)
        else:
            try:
                landed = result.landed_keys(task.keys)
            except ValueError as exc:  # a plugin's malformed bitmap: trust none of it
                logger.warning("L2 adapter #%d (%s): %s", task.adapter_index, name, exc)
                landed = []
            failed = len(task.keys) - len(landed)
            self.stats["failed_tasks"] += 1
            self.stats["failed_keys"] += failed
            self.stats["completed_keys"] += len(landed)
            _failure_log.warning(
                ("store", task.adapter_index),
                "L2 store task %d on adapter #%d (%s) failed for %d of %d keys (not retried): %s",
                task.task_id,
                task.adapter_index,
                name,
                failed,
                len(task.keys),
                getattr(result, "error", None) or failure_cause(slot.adapter if slot else None),
            )
            if landed:
                deletions = self.policy.select_l1_deletions(landed)
                with self._mu:
                    self._delete_after.update(deletions)
        self._run_deferred_deletions(task.keys)

    def _run_deferred_deletions(self, keys: list[ObjectKey]) -> None:
        ready = []
        with self._mu:
            for k in keys:
                if (
                    k in self._delete_after
                    and self._key_refs.get(k, 0) == 0
                    and not self._queued(k)
                ):
                    self._delete_after.discard(k)
                    ready.append(k)
        if ready:
            self.l1.delete(ready)

    def _queued(self, key: ObjectKey) -> bool:
        return any(key in q for q in self._per_adapter.values())

    def _release(self, keys: list[ObjectKey], objs: list[MemoryObj]) -> None:
        self.l1.finish_read(keys)
        self.l1.unpin_objects(objs)
        with self._mu:
            for k in keys:
                left = self._key_refs.get(k, 0) - 1
                if left > 0:
                    self._key_refs[k] = left
                else:
                    self._key_refs.pop(k, None)

    def _route_incoming(self) -> None:
        with self._mu:
            if not self._incoming:
                return
            keys = list(self._incoming)
            self._incoming.clear()
        descriptors = [s.descriptor() for s in self.registry.slots(include_draining=False)]
        if not descriptors:
            return
        groups: dict[tuple[str, int], list[ObjectKey]] = defaultdict(list)
        for k in keys:
            groups[(k.model_name, k.kv_rank)].append(k)
        live = {d.index for d in descriptors}
        for gkeys in groups.values():
            targets = self.policy.select_store_targets(gkeys, descriptors)
            with self._mu:
                for idx, tkeys in targets.items():
                    if idx in live and tkeys:
                        self._per_adapter[idx].extend(tkeys)

    def _dispatch(self) -> None:
        for slot in self.registry.slots(include_draining=False):
            while True:
                with self._mu:
                    q = self._per_adapter.get(slot.index)
                    if not q:
                        break
                    running = sum(1 for (i, _t) in self._inflight if i == slot.index)
                    room = self.max_in_flight - running
                    if room <= 0:
                        break
                    batch = [q.popleft() for _ in range(min(len(q), MAX_KEYS_PER_TASK))]
                leftover = self._submit(slot, batch, room)
                if leftover:
                    with self._mu:
                        self._per_adapter[slot.index].extendleft(reversed(leftover))
                    break
        # keys queued for adapters that went away are dropped
        live = {s.index for s in self.registry.slots(include_draining=False)}
        with self._mu:
            for idx in [i for i in self._per_adapter if i not in live]:
                del self._per_adapter[idx]

    def _submit(self, slot: AdapterSlot, batch: list[ObjectKey], room: int) -> list[ObjectKey]:
        """Submit one task per (model, kv_rank) group, at most ``room`` tasks; returns the keys
        of groups left for later (backpressure)."""
        groups: dict[tuple[str, int], list[ObjectKey]] = defaultdict(list)
        for k in dict.fromkeys(batch):
            groups[(k.model_name, k.kv_rank)].append(k)
        ordered = list(groups.values())
        leftover: list[ObjectKey] = []
        submitted = 0
        for gi, keys in enumerate(ordered):
            if submitted >= room:
                leftover = [k for g in ordered[gi:] for k in g]
                break
            locked = self.l1.reserve_read(keys)
            ok_keys = [k for k in keys if locked[k][0] is L1Error.SUCCESS]
            objs = [locked[k][1] for k in ok_keys]
            skipped = len(keys) - len(ok_keys)
            if skipped:
                self.stats["skipped_keys"] += skipped
            if not ok_keys:
                continue
            self.l1.pin_objects(objs)
            with self._mu:
                for k in ok_keys:
                    self._key_refs[k] += 1
            try:
                task_id = slot.adapter.submit_store_task(ok_keys, objs)
            except Exception as exc:
                _failure_log.warning(
                    ("submit", slot.index),
                    "L2 adapter #%d (%s) submit_store_task raised; %d keys not stored: %s: %s",
                    slot.index,
                    slot.type_name,
                    len(ok_keys),
                    type(exc).__name__,
                    exc,
                )
                self.stats["failed_tasks"] += 1
                self.stats["failed_keys"] += len(ok_keys)
                self._release(ok_keys, objs)
                continue
            submitted += 1
            with self._mu:
                self._inflight[(slot.index, task_id)] = _Task(
                    slot.index, task_id, ok_keys, objs, time.monotonic()
                )
            self.stats["submitted_tasks"] += 1
            self.stats["submitted_keys"] += len(ok_keys)
            logger.debug(
                "L2 store task %s submitted to adapter #%d (%s): %d keys",
                task_id,
                slot.index,
                slot.type_name,
                len(ok_keys),
            )
        return leftover

    def forget_adapter(self, adapter_index: int) -> None:
        """Release pins of tasks still attributed to a removed adapter."""
        with self._mu:
            tasks = [t for (i, _), t in self._inflight.items() if i == adapter_index]
            for t in tasks:
                del self._inflight[(t.adapter_index, t.task_id)]
            self._per_adapter.pop(adapter_index, None)
        for t in tasks:
            self._release(t.keys, t.objs)

    def report_status(self) -> dict[str, Any]:
        with self._mu:
            inflight = len(self._inflight)
        return {
            "l1_index": self.l1_index,
            "in_flight_tasks": inflight,
            "pending_keys": self.pending_count(),
            # 0.5.6's names for the two counts above
            "in_flight_task_count": inflight,
            "pending_keys_count": self.pending_count(),
            "thread_alive": self._thread.is_alive(),
            **self.registry.counts(),
            "max_in_flight_per_adapter": self.max_in_flight,
            **self.stats,
            "completed_tasks_by_adapter": dict(self.completed_tasks_by_adapter),
            "is_healthy": self._thread.is_alive() or self._stop.is_set(),
        }

    def close(self) -> None:
        self._stop.set()
        self._control.notify()
        self._thread.join(timeout=POLL_MS / 1000.0 + 2)
        with self._mu:
            tasks = list(self._inflight.values())
            self._inflight.clear()
            self._incoming.clear()
            self._per_adapter.clear()
        for t in tasks:
            self._release(t.keys, t.objs)
        self._wake.close()
        self._control.close()
