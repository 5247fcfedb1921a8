"""The native-connector contract (docs/design/storage-engine.md#native-contract) over NIXL, for
``nixl_native``.

``event_fd``, ``submit_batch_get/set/exists`` (and ``submit_batch_delete`` where the storage can
delete), ``drain_completions`` and ``close``, driven by core's ``NativeConnectorL2Adapter``
bridge exactly like the compiled fs and redis clients. NIXL's wheel ships no C++ headers, so
this connector is Python over NIXL's Python API; the bridge cannot tell the difference.

Workers: ``num_workers`` threads, each owning one NIXL agent with the whole L1 arena registered
as DRAM. A batch of n keys is split into ``min(workers, n)`` tiles; the last tile to finish
pushes exactly one completion. Per key:

* FILE_SEG plugins (POSIX, ...): the L2 file name (docs/design/storage-formats.md#l2-names) under
  ``file_path``. Set writes a unique temp file through NIXL, fsyncs it and publishes it with
  ``link()`` (an existing file is never replaced: the first writer wins). Get reads the first
  ``len(buffer)`` bytes of a file at least that long. Exists stats the file; delete unlinks it.
* OBJ_SEG plugins (OBJ, ...): one object per key named by the native key string. Exists asks
  NIXL's ``query_memory``; there is no delete (NIXL has no object delete), so eviction is
  refused at creation.

Buffers must lie in the registered arena; one that does not fails its key (get) or its tile
(set) with the reason, as docs/design/storage-engine.md#native-framework says.
"""

from __future__ import annotations

import errno
import itertools
import os
import queue
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from lmcache.storage.nixl._arena import Arena, BufferRejected, buffer_address
from lmcache.storage.nixl._health import Health
from lmcache.storage.nixl._nixl_api import describe_error, new_agent
from lmcache.storage.nixl.config import ADAPTER_PARAM_KEYS, is_true
from lmcache.v1.distributed.l2_adapters.api import (
    PythonNativeConnector,
    fsync_dir,
    object_key_to_filename,
    string_to_object_key,
)

DIRECT_IO_ALIGN = 512
MIN_WAIT_S = 0.00005
MAX_WAIT_S = 0.001


@dataclass
class _Batch:
    future_id: int
    op: str  # get | set | exists | delete
    keys: list[str]
    spans: list[tuple[int, int] | str]  # (address, length), or why the buffer was refused
    remaining: int = 0
    results: list[bool] = field(default_factory=list)
    error: str = ""
    mu: threading.Lock = field(default_factory=threading.Lock)


class _Stop:
    pass


