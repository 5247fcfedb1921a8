"""KV events from a real ``lmcache server``: 0.5.6's ``subscribe_kv_events`` stream (L1 and
L2 stores and removals, with tokens, parent hashes and medium), and the vLLM-format ZeroMQ
publisher of ``--kv-events-config`` read by a real SUB socket."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import zmq
from testsupport.ports import free_port

from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.kv_event_publisher import KVEventsConfig

OP = msgspec.msgpack.encode("subscribe_kv_events")
BATCH = msgspec.msgpack.Decoder(P.KVEventBatch)


class Subscriber:
    """A 0.5.6-style stream client on a raw DEALER: subscribe, then ack each batch."""

    def __init__(
        self, mp, url: str, model: str, instance_id: int = 7, cursor: int = 0, features=()
    ):
        self.peer = mp.RawPeer(url)
        if features:  # as our connector's subscriber does; 0.5.6's negotiates nothing
            assert P.decode(self.peer.request("negotiate_features", list(features))[2])
        self.uid = msgspec.msgpack.encode(100)
        self.peer.send([self.uid, OP, *(P.encode(v) for v in (instance_id, model, cursor, 1024))])

    def next(self, timeout: float = 10.0) -> P.KVEventBatch | None:
        """The next batch (acked), or None when the stream ended."""
        frames = self.peer.recv(timeout)
        assert frames is not None, "no batch arrived"
        assert frames[0] == self.uid and frames[1] == OP
        if len(frames) == 2:
            return None
        self.peer.send([self.uid, b"", b"ack"])
        return BATCH.decode(frames[2])

    def poll(self, timeout: float) -> list[P.KVEventRecord]:
        """The records of the batches that arrive within ``timeout`` of each other."""
        out: list[P.KVEventRecord] = []
        while (frames := self.peer.recv(timeout)) is not None and len(frames) > 2:
            self.peer.send([self.uid, b"", b"ack"])
            out.extend(BATCH.decode(frames[2]).events)
        return out

    def records(self, want, timeout: float = 20.0) -> list[P.KVEventRecord]:
        """Batches until ``want(records so far)`` holds."""
        out: list[P.KVEventRecord] = []
        deadline = time.monotonic() + timeout
        while not want(out):
            assert time.monotonic() < deadline, f"records so far: {out}"
            batch = self.next(max(0.1, deadline - time.monotonic()))
            assert batch is not None and batch.enabled
            out.extend(batch.events)
        return out

    def close(self) -> None:
        self.peer.send([self.uid, b"", b"cancel"])
        self.peer.close()


def _kinds(records, kind, medium):
    return [r for r in records if r.kind == kind and r.medium == medium]


def test_stream_reports_l1_stores_with_tokens_and_removals(lmcache_server, mp):
    srv = lmcache_server()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model="ev")
    sub = Subscriber(mp, srv.rpc_url, "ev")
    try:
        assert P.KV_EVENT_CAPABILITY in c.get_experimental()
        first = sub.next()
        assert first.enabled and first.events == [] and not first.lost
        assert ctx.submit_store(mp.key("s", model="ev"), list(range(1, 33))).result(20)
        stored = sub.records(lambda r: len(r) >= 2)
        assert [r.kind for r in stored] == ["stored", "stored"]
        assert {r.medium for r in stored} == {"CPU"}
        assert stored[0].token_ids == mp.TOKENS[:256] and stored[1].token_ids == mp.TOKENS[256:]
        assert stored[0].parent_block_hash is None
        assert stored[1].parent_block_hash == stored[0].block_hashes[0]
        assert stored[0].seq < stored[1].seq and stored[0].model_name == "ev"
        st = mp.status(srv)["kv_events"]
        assert st["enabled"] and st["log_depth"] >= 2 and st["log_capacity"] == 32768
        assert st["subscribers"] == 1 and st["incarnation"] == first.incarnation
        assert mp.metric(srv, "lmcache_mp_kv_events_log_depth") >= 2
        assert c.call("clear", True) is None
        removed = sub.records(lambda r: r)
        assert removed[0].kind == "removed" and removed[0].medium == "CPU"
        assert set(removed[0].block_hashes) == {r.block_hashes[0] for r in stored}
    finally:
        sub.close()
        ctx.close()
        c.close()


def test_stream_filters_by_model_and_replays_from_a_cursor(lmcache_server, mp):
    srv = lmcache_server()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model="mine")
    c2, ctx2 = mp.worker(srv.rpc_url, mp.make_kv(), model="other")
    try:
        assert ctx2.submit_store(mp.key("o", model="other"), list(range(1, 33))).result(20)
        assert ctx.submit_store(mp.key("m", model="mine"), list(range(1, 33))).result(20)
        mp.wait_for(lambda: mp.status(srv)["kv_events"]["log_depth"] >= 4, "4 records logged")
        sub = Subscriber(mp, srv.rpc_url, "mine")
        try:  # a cursor of 0 replays the log: only this model's records
            got = sub.records(lambda r: len(r) >= 2)
            assert {r.model_name for r in got} == {"mine"} and len(got) == 2
        finally:
            sub.close()
        sub = Subscriber(mp, srv.rpc_url, "mine", instance_id=8, cursor=got[0].seq)
        try:  # resuming after the first record: the second only
            assert [r.seq for r in sub.records(lambda r: r)] == [got[1].seq]
        finally:
            sub.close()
    finally:
        for x in (ctx, c, ctx2, c2):
            x.close()


def test_l2_stores_and_evictions_carry_the_l2_medium(lmcache_server, mp):
    l2 = {
        "type": "mock",
        "max_size_gb": 0.0001,
        "mock_bandwidth_gb": 10.0,
        "eviction": {"eviction_policy": "LRU"},
    }
    srv = lmcache_server("--l2-adapter", json.dumps(l2))
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model="l2ev")
    sub = Subscriber(mp, srv.rpc_url, "l2ev")
    try:
        sub.next()
        for i in range(4):  # 8 chunks of 32 KiB into ~100 KiB of L2
            toks = [t + 1000 * i for t in mp.TOKENS]
            k = mp.key(f"s{i}", model="l2ev", tokens=toks)
            assert ctx.submit_store(k, list(range(1, 33))).result(20)
        got = sub.records(lambda r: _kinds(r, "removed", "MOCK"), timeout=30)
        l2_stored = _kinds(got, "stored", "MOCK")
        assert l2_stored and all(len(r.token_ids) == 256 for r in l2_stored)
        evicted = {h for r in _kinds(got, "removed", "MOCK") for h in r.block_hashes}
        assert evicted <= {r.block_hashes[0] for r in l2_stored}
    finally:
        sub.close()
        ctx.close()
        c.close()


# --------------------------------------------------------------- partial_chunk tails
PARTIAL = P.SUPPORTED_FEATURES + (P.FEATURE_PARTIAL_CHUNK,)


def _tail_worker(mp, srv, model: str):
    """A worker that negotiated ``partial_chunk`` (as the connector's link does)."""
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(num_blocks=64, block_size=16), model=model)
    assert P.FEATURE_PARTIAL_CHUNK in c.negotiate_default_features(PARTIAL)
    return c, ctx


