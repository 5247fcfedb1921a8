"""KV events for vLLM: what the ``lmcache server`` holds, as vLLM's own ``BlockStored`` /
``BlockRemoved`` events (docs/vllm.md#kv-events).

With ``--kv-events-config '{"enable_kv_cache_events": true, ...}'`` vLLM asks its
connector for events: each worker's ``get_kv_connector_kv_cache_events()`` hands them to
the scheduler, whose ``take_events()`` gives them to vLLM's publisher. One worker per
server (``ParallelStrategy.is_kv_event_subscriber``) subscribes to the server's event log
(``subscribe_kv_events``, the same stream LMCache 0.5.6's connector reads) and turns its
records into events here: each chunk is announced once per medium (``"CPU"`` for L1, the
L2 adapter type in upper case for L2 tiers), removed only after it was announced, and
everything announced is withdrawn when the server restarts or events were lost. A chunk's
block hash is the server's chunk hash and its block size the chunk size; a ``partial_chunk``
tail is one block too, its hash the tail's key and its block size its token count (a
multiple of vLLM's block size), chained to the chunk before it.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

from lmcache.integration.vllm.vllm_base import KVConnectorKVEvents
from lmcache.utils import init_logger
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.kv_event_subscriber import KVEventSubscriber

logger = init_logger(__name__)

# Events vLLM has not taken yet; it takes them every step, so only a stalled engine fills it.
MAX_PENDING = 65536


class WorkerKVEvents:
    """The subscription of one worker and the events it has for vLLM."""

    def __init__(self, url: str, instance_id: int, model_name: str, tails: bool = False) -> None:
        """``tails``: the worker's link negotiated ``partial_chunk``, so the subscription
        asks for the tails' records too."""
        self._lock = threading.Lock()
        # (kind, medium, hashes, parent, tokens)
        self._pending: collections.deque[tuple[str, str, list[bytes], Any, list[int]]] = (
            collections.deque(maxlen=MAX_PENDING)
        )
        self._announced: dict[str, set[bytes]] = {}
        self._subscriber = KVEventSubscriber(
            url,
            instance_id,
            model_name,
            self._on_batch,
            self._on_disabled,
            features=(P.FEATURE_PARTIAL_CHUNK,) if tails else (),
        )

    def start(self) -> None:
        self._subscriber.start()

    def stop(self) -> None:
        self._subscriber.stop()

    def _on_disabled(self, reason: str) -> None:
        logger.warning("vLLM asked for KV events, but %s: take_events stays empty", reason)

    def _on_batch(self, batch: P.KVEventBatch) -> None:
        with self._lock:
            if batch.lost:
                self._withdraw_all()
            for rec in batch.events:
                announced = self._announced.setdefault(rec.medium, set())
                if rec.kind == P.KV_EVENT_KIND_REMOVED:
                    hashes = [h for h in rec.block_hashes if h in announced]
                    if hashes:
                        announced.difference_update(hashes)
                        self._pending.append(("removed", rec.medium, hashes, None, []))
                elif rec.kind == P.KV_EVENT_KIND_STORED:
                    hashes = [h for h in rec.block_hashes if h not in announced]
                    if hashes and rec.token_ids:
                        announced.update(hashes)
                        self._pending.append(
                            ("stored", rec.medium, hashes, rec.parent_block_hash, rec.token_ids)
                        )

    def _withdraw_all(self) -> None:
        for medium, hashes in self._announced.items():
            if hashes:
                self._pending.append(("removed", medium, sorted(hashes), None, []))
        self._announced.clear()

    def take(self, convert: Callable[..., list[Any]] | None = None) -> list[Any]:
        """The events since the last call, oldest first, as vLLM's event objects
        (``convert(pending)`` turns the (kind, medium, hashes, parent, tokens) tuples into
        them: ``to_vllm_events`` unless given)."""
        with self._lock:
            pending = list(self._pending)
            self._pending.clear()
        if not pending:
            return []
        return (convert or to_vllm_events)(pending)


def to_vllm_events(pending: list[tuple[str, str, list[bytes], Any, list[int]]]) -> list[Any]:
    """(kind, medium, hashes, parent, tokens) tuples as vLLM's ``BlockStored`` /
    ``BlockRemoved``, hashes converted as vLLM converts its own
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), ``block_size`` the tokens per block
    (``stored_block_size``: a tail's is its length)."""
    from vllm.distributed.kv_events import (  # type: ignore[import-not-found]
        BlockRemoved,
        BlockStored,
    )

    convert = _hash_converter()
    out: list[Any] = []
    for kind, medium, hashes, parent, tokens in pending:
        block_hashes = [convert(h) for h in hashes]
        if kind == "removed":
            out.append(BlockRemoved(block_hashes=block_hashes, medium=medium))
        else:
            out.append(
                BlockStored(
                    block_hashes=block_hashes,
                    parent_block_hash=None if parent is None else convert(parent),
                    token_ids=list(tokens),
                    block_size=P.stored_block_size(tokens, hashes),
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                )
            )
    return out


def _hash_converter() -> Callable[[bytes], Any]:
    try:
        from vllm.v1.core.kv_cache_utils import (  # type: ignore[import-not-found]
            maybe_convert_block_hash,
        )

        return maybe_convert_block_hash  # type: ignore[no-any-return]
    except ImportError:  # an older vLLM: hashes as bytes
        return lambda h: h


def kv_events_container(events: list[Any]) -> LMCacheMPKVEvents:
    """vLLM's ``KVConnectorKVEvents`` holding ``events`` (what a worker returns)."""
    return LMCacheMPKVEvents(events)


class LMCacheMPKVEvents(KVConnectorKVEvents):  # type: ignore[misc,valid-type]
    """Events of the workers of one step, in the order they reported them (one worker per
    server reports; vLLM merges other workers' containers in). A module-level class: vLLM
    pickles it from the worker to the scheduler."""

    def __init__(self, events: list[Any] | None = None) -> None:
        self._events: list[Any] = list(events or [])
        self._workers = 1

    def add_events(self, events: list[Any]) -> None:
        self._events.extend(events)

    def aggregate(self) -> LMCacheMPKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()
        self._workers = 1
