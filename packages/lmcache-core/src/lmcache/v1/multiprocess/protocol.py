"""Wire protocol of the MP cache server (docs/design/protocol.md#framing,
docs/design/protocol.md#errors).

Framing: a request is ``[uid, op, payload_0, ...]`` (the ROUTER prepends the peer
identity); a reply is ``[uid, op]`` echoed byte for byte plus ``[response]`` only when
the result is not None. Every frame is msgpack produced by msgspec.

* ``OPS`` is the op catalogue: legacy integer id (or None), snake_case name, handler
  kind and positional parameters. ``lookup_op`` accepts either form.
* Payload structs (``IPCCacheServerKey``, ``RegisterEngineDrivenContextPayload``, ...)
  travel as maps keyed by field name; unknown fields are ignored, missing fields with
  defaults are filled in, ints and bools are interchangeable.
* Ext type 1 carries a ``DeviceIPCWrapper`` through the platform's wire registry
  (``lmcache.v1.platform.base.ipc_wire``); ext type 2 carries a ``RemoteError`` and is
  only sent to peers that negotiated ``error_replies``.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any

import msgspec

# ---------------------------------------------------------------------------
# Error codes (10.1) and the RemoteError ext
# ---------------------------------------------------------------------------

EXT_IPC_WRAPPER = 1
EXT_REMOTE_ERROR = 2


class ErrorCode(str, enum.Enum):
    UNKNOWN_OP = "UNKNOWN_OP"
    NOT_SUPPORTED = "NOT_SUPPORTED"
    BAD_REQUEST = "BAD_REQUEST"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_REGISTERED = "NOT_REGISTERED"
    MODE_NOT_ENABLED = "MODE_NOT_ENABLED"
    INTERNAL = "INTERNAL"
    SHUTTING_DOWN = "SHUTTING_DOWN"


RETRYABLE_CODES = frozenset({ErrorCode.NOT_REGISTERED, ErrorCode.INTERNAL, ErrorCode.SHUTTING_DOWN})


class RemoteError(Exception):
    """An error reply from the server (ext type 2), raised by the client's futures."""

    def __init__(self, code: str, message: str, retryable: bool = False) -> None:
        super().__init__(f"{code}: {message}")
        self.code = str(code)
        self.message = message
        self.retryable = bool(retryable)

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "retryable": self.retryable}


