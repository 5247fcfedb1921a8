"""``raw_block``: L2 objects in fixed-size slots of a block device or pre-sized file, in
LMCache 0.5.6's on-disk format (``layout``), so a device written by either is read by the other.

Each object takes one slot (header + bytes). The key -> slot index lives in memory and is
checkpointed into the metadata region: periodically once I/O has been quiet for
``meta_idle_quiet_ms`` (``meta_enable_periodic``) and always at ``close``; start-up reads the
newest valid checkpoint and (``meta_verify_on_load``) drops every key whose slot header does
not carry that key and length. Keys stored after the last checkpoint are lost by a crash, as
in 0.5.6; their slots are reused.

Capacity is slots x slot_bytes, and every key is charged one slot. As in 0.5.6 the adapter
never evicts by itself: a store that finds no free slot fails that key (the task reports
failure), and the L2 eviction controller (an ``eviction`` block) frees slots through
``delete``. Keys locked by a lookup or being read are never deleted.

Threads: stores and loads run on two pools (``num_store_workers``, ``num_load_workers``);
lookups and unlocks touch only the index and run on the caller's thread; one thread writes
periodic checkpoints.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lmcache.storage.raw_block import layout
from lmcache.storage.raw_block.config import RawBlockL2AdapterConfig
from lmcache.storage.raw_block.device import IO, Device
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.l2_adapters.api import (
    Bitmap,
    CompletionChannels,
    HealthTracker,
    KeyLockTable,
    L1MemoryDesc,
    L2StoreResult,
    LMCacheConfigError,
    RateLimitedLog,
    TaskIds,
    init_logger,
)
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId

logger = init_logger(__name__)
# A full device (no eviction block) refuses every store: one line per cause every 30 s.
_store_refusals = RateLimitedLog(logger, interval=30.0)


@dataclass
class _Entry:
    meta: layout.EntryMeta
    key: ObjectKey
    loading: int = 0  # loads in flight reading this slot: it is not freed meanwhile


def _object_meta(offset: int, obj: Any, size: int) -> layout.EntryMeta:
    """What 0.5.6 records about a stored object (shape, dtype, format, cached positions)."""
    md = getattr(obj, "metadata", None)
    shape = getattr(md, "shape", None)
    dtype = getattr(md, "dtype", None)
    fmt = getattr(md, "fmt", None)
    positions: Any = getattr(md, "cached_positions", None)
    return layout.EntryMeta(
        offset,
        size,
        [int(d) for d in shape] if shape is not None else None,
        layout.DTYPE_NAMES.get(str(dtype), str(dtype)) if dtype is not None else None,
        getattr(fmt, "name", None) if fmt is not None else None,
        [int(p) for p in positions.tolist()] if hasattr(positions, "tolist") else None,
    )


def _byte_view(obj: Any) -> memoryview:
    view = memoryview(obj.byte_array)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class RawBlockL2Adapter(CompletionChannels, L2AdapterInterface):
    def __init__(
        self, config: RawBlockL2AdapterConfig, l1_memory_desc: L1MemoryDesc | None = None
    ) -> None:
        if config.use_uring_cmd or config.fdp_enabled:
            raise LMCacheConfigError(
                "raw_block: use_uring_cmd (NVMe io_uring passthrough on /dev/ngXnY) and "
                "fdp_enabled are not provided by lmcache-raw-block yet; set use_uring_cmd=false "
                "and fdp_enabled=false (io_engine 'io_uring' on the block device, e.g. "
                "/dev/nvme0n1, reads and writes the same format)"
            )
        self._cfg = config
        self._dev = Device(config)
        try:
            self._geo = self._geometry()
            self._setup()
        except Exception:
            self._dev.close()
            raise

    def _setup(self) -> None:
        config = self._cfg
        super().__init__(max_capacity_bytes=self._geo.max_slots * config.slot_bytes)
        self._health = HealthTracker(f"raw_block at {config.device_path}")
        self._lock = threading.Lock()
        self._index: dict[str, _Entry] = {}
        self._storing: set[str] = set()
        self._free: list[int] = []
        self._next_slot = 0
        self._pins = KeyLockTable()
        self._ids = TaskIds()
        self._dirty = 0  # index changes; a checkpoint records how many it covers
        self._persisted = 0
        self._seq = 0
        self._io_inflight = 0
        self._last_io = time.monotonic()
        self._ckpt_lock = threading.Lock()
        self._closed = False
        self._recovery_note = "no checkpoint read (load_checkpoint_on_init=false)"
        if config.load_checkpoint_on_init:
            self._recover()
        recovered = [(e.key, config.slot_bytes) for e in self._index.values()]
        if recovered:
            self._notify_keys_stored([k for k, _ in recovered], [s for _, s in recovered])
        self._open_channels()
        self._store_pool = ThreadPoolExecutor(config.num_store_workers, "lmc-rawblk-store")
        self._load_pool = ThreadPoolExecutor(config.num_load_workers, "lmc-rawblk-load")
        self._stop = threading.Event()
        self._ckpt_thread: threading.Thread | None = None
        if config.meta_enable_periodic:
            self._ckpt_thread = threading.Thread(
                target=self._checkpoint_loop, name="lmc-rawblk-ckpt", daemon=True
            )
            self._ckpt_thread.start()
        logger.info(
            "raw_block ready: %s (%s, %s), %d slots of %d bytes (%.2f GiB), %d keys recovered (%s)",
            config.device_path,
            config.io_engine,
            "O_DIRECT" if config.use_odirect else "buffered",
            self._geo.max_slots,
            config.slot_bytes,
            self.max_capacity_bytes / 2**30,
            len(recovered),
            self._recovery_note,
        )

    def _geometry(self) -> layout.Geometry:
        cfg = self._cfg
        size = self._dev.size
        capacity = min(cfg.capacity_bytes, size) if cfg.capacity_bytes > 0 else size
        geo = layout.Geometry(
            capacity, cfg.block_align, cfg.header_bytes, cfg.slot_bytes, cfg.meta_total_bytes
        )
        if geo.max_slots <= 0:
            raise LMCacheConfigError(
                f"raw_block: device_path {cfg.device_path!r} has {size} bytes (capacity "
                f"{capacity}); it needs meta_total_bytes ({cfg.meta_total_bytes}) plus at least "
                f"one slot ({cfg.slot_bytes}). Use a larger device or file (truncate -s 8G "
                "PATH), or lower meta_total_bytes / slot_bytes"
            )
        return geo

    # --- recovery --------------------------------------------------------------------------

    def _read_checkpoint(self, index: int) -> tuple[layout.MetaHeader, bytes] | None:
        geo = self._geo
        base = geo.container_offset(index)
        block = bytearray(geo.block_align)
        if not all(self._dev.read([IO(base, block, len(block), len(block))])):
            return None
        header = layout.decode_meta_header(
            block,
            self._cfg.meta_magic.encode(),
            self._cfg.meta_version,
            geo.meta_payload_capacity,
        )
        if header is None:
            return None
        total = layout.round_up(header.payload_len, geo.block_align)
        buf = bytearray(total)
        io = IO(base + geo.block_align, buf, header.payload_len, total)
        if not all(self._dev.read([io])):
            return None
        payload = bytes(buf[: header.payload_len])
        return (header, payload) if layout.payload_matches(header, payload) else None

    def _recover(self) -> None:
        found = [c for c in (self._read_checkpoint(i) for i in range(layout.META_COPIES)) if c]
        if not found:
            self._recovery_note = "no valid checkpoint on the device"
            return
        header, payload = max(found, key=lambda c: c[0].seq)
        decoded = layout.decode_checkpoint(
            payload,
            device_path=self._cfg.device_path,
            geometry=self._geo,
            meta_magic=self._cfg.meta_magic,
            meta_version=self._cfg.meta_version,
        )
        if isinstance(decoded, str):
            self._recovery_note = f"checkpoint seq {header.seq} ignored: {decoded}"
            logger.warning("raw_block %s: %s", self._cfg.device_path, self._recovery_note)
            return
        next_slot, entries = decoded
        self._seq = header.seq
        index: dict[str, _Entry] = {}
        used: set[int] = set()
        for encoded, meta in entries.items():
            try:
                key = layout.decode_key(encoded)
            except ValueError as exc:
                logger.warning("raw_block: checkpoint entry skipped: %s", exc)
                continue
            slot = self._geo.slot_of(meta.offset)
            if slot is None or slot in used:
                continue
            used.add(slot)
            index[encoded] = _Entry(meta, key)
        dropped = self._verify(index) if self._cfg.meta_verify_on_load else 0
        self._index = index
        slots = {self._geo.slot_of(e.meta.offset) for e in index.values()}
        self._next_slot = max([next_slot, *((s or 0) + 1 for s in slots)])
        self._free = [s for s in range(self._next_slot) if s not in slots]
        self._free.reverse()  # pop() takes the lowest slot first
        self._dirty = 1 if dropped else 0
        self._recovery_note = f"checkpoint seq {header.seq}" + (
            f", {dropped} stale keys dropped" if dropped else ""
        )

    def _verify(self, index: dict[str, _Entry]) -> int:
        """Drop the entries whose slot header does not carry their key and length."""
        align = self._geo.block_align
        items = list(index.items())
        stale: list[str] = []
        step = max(1, self._cfg.iouring_queue_depth)
        for start in range(0, len(items), step):
            chunk = items[start : start + step]
            bufs = [bytearray(align) for _ in chunk]
            ok = self._dev.read(
                [IO(e.meta.offset, b, align, align) for (_, e), b in zip(chunk, bufs, strict=True)]
            )
            for (encoded, entry), buf, good in zip(chunk, bufs, ok, strict=True):
                hdr = layout.decode_slot_header(buf) if good else None
                if hdr != (layout.slot_identity(encoded), entry.meta.size):
                    stale.append(encoded)
        for encoded in stale:
            del index[encoded]
        if stale:
            logger.warning(
                "raw_block %s: %d recovered keys dropped: their slot headers do not match the "
                "checkpoint",
                self._cfg.device_path,
                len(stale),
            )
        return len(stale)

    # --- store -------------------------------------------------------------------------------

    def _submit(self, pool: ThreadPoolExecutor, fn: Any, fail: Any, *args: Any) -> None:
        """Run ``fn(*args)`` on ``pool``; ``fail()`` publishes the task's failure when the
        adapter is closed or ``fn`` raises (a bug in one task never loses its completion)."""

        def run() -> None:
            try:
                fn(*args)
            except Exception:
                logger.exception("raw_block: %s failed", fn.__name__)
                fail()

        try:
            if self._closed:
                raise RuntimeError("closed")
            pool.submit(run)
        except RuntimeError:  # closed, or the pool shut down by a concurrent close
            fail()

    def submit_store_task(self, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        task_id = self._ids.next()
        if len(keys) != len(objects):
            self._store_channel.complete(
                task_id,
                L2StoreResult(
                    False, error=f"{len(keys)} keys but {len(objects)} buffers in one store"
                ),
            )
            return task_id
        self._submit(
            self._store_pool,
            self._store,
            lambda: self._store_channel.complete(
                task_id, L2StoreResult(False, error="the adapter is closed or failed (see log)")
            ),
            task_id,
            list(keys),
            list(objects),
        )
        return task_id

    def _slot_locked(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._next_slot < self._geo.max_slots:
            self._next_slot += 1
            return self._next_slot - 1
        return None

    def _store(self, task_id: int, keys: list[ObjectKey], objects: list[Any]) -> None:
        geo = self._geo
        errors: list[str] = []
        failed: set[ObjectKey] = set()
        todo: list[tuple[str, ObjectKey, Any, int, memoryview]] = []  # enc, key, obj, slot, view
        for key, obj in zip(keys, objects, strict=True):
            enc = layout.encode_key(key)
            view = _byte_view(obj)
            if self._dev.length(len(view)) > geo.payload_capacity():
                errors.append(
                    f"{enc}: {len(view)} bytes do not fit a slot ({geo.payload_capacity()} bytes "
                    "after the header); raise slot_bytes"
                )
                failed.add(key)
                continue
            with self._lock:
                if enc in self._index or enc in self._storing:
                    continue  # stored already: 0 new bytes
                slot = self._slot_locked()
                if slot is None:
                    errors.append(
                        f"{enc}: no free slot (all {geo.max_slots} of {geo.slot_bytes} bytes in "
                        "use); configure an 'eviction' block or use a larger device"
                    )
                    failed.add(key)
                    continue
                self._storing.add(enc)
                self._io_inflight += 1
            todo.append((enc, key, obj, slot, view))
        # Headers first, then the bytes: a reused slot stops naming its old key (which an
        # older checkpoint may still list) before its bytes change, so a crash in between
        # makes recovery drop that key instead of serving it another key's bytes.
        headers: list[IO] = []
        payloads: list[IO] = []
        for enc, _key, _obj, slot, view in todo:
            off = geo.slot_offset(slot)
            header = layout.encode_slot_header(enc, len(view), geo.header_bytes)
            headers.append(IO(off, header, len(header), len(header)))
            payloads.append(
                IO(off + geo.header_bytes, view, len(view), self._dev.length(len(view)))
            )
        try:
            ok = self._dev.write(headers)
            written = [io for io, good in zip(payloads, ok, strict=True) if good]
            it = iter(self._dev.write(written))
            ok = [good and next(it) for good in ok]
        except Exception as exc:
            self._dev.last_error = f"write: {exc}"
            ok = [False] * len(todo)
        new_keys: list[ObjectKey] = []
        with self._lock:
            for i, (enc, key, obj, slot, view) in enumerate(todo):
                self._storing.discard(enc)
                self._io_inflight -= 1
                if ok[i]:
                    meta = _object_meta(geo.slot_offset(slot), obj, len(view))
                    self._index[enc] = _Entry(meta, key)
                    self._dirty += 1
                    new_keys.append(key)
                else:
                    self._free.append(slot)
                    failed.add(key)
                    errors.append(f"{enc}: {self._dev.last_error or 'write failed'}")
            self._last_io = time.monotonic()
        if todo and len(new_keys) == len(todo):
            self._health.success("store")
        if len(new_keys) < len(todo):
            self._health.failure("store", errors[-1])
        elif errors:
            _store_refusals.warning(errors[0].split(": ", 1)[1], "raw_block store: %s", errors[0])
        sizes = [self._cfg.slot_bytes] * len(new_keys)
        if new_keys:
            self._notify_keys_stored(new_keys, sizes)
        result = L2StoreResult.per_key(
            [key not in failed for key in keys],
            sum(sizes),
            error=f"{len(errors)} of {len(keys)} keys: {errors[0]}" if errors else None,
        )
        self._store_channel.complete(task_id, result)

    # --- lookup --------------------------------------------------------------------------------

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc] | None = None
    ) -> L2TaskId:
        task_id = self._ids.next()
        bm = Bitmap(len(keys))
        with self._lock:  # pin under the index lock: a delete cannot slip in between
            found = [i for i, k in enumerate(keys) if layout.encode_key(k) in self._index]
            self._pins.lock([keys[i] for i in found])
        if found:
            bm.batched_set(found)
        self._lookup_channel.complete(task_id, bm)
        return task_id

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self._pins.unlock(list(keys))

    # --- load ----------------------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[Any]) -> L2TaskId:
        task_id = self._ids.next()
        if len(keys) != len(objects):
            self._load_channel.complete(task_id, Bitmap(len(keys)))
            return task_id
        self._submit(
            self._load_pool,
            self._load,
            lambda: self._load_channel.complete(task_id, Bitmap(len(keys))),
            task_id,
            list(keys),
            list(objects),
        )
        return task_id

    def _load(self, task_id: int, keys: list[ObjectKey], objects: list[Any]) -> None:
        hdr = self._geo.header_bytes
        reads: list[tuple[int, _Entry]] = []
        ios: list[IO] = []
        with self._lock:
            for i, (key, obj) in enumerate(zip(keys, objects, strict=True)):
                entry = self._index.get(layout.encode_key(key))
                if entry is None:
                    continue
                view = _byte_view(obj)
                if len(view) != entry.meta.size:
                    logger.warning(
                        "raw_block load of %s skipped: it holds %d bytes but the destination "
                        "takes %d",
                        layout.encode_key(key),
                        entry.meta.size,
                        len(view),
                    )
                    continue
                entry.loading += 1
                self._io_inflight += 1
                reads.append((i, entry))
                size = entry.meta.size
                ios.append(IO(entry.meta.offset + hdr, view, size, self._dev.length(size)))
        try:
            ok = self._dev.read(ios)
        except Exception as exc:
            self._dev.last_error = f"read: {exc}"
            ok = [False] * len(ios)
        loaded = [False] * len(keys)
        with self._lock:
            for (i, entry), good in zip(reads, ok, strict=True):
                entry.loading -= 1
                self._io_inflight -= 1
                loaded[i] = good
            self._last_io = time.monotonic()
        for (i, entry), good in zip(reads, ok, strict=True):
            if good and entry.meta.cached_positions is not None:
                _set_cached_positions(objects[i], entry.meta.cached_positions)
        if reads:
            if all(ok):
                self._health.success("load")
            else:
                self._health.failure("load", self._dev.last_error or "read failed")
        self._complete_load(task_id, keys, loaded)

    # --- eviction --------------------------------------------------------------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Free the slots of unpinned keys; keys locked by a lookup or being read are skipped
        (the eviction controller retries them later)."""
        removed: list[ObjectKey] = []
        with self._lock:
            for key in dict.fromkeys(keys):
                enc = layout.encode_key(key)
                entry = self._index.get(enc)
                if entry is None or entry.loading or self._pins.is_locked(key):
                    continue
                del self._index[enc]
                slot = self._geo.slot_of(entry.meta.offset)
                if slot is not None:
                    self._free.append(slot)
                self._dirty += 1
                removed.append(key)
        if removed:
            self._notify_keys_deleted(removed, [self._cfg.slot_bytes] * len(removed))

    def register_listener(self, listener: Any) -> None:
        """Also replays the keys already on the device to the new listener, so an eviction
        controller attached after start-up tracks the recovered keys too."""
        super().register_listener(listener)
        with self._lock:
            known = [e.key for e in self._index.values()]
        if known:
            listener.on_l2_keys_stored(known, [self._cfg.slot_bytes] * len(known))

    # --- checkpoints -----------------------------------------------------------------------------

    def checkpoint(self, force: bool = True) -> bool:
        """Write the index to the metadata region when it changed (``force=False``: only when
        no I/O ran for ``meta_idle_quiet_ms``). Returns whether one was written."""
        cfg, geo = self._cfg, self._geo
        with self._ckpt_lock:
            with self._lock:
                if self._dirty == self._persisted:
                    return False
                quiet = time.monotonic() - self._last_io >= cfg.meta_idle_quiet_ms / 1000
                if not force and (self._io_inflight or not quiet):
                    return False
                dirty = self._dirty
                entries = {enc: e.meta for enc, e in self._index.items()}
                next_slot = self._next_slot
            payload = layout.encode_checkpoint(
                device_path=cfg.device_path,
                geometry=geo,
                meta_magic=cfg.meta_magic,
                meta_version=cfg.meta_version,
                next_slot=next_slot,
                entries=entries,
            )
            if len(payload) > geo.meta_payload_capacity:
                self._health.failure(
                    "checkpoint",
                    f"the index ({len(payload)} bytes) does not fit a checkpoint copy "
                    f"({geo.meta_payload_capacity} bytes); raise meta_total_bytes",
                )
                return False
            seq = self._seq + 1
            base = geo.container_offset((seq - 1) % layout.META_COPIES)
            total = layout.round_up(len(payload), geo.block_align)
            header = layout.encode_meta_header(
                cfg.meta_magic.encode(), cfg.meta_version, seq, payload, geo.block_align
            )
            # payload first, then the header that makes it valid
            ok = self._dev.write([IO(base + geo.block_align, payload, len(payload), total)]) == [
                True
            ] and self._dev.write([IO(base, header, len(header), len(header))]) == [True]
            if not ok:
                self._health.failure("checkpoint", self._dev.last_error or "write failed")
                return False
            self._seq = seq
            with self._lock:
                self._persisted = dirty
            return True

    def _checkpoint_loop(self) -> None:
        interval = max(1, self._cfg.meta_checkpoint_interval_sec)
        while not self._stop.wait(interval):
            try:
                self.checkpoint(force=False)
            except Exception:
                logger.exception("raw_block: periodic checkpoint failed")

    # --- status and lifecycle ----------------------------------------------------------------------

    def report_status(self) -> dict[str, Any]:
        health = self._health.status()
        with self._lock:
            status = {
                "indexed_key_count": len(self._index),
                "free_slot_count": len(self._free) + self._geo.max_slots - self._next_slot,
                "max_slots": self._geo.max_slots,
                "metadata_seq": self._seq,
            }
        error = self._dev.worker_error() if not self._closed else None
        return {
            "is_healthy": health["healthy"] and not self._closed and error is None,
            **health,
            "type": "RawBlockL2Adapter",
            "device_path": self._cfg.device_path,
            "io_engine": self._cfg.io_engine,
            "slot_bytes": self._cfg.slot_bytes,
            "usable_capacity_bytes": self.max_capacity_bytes,
            "recovery": self._recovery_note,
            "worker_error": error,
            **status,
        }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._ckpt_thread is not None:
            self._ckpt_thread.join()
        self._store_pool.shutdown(wait=True)
        self._load_pool.shutdown(wait=True)
        try:
            self.checkpoint(force=True)
        except Exception:
            logger.exception("raw_block: final checkpoint of %s failed", self._cfg.device_path)
        self._dev.close()
        self._pins.clear()
        self._close_channels()


def _set_cached_positions(obj: Any, positions: Any) -> None:
    """0.5.6 hands the recorded cached positions back on load (a malformed record from a
    checkpoint is ignored: the bytes loaded are right either way)."""
    md = getattr(obj, "metadata", None)
    if md is None:
        return
    import torch

    try:
        md.cached_positions = torch.tensor(positions, dtype=torch.long)
    except (TypeError, ValueError, RuntimeError):
        logger.debug("raw_block: cached_positions %r ignored", positions)
