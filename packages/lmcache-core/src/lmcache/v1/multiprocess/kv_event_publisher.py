"""The server's KV events as vLLM publishes its own (``--kv-events-config``), so a
cache-aware router (llm-d, Dynamo, ...) that reads vLLM's stream reads ours unchanged
(docs/server.md#kv-events).

Wire format (vLLM's ``vllm.distributed.kv_events``): each message is three frames
``[topic, seq (8 bytes, big endian, from 0), payload]`` on a PUB socket; the payload is a
msgpack ``KVEventBatch`` ``[ts, [event, ...]]`` whose events are ``BlockStored`` /
``BlockRemoved`` maps tagged ``type``. With a ``replay_endpoint``, a ROUTER answers a
request ``[b"", start_seq (8 bytes)]`` with every buffered message from ``start_seq`` as
``[b"", topic, seq, payload]``, then ``[b"", b"", -1 (8 bytes, signed), b""]``.
The endpoint rule is vLLM's: an address with ``*`` or ``::`` and ``ipc://``/``inproc://``
are bound, any other is connected to (the router binds).
"""

from __future__ import annotations

import collections
import json
import threading
import time
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import zmq

from lmcache.utils import init_logger
from lmcache.v1.multiprocess.protocol import (
    KV_EVENT_KIND_REMOVED,
    KVEventRecord,
    stored_block_size,
)

logger = init_logger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


# vLLM's event shapes (vllm/distributed/kv_events.py): same names, tags and options, the
# fields a consumer needs (vLLM's later optional fields default to None on its side).
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged events."""


class BlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


@dataclass(frozen=True)
class KVEventsConfig:
    """``--kv-events-config``: vLLM's ``KVEventsConfig`` keys (``enable_kv_cache_events``,
    ``publisher``, ``endpoint``, ``replay_endpoint``, ``buffer_steps``, ``hwm``,
    ``max_queue_size``, ``topic``) with vLLM's defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, text: str | dict[str, Any] | None) -> KVEventsConfig:
        """From the flag's JSON (or a dict); ``ValueError`` naming the bad key or value."""
        if text is None or text == "":
            return cls()
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"--kv-events-config is not JSON ({exc}): pass e.g. "
                '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\''
            ) from None
        if not isinstance(raw, dict):
            raise ValueError(f"--kv-events-config must be a JSON object, got {raw!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"--kv-events-config has unknown key(s) {unknown}; the keys are {sorted(known)}"
            )
        try:
            cfg = cls(**raw)
        except TypeError as exc:
            raise ValueError(f"--kv-events-config: {exc}") from None
        if cfg.publisher not in (None, "zmq", "null"):
            raise ValueError(
                f'--kv-events-config publisher must be "zmq" or "null" (got {cfg.publisher!r})'
            )
        for name in ("buffer_steps", "hwm"):
            if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) < 0:
                raise ValueError(
                    f"--kv-events-config {name} must be an integer >= 0 (got {getattr(cfg, name)!r})"
                )
        if cfg.enabled and not cfg.endpoint:
            raise ValueError('--kv-events-config needs an endpoint, e.g. "tcp://*:5557"')
        return cfg


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard, IPv6-any and ipc/inproc endpoints are bound, the rest connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def to_vllm_events(records: list[KVEventRecord]) -> list[Any]:
    """Our log records as vLLM's ``BlockStored`` / ``BlockRemoved`` (hashes as bytes); a
    ``BlockStored``'s ``block_size`` is its tokens per block (``stored_block_size``)."""
    out: list[Any] = []
    for rec in records:
        if rec.kind == KV_EVENT_KIND_REMOVED:
            out.append(BlockRemoved(block_hashes=list(rec.block_hashes), medium=rec.medium))
        else:
            out.append(
                BlockStored(
                    block_hashes=list(rec.block_hashes),
                    parent_block_hash=rec.parent_block_hash,
                    token_ids=list(rec.token_ids),
                    block_size=stored_block_size(rec.token_ids, rec.block_hashes),
                    lora_id=None,
                    medium=rec.medium,
                    lora_name=None,
                )
            )
    return out


class ZmqKVEventPublisher:
    """PUB socket (plus the optional replay ROUTER) in vLLM's format. ``publish`` is called
    from one thread only (``KVEventStreams``); replay requests have their own thread."""

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._ctx: zmq.Context = zmq.Context.instance()
        self._topic = config.topic.encode()
        self._seq = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=max(1, config.buffer_steps)
        )
        self._buffer_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._replay_thread: threading.Thread | None = None
        self.endpoint = ""
        self.replay_endpoint = ""

    def start(self) -> None:
        """Open the sockets; ``OSError`` naming the endpoint and the fix when one fails."""
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.set_hwm(self.config.hwm)
        self._pub = pub
        self.endpoint = self._open(pub, self.config.endpoint)
        if self.config.replay_endpoint:
            rep = self._ctx.socket(zmq.ROUTER)
            rep.setsockopt(zmq.LINGER, 0)
            self._replay = rep
            self.replay_endpoint = self._open(rep, self.config.replay_endpoint, bind=True)
            self._replay_thread = threading.Thread(
                target=self._serve_replay, name="lmcache-kv-events-replay", daemon=True
            )
            self._replay_thread.start()
        logger.info(
            "KV events published in vLLM's format on %s (topic %r)%s",
            self.endpoint,
            self.config.topic,
            f", replay on {self.replay_endpoint}" if self.replay_endpoint else "",
        )

    def _open(self, sock: zmq.Socket, endpoint: str, bind: bool | None = None) -> str:
        bind = is_bind_endpoint(endpoint) if bind is None else bind
        try:
            if bind:
                sock.bind(endpoint)
                return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            sock.connect(endpoint)
            return endpoint
        except zmq.ZMQError as exc:
            self.stop()
            raise OSError(
                f"--kv-events-config: cannot {'bind' if bind else 'connect'} {endpoint!r}: {exc}; "
                "use tcp://*:PORT (or tcp://HOST:PORT of a router that binds) with a free port"
            ) from exc

    def publish(self, records: list[KVEventRecord]) -> None:
        if self._pub is None or not records:
            return
        payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=to_vllm_events(records)))
        seq = self._seq
        self._seq += 1
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # a full queue drops, as vLLM's PUB does past hwm
            logger.warning("KV event batch %d not published: %s", seq, exc)
        if self._replay is not None:
            with self._buffer_lock:
                self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        rep = self._replay
        assert rep is not None
        while not self._stop.is_set():
            try:
                if not rep.poll(200):
                    continue
                frames = rep.recv_multipart()
                if len(frames) != 3:
                    logger.warning("bad KV event replay request (%d frames)", len(frames))
                    continue
                client, _, start = frames
                first = int.from_bytes(start, "big")
                with self._buffer_lock:
                    buffered = [(s, p) for s, p in self._buffer if s >= first]
                for seq, payload in buffered:
                    rep.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
                rep.send_multipart((client, b"", b"", END_SEQ, b""))
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                logger.warning("KV event replay failed: %s", exc)

    def stop(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