def _chunk_and_tail_hashes(tokens: list[int], end: int) -> tuple[bytes, bytes]:
    """The first chunk's hash and the key of the tail ``tokens[256:end]`` after it."""
    from lmcache.v1.multiprocess.token_hasher import chunk_hashes, tail_hash, tokens_to_be_bytes

    chunk = chunk_hashes(tokens[:256], 256)[0]
    return chunk, tail_hash(chunk, tokens_to_be_bytes(tokens[256:end]))


def test_a_tail_is_one_block_chained_to_its_chunk_and_removed_with_it(lmcache_server, mp):
    srv = lmcache_server()
    c, ctx = _tail_worker(mp, srv, "tail")
    sub = Subscriber(mp, srv.rpc_url, "tail", features=[P.FEATURE_PARTIAL_CHUNK])
    old = Subscriber(mp, srv.rpc_url, "tail", instance_id=8)  # LMCache 0.5.6's connector
    try:
        sub.next()
        old.next()
        # 400 tokens: one whole chunk and a tail of 144 (9 engine blocks of 16)
        assert ctx.submit_store(mp.key("t", model="tail", end=400), list(range(1, 26))).result(20)
        stored = sub.records(lambda r: len(r) >= 2)
        chunk, tail = _chunk_and_tail_hashes(mp.TOKENS, 400)
        assert [(r.kind, r.medium, r.block_hashes) for r in stored] == [
            ("stored", "CPU", [chunk]),
            ("stored", "CPU", [tail]),
        ]
        assert stored[1].token_ids == mp.TOKENS[256:400]
        assert stored[1].parent_block_hash == chunk
        assert P.stored_block_size(stored[1].token_ids, stored[1].block_hashes) == 144
        assert mp.status(srv)["kv_events"]["unbound_stores"] == 0  # the tail was bound too
        # a subscriber without partial_chunk would announce the tail as a whole chunk: it
        # gets the whole chunks only
        assert [r.block_hashes for r in old.records(lambda r: r)] == [[chunk]]
        assert c.call("clear", True) is None
        removed = sub.records(lambda r: r)
        assert removed[0].kind == "removed" and set(removed[0].block_hashes) == {chunk, tail}
    finally:
        sub.close()
        old.close()
        ctx.close()
        c.close()