class NixlConnector(PythonNativeConnector):
    """Base of the FILE and OBJ connectors: workers and tiles over the shared completion half."""

    storage_type = ""
    supports_query = True

    def __init__(
        self,
        backend: str,
        backend_params: dict[str, str],
        num_workers: int,
        arena: Arena,
        agents: list[Any],
        health: Health,
    ) -> None:
        self.backend = backend
        self.backend_params = backend_params
        self.arena = arena
        self.health = health
        self._agents = agents
        self._regs = [a.register_memory(arena.region(), mem_type="DRAM") for a in agents]
        self._open_completions()
        self._tiles: queue.SimpleQueue[tuple[_Batch, int, int] | _Stop] = queue.SimpleQueue()
        self._closed = False
        self._threads = [
            threading.Thread(
                target=self._work, args=(agent,), name=f"lmc-nixl-native-{i}", daemon=True
            )
            for i, agent in enumerate(agents)
        ]
        for t in self._threads:
            t.start()

    # --- native-connector contract ----------------------------------------------------------------

    def close(self) -> None:
        """Stops the workers after their current tile (no buffer is touched afterwards),
        releases the agents' registrations and the fd. Synthesises no completions."""
        if self._closed:
            return
        self._closed = True
        while True:  # queued tiles are dropped: their buffers may be gone after close()
            try:
                self._tiles.get_nowait()
            except queue.Empty:
                break
        for _ in self._threads:
            self._tiles.put(_Stop())
        for t in self._threads:
            t.join()
        for agent, reg in zip(self._agents, self._regs, strict=True):
            try:
                agent.deregister_memory(reg)
            except Exception:
                pass
        self._agents.clear()
        self._close_completions()

    # --- submission -------------------------------------------------------------------------

    def _submit(self, op: str, keys: list[str], views: list[Any] | None) -> int:
        if self._closed:
            raise RuntimeError("nixl_native connector is closed")
        if not keys:
            raise RuntimeError("keys list is empty")
        spans: list[tuple[int, int] | str] = []
        if views is not None:
            if len(views) != len(keys):
                raise RuntimeError("keys and memviews size mismatch")
            for i, v in enumerate(views):
                mv = memoryview(v)
                if not mv.c_contiguous:
                    raise RuntimeError(f"buffer {i} is not C-contiguous")
                spans.append(self._span(mv))
        batch = _Batch(self._next_future_id(), op, list(keys), spans, results=[False] * len(keys))
        tiles = min(len(self._threads), len(keys))
        per = -(-len(keys) // tiles)
        starts = list(range(0, len(keys), per))
        batch.remaining = len(starts)
        for s in starts:
            self._tiles.put((batch, s, min(len(keys), s + per)))
        return batch.future_id

    def _span(self, mv: memoryview) -> tuple[int, int] | str:
        n = mv.nbytes
        try:
            addr = buffer_address(mv)
        except BufferRejected as exc:
            return str(exc)
        end = self.arena.base + self.arena.num_pages * self.arena.page
        if not (self.arena.base <= addr and addr + n <= end):
            return (
                f"the buffer at {addr:#x} ({n} bytes) lies outside the registered L1 arena "
                f"[{self.arena.base:#x}, {end:#x}); NIXL moves only buffers of the L1 pool"
            )
        return addr, n

    # --- workers ------------------------------------------------------------------------------

    def _work(self, agent: Any) -> None:
        while True:
            item = self._tiles.get()
            if isinstance(item, _Stop):
                return
            batch, start, end = item
            error = ""
            try:
                self._run_tile(agent, batch, start, end)
            except Exception as exc:  # exists/set: the tile (so the batch) fails
                error = describe_error(exc)
                self.health.failure(
                    f"{batch.op} of {end - start} keys failed: {error}",
                    backend=not isinstance(exc, BufferRejected),
                )
            with batch.mu:
                if error and not batch.error:
                    batch.error = error
                batch.remaining -= 1
                last = batch.remaining == 0
            if last:
                self._finish(batch)

    def _run_tile(self, agent: Any, batch: _Batch, start: int, end: int) -> None:
        if batch.op == "exists":
            found = self.exists_many(agent, batch.keys[start:end])
            batch.results[start:end] = found
            return
        for i in range(start, end):
            key = batch.keys[i]
            span = batch.spans[i] if batch.spans else None
            if batch.op == "set":
                if isinstance(span, str):
                    raise BufferRejected(f"set of {key}: {span}")
                self.set_one(agent, key, *span)
                batch.results[i] = True
                continue
            try:  # get and delete fail per key; the batch stays ok
                if isinstance(span, str):
                    raise BufferRejected(span)
                if batch.op == "get":
                    batch.results[i] = self.get_one(agent, key, *span)
                else:
                    batch.results[i] = self.delete_one(key)
            except Exception as exc:
                self.health.failure(
                    f"{batch.op} of {key} failed: {describe_error(exc)}",
                    backend=not isinstance(exc, BufferRejected),
                )

    def _finish(self, batch: _Batch) -> None:
        ok = not batch.error
        if ok and batch.op in ("set", "get"):
            self.health.success()
        results = None if batch.op == "set" else list(batch.results)
        self._complete(batch.future_id, ok, batch.error, results)

    # --- NIXL ------------------------------------------------------------------------------------

    @staticmethod
    def move(
        agent: Any, op: str, addr: int, n: int, remote: tuple[int, int, int], mem: str
    ) -> None:
        """One transfer of ``n`` bytes between ``addr`` (arena) and ``remote``; raises unless it
        ends DONE."""
        local = agent.get_xfer_descs([(addr, n, 0)], mem_type="DRAM")
        far = agent.get_xfer_descs([remote], mem_type=mem)
        handle = agent.initialize_xfer(op, local, far, agent.name)
        try:
            state = agent.transfer(handle)
            wait = MIN_WAIT_S
            while state == "PROC":
                time.sleep(wait)
                wait = min(MAX_WAIT_S, wait * 2)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL {op} transfer ended in {state}")
        finally:
            agent.release_xfer_handle(handle)

    # overridden per storage type
    def set_one(self, agent: Any, key: str, addr: int, n: int) -> None:
        raise NotImplementedError

    def get_one(self, agent: Any, key: str, addr: int, n: int) -> bool:
        raise NotImplementedError

    def exists_many(self, agent: Any, keys: list[str]) -> list[bool]:
        raise NotImplementedError

    def delete_one(self, key: str) -> bool:
        raise NotImplementedError


class NixlFileConnector(NixlConnector):
    """FILE_SEG plugins: one file per key under its L2 name
    (docs/design/storage-formats.md#l2-names), published like ``fs``."""

    storage_type = "FILE"
    supports_delete = True
    atomic_publication = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.root = os.path.abspath(self.backend_params["file_path"])
        os.makedirs(self.root, exist_ok=True)
        self.supports_direct_io = is_true(self.backend_params.get("use_direct_io")) and hasattr(
            os, "O_DIRECT"
        )

    def submit_batch_delete(self, keys: list[str]) -> int:
        return self._submit("delete", keys, None)

    def path(self, key: str) -> str:
        obj_key = string_to_object_key(key)
        if obj_key is None:
            raise ValueError(f"unparsable key string {key!r}")
        return os.path.join(self.root, object_key_to_filename(obj_key))

    def _flags(self, addr: int, n: int) -> int:
        aligned = addr % DIRECT_IO_ALIGN == 0 and n % DIRECT_IO_ALIGN == 0
        return os.O_DIRECT if self.supports_direct_io and aligned else 0

    def set_one(self, agent: Any, key: str, addr: int, n: int) -> None:
        final = self.path(key)
        if os.path.exists(final):
            return  # first writer wins; the value is content-addressed
        tmp = f"{final[: -len('.data')]}.{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | self._flags(addr, n), 0o644)
        try:
            reg = agent.register_memory([(0, n, fd, "")], mem_type="FILE")
            try:
                self.move(agent, "WRITE", addr, n, (0, n, fd), "FILE")
            finally:
                agent.deregister_memory(reg)
            if os.fstat(fd).st_size < n:
                raise OSError(errno.EIO, f"short write ({os.fstat(fd).st_size} of {n} bytes)")
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink(tmp)
            raise
        os.close(fd)
        try:
            os.link(tmp, final)  # never replaces an existing file
        except FileExistsError:
            pass  # another writer published the same key first
        finally:
            _unlink(tmp)
        fsync_dir(self.root)

    def get_one(self, agent: Any, key: str, addr: int, n: int) -> bool:
        try:
            fd = os.open(self.path(key), os.O_RDONLY | self._flags(addr, n))
        except FileNotFoundError:
            return False
        try:
            if os.fstat(fd).st_size < n:
                return False  # shorter than the destination: a miss
                # (docs/design/storage-formats.md#value-bytes)
            reg = agent.register_memory([(0, n, fd, "")], mem_type="FILE")
            try:
                self.move(agent, "READ", addr, n, (0, n, fd), "FILE")
            finally:
                agent.deregister_memory(reg)
            return True
        finally:
            os.close(fd)

    def exists_many(self, agent: Any, keys: list[str]) -> list[bool]:
        out = []
        for key in keys:
            try:
                out.append(os.stat(self.path(key)).st_size > 0)
            except FileNotFoundError:
                out.append(False)
        return out

    def delete_one(self, key: str) -> bool:
        try:
            os.unlink(self.path(key))
            return True
        except FileNotFoundError:
            return False


class NixlObjConnector(NixlConnector):
    """OBJ_SEG plugins: one object per key named by the native key string; no delete."""

    storage_type = "OBJ"
    supports_delete = False
    supports_direct_io = False
    atomic_publication = True  # an object PUT is all or nothing

    _dev_ids = itertools.count(1)

    def _dev(self) -> int:
        return next(self._dev_ids) % (1 << 31)

    def set_one(self, agent: Any, key: str, addr: int, n: int) -> None:
        self._move_object(agent, "WRITE", key, addr, n)

    def get_one(self, agent: Any, key: str, addr: int, n: int) -> bool:
        if not self.exists_many(agent, [key])[0]:
            return False
        self._move_object(agent, "READ", key, addr, n)
        return True

    def _move_object(self, agent: Any, op: str, key: str, addr: int, n: int) -> None:
        """``op`` (READ or WRITE) ``n`` bytes at ``addr`` from/to the object ``key``, through a
        registration of the object that lives only for this transfer."""
        dev = self._dev()
        reg = agent.register_memory([(0, n, dev, key)], mem_type="OBJ")
        try:
            self.move(agent, op, addr, n, (0, n, dev), "OBJ")
        finally:
            agent.deregister_memory(reg)

    def exists_many(self, agent: Any, keys: list[str]) -> list[bool]:
        found = agent.query_memory(
            [(0, 0, self._dev(), k) for k in keys], self.backend, mem_type="OBJ"
        )
        return [r is not None for r in found]


def open_connector(
    backend: str, backend_params: dict[str, str], num_workers: int, arena: Arena, health: Health
) -> NixlConnector:
    """Create the workers' agents, pick FILE or OBJ from the plugin's memory types, and build
    the matching connector. Raises ValueError/RuntimeError with the reason."""
    params = {k: v for k, v in backend_params.items() if k not in ADAPTER_PARAM_KEYS}
    agents: list[Any] = []
    try:
        for _ in range(num_workers):
            agents.append(new_agent(f"lmcache-nixl-native-{uuid.uuid4()}", backend, params))
        mems = set(agents[0].get_backend_mem_types(backend))
        if "FILE_SEG" in mems:
            if "file_path" not in backend_params:
                raise ValueError(
                    f"backend_params must include 'file_path' for FILE_SEG backend {backend!r}"
                )
            cls: type[NixlConnector] = NixlFileConnector
        elif "OBJ_SEG" in mems:
            cls = NixlObjConnector
        else:
            raise ValueError(
                f"NIXL backend {backend!r} offers neither FILE_SEG nor OBJ_SEG storage "
                f"(memory types: {', '.join(sorted(mems)) or 'none'}); nixl_native needs one"
            )
        return cls(backend, backend_params, num_workers, arena, agents, health)
    except BaseException:
        agents.clear()
        raise


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