class RequestError(Exception):
    """Raised by server handlers: becomes an error reply for negotiated peers, silence otherwise."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


# Features a client may enable with negotiate_features (10.1, 8.4).
FEATURE_ERROR_REPLIES = "error_replies"
FEATURE_RAW_PAYLOAD_V1 = "raw_payload_v1"
# Ours: key.token_ids may be a bin of uint32 big-endian values instead of an int array. That
# is the form hashing needs, and decoding 4096 msgpack ints into Python ints alone costs
# ~0.1 ms per request. The server accepts both forms from anyone; a client sends bytes only
# after negotiating it, so a 0.5.6 server never sees them.
FEATURE_TOKEN_IDS_U32BE = "token_ids_u32be"
# Ours: lookup and status queries are handled in arrival order per connection, so a client
# may send query/wait_prefetch_status right behind its lookup without waiting for the ack
# (one round trip instead of two). 0.5.6 ran them on a pool, where the query could overtake.
FEATURE_ORDERED_LOOKUP = "ordered_lookup"
# Ours: lookup takes an optional third payload, a wait timeout in seconds. With it the
# reply is what wait_prefetch_status(request_id, timeout) would answer right after the
# lookup: the hit count in chunks (consumed, as a status query consumes it), or nil when
# the timeout passes first (the status then stays queryable). One request and one reply
# instead of two of each; a client sends the third payload only after negotiating this.
FEATURE_LOOKUP_WAIT = "lookup_wait"
# Ours: a request's last, partial chunk is an object of its own (docs/design/protocol.md#partial-chunk).
# Keys of this peer may end past the last whole chunk (``end`` unaligned, ``start`` still
# aligned): tokens ``[chunk_floor(end), end)`` are the *tail*, kept in one chunk-shaped object
# (its first ``end % chunk_size`` token slots used) under ``tail_hash``, which no whole chunk
# can have. A lookup also probes the tail after its whole-chunk hit, and the lookup status
# (query/wait_prefetch_status, lookup_wait) is then the hit in TOKENS, not chunks. Opt-in: our
# clients ask for it only where they send such keys (the vLLM connector), so every other
# client keeps chunk counts. Whole chunks keep 0.5.6's keys and bytes.
FEATURE_PARTIAL_CHUNK = "partial_chunk"
# Ours: retrieve (lmcache_driven) takes an optional sixth payload, a deadline in seconds since
# the epoch (time.time(), the one clock a server and the workers whose memory it maps share
# across containers). Past it the server answers False without copying: the worker gave up
# then, and vLLM may have handed those blocks to another request. A client sends it only
# after negotiating this (docs/design/protocol.md#retrieve-deadline).
FEATURE_RETRIEVE_DEADLINE = "retrieve_deadline"
SUPPORTED_FEATURES: tuple[str, ...] = (
    FEATURE_ERROR_REPLIES,
    FEATURE_RAW_PAYLOAD_V1,
    FEATURE_TOKEN_IDS_U32BE,
    FEATURE_ORDERED_LOOKUP,
    FEATURE_LOOKUP_WAIT,
    FEATURE_RETRIEVE_DEADLINE,
)
# Features the server offers that a client enables only by naming them.
OPT_IN_FEATURES: tuple[str, ...] = (FEATURE_PARTIAL_CHUNK,)
# Everything get_experimental lists and negotiate_features may enable.
OFFERED_FEATURES: tuple[str, ...] = SUPPORTED_FEATURES + OPT_IN_FEATURES

# ---------------------------------------------------------------------------
# Payload structs (4.1, 5.2)
# ---------------------------------------------------------------------------


class IPCCacheServerKey(msgspec.Struct, kw_only=True):
    """The request key of store/retrieve/lookup/prepare/commit/free (4.1)."""

    model_name: str
    world_size: int
    worker_id: int | None
    token_ids: list[int] | bytes  # bytes: uint32 big-endian (FEATURE_TOKEN_IDS_U32BE)
    start: int
    end: int
    request_id: str
    cache_salt: str = ""
    request_configs: dict[str, Any] | None = None
    num_kv_readers: int = 0


class RegisterEngineDrivenContextPayload(msgspec.Struct, kw_only=True):
    instance_id: int
    model_name: str
    world_size: int
    block_size: int
    num_layers: int
    hidden_dim_size: int
    dtype_str: str
    use_mla: bool = False
    num_physical_slots: int | None = None


class EngineGroupInfo(msgspec.Struct, kw_only=True):
    engine_group_id: int = 0
    layer_indices: list[int] = []
    tokens_per_block: int = 16
    sw_size_tokens: int = -1
    extra_object_group_tag: int = 0
    recurrent_state: bool = False


class RequestAllocationRecord(msgspec.Struct, kw_only=True):
    """Blocks and tokens newly allocated to one request in a scheduler step."""

    req_id: str = ""
    new_block_ids: Any = None
    new_token_ids: Any = None


# The older name vLLM's connector still imports (docs/design/architecture.md#vllm-imports).
BlockAllocationRecord = RequestAllocationRecord


# ---------------------------------------------------------------------------
# KV events (0.5.6's ``subscribe_kv_events`` stream; docs/design/protocol.md#kv-events)
# ---------------------------------------------------------------------------

# get_experimental lists it when the server keeps a KV event log (--kv-event-log-size > 0).
KV_EVENT_CAPABILITY = "kv_event_stream"
KV_EVENT_KIND_STORED = "stored"
KV_EVENT_KIND_REMOVED = "removed"
KV_EVENT_MEDIUM_CPU = "CPU"  # L1; an L2 tier's medium is its adapter type in upper case
# A stream control frame: ``[uid, STREAM_CONTROL_OP, b"ack" | b"cancel"]``.
STREAM_CONTROL_OP = b""
STREAM_ACK = b"ack"
STREAM_CANCEL = b"cancel"


class KVEventRecord(msgspec.Struct, kw_only=True):
    """One change of one tier: ``stored`` carries one chunk (its tokens and parent hash)
    or one ``partial_chunk`` tail (fewer tokens, a multiple of the engine's block size),
    ``removed`` any number of chunk and tail hashes."""

    seq: int
    kind: str
    medium: str
    model_name: str
    block_hashes: list[bytes]
    parent_block_hash: bytes | None = None
    token_ids: list[int] = []


def stored_block_size(token_ids: list[int], block_hashes: list[Any]) -> int:
    """The ``block_size`` of a vLLM ``BlockStored`` event for a stored record: the tokens
    each of its blocks holds (the chunk size for chunks, the tail's length for a tail), so
    ``len(token_ids) == block_size * len(block_hashes)`` as in vLLM's own events."""
    return len(token_ids) // max(1, len(block_hashes))


class KVEventBatch(msgspec.Struct, kw_only=True):
    """One batch of a subscription. A new ``incarnation`` (server restart) or ``lost``
    (the cursor fell out of the log) means: withdraw what was announced before.
    ``enabled=False`` ends the stream; resume at ``next_cursor``."""

    enabled: bool
    incarnation: int
    next_cursor: int
    lost: bool
    events: list[KVEventRecord] = []


# ---------------------------------------------------------------------------
# Op catalogue (5.1)
# ---------------------------------------------------------------------------


class HandlerKind(str, enum.Enum):
    SYNC = "sync"
    AFFINITY = "affinity"
    NORMAL = "normal"


_REQUIRED = object()


@dataclass(frozen=True)
class Param:
    name: str
    type: Any  # a msgspec-convertible type, or Any to keep the decoded value
    default: Any = _REQUIRED

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


@dataclass(frozen=True)
class OpSpec:
    name: str
    legacy_id: int | None
    kind: HandlerKind | None  # None for LATER ops
    params: tuple[Param, ...] = ()
    supported: bool = True

    @functools.cached_property
    def min_params(self) -> int:
        return sum(1 for p in self.params if p.required)

    @functools.cached_property
    def max_params(self) -> int:
        return len(self.params)


_K = Param("key", IPCCacheServerKey)
_INST = Param("instance_id", int)
_S, _A, _N = HandlerKind.SYNC, HandlerKind.AFFINITY, HandlerKind.NORMAL

OPS: tuple[OpSpec, ...] = (
    OpSpec(
        "register_kv_cache",
        1,
        _S,
        (
            _INST,
            Param("kv_cache", Any),
            Param("model_name", str),
            Param("world_size", int),
            Param("engine_type", str, "vllm"),
            Param("layout_hints", dict | None, None),
            Param("engine_group_infos", list[EngineGroupInfo] | None, None),
        ),
    ),
    OpSpec("unregister_kv_cache", 2, _S, (_INST,)),
    OpSpec("register_q_cache", 3, None, supported=False),
    OpSpec("unregister_q_cache", 4, None, supported=False),
    OpSpec("store_q", 5, None, supported=False),
    OpSpec(
        "store",
        6,
        _A,
        (_K, _INST, Param("block_ids", list[list[int]]), Param("event_ipc_handle", bytes, b"")),
    ),
    OpSpec(
        "retrieve",
        7,
        _A,
        (
            _K,
            _INST,
            Param("block_ids", list[list[int]]),
            Param("event_ipc_handle", bytes, b""),
            Param("skip_first_n_tokens", int, 0),
            Param("deadline", float | None, None),  # FEATURE_RETRIEVE_DEADLINE
        ),
    ),
    # IMPROVE (NORMAL in 0.5.6): lookup never blocks (L2 lookups and loads run on the
    # storage layer's own threads), so it runs inline, and status queries after it are
    # answered in order, without two pool handoffs per request.
    OpSpec(
        "lookup",
        8,
        _S,
        (_K, Param("tp_size", Any, None), Param("wait_timeout", float | None, None)),
    ),
    OpSpec("query_prefetch_status", 9, _S, (Param("request_id", str),)),
    OpSpec("wait_prefetch_status", 10, _S, (Param("request_id", str), Param("timeout", float))),
    # IMPROVE (NORMAL in 0.5.6): releasing read locks and touching LRU positions never
    # blocks either; inline, a request's teardown costs no pool handoffs and no busy pool
    # (a long clear) holds it up.
    OpSpec("free_lookup_locks", 12, _S, (_K, Param("tp_size", Any, None))),
    OpSpec("end_session", 13, _S, (Param("request_id", str),)),
    OpSpec(
        "register_kv_cache_engine_driven_context",
        14,
        _S,
        (Param("payload", RegisterEngineDrivenContextPayload),),
    ),
    OpSpec("unregister_kv_cache_engine_driven_context", 15, _S, (_INST,)),
    OpSpec("prepare_store", 16, _A, (_K, _INST)),
    # memoryview: the copy path's payload (64 MiB per request) is read in place, not copied
    OpSpec("commit_store", 17, _A, (_K, _INST, Param("data", memoryview, b""))),
    OpSpec("prepare_retrieve", 18, _A, (_K, _INST)),
    OpSpec("commit_retrieve", 19, _A, (_K, _INST)),
    OpSpec("clear", 20, _N, (Param("force", bool, False),)),
    OpSpec("get_chunk_size", 21, _S),
    OpSpec("ping", 22, _S, (Param("instance_id", int | None, None),)),
    OpSpec(
        "report_block_allocation",
        23,
        _N,
        (
            Param("instance_id", Any, None),
            Param("model_name", Any, None),
            Param("records", Any, None),
        ),
    ),
    OpSpec("noop", 24, _S),
    OpSpec("cb_register_rope", 25, None, supported=False),
    OpSpec("cb_unregister_rope", 26, None, supported=False),
    OpSpec("cb_retrieve_pre_computed", 27, None, supported=False),
    OpSpec("cb_unified_lookup", 28, None, supported=False),
    OpSpec("p2p_lookup_and_lock", 29, None, supported=False),
    OpSpec("p2p_query_lookup_results", 30, None, supported=False),
    OpSpec("p2p_unlock_objects", 31, None, supported=False),
    OpSpec("get_experimental", 32, _S),
    OpSpec("cb_protocol_handshake", 33, None, supported=False),
    OpSpec("cb_reorder_plan", None, None, supported=False),
    # A stream (docs/design/protocol.md#kv-events): the server answers with one batch per
    # credit; the client acks each batch or cancels with ``[uid, b"", b"ack"|b"cancel"]``.
    OpSpec(
        "subscribe_kv_events",
        None,
        _S,
        (
            Param("instance_id", int),
            Param("model_name", str),
            Param("cursor", int),
            Param("max_events", int),
        ),
    ),
    OpSpec("server_module_call", None, None, supported=False),
    OpSpec("negotiate_features", None, _S, (Param("features", list[str]),)),
)

OPS_BY_NAME: dict[str, OpSpec] = {op.name: op for op in OPS}
OPS_BY_ID: dict[int, OpSpec] = {op.legacy_id: op for op in OPS if op.legacy_id is not None}


def lookup_op(op: object) -> OpSpec | None:
    """The op for a decoded op frame (legacy int id or name); None when unknown."""
    if isinstance(op, bool):
        return None
    if isinstance(op, int):
        return OPS_BY_ID.get(op)
    if isinstance(op, str):
        return OPS_BY_NAME.get(op)
    return None


def op_wire_value(op: OpSpec) -> int | str:
    """How our client sends an op: its legacy id when it has one, else its name (2.2)."""
    return op.legacy_id if op.legacy_id is not None else op.name


# ---------------------------------------------------------------------------
# Encoding (3)
# ---------------------------------------------------------------------------


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, RemoteError):
        return msgspec.msgpack.Ext(EXT_REMOTE_ERROR, msgspec.msgpack.encode(obj.to_wire()))
    if isinstance(obj, enum.Enum):
        return obj.value
    wire = _ipc_wire()
    if wire is not None and wire.is_wire_wrapper(obj):
        ext = wire.encode_wrapper(obj)
        if isinstance(ext, msgspec.msgpack.Ext):
            return ext
        return msgspec.msgpack.Ext(EXT_IPC_WRAPPER, ext)
    raise NotImplementedError(f"cannot encode {type(obj).__name__} on the MP wire")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == EXT_REMOTE_ERROR:
        body = msgspec.msgpack.decode(data)
        if not isinstance(body, dict):
            raise ValueError("malformed RemoteError ext: body is not a map")
        return RemoteError(
            str(body.get("code", "INTERNAL")),
            str(body.get("message", "")),
            bool(body.get("retryable", False)),
        )
    if code == EXT_IPC_WRAPPER:
        wire = _ipc_wire()
        if wire is None:
            raise ValueError("DeviceIPCWrapper ext received but the platform wire codec is missing")
        return wire.decode_wrapper(bytes(data))
    raise ValueError(f"unknown msgpack ext type {code}")


class _IpcWireShim:
    """Adapts the platform's wire registry (lmcache.v1.platform.base.ipc_wire)."""

    def __init__(self, module: Any) -> None:
        self._m = module
        from lmcache.v1.platform.base.ipc_wrapper import DeviceIPCWrapper

        self._base = DeviceIPCWrapper

    def is_wire_wrapper(self, obj: Any) -> bool:
        return isinstance(obj, self._base)

    def encode_wrapper(self, obj: Any) -> Any:
        return self._m.encode_wrapper(obj)

    def decode_wrapper(self, data: bytes) -> Any:
        return self._m.decode_wrapper(data)


_IPC_WIRE: Any = None


def _ipc_wire() -> _IpcWireShim | None:
    global _IPC_WIRE
    if _IPC_WIRE is None:
        try:
            from lmcache.v1.platform.base import ipc_wire

            _IPC_WIRE = _IpcWireShim(ipc_wire)
        except ImportError:
            _IPC_WIRE = False
    return _IPC_WIRE or None


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def encode(obj: Any) -> bytes:
    return _ENCODER.encode(obj)


def decode(data: bytes | memoryview) -> Any:
    return _DECODER.decode(data)


_TYPED_DECODERS: dict[Any, msgspec.msgpack.Decoder] = {}


def decode_param(param: Param, data: bytes | memoryview) -> Any:
    """Decode one payload frame straight into the parameter's type (lenient: int<->bool,
    missing defaults filled, unknown fields ignored); raises msgspec errors on bad input."""
    if param.type is Any:
        return _DECODER.decode(data)
    dec = _TYPED_DECODERS.get(param.type)
    if dec is None:
        dec = msgspec.msgpack.Decoder(param.type, strict=False, ext_hook=_ext_hook)
        _TYPED_DECODERS[param.type] = dec
    return dec.decode(data)


def convert_param(param: Param, value: Any) -> Any:
    """Type a decoded payload value; raises msgspec.ValidationError on a bad value."""
    if param.type is Any:
        return value
    return msgspec.convert(value, param.type, strict=False)


def to_builtins(obj: Any) -> Any:
    """Structs -> maps keyed by field name (what the wire carries)."""
    return msgspec.to_builtins(obj, enc_hook=lambda o: o)


# ---------------------------------------------------------------------------
# Key validation (4.1)
# ---------------------------------------------------------------------------

_BAD_SALT_CHARS = ("@", "/", "\\", "\x00")


def num_tokens(key: IPCCacheServerKey) -> int:
    ids = key.token_ids
    return len(ids) // 4 if isinstance(ids, bytes) else len(ids)


def token_prefix(key: IPCCacheServerKey, end: int) -> list[int] | bytes:
    """The first ``end`` token ids, in the form the key carries them."""
    ids = key.token_ids
    return ids[: 4 * end] if isinstance(ids, bytes) else ids[:end]


def validate_key(
    key: IPCCacheServerKey, *, chunk_aligned: bool, chunk_size: int, partial: bool = False
) -> None:
    """Raise RequestError(INVALID_ARGUMENT) naming the bad value and the fix. ``partial``
    (``FEATURE_PARTIAL_CHUNK``) lets an aligned key end inside a chunk (its tail)."""

    def bad(msg: str) -> RequestError:
        return RequestError(ErrorCode.INVALID_ARGUMENT, msg)

    if isinstance(key.token_ids, bytes) and len(key.token_ids) % 4:
        raise bad(
            f"token_ids as bytes must hold whole uint32 values (got {len(key.token_ids)} bytes); "
            "send 4 big-endian bytes per token"
        )
    n = num_tokens(key)
    if not (0 <= key.start <= key.end <= n):
        raise bad(
            f"token range [{key.start}, {key.end}) is outside the {n} token_ids; "
            "use 0 <= start <= end <= len(token_ids)"
        )
    if chunk_aligned and (key.start % chunk_size or (key.end % chunk_size and not partial)):
        raise bad(
            f"token range [{key.start}, {key.end}) is not aligned to chunk_size {chunk_size}; "
            "align start and end to whole chunks"
        )
    if not 1 <= key.world_size <= 255:
        raise bad(f"world_size must be in 1..255 (got {key.world_size})")
    if key.worker_id is not None and not 0 <= key.worker_id < key.world_size:
        raise bad(f"worker_id must be in [0, {key.world_size}) or nil (got {key.worker_id})")
    if not key.request_id:
        raise bad("request_id must not be empty; send the engine's request id")
    if "@" in key.model_name:
        raise bad(f"model_name must not contain '@' (got {key.model_name!r})")
    if len(key.cache_salt) > 128:
        raise bad(f"cache_salt exceeds max length 128 (got {len(key.cache_salt)})")
    if key.cache_salt and any(c in key.cache_salt for c in _BAD_SALT_CHARS):
        raise bad(f"cache_salt must not contain @, /, \\ or NUL (got {key.cache_salt!r})")
