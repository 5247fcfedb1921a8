"""``ReadPath``: ``retrieve`` (lmcache_driven: the server scatters L1 into the worker's KV)
and ``prepare_retrieve``/``commit_retrieve`` (engine_driven), with their metrics."""

from __future__ import annotations

import time
from typing import Any

from lmcache.utils import init_logger
from lmcache.v1.multiprocess import kv_copy
from lmcache.v1.multiprocess import payload_codec as codec
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.engine.host_copy import chunk_blocks
from lmcache.v1.multiprocess.engine.parts import EnginePath
from lmcache.v1.multiprocess.engine.records import (
    ENGINE_DRIVEN,
    HOST_DEVICE,
    L1_TAG,
    LMCACHE_DRIVEN,
    Instance,
    PendingRead,
    RequestContext,
    codec_feature,
    kv_device,
    obj_bytes,
    obj_tensor,
    partial_feature,
    shm_slots,
)
from lmcache.v1.multiprocess.protocol import RequestError
from lmcache.v1.platform.base.ipc_wrapper import dtype_name

logger = init_logger(__name__)


class ReadPath(EnginePath):
    # ------------------------------------------------------------------ reads
    def retrieve(
        self,
        ctx: RequestContext,
        key: P.IPCCacheServerKey,
        instance_id: int,
        block_ids: list[list[int]],
        event_ipc_handle: bytes = b"",
        skip_first_n_tokens: int = 0,
        deadline: float | None = None,
    ) -> tuple[bytes, bool]:
        """``deadline`` (``FEATURE_RETRIEVE_DEADLINE``, time.time()): the worker stops waiting
        then and vLLM may reuse the blocks, so a copy that has not started by then never does."""
        self.registry.require_mode(LMCACHE_DRIVEN)
        session, keys = self.session_keys.own_keys(key, partial=partial_feature(ctx))
        self.session_keys.retrieve_begin(session)
        try:
            inst = self.registry.lmcache_driven(instance_id, "lmcache_mp_num_submitted_retrieves")
            if inst is None:
                return (b"", False)
            blocks = chunk_blocks(self.cs, inst, block_ids, key.end - key.start)
            objs = self.storage.read_locked(keys)
            if objs is None or blocks is None:
                self._count_read_failure(inst, len(keys))
                return (b"", False)
            bpc, ids = blocks
            if deadline is not None and time.time() > deadline:
                logger.warning(
                    "retrieve of %s for instance %d reached the server %.1f s after its "
                    "worker's deadline: not copied (the worker has given up on it)",
                    key.request_id,
                    instance_id,
                    time.time() - deadline,
                )
                self.metrics.inc("lmcache_mp_num_late_retrieves_skipped", device=kv_device(inst))
                return (b"", False)
            lay = self.layouts[inst.layout_key]
            self.copier.timed(
                "lmcache_mp_l0_l1_load_throughput_GB_per_second",
                len(keys) * lay.nbytes,
                inst,
                kv_copy.scatter_cpu_to_paged_kv,
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
            # one share per key, success or not
            self.session_keys.release_worker_shares(session, key, keys)
            self.session_keys.retrieve_done(session)

    def prepare_retrieve(
        self, ctx: RequestContext, key: P.IPCCacheServerKey, instance_id: int
    ) -> dict[str, Any]:
        inst = self.registry.require(instance_id, ENGINE_DRIVEN)
        session, keys = self.session_keys.own_keys(key, partial=partial_feature(ctx))
        self.metrics.inc("lmcache_mp_num_submitted_retrieves", device=HOST_DEVICE)
        lay = self.layouts[inst.layout_key]
        objs = self.storage.read_locked(keys)
        if objs is None:
            self._count_read_failure(inst, len(keys))
            if inst.strategy != "shm":
                self.session_keys.release_worker_shares(session, key, keys)
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
                    key, keys, time.monotonic(), self.session_keys.retrieve_begin(session)
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
            self.session_keys.release_worker_shares(session, key, keys)
        self.metrics.inc("lmcache_mp_num_finished_retrieves", device=HOST_DEVICE)
        return {"success": True, "data": data, "context": context}

    def commit_retrieve(
        self, ctx: RequestContext, key: P.IPCCacheServerKey, instance_id: int
    ) -> bool:
        inst = self.registry.require(instance_id, ENGINE_DRIVEN)
        rkey = (key.request_id, key.start, key.end)
        with inst.lock:
            read = inst.pending_reads.pop(rkey, None)
            failed = inst.pending_reads.pop((*rkey, "failed"), None)
        if read is not None:
            self.session_keys.finish_read(read)
            self.metrics.inc("lmcache_mp_num_finished_retrieves", device=HOST_DEVICE)
            return True
        if failed is not None:
            self.session_keys.finish_read(failed)
            return False
        return inst.strategy != "shm"

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
