"""``fs``: a pure-Python file-per-key L2 adapter (docs/design/storage-engine.md#backend-fs).

Work runs on a bounded thread pool (``num_workers`` threads per adapter, never a thread per
key); completions are published through core's completion channels.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from lmcache.storage.fs._files import (
    ScanProgress,
    fs_block_size,
    read_file_into,
    scan_directory,
    write_new_file,
)
from lmcache.storage.fs.config import FSL2AdapterConfig, check_relative_tmp_dir
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.distributed.l2_adapters.api import (
    Bitmap,
    CompletionChannels,
    HealthTracker,
    KeyLockTable,
    L2StoreResult,
    RateLimitedLog,
    init_logger,
    object_key_to_filename,
    record_unknown_keys,
)
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId

logger = init_logger(__name__)
# Per-file errors repeat for every key while a disk is full: one line per kind every 30 s.
_file_errors = RateLimitedLog(logger, interval=30.0)

LOCK_TTL_SECONDS = 300
DELETE_TIMEOUT_SECONDS = 30
MAX_DELETES_IN_FLIGHT = 64


class _Batch:
    """Counts down the keys of one task; the last one finishes the task."""

    def __init__(self, tid: L2TaskId, keys: list[ObjectKey]) -> None:
        self.tid = tid
        self.keys = keys
        n = len(keys)
        self.remaining = n
        self.ok = [False] * n
        self.new_bytes = [0] * n
        self.error: str | None = None  # the first failure's cause
        self.lock = threading.Lock()

    def done(self, i: int, ok: bool, new_bytes: int = 0, error: str | None = None) -> bool:
        with self.lock:
            self.ok[i] = ok
            self.new_bytes[i] = new_bytes
            if error and self.error is None:
                self.error = error
            self.remaining -= 1
            return self.remaining == 0

    def report_health(self, health: HealthTracker, op: str) -> None:
        if self.error is None:
            health.success(op)
        else:
            health.failure(op, self.error)


class FSL2Adapter(CompletionChannels, L2AdapterInterface):
    def __init__(
        self, config: FSL2AdapterConfig | dict[str, Any], l1_memory_desc: Any = None, **_: Any
    ) -> None:
        if isinstance(config, dict):
            config = FSL2AdapterConfig.from_dict(config)
        super().__init__(max_capacity_bytes=config.max_capacity_bytes)
        check_relative_tmp_dir(config.relative_tmp_dir)
        self._cfg = config
        self._base = os.path.abspath(config.base_path)
        os.makedirs(self._base, exist_ok=True)
        self._tmp_dir = (
            os.path.join(self._base, config.relative_tmp_dir)
            if config.relative_tmp_dir
            else self._base
        )
        os.makedirs(self._tmp_dir, exist_ok=True)
        self._block = fs_block_size(self._base)
        self._odirect_warned = False
        self._health = HealthTracker(f"fs at {self._base}")

        self._pool = ThreadPoolExecutor(config.num_workers, thread_name_prefix="lmc-fs")
        self._delete_pool = ThreadPoolExecutor(
            min(MAX_DELETES_IN_FLIGHT, max(4, config.num_workers)), thread_name_prefix="lmc-fs-del"
        )
        self._open_channels()

        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sizes: dict[ObjectKey, int] = {}  # keys counted in usage, with their sizes
        # Keys of stores not finished yet: the start-up scan leaves files it finds for them to
        # the store, which counts and reports them itself.
        self._storing: collections.Counter[ObjectKey] = collections.Counter()
        self._locks = KeyLockTable(LOCK_TTL_SECONDS)
        self._deleting: set[ObjectKey] = set()
        self._closed = False

        self._scan = ScanProgress()
        self._scan_thread = threading.Thread(
            target=scan_directory,
            args=(self._base, self._tmp_dir, self._on_recovered, self._scan),
            name="lmc-fs-scan",
            daemon=True,
        )
        self._scan_thread.start()

    # --- helpers --------------------------------------------------------------------------

    def _path(self, key: ObjectKey) -> str:
        return os.path.join(self._base, object_key_to_filename(key))

    def _direct_ok(self, obj: Any, n: int) -> bool:
        if not self._cfg.use_odirect:
            return False
        try:
            ptr = int(obj.data_ptr)
        except (AttributeError, NotImplementedError, TypeError):
            return False  # no stable address: buffered I/O
        if ptr % self._block == 0 and n % self._block == 0 and n > 0:
            return True
        if not self._odirect_warned:
            self._odirect_warned = True
            logger.warning(
                "fs: use_odirect is on but a buffer (address %#x, %d bytes) is not aligned to "
                "%d bytes; using buffered I/O for such buffers (set --l1-align-bytes %d)",
                ptr,
                n,
                self._block,
                self._block,
            )
        return False

    def _on_recovered(self, keys: list[ObjectKey], sizes: list[int]) -> None:
        with self._lock:
            fresh, fresh_sizes = record_unknown_keys(self._sizes, self._storing, keys, sizes)
        if fresh:
            self._notify_keys_stored(fresh, fresh_sizes)

    def register_listener(self, listener: Any) -> None:
        """Also replays the keys already known (recovered or stored) to the new listener, so
        an eviction controller attached after start-up still tracks every file."""
        super().register_listener(listener)
        with self._lock:
            known = list(self._sizes.items())
        if known:
            listener.on_l2_keys_stored([k for k, _ in known], [s for _, s in known])

    def _submit(self, fn: Any, *args: Any) -> None:
        try:
            self._pool.submit(fn, *args)
        except RuntimeError:  # closed: the task simply never completes
            pass

    def _submit_per_key(self, fn: Any, batch: _Batch, objects: list[Any]) -> None:
        """``fn(batch, i, key, obj)`` for every key of ``batch`` on the pool."""
        for i, (key, obj) in enumerate(zip(batch.keys, objects, strict=False)):
            self._submit(fn, batch, i, key, obj)

    # --- store ----------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        batch = _Batch(next(self._ids), list(keys))
        if not keys:
            self._finish_store(batch)
            return batch.tid
        with self._lock:
            self._storing.update(keys)
        self._submit_per_key(self._store_one, batch, objects)
        return batch.tid

    def _store_one(self, batch: _Batch, i: int, key: ObjectKey, obj: Any) -> None:
        ok, written, error = False, 0, None
        try:
            data = obj.byte_array
            written = write_new_file(
                self._path(key),
                self._tmp_dir,
                data,
                fsync=self._cfg.fsync,
                direct=self._direct_ok(obj, len(data)),
            )
            ok = True
        except Exception as exc:
            error = f"{object_key_to_filename(key)}: {exc}"
            _file_errors.warning(("store", self._base), "fs: store of %s failed", error)
        if batch.done(i, ok, written, error):
            self._finish_store(batch)

    def _finish_store(self, batch: _Batch) -> None:
        keys = batch.keys
        new: list[tuple[ObjectKey, int]] = []
        with self._lock:
            self._storing -= collections.Counter(keys)  # drops keys that reach 0
            for key, n in zip(keys, batch.new_bytes, strict=False):
                if n > 0 and key not in self._sizes:
                    self._sizes[key] = n
                    new.append((key, n))
        if new:
            self._notify_keys_stored([k for k, _ in new], [n for _, n in new])
        if keys:
            batch.report_health(self._health, "store")
        result = L2StoreResult.per_key(batch.ok, sum(n for _, n in new), error=batch.error)
        self._store_channel.complete(batch.tid, result)

    # --- lookup and lock -----------------------------------------------------------------

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, Any] | None = None
    ) -> L2TaskId:
        tid = next(self._ids)
        self._submit(self._lookup, tid, list(keys))
        return tid

    def _lookup(self, tid: L2TaskId, keys: list[ObjectKey]) -> None:
        bm = Bitmap(len(keys))
        for i, key in enumerate(keys):
            # Lock first, then look: a delete that starts later skips the key.
            with self._lock:
                if key in self._deleting:
                    continue
                self._locks.lock([key])
            try:
                st = os.stat(self._path(key))
                hit = st.st_size > 0
            except OSError:
                hit = False
            if hit:
                bm.set(i)
            else:
                self._locks.unlock([key])
        self._lookup_channel.complete(tid, bm)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self._locks.unlock(list(keys))

    def is_locked(self, key: ObjectKey) -> bool:
        return self._locks.is_locked(key)

    # --- load -----------------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        tid = next(self._ids)
        if not keys:
            self._load_channel.complete(tid, Bitmap(0))
            return tid
        self._submit_per_key(self._load_one, _Batch(tid, list(keys)), objects)
        return tid

    def _load_one(self, batch: _Batch, i: int, key: ObjectKey, obj: Any) -> None:
        ok, error = False, None
        try:
            dest = obj.byte_array
            ok = read_file_into(
                self._path(key),
                dest,
                direct=self._direct_ok(obj, len(dest)),
                read_ahead=self._cfg.read_ahead_size,
            )
        except Exception as exc:
            error = f"{object_key_to_filename(key)}: {exc}"
            _file_errors.warning(("load", self._base), "fs: load of %s failed", error)
        if not batch.done(i, ok, error=error):
            return
        batch.report_health(self._health, "load")
        self._complete_load(batch.tid, batch.keys, batch.ok)

    # --- delete ---------------------------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Unlink unlocked keys (locked ones are skipped). Each removal notifies on its own,
        so one that finishes after the 30 s wait still updates usage."""
        with self._lock:
            todo = []
            for key in dict.fromkeys(keys):
                if self._locks.is_locked(key) or key in self._deleting:
                    continue
                self._deleting.add(key)
                todo.append(key)
        if not todo:
            return
        futures = []
        for key in todo:
            try:
                futures.append(self._delete_pool.submit(self._delete_one, key))
            except RuntimeError:
                with self._lock:
                    self._deleting.discard(key)
        _, pending = wait(futures, timeout=DELETE_TIMEOUT_SECONDS)
        if pending:
            logger.warning(
                "fs: delete() timed out after %ss for %d keys", DELETE_TIMEOUT_SECONDS, len(pending)
            )

    def _delete_one(self, key: ObjectKey) -> None:
        try:
            try:
                os.unlink(self._path(key))
                removed = True
            except FileNotFoundError:
                removed = False
            except OSError as exc:
                logger.warning("fs: cannot delete %s: %s", object_key_to_filename(key), exc)
                removed = False
            with self._lock:
                size = self._sizes.pop(key, 0)
            if removed or size:
                self._notify_keys_deleted([key], [size])
        finally:
            with self._lock:
                self._deleting.discard(key)

    # --- status and lifecycle -------------------------------------------------------------

    def report_status(self) -> dict[str, Any]:
        with self._lock:
            locked = self._locks.num_locked()
            known = len(self._sizes)
        health = self._health.status()
        healthy = health["healthy"] and not self._closed and self._scan.error is None
        return {
            "is_healthy": healthy,
            **health,
            "healthy": healthy,
            "type_name": "fs",
            "base_path": self._base,
            "keys": known,
            "locked_keys": locked,
            "scan": self._scan.as_dict(),
        }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # wait=True: no buffer is touched once close() returns.
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._delete_pool.shutdown(wait=True, cancel_futures=True)
        self._close_channels()