def test_evicted_tails_leave_l2_with_a_removal(lmcache_server, mp):
    l2 = {
        "type": "mock",
        "max_size_gb": 0.0001,  # ~100 KiB: three objects of 32 KiB
        "mock_bandwidth_gb": 10.0,
        "eviction": {"eviction_policy": "LRU"},
    }
    srv = lmcache_server("--l2-adapter", json.dumps(l2))
    c, ctx = _tail_worker(mp, srv, "l2tail")
    sub = Subscriber(mp, srv.rpc_url, "l2tail", features=[P.FEATURE_PARTIAL_CHUNK])

    def store(i: int) -> bytes:  # a chunk and a tail of 64 tokens; the tail's hash
        toks = [t + 1000 * i for t in mp.TOKENS]
        k = mp.key(f"s{i}", model="l2tail", tokens=toks, end=320)
        assert ctx.submit_store(k, list(range(1, 21))).result(20)
        return _chunk_and_tail_hashes(toks, 320)[1]

    def hashes(records, kind):
        return {h for r in _kinds(records, kind, "MOCK") for h in r.block_hashes}

    try:
        sub.next()
        tail = store(0)
        got = sub.records(lambda r: tail in hashes(r, "stored"), timeout=30)
        stored = next(r for r in _kinds(got, "stored", "MOCK") if r.block_hashes == [tail])
        assert len(stored.token_ids) == 64 and stored.parent_block_hash is not None
        # newer prompts fill L2 until its LRU eviction reaches the oldest tail
        deadline = time.monotonic() + 30
        i = 1
        while tail not in hashes(got, "removed"):
            assert time.monotonic() < deadline, f"the tail never left L2: {got}"
            store(i)
            i += 1
            got += sub.poll(1.0)
    finally:
        sub.close()
        ctx.close()
        c.close()


def test_log_size_zero_turns_events_off(lmcache_server, mp):
    srv = lmcache_server("--kv-event-log-size", "0")
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv())
    sub = Subscriber(mp, srv.rpc_url, "m")
    try:
        assert P.KV_EVENT_CAPABILITY not in c.get_experimental()
        assert mp.status(srv)["kv_events"] == {"enabled": False}
        batch = sub.next()
        assert not batch.enabled and sub.next() is None  # one batch, then the stream ends
    finally:
        sub.close()
        ctx.close()
        c.close()


