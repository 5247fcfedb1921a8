"""``WritePath``: ``store`` (lmcache_driven: the server gathers the worker's KV into L1)
and ``prepare_store``/``commit_store`` (engine_driven, SHM or copied payloads)."""

from __future__ import annotations

from typing import Any

from lmcache.utils import RateLimitedLog, init_logger
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
    RequestContext,
    Reservation,
    codec_feature,
    keys_salt,
    kv_device,
    obj_bytes,
    obj_tensor,
    partial_feature,
    shm_slots,
)

logger = init_logger(__name__)
# Conditions a busy server may hit many times a second (a full L1, a full session table).
_limited = RateLimitedLog(logger, interval=10.0)


class WritePath(EnginePath):
    # ------------------------------------------------------------------ writes
    def _reserve(
        self, inst: Instance, keys: list[Any], positions_filter: list[bool] | None = None
    ) -> Reservation:
        lay = self.layouts[inst.layout_key]
        want = [k for i, k in enumerate(keys) if positions_filter is None or positions_filter[i]]
        out = self.storage.reserve_write(want, lay.desc)
        if out.failed:
            self.metrics.inc(
                "lmcache_mp_l1_allocation_failure_chunks",
                len(out.failed),
                during="l1_store",
                model_name=inst.model_name,
            )
            used, total = self.storage.memory_usage()
            _limited.warning(
                "l1_full",
                "L1 is full: %d chunk(s) of a store were not cached (L1 %d of %d bytes used); "
                "raise --l1-size-gb or add an L2 tier",
                len(out.failed),
                used,
                total,
            )
        positions = [i for i, k in enumerate(keys) if k in out.objs]
        return Reservation(keys, out.objs, positions, len(out.failed))

    def _admit(self, res: Reservation) -> bool:
        bad = self.storage.finish_write(list(res.objs))
        if res.objs:
            self.metrics.inc(
                "lmcache_mp_l1_write_chunks",
                len(res.objs) - len(bad),
                l1_tag=L1_TAG,
                cache_salt=keys_salt(res.keys),
            )
        return not bad and res.failed == 0

    def prepare_store(
        self, ctx: RequestContext, key: P.IPCCacheServerKey, instance_id: int
    ) -> dict[str, Any]:
        inst = self.registry.require(instance_id, ENGINE_DRIVEN)
        _session, keys = self.session_keys.own_keys(key, store=True, partial=partial_feature(ctx))
        self.metrics.inc("lmcache_mp_num_submitted_stores", device=HOST_DEVICE)
        res = self._reserve(inst, keys)
        rkey = (key.request_id, key.start, key.end)
        with inst.lock:
            stale = inst.reservations.pop(rkey, None)
            inst.reservations[rkey] = res
        if stale is not None:
            self.storage.abort_write(list(stale.objs))
        lay = self.layouts[inst.layout_key]
        if inst.strategy == "shm":
            slots = shm_slots(res.objs.values(), lay)
            return {"context": {"slots": slots, "chunk_indices": res.positions}}
        if codec_feature(ctx):
            return {"context": {"encoding": "raw_v1", "chunk_indices": res.positions}}
        return {"context": {}}

    def commit_store(
        self, ctx: RequestContext, key: P.IPCCacheServerKey, instance_id: int, data: bytes = b""
    ) -> bool:
        inst = self.registry.require(instance_id, ENGINE_DRIVEN)
        with inst.lock:
            res = inst.reservations.pop((key.request_id, key.start, key.end), None)
        if res is None:
            return False
        ok = self._commit(inst, key, res, data)
        self.metrics.inc("lmcache_mp_num_finished_stores", device=HOST_DEVICE)
        return ok

    def _commit(
        self, inst: Instance, key: P.IPCCacheServerKey, res: Reservation, data: bytes
    ) -> bool:
        lay = self.layouts[inst.layout_key]
        try:
            enc = codec.detect_encoding(data)
        except codec.PayloadError as exc:
            return self._reject(res, exc)
        if enc == codec.ENCODING_EMPTY:
            if inst.strategy != "shm":
                return self._reject(
                    res,
                    codec.PayloadError("empty_copy", "empty commit_store payload on the copy path"),
                )
            return self._admit(res)
        if inst.strategy == "shm":
            logger.warning(
                "worker %d could not use SHM '%s'; switching it to the copy path",
                inst.instance_id,
                self.registry.shm_name,
            )
            inst.strategy = "copy"
        n = len(res.keys)
        try:
            if enc == codec.ENCODING_PICKLE:
                tensors = codec.restricted_unpickle_tensors(
                    data,
                    expected_count=n,
                    expected_shape=lay.shape,
                    expected_dtype=lay.dtype,
                    max_bytes=n * (lay.nbytes + codec.PICKLE_SLACK_PER_CHUNK),
                )
                chunks = [codec.tensor_bytes(t) for t in tensors]
            else:
                chunks = codec.decode_raw_v1(data, n)
            for i, k in enumerate(res.keys):
                obj = res.objs.get(k)
                if obj is None:
                    continue
                src = chunks[i]
                if len(src) != lay.nbytes:
                    raise codec.PayloadError(
                        "raw_v1_length", f"chunk {i} has {len(src)} bytes, expected {lay.nbytes}"
                    )
                obj_bytes(obj, lay.nbytes)[:] = src
        except codec.PayloadError as exc:
            return self._reject(res, exc)
        return self._admit(res)

    def _reject(self, res: Reservation, exc: codec.PayloadError) -> bool:
        logger.error("commit_store payload rejected: %s", exc)
        self.metrics.inc("lmcache_mp_rejected_payloads", reason=exc.reason)
        self.storage.abort_write(list(res.objs))
        return False

    def store(
        self,
        ctx: RequestContext,
        key: P.IPCCacheServerKey,
        instance_id: int,
        block_ids: list[list[int]],
        event_ipc_handle: bytes = b"",
    ) -> tuple[bytes, bool]:
        self.registry.require_mode(LMCACHE_DRIVEN)
        inst = self.registry.lmcache_driven(instance_id, "lmcache_mp_num_submitted_stores")
        if inst is None:
            return (b"", False)
        _session, keys = self.session_keys.own_keys(key, store=True, partial=partial_feature(ctx))
        blocks = chunk_blocks(self.cs, inst, block_ids, key.end - key.start)
        if blocks is None:
            return (b"", False)
        bpc, ids = blocks
        null = self.config.null_block_id
        wanted = [any(b != null for b in ids[i * bpc : (i + 1) * bpc]) for i in range(len(keys))]
        res = self._reserve(inst, keys, wanted)
        try:
            if res.objs:
                lay = self.layouts[inst.layout_key]
                outs = [obj_tensor(res.objs[keys[i]], lay) for i in res.positions]
                self.copier.timed(
                    "lmcache_mp_l0_l1_store_throughput_GB_per_second",
                    len(outs) * lay.nbytes,
                    inst,
                    kv_copy.gather_paged_kv_to_cpu,
                    ids,
                    bpc,
                    layout_hints=inst.layout_hints,
                    out=outs,
                    chunk_indices=res.positions,
                )
        except Exception as exc:
            logger.error("store for instance %d failed: %s", instance_id, exc)
            self.storage.abort_write(list(res.objs))
            return (b"", False)
        ok = self._admit(res)
        self.metrics.inc("lmcache_mp_num_finished_stores", device=kv_device(inst))
        return (b"", ok)
