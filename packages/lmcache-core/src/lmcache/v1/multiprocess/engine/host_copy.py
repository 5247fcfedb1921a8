"""``HostKVCopier``: runs the server's copies between L1 and the KV caches of lmcache_driven
workers (the ``kv_copy`` functions, and the HTTP API's block checksums), and times them."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.v1.multiprocess.engine.records import Instance, kv_device
from lmcache.v1.multiprocess.metrics import ServerMetrics


def chunk_blocks(
    chunk_size: int, inst: Instance, block_ids: list[list[int]], n_tokens: int
) -> tuple[int, list[int]] | None:
    """(blocks per chunk, the block ids of ``n_tokens`` tokens: whole chunks, and the blocks
    of a last partial one) for an lmcache_driven copy, or None when ``block_ids`` holds too
    few: never copy out of bounds."""
    bs = inst.meta["block_size"]
    bpc = chunk_size // bs
    need = -(-n_tokens // bs)
    ids = list(block_ids[0]) if block_ids else []
    if len(ids) < need:
        return None
    return bpc, ids[:need]


class HostKVCopier:
    """Every copy of a worker's CPU KV caches runs on this one thread.

    torch splits each of a request's many small CPU copies over OpenMP threads, and
    libgomp keeps a thread team per thread that ever ran a parallel region. Once a
    process has more OpenMP threads than cores, libgomp's workers stop spinning between
    regions (100 spins instead of 300000, GOMP_SPINCOUNT), so every copy waits for a
    worker to be woken. With each affinity slot copying for itself, a 64 MiB
    lmcache_driven store took 12-13 ms until a second slot had copied, 22-26 ms after
    (2 cores, server-side gather 5.9 then ~3 GB/s); one copying thread keeps one team.
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mp-host-copy")

    def run(self, inst: Instance, copy: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``copy(inst.kv_caches, *args, **kw)`` (a gather or scatter of the worker's KV): on
        the host-copy thread when the KV caches are CPU tensors, else (device copies on the
        slot's stream) in the calling thread."""
        if not inst.kv_caches or inst.kv_caches[0].device.type != "cpu":
            return copy(inst.kv_caches, *args, **kw)
        return self._thread.submit(copy, inst.kv_caches, *args, **kw).result()

    def timed(
        self,
        throughput_metric: str,
        nbytes: int,
        inst: Instance,
        copy: Callable[..., Any],
        *args: Any,
        **kw: Any,
    ) -> None:
        """``run`` that observes its GB/s in ``throughput_metric``."""
        t0 = time.perf_counter()
        self.run(inst, copy, *args, **kw)
        dt = time.perf_counter() - t0
        if dt > 0 and nbytes:
            self._metrics.observe(
                throughput_metric,
                nbytes / dt / 1e9,
                device=kv_device(inst),
                engine_id=str(inst.instance_id),
                model_name=inst.model_name,
            )

    def stop(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
