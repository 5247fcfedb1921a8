"""The records every collaborator of ``CacheEngine`` shares: the request context, the
records of registered workers (``Instance``, ``Layout``) and their staged transfers
(``Reservation``, ``PendingRead``), the ObjectKey fan-out of a request, and small helpers
over them. Only data and pure functions: the tables that hold these records belong to the
collaborators (``InstanceRegistry``, ``LayoutTable``, ``SessionKeys``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.protocol import ErrorCode, RequestError
from lmcache.v1.multiprocess.sessions import Session
from lmcache.v1.multiprocess.token_hasher import compute_kv_rank, tail_hash
from lmcache.v1.platform.base.ipc_wrapper import dtype_name

ENGINE_DRIVEN = "engine_driven"
LMCACHE_DRIVEN = "lmcache_driven"
MODE_FIX = "start lmcache server with --supported-transfer-mode auto"
# Metric labels: the one L1 this server has (0.5.6's default tag), and the device of the
# engine-driven path, whose copies go through this host's memory.
L1_TAG = "_default"
HOST_DEVICE = "cpu"


#: Engine-driven transfer ops that, on the SHM path, only touch server bookkeeping.
BOOKKEEPING_OPS = frozenset(
    {"prepare_store", "commit_store", "prepare_retrieve", "commit_retrieve"}
)


class RequestContext:
    """What a handler knows about its request, and how it replies later when parked."""

    def __init__(
        self,
        peer: bytes,
        features: frozenset[str],
        reply: Callable[[Any], None],
        uid: bytes = b"",
    ):
        self.peer = peer
        self.features = features
        self.uid = uid  # the request's uid frame: with ``peer``, the key of a stream
        self._reply = reply
        self._lock = threading.Lock()
        self._done = False
        self.deferred = False

    def defer(self) -> None:
        self.deferred = True

    def send(self, value: Any) -> None:
        """One more reply frame of a stream (``subscribe_kv_events``); ``None`` ends it."""
        self._reply(value)

    def reply(self, value: Any) -> bool:
        """Send the (deferred) reply once; later calls are ignored."""
        return self.reply_with(lambda: value)

    def reply_with(self, make_value: Callable[[], Any]) -> bool:
        """``reply(make_value())``, where ``make_value`` runs only while no reply went out
        yet: a waiter that already timed out must not consume a result it cannot send."""
        with self._lock:
            if self._done:
                return False
            self._done = True
        self._reply(make_value())
        return True


@dataclass
class Layout:
    """The host chunk layout registered for (model_name, world_size)."""

    model_name: str
    world_size: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    desc: Any
    refcount: int = 0
    block_size: int = 0  # the engine's tokens per block (0: unknown); tails are multiples of it

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass
class Reservation:
    keys: list[Any]  # one key per chunk of the range (own rank)
    objs: dict[Any, Any]  # reserved by this request
    positions: list[int]  # chunk positions (relative to start) of the reserved objs
    failed: int
    created: float = field(default_factory=time.monotonic)


@dataclass
class PendingRead:
    """An SHM read between prepare_retrieve and commit_retrieve. A worker that copies counts
    as an in-flight retrieve of its session, so an end_session meanwhile leaves the slots
    locked. A failed prepare (``copying`` False) still owes its worker's lookup shares."""

    key: P.IPCCacheServerKey
    keys: list[Any]  # read-locked by the request's lookup
    prepared: float
    session: Session
    copying: bool = True


@dataclass
class Instance:
    instance_id: int
    mode: str
    model_name: str
    world_size: int
    layout_key: tuple[str, int]
    strategy: str = "copy"  # engine_driven: "shm" or "copy"
    last_seen: float = field(default_factory=time.monotonic)
    pinged: bool = False
    reservations: dict[tuple, Reservation] = field(default_factory=dict)
    # SHM reads between prepare_retrieve and commit_retrieve
    pending_reads: dict[tuple, PendingRead] = field(default_factory=dict)
    kv_caches: list[torch.Tensor] = field(default_factory=list)
    layout_hints: dict[str, Any] = field(default_factory=dict)
    wrappers: list[Any] = field(default_factory=list)
    cache_context: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def request_dtype(name: str) -> torch.dtype:
    """The torch dtype a request names (``"bfloat16"``, ``"torch.float16"``);
    ``RequestError(INVALID_ARGUMENT)`` when it names none."""
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise RequestError(
            ErrorCode.INVALID_ARGUMENT,
            f"dtype_str {name!r} is not a torch dtype name; send e.g. 'bfloat16' or 'float16'",
        )
    return dt