def test_bad_subscriptions_get_an_error_and_the_server_serves_on(lmcache_server, mp):
    srv = lmcache_server()
    peer = mp.RawPeer(srv.rpc_url)
    try:
        assert peer.request("negotiate_features", [P.FEATURE_ERROR_REPLIES]) is not None
        frames = peer.request("subscribe_kv_events", 1, "m", -1, 10)
        err = P.decode(frames[2])
        assert isinstance(err, P.RemoteError) and "cursor must be >= 0" in err.message
        peer.send([msgspec.msgpack.encode(99), b"", b"ack"])  # a control frame of no stream
        assert P.decode(peer.request("noop")[2]) == "OK"
    finally:
        peer.close()


# --------------------------------------------------------------- vLLM-format publisher
try:  # vLLM's own classes where vLLM is installed, else the same shapes declared here
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.distributed.kv_events import KVEventBatch as VllmBatch
except Exception:

    class _Event(msgspec.Struct, omit_defaults=True, tag=True):
        pass

    class BlockStored(_Event):  # type: ignore[no-redef]
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None

    class BlockRemoved(_Event):  # type: ignore[no-redef]
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None

    class VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[no-redef]
        ts: float
        events: list[BlockStored | BlockRemoved]
        data_parallel_rank: int | None = None


def _router(lmcache_server, **extra):
    """(a router's bound SUB socket, a server publishing to it in vLLM's format)."""
    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.bind(f"tcp://127.0.0.1:{port}")  # a router that binds; the server connects (vLLM's rule)
    cfg = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{port}",
        "topic": "kv",
        **extra,
    }
    return sub, lmcache_server("--kv-events-config", json.dumps(cfg))


def _published_stores(sub, store, want: int) -> list:
    """vLLM's events off ``sub`` until ``want`` BlockStored arrived. PUB drops what it
    sends before the connection is up, so ``store(i)`` stores new chunks until some arrive;
    the events from the first arriving batch on."""
    dec = msgspec.msgpack.Decoder(VllmBatch)
    events: list = []
    deadline = time.monotonic() + 30
    i = 0
    while len([e for e in events if isinstance(e, BlockStored)]) < want:
        assert time.monotonic() < deadline, f"events so far: {events}"
        store(i)
        i += 1
        while sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv" and len(seq) == 8
            events.extend(dec.decode(payload).events)
    return events


def test_publisher_speaks_vllms_wire_format_with_replay(lmcache_server, mp):
    replay_port = free_port()
    sub, srv = _router(lmcache_server, replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model="pub")
    dec = msgspec.msgpack.Decoder(VllmBatch)
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)

    def store(i: int) -> None:
        toks = [t + 10000 * i for t in mp.TOKENS]
        assert ctx.submit_store(
            mp.key(f"p{i}", model="pub", tokens=toks), list(range(1, 33))
        ).result(20)

    try:
        events = _published_stores(sub, store, 2)
        stored = [e for e in events if isinstance(e, BlockStored)]
        assert stored[0].medium == "CPU" and stored[0].block_size == 256
        toks = [t - mp.TOKENS[0] + stored[0].token_ids[0] for t in mp.TOKENS]
        assert stored[0].token_ids == toks[:256] and stored[0].parent_block_hash is None
        assert stored[1].token_ids == toks[256:]
        assert stored[1].parent_block_hash == stored[0].block_hashes[0]
        assert c.call("clear", True) is None
        deadline = time.monotonic() + 20
        removed: list = []
        while not removed:
            assert time.monotonic() < deadline, "no BlockRemoved"
            if sub.poll(1000):
                _t, _s, payload = sub.recv_multipart()
                removed = [e for e in dec.decode(payload).events if isinstance(e, BlockRemoved)]
        assert removed[0].medium == "CPU"
        assert stored[0].block_hashes[0] in removed[0].block_hashes
        # replay from sequence 0 (vLLM's request: [b"", start seq]): every buffered batch
        # as [b"", topic, seq, payload], then the end marker [b"", b"", -1, b""]
        req.connect(f"tcp://127.0.0.1:{replay_port}")
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert req.poll(10000), "the replay did not end"
            frames = req.recv_multipart()
            if frames[1] == b"":
                assert int.from_bytes(frames[2], "big", signed=True) == -1
                break
            assert frames[1] == b"kv"
            replayed.append(int.from_bytes(frames[2], "big"))
            assert dec.decode(frames[3]).events
        assert replayed and replayed[0] == 0 and replayed == sorted(replayed)
    finally:
        req.close()
        sub.close()
        ctx.close()
        c.close()


