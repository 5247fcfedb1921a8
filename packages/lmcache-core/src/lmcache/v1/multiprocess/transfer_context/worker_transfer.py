"""The worker's transfer contexts and the router that picks one
(docs/design/platform.md#transfer-router, docs/design/protocol.md#transfer-paths).

Both contexts share one surface (``TransferContext``), used by the vLLM connector and the
benchmarks::

    ctx = create_transfer_context(kv_caches, instance_id=iid, req_client=client)
    ctx.register(model_name, world_size)           # op 1 or op 14, then negotiation
    ok = ctx.submit_store(key, block_ids).result()  # MPFuture -> bool
    ok = ctx.submit_retrieve(key, block_ids, skip_first_n_tokens=0).result()
    ctx.unregister(); ctx.close()

``kv_caches``: per-layer tensors (a list, or vLLM's ``{layer_name: tensor}`` dict).
``block_ids``: the flat block list covering ``[key.start, key.end)`` (or ``[[...]]``).
``ctx.mode`` is ``"SHM"``, ``"pickle"``, ``"raw_v1"`` or ``"lmcache_driven"``.

``create_transfer_context(kv_caches, *, instance_id, req_client, mode=None, **kw)`` resolves
``mode`` (explicit, else ``ENV_MP_TRANSFER_MODE``, else AUTO, which follows the device spec's
``default_mp_transfer_mode()``) and builds ``LMCacheDrivenTransferContext`` (the server copies
from/to the worker's KV memory) or ``EngineDrivenTransferContext`` (the worker copies to/from
host chunks the server hands out). The copy functions live in ``lmcache.v1.multiprocess.kv_copy``.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from typing import Any

import torch

from lmcache.utils import init_logger
from lmcache.v1.cpu_affinity import move_to_spare_cpus
from lmcache.v1.distributed.page_residency import (
    lower_thread_priority,
    populate_read,
    resident_regions,
)
from lmcache.v1.multiprocess import payload_codec as codec
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.client import MPClient, MPFuture
from lmcache.v1.multiprocess.kv_copy import (
    gather_paged_kv_to_cpu,
    kv_geometry,
    scatter_cpu_to_paged_kv,
)
from lmcache.v1.multiprocess.transfer_context.copy_gate import CopyGate, server_copy_deadline
from lmcache.v1.platform import resolve_device_ops
from lmcache.v1.platform.base.device_spec import (
    effective_default_mode,
    effective_lmcache_driven_available,
)
from lmcache.v1.platform.transfer_mode import (
    MP_TRANSFER_MODE_ENV_VAR,
    MPTransferMode,
    resolve_mp_transfer_mode,
)

logger = init_logger(__name__)


# 0.5.6's name for the variable that picks the mode when the caller gives none.
ENV_MP_TRANSFER_MODE = MP_TRANSFER_MODE_ENV_VAR

__all__ = [
    "ENV_MP_TRANSFER_MODE",
    "EngineDrivenTransferContext",
    "LMCacheDrivenTransferContext",
    "MPTransferMode",
    "TransferContext",
    "create_transfer_context",
]

_lease_clock = time.monotonic  # what a retrieve's copy is timed with against the server's lease
_MAP_REGION = 2 << 20  # granule in which the SHM pool is mapped into a worker before a copy
_MAP_RUN_REGIONS = 32  # regions (64 MiB) mapped per call by the background mapper
_MAP_IDLE_PASSES = 4  # background mapping stops after this many passes that found nothing new
# Mapped before registration returns (where the server has backed it): all of a default
# 4 GiB pool, the first 4 GiB of a larger one (a fresh server hands out low offsets first).
# Mapping costs the same wherever it runs (10-15 ms per 64 MiB on a small VM, as much as the
# copy itself), but on the copy path it doubles a store, and the background thread, at the
# lowest priority, hardly advances while transfers keep the cores busy. About 0.2 s per GiB.
_MAP_AT_ATTACH_REGIONS = (4 << 30) // _MAP_REGION


def _as_list(kv_caches: Any) -> list[torch.Tensor]:
    if isinstance(kv_caches, dict):
        return list(kv_caches.values())
    return list(kv_caches)


def _flat_ids(block_ids: Any) -> list[int]:
    if isinstance(block_ids, torch.Tensor):
        return [int(b) for b in block_ids.reshape(-1).tolist()]
    ids = list(block_ids)
    if ids and isinstance(ids[0], list | tuple):
        return [int(b) for b in ids[0]]
    return [int(b) for b in ids]


class TransferContext:
    """What both contexts share: the KV tensors, their geometry, the registration handshake."""

    mode = ""

    def __init__(
        self,
        kv_caches: Any,
        *,
        instance_id: int,
        req_client: MPClient,
        layout_hints: dict[str, Any] | None = None,
        timeout: float | None = 300.0,
    ) -> None:
        self.kv_caches = _as_list(kv_caches)
        self.instance_id = int(instance_id)
        self.client = req_client
        self.layout_hints = dict(layout_hints or {})
        self.timeout = timeout
        self.geometry = kv_geometry(self.kv_caches, self.layout_hints)
        # Found now, not on the first transfer: finding the device backend scans the installed
        # packages' entry points (~0.2 s), which a new process's first cache hit would pay.
        resolve_device_ops(self.kv_caches[0].device.type)
        self.chunk_size = 0
        self.model_name = ""
        self.world_size = 1

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.geometry.block_size

    def _prepare_common(self, model_name: str, world_size: int) -> None:
        self.model_name, self.world_size = model_name, int(world_size)
        self.chunk_size = int(self.client.get_chunk_size(timeout=self.timeout))
        if self.chunk_size % self.geometry.block_size:
            raise ValueError(
                f"server chunk_size {self.chunk_size} is not a multiple of the KV block size "
                f"{self.geometry.block_size}"
            )
        self.client.negotiate_default_features()

    def create_recorded_event(self) -> None:
        return None

    def flush_inflight_stores(self) -> None:
        return None

    # The surface each context implements (see the module docstring).
    def register(self, model_name: str, world_size: int, engine_group_infos: Any = None) -> None:
        raise NotImplementedError

    def submit_store(self, key: P.IPCCacheServerKey, block_ids: Any) -> MPFuture:
        raise NotImplementedError

    def submit_retrieve(
        self,
        key: P.IPCCacheServerKey,
        block_ids: Any,
        skip_first_n_tokens: int = 0,
        timeout: float | None = None,
        gate: CopyGate | None = None,
    ) -> MPFuture:
        """``timeout``: how long the caller waits for this retrieve; after it nothing may
        write into ``block_ids``. The engine-driven context waits for the server at most that
        long in this call; the lmcache-driven one sends the server a deadline derived from it
        (``FEATURE_RETRIEVE_DEADLINE``). None: ``self.timeout`` per RPC, no deadline.
        ``gate`` (engine-driven): the copy into the blocks runs only while it is open."""
        raise NotImplementedError

    def unregister(self, timeout: float = 5.0) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class EngineDrivenTransferContext(TransferContext):
    """The worker copies its paged KV to/from host chunks the server manages (op 14-19)."""

    def __init__(self, kv_caches: Any, **kwargs: Any) -> None:
        super().__init__(kv_caches, **kwargs)
        self.mode = ""
        self._shm_fd: int | None = None
        self._shm_map: mmap.mmap | None = None
        self._shm_flat: torch.Tensor | None = None
        self.shm_name = ""
        self._mapped_regions: set[int] = set()  # pool regions (_MAP_REGION) mapped here
        self._populate_ok = True
        self._mapper: threading.Thread | None = None
        self._mapper_stop = threading.Event()

    def register(self, model_name: str, world_size: int, engine_group_infos: Any = None) -> None:
        if engine_group_infos is not None and len(engine_group_infos) > 1:
            raise ValueError(
                "engine-driven transfer does not support multiple KV transfer groups now"
            )
        self._prepare_common(model_name, world_size)
        geo = self.geometry
        payload = P.RegisterEngineDrivenContextPayload(
            instance_id=self.instance_id,
            model_name=model_name,
            world_size=int(world_size),
            block_size=geo.block_size,
            num_layers=geo.num_layers,
            hidden_dim_size=geo.hidden_dim,
            dtype_str=str(geo.dtype).removeprefix("torch."),
            use_mla=geo.kv_size == 1,
            num_physical_slots=self.chunk_size,
        )
        reply = self.client.call(
            "register_kv_cache_engine_driven_context", payload, timeout=self.timeout
        )
        shm_name = str((reply or {}).get("shm_name", "") or "")
        pool_size = int((reply or {}).get("pool_size", 0) or 0)
        self._detach()
        if shm_name and pool_size > 0:
            logger.info(
                "Creating EngineDrivenContextShm (shm_name=%s, pool_size=%d)", shm_name, pool_size
            )
            try:
                self._attach(shm_name, pool_size)
                self.mode = "SHM"
            except OSError as exc:
                tail = "raw_v1" if self._raw else "pickle"
                logger.warning(
                    "Failed to initialize SHM context (shm_name=%s), falling back to %s transport: %s",
                    shm_name,
                    tail,
                    exc,
                )
        if not self.mode:
            if self._raw:
                logger.info("Creating EngineDrivenContextRaw (raw_v1 transport)")
                self.mode = "raw_v1"
            else:
                logger.info("Creating EngineDrivenContextPickle (pickle transport)")
                self.mode = "pickle"
        logger.info(
            "Worker engine-driven context registered (instance_id=%d, mode=%s)",
            self.instance_id,
            self.mode,
        )

    @property
    def _raw(self) -> bool:
        return P.FEATURE_RAW_PAYLOAD_V1 in self.client.features

    def _attach(self, name: str, size: int) -> None:
        fd = os.open(os.path.join("/dev/shm", name.lstrip("/")), os.O_RDWR)
        try:
            m = mmap.mmap(fd, size)
        except Exception:
            os.close(fd)
            raise
        self._shm_fd, self._shm_map, self.shm_name = fd, m, name
        self._shm_flat = torch.frombuffer(m, dtype=torch.uint8)
        self._mapped_regions = set()
        self._populate_ok = True
        self._mapper_stop = threading.Event()
        flat = self._shm_flat
        if self._map_pass(flat, self._mapper_stop, max_regions=_MAP_AT_ATTACH_REGIONS) is None:
            return  # this kernel cannot map ahead: slots are mapped on first use
        self._mapper = threading.Thread(
            target=self._map_backed_regions,
            args=(flat, self._mapper_stop),
            name="lmcache-shm-map",
            daemon=True,
        )
        self._mapper.start()

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the SHM pool mapped into this process so far."""
        if self._shm_flat is None:
            return 0
        size = self._shm_flat.numel()
        return sum(min(_MAP_REGION, size - r * _MAP_REGION) for r in list(self._mapped_regions))

    def _map_backed_regions(self, flat: torch.Tensor, stop: threading.Event) -> None:
        """Map, in the background, the pool regions the server has already backed, so stores
        and retrieves seldom map pages on their own path (a 64 MiB slot costs 2-9 ms to map).
        Regions not backed yet are left alone (mapping them would back them: the server may
        keep its memory use growing with L1) and are mapped on first use. Passes repeat every
        0.5 s while the server is still backing its pool (and for a few passes before it
        starts, as when a worker registers right after the server started)."""
        move_to_spare_cpus()
        lower_thread_priority()
        regions = -(-flat.numel() // _MAP_REGION)
        idle_passes = 0
        while not stop.is_set():
            mapped_now = self._map_pass(flat, stop)
            if mapped_now is None:
                return
            idle_passes = 0 if mapped_now else idle_passes + 1
            if idle_passes >= _MAP_IDLE_PASSES or len(self._mapped_regions) >= regions:
                return
            stop.wait(0.5)

    def _map_pass(
        self, flat: torch.Tensor, stop: threading.Event, max_regions: int | None = None
    ) -> int | None:
        """One pass front to back over the pool mapping the backed regions not mapped yet (at
        most ``max_regions`` of them); the number mapped, or None when mapping is not possible.
        Residency is read once per pass and runs of regions are mapped in one call each: this
        thread runs at the lowest priority, and every time it takes the GIL a transfer on the
        engine's thread may wait for it (a new process's first cache hit did, by 0.1-0.3 s)."""
        base, size = flat.data_ptr(), flat.numel()
        try:
            resident = resident_regions(base, size, _MAP_REGION)
        except OSError as exc:
            logger.info("SHM pool is mapped on first use only (%s)", exc)
            self._populate_ok = False
            return None
        budget = len(resident) if max_regions is None else max_regions
        mapped_now, r = 0, 0
        while r < len(resident) and mapped_now < budget and not stop.is_set():
            if r in self._mapped_regions or not resident[r]:
                r += 1
                continue
            end = r + 1
            while (
                end < len(resident)
                and end - r < _MAP_RUN_REGIONS
                and mapped_now + end - r < budget
                and resident[end]
                and end not in self._mapped_regions
            ):
                end += 1
            try:
                populate_read(
                    base + r * _MAP_REGION, min(end * _MAP_REGION, size) - r * _MAP_REGION
                )
            except OSError as exc:
                logger.info("SHM pool is mapped on first use only (%s)", exc)
                self._populate_ok = False
                return None
            self._mapped_regions.update(range(r, end))
            mapped_now += end - r
            r = end
        return mapped_now

    def _detach(self) -> None:
        self._mapper_stop.set()
        if self._mapper is not None:
            self._mapper.join()
            self._mapper = None
        self._shm_flat = None
        if self._shm_map is not None:
            try:
                self._shm_map.close()
            except BufferError:
                pass  # a view is still alive; the mapping goes with it
            self._shm_map = None
        if self._shm_fd is not None:
            os.close(self._shm_fd)
            self._shm_fd = None

    def _slot_views(self, slots: list[dict[str, Any]]) -> list[torch.Tensor]:
        assert self._shm_flat is not None
        out = []
        for s in slots:
            dtype = getattr(torch, s["dtype"])
            off, length = int(s["offset"]), int(s["length"])
            self._map_pool_range(off, length)
            raw = self._shm_flat[off : off + length]
            out.append(raw.view(dtype).view(tuple(s["shape"])))
        return out

    def _map_pool_range(self, off: int, length: int) -> None:
        """Map the pool pages of a slot into this process in one call the first time a slot
        touches them: faulting them in one 4 KiB page at a time during the copy doubles the
        cost of a store while L1 fills. Later slots at the same addresses find them mapped."""
        first, last = off // _MAP_REGION, (off + length - 1) // _MAP_REGION
        todo = [r for r in range(first, last + 1) if r not in self._mapped_regions]
        if not todo or not self._populate_ok:
            return
        assert self._shm_flat is not None
        base, size = self._shm_flat.data_ptr(), self._shm_flat.numel()
        try:
            for r in todo:
                populate_read(base + r * _MAP_REGION, min(_MAP_REGION, size - r * _MAP_REGION))
                self._mapped_regions.add(r)
        except OSError as exc:
            self._populate_ok = False
            logger.info("SHM slots are mapped on first write (%s)", exc)

    def _span(self, key: P.IPCCacheServerKey, ids: list[int]) -> tuple[int, list[int]]:
        """The chunks of ``[key.start, key.end)``, a last partial one (a ``partial_chunk``
        tail) included, and the block ids that hold its tokens."""
        n_tokens = key.end - key.start
        return -(-n_tokens // self.chunk_size), ids[: -(-n_tokens // self.geometry.block_size)]

    def submit_store(self, key: P.IPCCacheServerKey, block_ids: Any) -> MPFuture:
        bpc = self.blocks_per_chunk
        n, ids = self._span(key, _flat_ids(block_ids))
        reply = self.client.call("prepare_store", key, self.instance_id, timeout=self.timeout)
        ctx = (reply or {}).get("context") or {}
        if self.mode == "SHM" and "slots" in ctx:
            idx = list(ctx.get("chunk_indices") or [])
            if idx:
                gather_paged_kv_to_cpu(
                    self.kv_caches,
                    ids,
                    bpc,
                    self.layout_hints,
                    out=self._slot_views(ctx["slots"]),
                    chunk_indices=idx,
                )
            data = b""
        elif ctx.get("encoding") == "raw_v1":
            idx = list(ctx.get("chunk_indices") or [])
            got = gather_paged_kv_to_cpu(
                self.kv_caches, ids, bpc, self.layout_hints, chunk_indices=idx
            )
            chunks: list[Any] = [None] * n
            for i, t in zip(idx, got, strict=True):
                chunks[i] = t
            data = codec.encode_raw_v1(chunks)
        else:
            data = codec.pickle_tensors(
                gather_paged_kv_to_cpu(self.kv_caches, ids, bpc, self.layout_hints)
            )
        ok = self.client.call("commit_store", key, self.instance_id, data, timeout=self.timeout)
        return MPFuture.resolved(bool(ok), "store")

    def submit_retrieve(
        self,
        key: P.IPCCacheServerKey,
        block_ids: Any,
        skip_first_n_tokens: int = 0,
        timeout: float | None = None,
        gate: CopyGate | None = None,
    ) -> MPFuture:
        bpc = self.blocks_per_chunk
        n, ids = self._span(key, _flat_ids(block_ids))
        asked = _lease_clock()
        # A synchronous load passes the time it has left: the engine's forward waits on it.
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float:
            return self.timeout if deadline is None else max(0.0, deadline - time.monotonic())

        try:
            reply = (
                self.client.call("prepare_retrieve", key, self.instance_id, timeout=left()) or {}
            )
        except Exception:
            # No reply in time: a server that stalled may still prepare it when it resumes,
            # and then keeps the slots read-locked for this live worker until a commit. The
            # commit sent now reaches it behind the prepare (one worker's transfers run in
            # order) and releases them; a server that never got the prepare answers False.
            self.client.submit("commit_retrieve", key, self.instance_id).add_done_callback(
                _drop_result
            )
            raise
        ok = bool(reply.get("success"))
        ctx = reply.get("context") or {}
        if ok and "slots" in ctx and self._shm_flat is None:
            # The server believes this worker maps its SHM pool, but attaching failed here:
            # report a miss (the engine recomputes) instead of reading memory we cannot see.
            logger.warning(
                "retrieve of %s: the server offered SHM slots but this worker is on the %s path; "
                "treating it as a miss",
                key.request_id,
                self.mode,
            )
            ok = False
        if ok and gate is not None and not gate.begin():
            logger.info("retrieve of %s came after its worker gave up: not copied", key.request_id)
            ok, gate = False, None
        if ok:
            try:
                if "slots" in ctx:
                    chunks = self._slot_views(ctx["slots"])
                elif ctx.get("encoding") == "raw_v1":
                    shape, dtype = tuple(ctx["shape"]), getattr(torch, ctx["dtype"])
                    chunks = [
                        torch.frombuffer(bytearray(v), dtype=torch.uint8).view(dtype).view(shape)
                        for v in codec.decode_raw_v1(reply.get("data", b""), n)
                    ]
                else:
                    chunks = codec.restricted_unpickle_tensors(
                        reply.get("data", b""), expected_count=n, expected_dtype=self.geometry.dtype
                    )
                scatter_cpu_to_paged_kv(
                    self.kv_caches,
                    ids,
                    chunks,
                    bpc,
                    skip_first_n_tokens,
                    self.layout_hints,
                )
            except (RuntimeError, ValueError, TypeError, IndexError) as exc:
                logger.error("engine-driven retrieve of %s failed: %s", key.request_id, exc)
                ok = False
            finally:
                if gate is not None:
                    gate.end()
        lease = float(ctx.get("lease_s") or 0)
        if not ok or _lease_clock() - asked < lease:
            # The server keeps the slots read-locked for the lease even if it drops this worker,
            # so the copy is good without the reply: commit_retrieve only releases the locks.
            # (A failed read has nothing to confirm.) Later requests of this client reach the
            # server after it, in order.
            self.client.submit("commit_retrieve", key, self.instance_id).add_done_callback(
                _log_commit_failure
            )
            return MPFuture.resolved(ok, "retrieve")
        # No lease (a 0.5.6 server) or the copy outlasted it: only the server knows whether
        # the slots stayed ours throughout.
        committed = self.client.call("commit_retrieve", key, self.instance_id, timeout=left())
        return MPFuture.resolved(bool(ok and committed), "retrieve")

    def unregister(self, timeout: float = 5.0) -> None:
        try:
            self.client.call(
                "unregister_kv_cache_engine_driven_context", self.instance_id, timeout=timeout
            )
        except Exception as exc:
            logger.warning("unregister of instance %d failed: %s", self.instance_id, exc)

    def close(self) -> None:
        self._detach()


class LMCacheDrivenTransferContext(TransferContext):
    """The server copies from/to this worker's KV memory, mapped through IPC wrappers (op 1, 6, 7)."""

    mode = "lmcache_driven"

    def __init__(self, kv_caches: Any, *, wrapper_factory: Any, **kwargs: Any) -> None:
        super().__init__(kv_caches, **kwargs)
        self.event_backend: Any = None  # set by register() once check 3 of
        # docs/design/platform.md#lmcache-driven-checks passes
        self.wrappers = [wrapper_factory(t) for t in self.kv_caches]

    def register(self, model_name: str, world_size: int, engine_group_infos: Any = None) -> None:
        # check 3 of docs/design/platform.md#lmcache-driven-checks: fail closed before anything
        # reaches the server, so a device without event IPC never registers and then sends empty
        # event handles.
        self.event_backend = _checked_event_backend(self.kv_caches)
        self._prepare_common(model_name, world_size)
        self.client.call(
            "register_kv_cache",
            self.instance_id,
            self.wrappers,
            model_name,
            int(world_size),
            "vllm",
            self.layout_hints,
            list(engine_group_infos or []),
            timeout=self.timeout,
        )
        logger.info("Worker lmcache-driven context registered (instance_id=%d)", self.instance_id)

    def submit_store(self, key: P.IPCCacheServerKey, block_ids: Any) -> MPFuture:
        fut = self.client.submit("store", key, self.instance_id, [_flat_ids(block_ids)], b"")
        return _ok_of(fut, "store")

    def submit_retrieve(
        self,
        key: P.IPCCacheServerKey,
        block_ids: Any,
        skip_first_n_tokens: int = 0,
        timeout: float | None = None,
        gate: CopyGate | None = None,
    ) -> MPFuture:
        # Asynchronous: the caller bounds its wait on the future itself. The server copies
        # into the blocks; told the deadline, it skips a copy the caller no longer waits for.
        args: list[Any] = [
            key,
            self.instance_id,
            [_flat_ids(block_ids)],
            b"",
            int(skip_first_n_tokens),
        ]
        if timeout is not None and P.FEATURE_RETRIEVE_DEADLINE in self.client.features:
            args.append(server_copy_deadline(timeout))
        return _ok_of(self.client.submit("retrieve", *args), "retrieve")

    def unregister(self, timeout: float = 5.0) -> None:
        try:
            self.client.call("unregister_kv_cache", self.instance_id, timeout=timeout)
        except Exception as exc:
            logger.warning("unregister of instance %d failed: %s", self.instance_id, exc)

    def close(self) -> None:
        for w in self.wrappers:
            try:
                w.close()
            except Exception:
                pass


def _drop_result(fut: MPFuture) -> None:
    """A reply nobody needs (read so the client keeps no slot for it)."""
    try:
        fut.result(0)
    except Exception:
        pass


def _log_commit_failure(fut: MPFuture) -> None:
    try:
        fut.result(0)
    except Exception as exc:  # the locks then expire on the server (l1 read TTL)
        logger.warning("commit_retrieve failed: %s", exc)


def _checked_event_backend(kv_caches: list[Any]) -> Any:
    """The event IPC backend of the KV tensors' device, after its support check
    (``RuntimeError`` with the platform's message when the device has none)."""
    from lmcache.v1.platform.base.event_ipc import get_event_ipc_backend

    first = kv_caches[0]
    if isinstance(first, list | tuple):  # a layer given as planes
        first = first[0]
    device = first.device
    backend = get_event_ipc_backend(device)
    backend.check_event_support(device)
    return backend


def _ok_of(fut: MPFuture, op: str) -> MPFuture:
    """An MPFuture resolving to the bool of a ``[event_handle, ok]`` reply."""
    out = MPFuture(None, fut.uid, op)

    def done(f: MPFuture) -> None:
        try:
            value = f.result(0)
            out._set(
                bool(value[1]) if isinstance(value, list | tuple) and len(value) == 2 else False
            )
        except Exception as exc:
            out._set(exc)

    fut.add_done_callback(done)
    return out


# -- the router ----------------------------------------------------------------------------
def create_transfer_context(
    kv_caches: Any, *, instance_id: int, req_client: Any, mode: Any = None, **kwargs: Any
) -> TransferContext:
    """The context for ``kv_caches``' device in ``mode`` (``None``: ``ENV_MP_TRANSFER_MODE``,
    then AUTO); ``kwargs`` go to the context (``layout_hints``, ``timeout``)."""
    device_type = _device_type(kv_caches)
    resolved = resolve_mp_transfer_mode(mode)
    if resolved == MPTransferMode.AUTO:
        try:
            # Looked up in the platform package at call time (here and below): the device
            # registry's functions are what tests substitute.
            from lmcache.v1.platform import get_device_spec

            spec = get_device_spec(device_type)
        except Exception:
            spec = None  # no usable spec: AUTO means engine_driven
        resolved = effective_default_mode(spec)
    logger.info("Creating transfer context (device_type=%s, mode=%s)", device_type, resolved.value)
    if resolved == MPTransferMode.LMCACHE_DRIVEN:
        return _build_lmcache_driven_context(
            kv_caches, device_type, instance_id=instance_id, req_client=req_client, **kwargs
        )
    return _build_engine_driven_context(
        kv_caches, instance_id=instance_id, req_client=req_client, **kwargs
    )


def _device_type(kv_caches: Any) -> str:
    tensors = list(kv_caches.values()) if isinstance(kv_caches, dict) else list(kv_caches)
    if not tensors:
        raise ValueError("kv_caches is empty")
    types = sorted({(t[0] if isinstance(t, tuple | list) else t).device.type for t in tensors})
    if len(types) != 1:
        raise ValueError(f"kv_caches must share one device type, got {', '.join(types)}")
    return types[0]


def _build_engine_driven_context(kv_caches: Any, **kwargs: Any) -> EngineDrivenTransferContext:
    return EngineDrivenTransferContext(kv_caches, **kwargs)


def _build_lmcache_driven_context(
    kv_caches: Any, device_type: str, **kwargs: Any
) -> LMCacheDrivenTransferContext:
    from lmcache.v1.platform import get_device_spec, resolve_kv_wrapper_factory

    try:
        factory = resolve_kv_wrapper_factory(device_type)
    except ValueError:
        raise ValueError(
            f"MP transfer mode 'lmcache_driven' is not supported for device type {device_type!r}: "
            "no KV-cache wrapper factory is registered. Use mode 'engine_driven' instead."
        ) from None
    spec = get_device_spec(device_type)
    # effective_...: same answer, plus the docs/design/platform.md#capability-flags warning when the
    # spec's two capability flags disagree
    if spec is not None and not effective_lmcache_driven_available(spec):
        raise ValueError(
            f"MP transfer mode 'lmcache_driven' is not available for device type {device_type!r}: "
            "required platform capability checks failed. Use mode 'engine_driven' instead."
        )
    return LMCacheDrivenTransferContext(kv_caches, wrapper_factory=factory, **kwargs)