def fan_out_keys(
    key: P.IPCCacheServerKey, hashes: list[bytes], first: int, last: int, ranks: Any = None
) -> list[list[Any]]:
    """One row of ObjectKeys per kv rank over chunks [first, last) (4.3).

    ``ranks`` None means: the key's own rank, or every rank for a nil worker_id.
    """
    if ranks is None:
        ranks = range(key.world_size) if key.worker_id is None else [key.worker_id]
    model, salt = key.model_name, key.cache_salt
    span = tuple(hashes[first:last])
    return [
        list(object_key_cache.row(span, model, compute_kv_rank(key.world_size, r), salt))
        for r in ranks
    ]


def tail_keys(
    key: P.IPCCacheServerKey, parent: bytes, tail_bytes: bytes, ranks: Any = None
) -> list[Any]:
    """The ObjectKey of a tail (``tail_hash``) per kv rank, ``ranks`` as in ``fan_out_keys``."""
    return [row[0] for row in fan_out_keys(key, [tail_hash(parent, tail_bytes)], 0, 1, ranks)]


class ObjectKeyCache:
    """The one ObjectKey of each recently seen (hash, model, rank, group, salt), and whole
    rows of them by (chunk hashes, model, rank, salt).

    The storage layer keeps the key objects a store brought in its dicts; a lookup that
    brings those same objects finds them by identity instead of running ObjectKey.__eq__
    (about 80 times for a 16-chunk lookup). A prompt seen before (every cache hit) gets its
    row with one dict lookup instead of building or finding 16 keys. Everything is dropped
    once either table holds more than ``MAX_KEYS`` keys. Any thread may use it (single dict
    operations; a lost race only yields equal, separate keys, or a slightly late clear)."""

    MAX_KEYS = 1 << 16

    def __init__(self) -> None:
        self._keys: dict[tuple[Any, ...], ObjectKey] = {}
        self._rows: dict[tuple[Any, ...], tuple[ObjectKey, ...]] = {}
        self._row_keys = 0  # keys in _rows, counted once per row

    def row(
        self, chunk_hashes: tuple[bytes, ...], model: str, kv_rank: int, salt: str
    ) -> tuple[ObjectKey, ...]:
        row = self._rows.get((chunk_hashes, model, kv_rank, salt))
        if row is not None:
            return row
        if len(self._keys) > self.MAX_KEYS or self._row_keys > self.MAX_KEYS:
            self._keys, self._rows, self._row_keys = {}, {}, 0
        keys = self._keys
        out = []
        for h in chunk_hashes:
            fields = (h, model, kv_rank, 0, salt)
            k = keys.get(fields)
            if k is None:
                k = keys[fields] = ObjectKey(*fields)
            out.append(k)
        row = self._rows[(chunk_hashes, model, kv_rank, salt)] = tuple(out)
        self._row_keys += len(row)
        return row


#: The process's one ``ObjectKeyCache`` (``fan_out_keys`` uses it).
object_key_cache = ObjectKeyCache()


def codec_feature(ctx: RequestContext) -> bool:
    return P.FEATURE_RAW_PAYLOAD_V1 in ctx.features


def partial_feature(ctx: RequestContext) -> bool:
    """The peer negotiated ``partial_chunk``: its keys may end in a tail."""
    return P.FEATURE_PARTIAL_CHUNK in ctx.features


def obj_bytes(obj: Any, nbytes: int) -> memoryview:
    """The first ``nbytes`` bytes of an L1 object, as a flat byte view (no copy)."""
    return memoryview(obj.byte_array).cast("B")[:nbytes]


def obj_tensor(obj: Any, lay: Layout) -> torch.Tensor:
    """A typed view of an L1 object in the registered chunk layout (no copy)."""
    raw = torch.frombuffer(obj_bytes(obj, lay.nbytes), dtype=torch.uint8)
    return raw.view(lay.dtype).view(lay.shape)


def shm_slots(objs: Iterable[Any], lay: Layout) -> list[dict[str, Any]]:
    """Where each L1 object lies in the SHM pool, as an engine-driven worker maps it."""
    return [
        {
            "offset": int(o.metadata.address),
            "length": lay.nbytes,
            "shape": list(lay.shape),
            "dtype": dtype_name(lay.dtype),
        }
        for o in objs
    ]


def close_all(wrappers: list[Any]) -> None:
    """Close every IPC wrapper of a worker, ignoring the ones that fail to close."""
    for w in wrappers:
        try:
            w.close()
        except Exception:
            pass


def kv_device(inst: Instance) -> str:
    """The device type of a worker's registered KV cache (a metric label)."""
    return inst.kv_caches[0].device.type if inst.kv_caches else HOST_DEVICE


def keys_salt(keys: list[Any]) -> str:
    """The cache_salt of a request's keys (a metric label)."""
    return str(getattr(keys[0], "cache_salt", "") or "") if keys else ""
