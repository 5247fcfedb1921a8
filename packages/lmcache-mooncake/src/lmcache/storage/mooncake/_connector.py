"""The native-connector contract (docs/design/storage-engine.md#native-contract) over Mooncake
Store's Python client, for ``mooncake_store``.

``event_fd``, ``submit_batch_get/set/exists/delete``, ``drain_completions`` and ``close``, driven
by core's ``NativeConnectorL2Adapter`` bridge like the compiled fs and redis clients.

Workers: one queue per lane (``lookup`` = exists, ``retrieve`` = get, ``store`` = set,
``delete``); a lane named in ``per_op_workers`` has its own threads, the others share
``num_workers`` threads. A batch is one call of Mooncake's batch API
(``batch_put_from`` / ``batch_get_into`` / ``batch_is_exist`` / ``batch_remove``) straight from
and into the L1 buffers (no copy on our side; the L1 arena is registered with the client once).

Mooncake's per-key codes become per-key results:

* get: a hit only when exactly ``len(buffer)`` bytes arrived; ``-704`` (not found) is a miss; a
  value of another length (longer ones answer ``-600``) is a miss, never a partial copy; any
  other code is a miss and marks the batch failed (the backend is in trouble: a dead segment, no master).
* set: a key landed only on code 0; ``-200`` (no space in any segment) and every other code
  fail that key, and the batch reports which keys failed and why.
* exists: 1 is found; 0 not found; an error code is "not found" and marks the batch failed.
* delete: 0 and ``-704`` are removed; ``-706`` (the object has a lease: someone read or wrote
  it moments ago) is left in place, so the next eviction round tries again.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmcache.storage.mooncake.config import LANES
from lmcache.v1.distributed.l2_adapters.api import PythonNativeConnector

OK = 0
NO_SPACE = -200
BUFFER_TOO_SMALL = -600
NOT_FOUND = -704
HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900

_MEANING = {
    NO_SPACE: "no space: no mounted segment has room (is the node holding the shared segment "
    "running, with a large enough global_segment_size?)",
    BUFFER_TOO_SMALL: "the stored value is larger than the buffer",
    NOT_FOUND: "not found",
    HAS_LEASE: "the object has a lease (it was just read or written); retried later",
    TRANSFER_FAIL: "transfer failed: the node holding the segment is unreachable",
    RPC_FAIL: "the master did not answer (is mooncake_master running at master_server_addr?)",
}

#: Our op names (the bridge's) -> the lane that runs them (0.5.6's lane keys).
OP_LANE = {"exists": "lookup", "get": "retrieve", "set": "store", "delete": "delete"}


def describe_code(code: int) -> str:
    """``code -200 (no space: ...)`` for a Mooncake status code."""
    meaning = _MEANING.get(code)
    return f"code {code} ({meaning})" if meaning else f"code {code}"


def buffer_address(view: memoryview) -> int:
    """Host address of a (read-only or writable) contiguous buffer."""
    return int(np.frombuffer(view.cast("B"), dtype=np.uint8).ctypes.data)


def summarize_failures(op: str, keys: list[str], codes: list[int], failed: list[bool]) -> str:
    """``set: 2 of 5 keys failed: 2 x code -200 (no space: ...); first: <key>``."""
    bad = [(k, c) for k, c, f in zip(keys, codes, failed, strict=True) if f]
    if not bad:
        return ""
    by_code = Counter(c for _, c in bad)
    parts = "; ".join(f"{n} x {describe_code(c)}" for c, n in by_code.most_common())
    return f"{op}: {len(bad)} of {len(keys)} keys failed: {parts}; first: {bad[0][0]}"


@dataclass
class _Batch:
    future_id: int
    op: str  # get | set | exists | delete
    keys: list[str]
    ptrs: list[int]
    sizes: list[int]


class _Stop:
    pass


class MooncakeConnector(PythonNativeConnector):
    """Worker lanes over one ``MooncakeDistributedStore``; see the module docstring."""

    def __init__(
        self,
        store: Any,
        num_workers: int,
        per_op_workers: dict[str, int],
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._store = store
        self._on_close = on_close
        self._open_completions()
        self._closed = False
        shared: queue.SimpleQueue[_Batch | _Stop] = queue.SimpleQueue()
        self._queues: dict[str, queue.SimpleQueue[_Batch | _Stop]] = {}
        self._threads: list[tuple[threading.Thread, queue.SimpleQueue[_Batch | _Stop]]] = []
        for lane in LANES:
            n = per_op_workers.get(lane, 0)
            self._queues[lane] = queue.SimpleQueue() if n else shared
            for i in range(n):
                self._spawn(self._queues[lane], f"lmc-mooncake-{lane}-{i}")
        if any(q is shared for q in self._queues.values()):
            for i in range(num_workers):
                self._spawn(shared, f"lmc-mooncake-{i}")

    def _spawn(self, q: queue.SimpleQueue[_Batch | _Stop], name: str) -> None:
        t = threading.Thread(target=self._work, args=(q,), name=name, daemon=True)
        self._threads.append((t, q))
        t.start()

    # --- native-connector contract ----------------------------------------------------------

    def submit_batch_delete(self, keys: list[str]) -> int:
        return self._submit("delete", keys, None)

    def close(self) -> None:
        """Stops the workers after their current batch (no buffer is touched afterwards), then
        closes the Mooncake client (its segment leaves the pool) and the fd."""
        if self._closed:
            return
        self._closed = True
        queues = {id(q): q for _, q in self._threads}
        for q in queues.values():  # queued batches are dropped: their buffers may be gone
            while True:
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
        for _, q in self._threads:
            q.put(_Stop())
        for t, _ in self._threads:
            t.join()
        if self._on_close is not None:
            self._on_close()
        self._close_completions()

    # --- submission and work ---------------------------------------------------------------

    def _submit(self, op: str, keys: list[str], views: list[Any] | None) -> int:
        if self._closed:
            raise RuntimeError("the mooncake_store connector is closed")
        ptrs: list[int] = []
        sizes: list[int] = []
        if views is not None:
            if len(views) != len(keys):
                raise RuntimeError(f"{len(keys)} keys but {len(views)} buffers")
            for i, v in enumerate(views):
                mv = memoryview(v)
                if not mv.c_contiguous:
                    raise RuntimeError(f"buffer {i} ({keys[i]}) is not C-contiguous")
                ptrs.append(buffer_address(mv))
                sizes.append(mv.nbytes)
        fid = self._next_future_id()
        self._queues[OP_LANE[op]].put(_Batch(fid, op, list(keys), ptrs, sizes))
        return fid

    def _work(self, q: queue.SimpleQueue[_Batch | _Stop]) -> None:
        while True:
            item = q.get()
            if isinstance(item, _Stop):
                return
            try:
                ok, error, results = self._run(item)
            except Exception as exc:  # the client raised: every key of the batch fails
                ok, error = False, f"{item.op} raised {type(exc).__name__}: {exc}"
                results = [False] * len(item.keys)
            self._complete(item.future_id, ok, error, results)  # set too: which keys landed

    def _run(self, b: _Batch) -> tuple[bool, str, list[bool]]:
        """``(batch ok, error text, per-key result)`` of one batch."""
        s = self._store
        if b.op == "set":
            codes = list(s.batch_put_from(b.keys, b.ptrs, b.sizes))
            results = [c == OK for c in codes]
            failed = [not r for r in results]
        elif b.op == "get":
            codes = list(s.batch_get_into(b.keys, b.ptrs, b.sizes))
            results = [c == n for c, n in zip(codes, b.sizes, strict=True)]
            # A value of another length is a miss for that key, not a backend failure.
            failed = [c < 0 and c not in (NOT_FOUND, BUFFER_TOO_SMALL) for c in codes]
        elif b.op == "exists":
            codes = list(s.batch_is_exist(b.keys))
            results = [c == 1 for c in codes]
            failed = [c not in (0, 1) for c in codes]
        else:  # delete
            codes = list(s.batch_remove(b.keys))
            results = [c in (OK, NOT_FOUND) for c in codes]
            failed = [c not in (OK, NOT_FOUND, HAS_LEASE) for c in codes]
        if len(codes) != len(b.keys):
            return (
                False,
                f"{b.op}: Mooncake answered {len(codes)} codes for {len(b.keys)} keys",
                [False] * len(b.keys),
            )
        error = summarize_failures(b.op, b.keys, codes, failed)
        return not error, error, results
