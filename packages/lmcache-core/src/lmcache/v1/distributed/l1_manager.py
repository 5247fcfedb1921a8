"""L1 manager: staging, resident objects, read locks and transfer pins
(docs/design/storage-engine.md#l1-manager).

One manager-wide lock makes every public batch call atomic. Listeners are called inside
that lock (they only record). Buffers handed to an adapter carry a *transfer pin*: a pinned
buffer is never freed or reused, even when its key is deleted or its read lock expires;
the memory is released when the last pin drops (IMPROVE,
docs/design/storage-engine.md#buffer-safety).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from lmcache.lmcache_native import TTLLock
from lmcache.utils import init_logger
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import L1ManagerConfig
from lmcache.v1.distributed.internal_api import (
    L1Error,
    L1ManagerInterface,
    L1ManagerListener,
    L1MemoryDesc,
    L1OperationResult,
)
from lmcache.v1.distributed.l1_memory import L1Allocator, layout_nbytes
from lmcache.v1.memory_management import MemoryObj

logger = init_logger(__name__)

__all__ = ["L1Manager"]

MAX_READ_LOCKS = 128


def _read_lock_count(read_locks: int) -> int:
    """The read locks one call may take on a key: 1 to ``MAX_READ_LOCKS``."""
    return max(1, min(MAX_READ_LOCKS, int(read_locks)))


class _Resident:
    __slots__ = ("is_temporary", "obj", "read_lock")

    def __init__(self, obj: MemoryObj, ttl: float, is_temporary: bool) -> None:
        self.obj = obj
        self.read_lock = TTLLock(ttl)
        self.is_temporary = is_temporary

    def lock_for_read(self, n: int) -> L1OperationResult:
        """Take ``n`` read locks; the result a read reservation reports for the key."""
        self.read_lock.lock(n)
        return (L1Error.SUCCESS, self.obj)


class _Staged:
    __slots__ = ("deadline", "is_temporary", "obj")

    def __init__(self, obj: MemoryObj, deadline: float, is_temporary: bool) -> None:
        self.obj = obj
        self.deadline = deadline
        self.is_temporary = is_temporary


class L1Manager(L1ManagerInterface):
    def __init__(self, config: L1ManagerConfig, allocator: L1Allocator | None = None) -> None:
        self.config = config
        self.tag = config.tag
        mem = config.memory_config
        self._allocator = allocator or L1Allocator(
            mem.size_in_bytes,
            mem.align_bytes,
            lazy=mem.use_lazy,
            init_size=mem.init_size_in_bytes,
            shm_name=mem.shm_name,
            use_hugepages=mem.use_hugepages,
            prefault=mem.prefault,
        )
        self._write_ttl = float(config.write_ttl_seconds)
        self._read_ttl = float(config.read_ttl_seconds)
        self._mu = threading.RLock()
        self._resident: dict[ObjectKey, _Resident] = {}
        self._staging: dict[ObjectKey, dict[str, _Staged]] = {}
        self._pins: dict[int, int] = {}  # arena offset -> transfer pins
        self._deferred: dict[int, MemoryObj] = {}  # freed while pinned
        self._listeners: list[L1ManagerListener] = []
        self._handlers: dict[str, list[Callable[[list[ObjectKey]], None]]] = {}  # by event
        self._candidate_source: Callable[[], list[ObjectKey]] | None = None
        self._demand_evicted = 0
        self._closed = False

    # --- helpers (call with the lock held) -----------------------------------------------------

    def _fire(self, event: str, keys: list[ObjectKey]) -> None:
        if not keys:
            return
        handlers = self._handlers.get(event)
        if handlers is None:
            handlers = self._handlers[event] = self._handlers_of(event)
        for handler in handlers:
            try:
                handler(keys)
            except Exception:
                logger.exception("L1 listener %s failed", event)

    def _handlers_of(self, event: str) -> list[Callable[[list[ObjectKey]], None]]:
        """The listeners' bound ``event`` methods, leaving out L1ManagerListener's no-ops:
        a lookup fires two events, and most listeners care about neither."""
        noop = getattr(L1ManagerListener, event, None)
        out = []
        for listener in self._listeners:
            method = getattr(listener, event, None)
            if method is not None and getattr(method, "__func__", None) is not noop:
                out.append(method)
        return out

    def _release(self, obj: MemoryObj) -> None:
        addr = obj.metadata.address
        if self._pins.get(addr, 0) > 0:
            self._deferred[addr] = obj
        else:
            self._allocator.free(obj)

    def _reclaim_expired_staging(self, key: ObjectKey, now: float) -> None:
        tags = self._staging.get(key)
        if not tags:
            return
        for tag, st in list(tags.items()):
            if st.deadline <= now:
                del tags[tag]
                self._release(st.obj)
        if not tags:
            del self._staging[key]

    def _live_staged(self, key: ObjectKey, now: float) -> bool:
        return any(st.deadline > now for st in self._staging.get(key, {}).values())

    def _gone(self, keys: list[ObjectKey]) -> list[ObjectKey]:
        """Keys that no longer exist at all (neither resident nor staged)."""
        return [k for k in keys if k not in self._resident and k not in self._staging]

    def _remove_resident(self, key: ObjectKey) -> None:
        entry = self._resident.pop(key)
        self._release(entry.obj)

    # --- configuration hooks ---------------------------------------------------------------------

    def register_listener(self, listener: L1ManagerListener) -> None:
        with self._mu:
            self._listeners.append(listener)
            self._handlers.clear()

    def set_eviction_candidate_source(self, fn: Callable[[], list[ObjectKey]] | None) -> None:
        """Eviction order for demand eviction (IMPROVE,
        docs/design/storage-engine.md#eviction-fixes); set by the L1 eviction controller."""
        with self._mu:
            self._candidate_source = fn

    @property
    def allocator(self) -> L1Allocator:
        return self._allocator

    @property
    def write_ttl_seconds(self) -> float:
        return self._write_ttl

    @property
    def read_ttl_seconds(self) -> float:
        return self._read_ttl

    # --- writes ----------------------------------------------------------------------------------------

    def _demand_evict(self, nbytes: int, n: int) -> None:
        if self._candidate_source is None:
            return
        align = self._allocator.align
        need_each = (nbytes + align - 1) // align * align + align
        batch: list[ObjectKey] = []
        for key in self._candidate_source():
            if self._allocator.fits(need_each, n) and not batch:
                return
            if not self.is_key_evictable(key):
                continue
            self._reclaim_expired_staging(key, time.monotonic())
            if key in self._resident:
                self._remove_resident(key)
                batch.append(key)
            if self._allocator.fits(need_each, n):
                break
        if batch:
            self._demand_evicted += len(batch)
            logger.debug("demand eviction freed %d L1 keys", len(batch))
            self._fire("on_l1_keys_deleted_by_manager", batch)

    def _allocate(self, layout: MemoryLayoutDesc, n: int) -> list[MemoryObj]:
        """Up to n objects; demand growth and eviction before giving up (IMPROVE,
        docs/design/storage-engine.md#eviction-fixes)."""
        if n == 0:
            return []
        objs = self._allocator.batched_allocate(layout.shapes, layout.dtypes, n)
        if objs is not None:
            return list(objs)
        if self._allocator.growth_pending:
            self._allocator.grow_now()
            objs = self._allocator.batched_allocate(layout.shapes, layout.dtypes, n)
            if objs is not None:
                return list(objs)
        self._demand_evict(layout_nbytes(layout.shapes, layout.dtypes), n)
        objs = self._allocator.batched_allocate(layout.shapes, layout.dtypes, n)
        if objs is not None:
            return list(objs)
        out: list[MemoryObj] = []
        for _ in range(n):
            one = self._allocator.allocate(layout.shapes, layout.dtypes)
            if one is None:
                break
            out.append(one)
        return out

    def reserve_write(
        self,
        keys: list[ObjectKey],
        is_temporary: list[bool],
        layout_desc: MemoryLayoutDesc,
        tag: str = "",
    ) -> dict[ObjectKey, L1OperationResult]:
        if len(keys) != len(is_temporary):
            raise ValueError("reserve_write: keys and is_temporary differ in length")
        out: dict[ObjectKey, L1OperationResult] = {}
        with self._mu:
            now = time.monotonic()
            fresh: list[tuple[ObjectKey, bool]] = []
            reserved: list[ObjectKey] = []
            phy = layout_nbytes(layout_desc.shapes, layout_desc.dtypes) + self._allocator.align - 1
            phy = phy // self._allocator.align * self._allocator.align
            for key, tmp in zip(keys, is_temporary, strict=False):
                if key in out:
                    continue
                if key in self._resident:
                    out[key] = (L1Error.KEY_NOT_WRITABLE, None)
                    continue
                st = self._staging.get(key, {}).get(tag)
                if st is not None:
                    if st.deadline > now:
                        out[key] = (L1Error.KEY_NOT_WRITABLE, None)
                        continue
                    addr = st.obj.metadata.address
                    if self._pins.get(addr, 0) == 0 and st.obj.get_physical_size() == phy:
                        st.deadline = now + self._write_ttl
                        st.is_temporary = bool(tmp)
                        st.obj.metadata.shapes = list(layout_desc.shapes)
                        st.obj.metadata.dtypes = list(layout_desc.dtypes)
                        out[key] = (L1Error.SUCCESS, st.obj)
                        reserved.append(key)
                        continue
                    del self._staging[key][tag]
                    self._release(st.obj)
                fresh.append((key, bool(tmp)))
            objs = self._allocate(layout_desc, len(fresh))
            for i, (key, tmp) in enumerate(fresh):
                if i < len(objs):
                    obj = objs[i]
                    obj.set_l1_manager(self.tag)
                    self._staging.setdefault(key, {})[tag] = _Staged(
                        obj, now + self._write_ttl, tmp
                    )
                    out[key] = (L1Error.SUCCESS, obj)
                    reserved.append(key)
                else:
                    out[key] = (L1Error.OUT_OF_MEMORY, None)
            self._fire("on_l1_keys_reserved_write", reserved)
        return out

    def _take_staged(self, key: ObjectKey, tag: str, now: float) -> tuple[L1Error, _Staged | None]:
        tags = self._staging.get(key)
        st = tags.get(tag) if tags else None
        if st is None:
            return L1Error.KEY_NOT_EXIST, None
        del tags[tag]  # type: ignore[union-attr]
        if not tags:
            del self._staging[key]
        if st.deadline <= now:
            self._release(st.obj)  # reclaimed: the reservation expired
            return L1Error.KEY_IN_WRONG_STATE, None
        return L1Error.SUCCESS, st

    def _take_each_staged(
        self, keys: list[ObjectKey], tag: str
    ) -> Iterator[tuple[ObjectKey, L1Error, _Staged | None]]:
        """``_take_staged`` of every key (under ``self._mu``), one clock reading for all."""
        now = time.monotonic()
        for key in keys:
            yield (key, *self._take_staged(key, tag, now))

    def _make_resident(self, key: ObjectKey, st: _Staged) -> tuple[_Resident, bool]:
        """Publish a finished write: the key's resident entry, and whether this write made it
        (when another writer won, its entry stays and this buffer is released)."""
        entry = self._resident.get(key)
        if entry is not None:
            self._release(st.obj)
            return entry, False
        entry = self._resident[key] = _Resident(st.obj, self._read_ttl, st.is_temporary)
        return entry, True

    def finish_write(self, keys: list[ObjectKey], tag: str = "") -> dict[ObjectKey, L1Error]:
        out: dict[ObjectKey, L1Error] = {}
        with self._mu:
            admitted: list[ObjectKey] = []
            for key, err, st in self._take_each_staged(keys, tag):
                out[key] = err  # SUCCESS also when another writer won
                if st is not None and self._make_resident(key, st)[1] and not st.is_temporary:
                    admitted.append(key)
            self._fire("on_l1_keys_write_finished", admitted)
            # reservations that expired leave nothing behind: trackers forget them
            expired = [k for k, e in out.items() if e is L1Error.KEY_IN_WRONG_STATE]
            self._fire("on_l1_keys_deleted_by_manager", self._gone(expired))
        return out

    def finish_write_and_reserve_read(
        self, keys: list[ObjectKey], read_locks: int = 1, tag: str = ""
    ) -> dict[ObjectKey, L1OperationResult]:
        n = _read_lock_count(read_locks)
        out: dict[ObjectKey, L1OperationResult] = {}
        with self._mu:
            done: list[ObjectKey] = []
            expired: list[ObjectKey] = []
            for key, err, st in self._take_each_staged(keys, tag):
                if st is None:
                    out[key] = (err, None)
                    if err is L1Error.KEY_IN_WRONG_STATE:
                        expired.append(key)
                    continue
                entry, _ = self._make_resident(key, st)
                out[key] = entry.lock_for_read(n)
                done.append(key)
            self._fire("on_l1_keys_finish_write_and_reserve_read", done)
            # as in finish_write: trackers told of the reservation forget what expired
            self._fire("on_l1_keys_deleted_by_manager", self._gone(expired))
        return out

    def finish_write_and_delete(
        self, keys: list[ObjectKey], tag: str = ""
    ) -> dict[ObjectKey, L1Error]:
        out: dict[ObjectKey, L1Error] = {}
        with self._mu:
            for key in keys:
                tags = self._staging.get(key)
                st = tags.pop(tag, None) if tags else None
                if tags is not None and not tags:
                    del self._staging[key]
                if st is None:
                    out[key] = L1Error.KEY_NOT_EXIST
                    continue
                self._release(st.obj)
                out[key] = L1Error.SUCCESS
            aborted = [k for k, e in out.items() if e is L1Error.SUCCESS]
            self._fire("on_l1_keys_deleted_by_manager", self._gone(aborted))
        return out

    # --- reads -------------------------------------------------------------------------------------------

    def reserve_read(
        self, keys: list[ObjectKey], read_locks: int = 1
    ) -> dict[ObjectKey, L1OperationResult]:
        n = _read_lock_count(read_locks)
        out: dict[ObjectKey, L1OperationResult] = {}
        with self._mu:
            locked: list[ObjectKey] = []
            for key in keys:
                entry = self._resident.get(key)
                if entry is None:
                    out[key] = (L1Error.KEY_NOT_EXIST, None)
                    continue
                out[key] = entry.lock_for_read(n)
                locked.append(key)
            self._fire("on_l1_keys_reserved_read", locked)
        return out

    def reserve_read_prefix(
        self, rows: list[list[ObjectKey]], read_locks: int = 1, keep_locks: bool = True
    ) -> int:
        """One pass under the lock when the locks are kept: keys past the prefix are never
        locked, and the prefix is locked and touched together (a lookup's hot path)."""
        if not keep_locks:
            return super().reserve_read_prefix(rows, read_locks, keep_locks)
        n = _read_lock_count(read_locks)
        hit = len(rows[0]) if rows else 0
        with self._mu:
            resident = self._resident
            found: list[list[_Resident]] = []
            for row in rows:
                entries = []
                for key in row[:hit]:
                    entry = resident.get(key)
                    if entry is None:
                        break
                    entries.append(entry)
                hit = len(entries)
                found.append(entries)
            locked: list[ObjectKey] = []
            now = time.monotonic()
            for row, entries in zip(rows, found, strict=True):
                for entry in entries[:hit]:
                    entry.read_lock.lock(n, now)
                locked += row[:hit]
            self._fire("on_l1_keys_reserved_read", locked)
            self._fire("on_l1_keys_accessed", locked)
        return hit

    def unsafe_read(self, keys: list[ObjectKey]) -> dict[ObjectKey, L1OperationResult]:
        out: dict[ObjectKey, L1OperationResult] = {}
        with self._mu:
            for key in keys:
                entry = self._resident.get(key)
                if entry is None:
                    out[key] = (L1Error.KEY_NOT_EXIST, None)
                elif not entry.read_lock.is_locked():
                    out[key] = (L1Error.KEY_NOT_READABLE, None)
                else:
                    out[key] = (L1Error.SUCCESS, entry.obj)
        return out

    def finish_read(self, keys: list[ObjectKey], read_locks: int = 1) -> dict[ObjectKey, L1Error]:
        n = _read_lock_count(read_locks)
        out: dict[ObjectKey, L1Error] = {}
        with self._mu:
            finished: list[ObjectKey] = []
            freed: list[ObjectKey] = []
            for key in keys:
                entry = self._resident.get(key)
                if entry is None:
                    out[key] = L1Error.KEY_NOT_EXIST
                    continue
                if not entry.read_lock.is_locked():
                    out[key] = L1Error.KEY_IN_WRONG_STATE
                    continue
                entry.read_lock.unlock(n)
                out[key] = L1Error.SUCCESS
                finished.append(key)
                if entry.is_temporary and not entry.read_lock.is_locked():
                    self._remove_resident(key)
                    freed.append(key)
            self._fire("on_l1_keys_read_finished", finished)
            self._fire("on_l1_keys_deleted_by_manager", freed)
        return out

    # --- transfer pins (IMPROVE, docs/design/storage-engine.md#buffer-safety) ---------------------

    def pin_objects(self, objs: Iterable[MemoryObj]) -> None:
        with self._mu:
            for o in objs:
                addr = o.metadata.address
                self._pins[addr] = self._pins.get(addr, 0) + 1

    def unpin_objects(self, objs: Iterable[MemoryObj]) -> None:
        with self._mu:
            for o in objs:
                addr = o.metadata.address
                left = self._pins.get(addr, 0) - 1
                if left > 0:
                    self._pins[addr] = left
                    continue
                self._pins.pop(addr, None)
                dead = self._deferred.pop(addr, None)
                if dead is not None:
                    self._allocator.free(dead)

    def pinned_bytes(self) -> int:
        with self._mu:
            total = 0
            for addr in self._pins:
                size = self._allocator.block_size(addr)
                total += size or 0
            return total

    # --- maintenance ---------------------------------------------------------------------------------------

    def delete(self, keys: list[ObjectKey], force: bool = False) -> dict[ObjectKey, L1Error]:
        out: dict[ObjectKey, L1Error] = {}
        with self._mu:
            now = time.monotonic()
            deleted: list[ObjectKey] = []
            had_staging = [k for k in dict.fromkeys(keys) if k in self._staging]
            for key in keys:
                self._reclaim_expired_staging(key, now)
                entry = self._resident.get(key)
                staged = self._live_staged(key, now)
                if entry is None and not staged:
                    out[key] = L1Error.KEY_NOT_EXIST
                    continue
                if not force and (staged or (entry is not None and entry.read_lock.is_locked())):
                    out[key] = L1Error.KEY_IS_LOCKED
                    continue
                if force and staged:
                    for st in self._staging.pop(key, {}).values():
                        self._release(st.obj)
                if entry is not None:
                    self._remove_resident(key)
                    deleted.append(key)
                out[key] = L1Error.SUCCESS
            # staging-only keys that were reclaimed or force-deleted are gone too
            cleared = [
                k for k in had_staging if out.get(k) in (L1Error.SUCCESS, L1Error.KEY_NOT_EXIST)
            ]
            deleted += [k for k in self._gone(cleared) if k not in deleted]
            self._fire("on_l1_keys_deleted_by_manager", deleted)
        return out

    def touch_keys(self, keys: list[ObjectKey]) -> None:
        with self._mu:
            self._fire("on_l1_keys_accessed", [k for k in keys if k in self._resident])

    def clear(self, force: bool = False) -> int:
        with self._mu:
            keys = list(self._resident) + [k for k in self._staging if k not in self._resident]
            res = self.delete(keys, force=force)
            return sum(1 for e in res.values() if e is L1Error.SUCCESS)

    def is_key_evictable(self, key: ObjectKey) -> bool:
        with self._mu:
            entry = self._resident.get(key)
            if entry is not None:
                return not entry.read_lock.is_locked()
            now = time.monotonic()
            tags = self._staging.get(key)
            return bool(tags) and all(st.deadline <= now for st in tags.values())

    def contains(self, key: ObjectKey) -> bool:
        with self._mu:
            return key in self._resident

    def contains_all(self, keys: Iterable[ObjectKey]) -> bool:
        """Every key is resident (one lock round for the whole batch)."""
        with self._mu:
            resident = self._resident
            return all(k in resident for k in keys)

    def is_read_locked(self, key: ObjectKey) -> bool:
        with self._mu:
            entry = self._resident.get(key)
            return entry is not None and entry.read_lock.is_locked()

    def get_key_size(self, key: ObjectKey) -> int:
        with self._mu:
            entry = self._resident.get(key)
            if entry is not None:
                return entry.obj.get_physical_size()
            return sum(st.obj.get_physical_size() for st in self._staging.get(key, {}).values())

    def keys(self) -> list[ObjectKey]:
        with self._mu:
            return list(self._resident)

    def get_memory_usage(self) -> tuple[int, int]:
        return self._allocator.used_bytes(), self._allocator.committed_size

    def get_staging_memory_usage(self) -> int:
        with self._mu:
            return sum(
                st.obj.get_physical_size() for t in self._staging.values() for st in t.values()
            )

    def get_l1_memory_desc(self) -> L1MemoryDesc:
        return self._allocator.memory_desc()

    @property
    def shm_name(self) -> str:
        return self._allocator.shm_name

    @property
    def pool_size(self) -> int:
        return self._allocator.pool_size

    @property
    def shm_disabled_reason(self) -> str:
        return self._allocator.shm_disabled_reason

    def memcheck(self) -> bool:
        with self._mu:
            if not self._allocator.memcheck():
                return False
            addrs = [e.obj.metadata.address for e in self._resident.values()]
            addrs += [st.obj.metadata.address for t in self._staging.values() for st in t.values()]
            addrs += list(self._deferred)
            if len(addrs) != len(set(addrs)):
                return False
            return all(self._allocator.block_size(a) is not None for a in addrs)

    def report_status(self) -> dict[str, Any]:
        with self._mu:
            now = time.monotonic()
            used, total = self.get_memory_usage()
            return {
                "tag": self.tag,
                "total_object_count": len(self._resident),
                "write_locked_count": sum(
                    1 for t in self._staging.values() for st in t.values() if st.deadline > now
                ),
                "read_locked_count": sum(
                    1 for e in self._resident.values() if e.read_lock.is_locked()
                ),
                "memory_used_bytes": used,
                "memory_total_bytes": total,
                "memory_usage_ratio": (used / total) if total else 0.0,
                "memory_configured_bytes": self._allocator.size,
                "capacity_bytes_by_backend": {"dram": self._allocator.size},
                "staging_object_count": sum(len(t) for t in self._staging.values()),
                "temporary_count": 0,  # this L1 keeps no temporary objects
                "staging_bytes": self.get_staging_memory_usage(),
                "pinned_bytes": self.pinned_bytes(),
                "deferred_free_count": len(self._deferred),
                "demand_evicted_keys": self._demand_evicted,
                "write_ttl_seconds": self._write_ttl,
                "read_ttl_seconds": self._read_ttl,
                "lazy": self._allocator.lazy,
                "committed_bytes": self._allocator.committed_size,
                "prefault": self._allocator.prefault,
                "prefaulted_bytes": self._allocator.prefaulted_bytes,
                "size_bytes": self._allocator.size,
                "shm_name": self.shm_name,
                "pool_size": self.pool_size,
                "shm_disabled_reason": self.shm_disabled_reason,
                "is_healthy": self.memcheck(),
            }

    def close(self) -> None:
        with self._mu:
            if self._closed:
                return
            self._closed = True
            self._resident.clear()
            self._staging.clear()
            self._listeners.clear()
            self._handlers.clear()
        self._allocator.close()
