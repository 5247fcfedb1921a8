"""The read path of ``CacheEngine``: ``retrieve`` (lmcache_driven) and
``prepare_retrieve``/``commit_retrieve`` (engine_driven), with their metrics."""

from __future__ import annotations

import time
from typing import Any

from lmcache.utils import init_logger
from lmcache.v1.multiprocess import payload_codec as codec
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.engine.state import (
    ENGINE_DRIVEN,
    HOST_DEVICE,
    L1_TAG,
    LMCACHE_DRIVEN,
    Instance,
    PendingRead,
    RequestContext,
    codec_feature,
    dtype_name,
    kv_device,
    obj_bytes,
    obj_tensor,
    shm_slots,
)
from lmcache.v1.multiprocess.protocol import RequestError

logger = init_logger(__name__)


class ReadPathMixin:
    """Part of ``CacheEngine`` (its state is set in ``CacheEngine.__init__``)."""

    # ------------------------------------------------------------------ reads
    def retrieve(
        self,
        ctx: RequestContext,
        key: P.IPCCacheServerKey,
        instance_id: int,
        block_ids: list[list[int]],
        event_ipc_handle: bytes = b"",
        skip_first_n_tokens: int = 0,
    ):
        self._require_mode(LMCACHE_DRIVEN)
        session, keys = self._own_keys(key)
        self._retrieve_begin(session)
        try:
            inst = self._driven_instance(instance_id, "lmcache_mp_num_submitted_retrieves")
            if inst is None:
                return (b"", False)
            from lmcache.v1.multiprocess.transfer_context.base import scatter_cpu_to_paged_kv

            blocks = self._chunk_blocks(inst, block_ids, len(keys))
            objs = self.storage.read_locked(keys)
            if objs is None or blocks is None:
                self._count_read_failure(inst, len(keys))
                return (b"", False)
            bpc, ids = blocks
            lay = self.layouts[inst.layout_key]
            self._timed_copy_host_kv(
                "lmcache_mp_l0_l1_load_throughput_GB_per_second",
                len(keys) * lay.nbytes,
                inst,
                scatter_cpu_to_paged_kv,
                ids,
                [obj_tensor(o, lay) for o in objs],
                bpc,
                skip_first_n_tokens,
                layout_hints=inst.layout_hints,
            )
            self._count_reads(inst, key, len(keys))
            self.metrics.inc("lmcache_mp_num_finished_retrieves", device=kv_device(inst))
            return (b"", True)
        except RequestError:
            raise
        except Exception as exc:
            logger.error("retrieve for instance %d failed: %s", instance_id, exc)
            return (b"", False)
        finally:
            self._release_worker_shares(session, key, keys)  # one share per key, success or not
            self._retrieve_done(session)

    def prepare_retrieve(self, ctx: RequestContext, key: P.IPCCacheServerKey, instance_id: int):
        inst = self._instance(instance_id, ENGINE_DRIVEN)
        session, keys = self._own_keys(key)
        self.metrics.inc("lmcache_mp_num_submitted_retrieves", device=HOST_DEVICE)
        lay = self.layouts[inst.layout_key]
        objs = self.storage.read_locked(keys)
        if objs is None:
            self._count_read_failure(inst, len(keys))
            if inst.strategy != "shm":
                self._release_worker_shares(session, key, keys)
            else:
                with inst.lock:
                    inst.pending_reads[(key.request_id, key.start, key.end, "failed")] = (
                        PendingRead(key, keys, time.monotonic(), session, copying=False)
                    )
            return {"success": False, "data": b"", "context": {}}
        self._count_reads(inst, key, len(keys))
        if inst.strategy == "shm":
            slots = shm_slots(objs, lay)
            with inst.lock:
                inst.pending_reads[(key.request_id, key.start, key.end)] = PendingRead(
                    key, keys, time.monotonic(), self._retrieve_begin(session)
                )
            context: dict[str, Any] = {"slots": slots}
            lease = self.config.retrieve_lease_seconds
            if lease > 0:  # a field 0.5.6 clients ignore; ours skip awaiting commit_retrieve
                context["lease_s"] = lease
            return {"success": True, "data": b"", "context": context}
        try:
            if codec_feature(ctx):
                data = codec.encode_raw_v1([obj_bytes(o, lay.nbytes) for o in objs])
                context = {
                    "encoding": "raw_v1",
                    "shape": list(lay.shape),
                    "dtype": dtype_name(lay.dtype),
                }
            else:
                data = codec.pickle_tensors([obj_tensor(o, lay) for o in objs])
                context = {}
        finally:
            self._release_worker_shares(session, key, keys)
        self.metrics.inc("lmcache_mp_num_finished_retrieves", device=HOST_DEVICE)
        return {"success": True, "data": data, "context": context}

    def commit_retrieve(self, ctx: RequestContext, key: P.IPCCacheServerKey, instance_id: int):
        inst = self._instance(instance_id, ENGINE_DRIVEN)
        rkey = (key.request_id, key.start, key.end)
        with inst.lock:
            read = inst.pending_reads.pop(rkey, None)
            failed = inst.pending_reads.pop((*rkey, "failed"), None)
        if read is not None:
            self._finish_read(read)
            self.metrics.inc("lmcache_mp_num_finished_retrieves", device=HOST_DEVICE)
            return True
        if failed is not None:
            self._finish_read(failed)
            return False
        return inst.strategy != "shm"

    def _driven_instance(self, instance_id: int, submitted_metric: str) -> Instance | None:
        """The lmcache_driven instance ``instance_id`` (None if there is none), counting the
        request in ``submitted_metric`` either way."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.mode != LMCACHE_DRIVEN:
            self.metrics.inc(submitted_metric, device="unknown")
            return None
        self.metrics.inc(submitted_metric, device=kv_device(inst))
        inst.last_seen = time.monotonic()
        return inst

    def _chunk_blocks(
        self, inst: Instance, block_ids: list[list[int]], n_chunks: int
    ) -> tuple[int, list[int]] | None:
        """(blocks per chunk, the block ids of ``n_chunks`` chunks) for an lmcache_driven
        copy, or None when ``block_ids`` holds too few: never copy out of bounds."""
        bpc = self.cs // inst.meta["block_size"]
        ids = list(block_ids[0]) if block_ids else []
        if len(ids) < n_chunks * bpc:
            return None
        return bpc, ids[: n_chunks * bpc]

    def _timed_copy_host_kv(
        self,
        throughput_metric: str,
        nbytes: int,
        inst: Instance,
        copy: Any,
        *args: Any,
        **kw: Any,
    ) -> None:
        """``_copy_host_kv`` that observes its GB/s in ``throughput_metric``."""
        t0 = time.perf_counter()
        self._copy_host_kv(inst, copy, *args, **kw)
        dt = time.perf_counter() - t0
        if dt > 0 and nbytes:
            self.metrics.observe(
                throughput_metric,
                nbytes / dt / 1e9,
                device=kv_device(inst),
                engine_id=str(inst.instance_id),
                model_name=inst.model_name,
            )

    def _count_reads(self, inst: Instance, key: P.IPCCacheServerKey, n: int) -> None:
        self.metrics.inc("lmcache_mp_l1_read_chunks", n, l1_tag=L1_TAG, cache_salt=key.cache_salt)
        self.metrics.inc(
            "lmcache_mp_num_chunks_loaded",
            n,
            cache_salt=key.cache_salt,
            model_name=inst.model_name,
            worker_id=str(inst.instance_id),
        )

    def _count_read_failure(self, inst: Instance, n: int) -> None:
        self.metrics.inc(
            "lmcache_mp_l1_read_failure_chunks",
            n,
            during="l1_retrieve",
            reason="not_found",
            model_name=inst.model_name,
        )