def test_publisher_sends_a_tail_as_one_block_of_its_length(lmcache_server, mp):
    sub, srv = _router(lmcache_server)
    c, ctx = _tail_worker(mp, srv, "pubtail")
    prompts: list[list[int]] = []

    def store(i: int) -> None:  # one chunk and a tail of 48 tokens (3 engine blocks)
        prompts.append([t + 10000 * i for t in mp.TOKENS])
        k = mp.key(f"t{i}", model="pubtail", tokens=prompts[-1], end=304)
        assert ctx.submit_store(k, list(range(1, 20))).result(20)

    try:
        events = _published_stores(sub, store, 2)
        stored = [e for e in events if isinstance(e, BlockStored)]
        chunk, tail = stored[0], stored[1]
        toks = next(p for p in prompts if p[:256] == chunk.token_ids)
        assert (chunk.block_size, chunk.parent_block_hash) == (256, None)
        assert tail.block_hashes == [_chunk_and_tail_hashes(toks, 304)[1]]
        assert tail.parent_block_hash == chunk.block_hashes[0] and tail.medium == "CPU"
        # vLLM's invariant: token_ids == block_size * len(block_hashes)
        assert tail.token_ids == toks[256:304] and tail.block_size == 48
        assert c.call("clear", True) is None
        deadline = time.monotonic() + 20
        removed: set = set()
        dec = msgspec.msgpack.Decoder(VllmBatch)
        while tail.block_hashes[0] not in removed:
            assert time.monotonic() < deadline, "no BlockRemoved for the tail"
            if sub.poll(1000):
                batch = dec.decode(sub.recv_multipart()[2])
                removed |= {
                    h for e in batch.events if isinstance(e, BlockRemoved) for h in e.block_hashes
                }
    finally:
        sub.close()
        ctx.close()
        c.close()


def test_publisher_config_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['endpont'\]"):
        KVEventsConfig.parse('{"endpont": "tcp://*:5557"}')
    with pytest.raises(ValueError, match="not JSON"):
        KVEventsConfig.parse("{")
    with pytest.raises(ValueError, match='publisher must be "zmq" or "null"'):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "kafka"}')
    assert not KVEventsConfig.parse('{"enable_kv_cache_events": false}').enabled
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}').endpoint == "tcp://*:5557"


def _configs(*argv: str):
    import argparse

    from lmcache.cli.server import add_server_args, build_configs

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return build_configs(parser.parse_args(list(argv)))


def test_flags_size_the_log_and_refuse_what_cannot_work():
    from lmcache.cli.errors import CLIError

    assert _configs()[0].kv_event_log_size == 32768  # 0.5.6's default: on
    assert _configs("--kv-event-log-size", "100")[0].kv_event_log_size == 100
    assert _configs("--disable-observability")[0].kv_event_log_size == 0  # as in 0.5.6
    on = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
    assert _configs("--kv-events-config", on)[0].kv_events_config == on
    with pytest.raises(CLIError, match=r"--kv-event-log-size must be >= 0 \(got -1\)"):
        _configs("--kv-event-log-size", "-1")
    with pytest.raises(CLIError, match="--kv-event-log-size 0 or --disable-observability"):
        _configs("--kv-event-log-size", "0", "--kv-events-config", on)
    with pytest.raises(CLIError, match="unknown key"):
        _configs("--kv-events-config", '{"topics": "x"}')


