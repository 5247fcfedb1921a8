"""``s3``: the L2 adapter over an S3 bucket (docs/design/storage-engine.md#backend-s3).

Every key of a task is one request, all in flight at once (the CRT client spreads them over
its connections). Requests complete on CRT threads; the last key of a task hands the task to
one finisher thread, which publishes the result, calls listeners and signals the task's event
fd. Lookups lock their hits (refcounts with a TTL) and ``delete`` skips locked keys.
Consecutive connection failures open a circuit breaker (``breaker.py``); a housekeeping
thread cancels requests past the timeout and runs the breaker's probe.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from lmcache.storage.s3.breaker import CircuitBreaker
from lmcache.storage.s3.config import S3L2AdapterConfig
from lmcache.storage.s3.objects import MAX_KEYS_PER_PAGE, parse_list_page
from lmcache.storage.s3.transport import Outcome, S3Transport
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, ObjectKey
from lmcache.v1.distributed.l2_adapters.api import (
    Bitmap,
    CompletionChannels,
    KeyLockTable,
    L2StoreResult,
    RateLimitedLog,
    TaskIds,
    init_logger,
    object_key_to_string,
)
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId

logger = init_logger(__name__)

DELETE_TIMEOUT_SECONDS = 30.0
HOUSEKEEPING_INTERVAL_SECONDS = 0.25
WARN_INTERVAL_SECONDS = 10.0
KNOWN_SIZES_CAPACITY = 1 << 20  # object names whose size a lookup may trust without a HEAD


class _Task:
    """Counts down the keys of one task; ``done`` is True for the last one."""

    def __init__(self, tid: L2TaskId, keys: list[ObjectKey]) -> None:
        self.tid = tid
        self.keys = keys
        self.ok = [False] * len(keys)
        self.remaining = len(keys)
        self.lock = threading.Lock()
        self.finished = threading.Event()  # delete() waits on it

    def done(self, i: int, ok: bool) -> bool:
        with self.lock:
            self.ok[i] = ok
            self.remaining -= 1
            return self.remaining == 0


def _bytes_view(obj: Any) -> memoryview:
    view = memoryview(obj.byte_array)
    return view if view.format == "B" else view.cast("B")


def _requests(keys: list[ObjectKey], objects: list[Any]) -> list[tuple[str, memoryview]]:
    """(object name, byte view) per key."""
    objects = list(objects)
    if len(objects) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(objects)} memory objects")
    return [(object_key_to_string(k), _bytes_view(o)) for k, o in zip(keys, objects, strict=True)]


class S3L2Adapter(CompletionChannels, L2AdapterInterface):
    def __init__(
        self, config: S3L2AdapterConfig | dict[str, Any], l1_memory_desc: Any = None, **_: Any
    ) -> None:
        if isinstance(config, dict):
            config = S3L2AdapterConfig.from_dict(config)
        super().__init__(max_capacity_bytes=config.max_capacity_bytes)
        self._cfg = config
        self._transport = S3Transport(config)
        self._url = self._transport.target.url
        self._breaker = CircuitBreaker(
            config.s3_max_connection_failures, config.s3_circuit_reset_seconds
        )
        # At most one warning per kind every 10 s; the next one says how many were left out.
        self._warn = RateLimitedLog(logger, interval=WARN_INTERVAL_SECONDS)
        self._open_channels()
        self._ids = TaskIds()
        self._locks = KeyLockTable()

        self._lock = threading.Lock()
        self._sizes: dict[ObjectKey, int] = {}  # keys counted in usage, with their sizes
        # Object name -> size seen by a store or a HEAD (most recent last, bounded).
        self._known_sizes: OrderedDict[str, int] = OrderedDict()
        self._deleting: set[ObjectKey] = set()
        self._last_error: str | None = None
        self._last_error_time: float | None = None
        self._last_success_time: float | None = None
        self._closed = False

        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="lmc-s3-done")
        self._stop = threading.Event()
        self._housekeeper = threading.Thread(
            target=self._housekeeping, name="lmc-s3-housekeeping", daemon=True
        )
        self._housekeeper.start()
        self._transport.head_bucket(self._bucket_checked)  # status and log show a bad bucket early
        logger.info(
            "s3: adapter ready (endpoint %s, region %s, %s-style, request timeout %g s)",
            self._url,
            config.s3_region,
            config.s3_addressing_style,
            config.s3_request_timeout_seconds,
        )

    # --- health ---------------------------------------------------------------------------

    def _observe(self, op: str, name: str, out: Outcome, fine: bool) -> None:
        """Record a request's outcome for the breaker, the status and the log. ``fine``: the
        answer is an expected one (a success, or a 404 of a lookup)."""
        now = time.time()
        if fine or out.reached_server:
            self._breaker.record_success()
        if fine:
            with self._lock:
                self._last_success_time = now
            return
        where = f"{op} {self._url}/{name}" if name else f"{op} {self._url}"
        with self._lock:
            self._last_error = f"{where}: {out.error}"
            self._last_error_time = now
        if out.connection_error and self._breaker.record_failure():
            logger.error(
                "s3: circuit breaker open after %d consecutive connection failures to %s "
                "(last: %s); requests fail at once until a probe succeeds in %g s",
                self._cfg.s3_max_connection_failures,
                self._url,
                out.error,
                self._cfg.s3_circuit_reset_seconds,
            )
            return
        self._warn.warning(op, "s3: %s failed: %s", where, out.error)

    def _admit(self, op: str, n: int) -> bool:
        """False (and a rate-limited warning) while the breaker refuses requests."""
        if self._breaker.allow():
            return True
        snap = self._breaker.snapshot()
        self._warn.warning(
            "breaker",
            "s3: circuit breaker %s for %s (last error: %s); %s of %d keys failed without a "
            "request, next probe in %.1f s",
            snap["state"],
            self._url,
            self._last_error,
            op,
            n,
            snap["reopen_in_s"],
        )
        return False

    def _housekeeping(self) -> None:
        while not self._stop.wait(HOUSEKEEPING_INTERVAL_SECONDS):
            try:
                self._transport.cancel_overdue()
                if self._breaker.take_probe():
                    self._transport.head_bucket(self._probe_done)
            except Exception:
                logger.exception("s3: housekeeping failed")

    def _bucket_checked(self, out: Outcome) -> None:
        if out.status == 404:
            out.error = "HTTP 404: no such bucket"
        self._observe("HEAD", "", out, out.error is None)
        if out.error is None:
            logger.info("s3: bucket %s is reachable", self._url)

    def _probe_done(self, out: Outcome) -> None:
        if out.reached_server:
            self._breaker.probe_succeeded()
            logger.info(
                "s3: %s answers again (HTTP %s); circuit breaker closed", self._url, out.status
            )
            self._bucket_checked(out)  # a missing bucket still shows in the status
            return
        self._breaker.probe_failed()
        with self._lock:
            self._last_error = f"probe {self._url}: {out.error}"
            self._last_error_time = time.time()
        self._warn.warning(
            "probe",
            "s3: probe of %s failed (%s); breaker stays open for %.1f s",
            self._url,
            out.error,
            self._breaker.snapshot()["reopen_in_s"],
        )

    def _remember_size(self, name: str, size: int) -> None:
        with self._lock:
            self._known_sizes[name] = size
            self._known_sizes.move_to_end(name)
            if len(self._known_sizes) > KNOWN_SIZES_CAPACITY:
                self._known_sizes.popitem(last=False)

    def _finish(self, fn: Any, *args: Any) -> None:
        try:
            self._finisher.submit(fn, *args)
        except RuntimeError:  # closed: nobody waits for the result any more
            pass

    # --- store ----------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        tid = self._ids.next()
        keys = list(keys)
        if not keys or not self._admit("store", len(keys)):
            self._store_channel.complete(tid, L2StoreResult(not keys, 0))
            return tid
        work = _requests(keys, objects)  # raises before any request goes out
        task = _Task(tid, keys)
        sizes = [len(view) for _, view in work]
        for i, (name, view) in enumerate(work):
            self._transport.put(name, view, partial(self._stored_one, task, sizes, i, name))
        return tid

    def _stored_one(self, task: _Task, sizes: list[int], i: int, name: str, out: Outcome) -> None:
        ok = out.error is None
        self._observe("PUT", name, out, ok)
        if ok:
            self._remember_size(name, sizes[i])
        if task.done(i, ok):
            self._finish(self._finish_store, task, sizes)

    def _finish_store(self, task: _Task, sizes: list[int]) -> None:
        new_keys, new_sizes = [], []
        with self._lock:
            for key, ok, size in zip(task.keys, task.ok, sizes, strict=True):
                if ok and key not in self._sizes:
                    self._sizes[key] = size
                    new_keys.append(key)
                    new_sizes.append(size)
        if new_keys:
            self._notify_keys_stored(new_keys, new_sizes)
        self._store_channel.complete(task.tid, L2StoreResult.per_key(task.ok, sum(new_sizes)))

    # --- lookup and lock ------------------------------------------------------------------

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, Any] | None = None
    ) -> L2TaskId:
        tid = self._ids.next()
        keys = list(keys)
        if not keys or not self._admit("lookup", len(keys)):
            self._lookup_channel.complete(tid, Bitmap(len(keys)))
            return tid
        # Lock first, then look: a delete that starts later skips these keys; keys being
        # deleted right now are misses.
        with self._lock:
            deleting = [k in self._deleting for k in keys]
            self._locks.lock([k for k, d in zip(keys, deleting, strict=True) if not d])
        task = _Task(tid, keys)
        for i, key in enumerate(keys):
            if deleting[i]:
                self._looked_up(task, i, None, None)
                continue
            name = object_key_to_string(key)
            with self._lock:
                known = self._known_sizes.get(name)
            if known is not None:  # seen by a store or an earlier HEAD: no request
                if task.done(i, True):
                    self._finish(self._finish_lookup, task)
            else:
                self._transport.head(name, partial(self._looked_up, task, i, name))
        return tid

    def _looked_up(self, task: _Task, i: int, name: str | None, out: Outcome | None) -> None:
        hit = False
        if out is not None and name is not None:
            hit = out.error is None and out.status == 200 and bool(out.size)
            self._observe("HEAD", name, out, hit or out.missing)
            if hit:
                self._remember_size(name, int(out.size or 0))
            else:
                self._locks.unlock([task.keys[i]])
        if task.done(i, hit):
            self._finish(self._finish_lookup, task)

    def _finish_lookup(self, task: _Task) -> None:
        bm = Bitmap(len(task.keys))
        for i, hit in enumerate(task.ok):
            if hit:
                bm.set(i)
        self._lookup_channel.complete(task.tid, bm)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self._locks.unlock(list(keys))

    # --- load -----------------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        tid = self._ids.next()
        keys = list(keys)
        if not keys or not self._admit("load", len(keys)):
            self._load_channel.complete(tid, Bitmap(len(keys)))
            return tid
        work = _requests(keys, objects)  # raises before any request goes out
        task = _Task(tid, keys)
        for i, (name, view) in enumerate(work):
            self._transport.get_into(
                name, view, partial(self._loaded_one, task, i, name, len(view))
            )
        return tid

    def _loaded_one(self, task: _Task, i: int, name: str, capacity: int, out: Outcome) -> None:
        ok = out.error is None
        mismatch = out.size is not None and not ok  # a body of another length: a data problem
        self._observe("GET", name, out, ok or out.missing or mismatch)
        if not ok:
            with self._lock:
                self._known_sizes.pop(name, None)
        if mismatch and (out.size or 0) > capacity:
            self._warn.warning(
                "oversized",
                "s3: load of %s/%s failed: the object is larger than the %d-byte buffer "
                "(nothing was written past it; another writer used another chunk layout?)",
                self._url,
                name,
                capacity,
            )
        elif mismatch:
            logger.debug(
                "s3: %s/%s is shorter than the buffer: a miss (%s)", self._url, name, out.error
            )
        if task.done(i, ok):
            self._finish(self._finish_load, task)

    def _finish_load(self, task: _Task) -> None:
        self._complete_load(task.tid, task.keys, task.ok)

    # --- delete and listing ---------------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """DELETE the unlocked keys in parallel and wait (at most 30 s). Keys deleted after
        the wait still update usage and listeners when their request ends."""
        with self._lock:
            todo = [
                k
                for k in dict.fromkeys(keys)
                if k not in self._deleting and not self._locks.is_locked(k)
            ]
            self._deleting.update(todo)
        if not todo:
            return
        if not self._admit("delete", len(todo)):
            with self._lock:
                self._deleting.difference_update(todo)
            return
        task = _Task(-1, todo)
        for i, key in enumerate(todo):
            name = object_key_to_string(key)
            self._transport.delete(name, partial(self._deleted_one, task, i, name))
        if not task.finished.wait(DELETE_TIMEOUT_SECONDS):
            logger.warning(
                "s3: delete() timed out after %gs for %d keys on %s",
                DELETE_TIMEOUT_SECONDS,
                task.remaining,
                self._url,
            )

    def _deleted_one(self, task: _Task, i: int, name: str, out: Outcome) -> None:
        ok = out.error is None or out.missing
        self._observe("DELETE", name, out, ok)
        if task.done(i, ok):
            self._finish(self._finish_delete, task)

    def _finish_delete(self, task: _Task) -> None:
        gone, sizes = [], []
        with self._lock:
            for key, ok in zip(task.keys, task.ok, strict=True):
                self._deleting.discard(key)
                if ok:
                    self._known_sizes.pop(object_key_to_string(key), None)
                    gone.append(key)
                    sizes.append(self._sizes.pop(key, 0))
        try:
            if gone:
                self._notify_keys_deleted(gone, sizes)
        finally:
            task.finished.set()

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyListPage:
        """One page of the bucket's keys (ListObjectsV2; at most 1000 per page). Objects whose
        names are not keys are skipped, so a page may hold fewer entries than asked for."""
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be positive (got {page_size})")
        if cursor is not None and (not isinstance(cursor, str) or not cursor):
            raise ValueError(f"cursor must be the next_page_token of a page (got {cursor!r})")
        if not self._breaker.allow():
            raise RuntimeError(
                f"S3 connection disabled (circuit-broken); listing unavailable — {self._url} "
                f"failed with {self._last_error}; the next probe is in "
                f"{self._breaker.snapshot()['reopen_in_s']} s"
            )
        prefix = f"{model_name}@" if model_name is not None else None
        out = self._transport.list_page(prefix, min(page_size, MAX_KEYS_PER_PAGE), cursor)
        self._observe("LIST", "", out, out.error is None)
        if out.error is not None:
            if cursor is not None and out.status == 400:
                raise ValueError(f"invalid cursor {cursor!r}: {self._url} answered {out.error}")
            raise RuntimeError(f"s3: ListObjectsV2 on {self._url} failed: {out.error}")
        entries, skipped, token = parse_list_page(out.body or b"")
        if skipped:
            logger.debug(
                "s3: listing skipped %d foreign objects, e.g. %r", len(skipped), skipped[0]
            )
        return KeyListPage(
            entries=[KeyEntry(key=k.to_encoded_object_key(), size_bytes=s) for k, s in entries],
            next_page_token=token,
        )

    # --- status and lifecycle -------------------------------------------------------------

    def report_status(self) -> dict[str, Any]:
        breaker = self._breaker.snapshot()
        with self._lock:
            last_error, last_error_time = self._last_error, self._last_error_time
            last_success_time = self._last_success_time
            keys = len(self._sizes)
        recent_error = last_error_time is not None and (
            last_success_time is None or last_error_time > last_success_time
        )
        healthy = not self._closed and breaker["state"] == "closed" and not recent_error
        usage = self.get_usage()
        target = self._transport.target
        return {
            "is_healthy": healthy,
            "healthy": healthy,
            "type_name": "s3",
            "endpoint": self._url,
            "bucket": target.bucket,
            "region": self._cfg.s3_region,
            "addressing_style": self._cfg.s3_addressing_style,
            "last_error": last_error,
            "last_error_time": last_error_time,
            "last_success_time": last_success_time,
            "breaker": breaker,
            "keys": keys,
            "in_flight_requests": self._transport.in_flight(),
            "current_size_bytes": usage.total_bytes_used,
            "max_capacity_bytes": usage.total_capacity_bytes,
        }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._housekeeper.join(timeout=5)
        self._transport.close()  # no buffer is touched after this
        self._finisher.shutdown(wait=True)
        self._close_channels()
        logger.info("s3: adapter for %s closed", self._url)