# --------------------------------------------------------------- the connector's side
def _raw(pending):
    return [
        (kind, medium, hashes, parent, tokens) for kind, medium, hashes, parent, tokens in pending
    ]


def test_worker_events_announce_each_chunk_once_and_remove_only_what_was_announced(
    lmcache_server, mp
):
    from lmcache.integration.vllm.kv_events import WorkerKVEvents

    srv = lmcache_server()
    c, ctx = mp.worker(srv.rpc_url, mp.make_kv(), model="conn")
    events = WorkerKVEvents(srv.rpc_url, 4242, "conn")
    events.start()
    got: list = []
    try:
        assert ctx.submit_store(mp.key("a", model="conn"), list(range(1, 33))).result(20)
        mp.wait_for(lambda: got.extend(events.take(_raw)) or len(got) >= 2, "two BlockStored")
        assert [(k, m) for k, m, *_ in got] == [("stored", "CPU"), ("stored", "CPU")]
        assert got[0][4] == mp.TOKENS[:256] and got[1][3] == got[0][2][0]
        hashes = {got[0][2][0], got[1][2][0]}
        # the same chunks again (another rank, or a re-store) announce nothing new
        assert ctx.submit_store(mp.key("b", model="conn"), list(range(1, 33))).result(20)
        assert c.call("clear", True) is None
        later: list = []
        mp.wait_for(lambda: later.extend(events.take(_raw)) or later, "BlockRemoved")
        assert [(k, m) for k, m, *_ in later] == [("removed", "CPU")]
        assert set(later[0][2]) == hashes
        # events lost (or a server restart): everything announced is withdrawn first
        assert ctx.submit_store(mp.key("c", model="conn"), list(range(1, 33))).result(20)
        mp.wait_for(lambda: len(events.take(_raw)) == 2, "stored again")
        events._on_batch(P.KVEventBatch(enabled=True, incarnation=1, next_cursor=0, lost=True))
        withdrawn = events.take(_raw)
        assert [(k, m, set(h)) for k, m, h, *_ in withdrawn] == [("removed", "CPU", hashes)]
    finally:
        events.stop()
        ctx.close()
        c.close()


def test_worker_events_announce_a_tail_and_withdraw_it(lmcache_server, mp):
    from lmcache.integration.vllm.kv_events import WorkerKVEvents

    srv = lmcache_server()
    c, ctx = _tail_worker(mp, srv, "conntail")
    events = WorkerKVEvents(srv.rpc_url, 4343, "conntail", tails=True)
    events.start()
    got: list = []
    try:
        k = mp.key("a", model="conntail", end=272)  # a chunk and a tail of one engine block
        assert ctx.submit_store(k, list(range(1, 18))).result(20)
        mp.wait_for(lambda: got.extend(events.take(_raw)) or len(got) >= 2, "two BlockStored")
        chunk, tail = _chunk_and_tail_hashes(mp.TOKENS, 272)
        assert [(kind, hashes, parent) for kind, _m, hashes, parent, _t in got] == [
            ("stored", [chunk], None),
            ("stored", [tail], chunk),
        ]
        assert got[1][4] == mp.TOKENS[256:272] and P.stored_block_size(got[1][4], [tail]) == 16
        assert c.call("clear", True) is None
        later: list = []
        mp.wait_for(lambda: later.extend(events.take(_raw)) or later, "BlockRemoved")
        assert [(kind, set(hashes)) for kind, _m, hashes, *_ in later] == [
            ("removed", {chunk, tail})
        ]
    finally:
        events.stop()
        ctx.close()
        c.close()
