"""The loop thread runs an engine-driven bookkeeping op (prepare/commit on the SHM path)
itself only when its peer's affinity slot has nothing queued, so a peer's ops still run in
the order it sent them (docs/design/protocol.md#server-threads: AFFINITY ops are FIFO per slot); a
request's teardown (free_lookup_locks, end_session) runs there too, so a busy normal pool does not
hold it up. A real server loop over real sockets, with a recording engine in place of the
cache engine."""

from __future__ import annotations

import threading
import types

import pytest

from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.client import MPClient
from lmcache.v1.multiprocess.server import MPCacheServer


class _RecordingEngine:
    """Records which op ran on which thread; ``retrieve`` blocks until released."""

    def __init__(self) -> None:
        self.config = types.SimpleNamespace(
            host="127.0.0.1", port=0, max_gpu_workers=1, max_cpu_workers=2
        )
        self.metrics = types.SimpleNamespace(observe=lambda *a, **k: None, inc=lambda *a, **k: None)
        self.release = threading.Event()
        self.ran: list[tuple[str, str]] = []
        self.handlers = {
            "noop": lambda ctx: "OK",
            "retrieve": self._blocking,
            "clear": self._blocking,
            "prepare_store": self._record("prepare_store"),
            "commit_retrieve": self._record("commit_retrieve"),
            "end_session": self._record("end_session", None),
            "free_lookup_locks": self._record("free_lookup_locks", None),
        }

    def _record(self, name, result=True):
        def handler(ctx, *args):
            self.ran.append((name, threading.current_thread().name))
            return result

        return handler

    def _blocking(self, ctx, *args):
        assert self.release.wait(20)
        self.ran.append(("blocking op", threading.current_thread().name))
        return (b"", True)

    def runs_inline(self, op, args):
        return op in ("prepare_store", "commit_retrieve")


def _key(rid: str) -> P.IPCCacheServerKey:
    return P.IPCCacheServerKey(
        model_name="m",
        world_size=1,
        worker_id=0,
        token_ids=list(range(256)),
        start=0,
        end=256,
        request_id=rid,
        num_kv_readers=1,
    )


@pytest.fixture
def served():
    """(recording engine, client of a real server loop in front of it)."""
    engine = _RecordingEngine()
    server = MPCacheServer(engine)  # type: ignore[arg-type]
    client = MPClient(server.start(), default_timeout=20)
    try:
        yield engine, client
    finally:
        engine.release.set()
        client.close()
        server.stop()


def test_bookkeeping_ops_run_inline_only_behind_an_idle_slot(served):
    engine, client = served
    # idle slot: the op runs on the loop thread
    assert client.call("prepare_store", _key("a"), 1) is True
    assert engine.ran == [("prepare_store", "mq-server-thread")]

    # busy slot: a transfer of this peer blocks on the slot's thread
    slow = client.submit("retrieve", _key("b"), 1, [[0]])
    queued = client.submit("commit_retrieve", _key("b"), 1)
    # the loop handles a peer's messages in order: once this SYNC op is answered, both
    # ops above were dispatched
    assert client.call("noop") == "OK"
    assert [name for name, _ in engine.ran] == ["prepare_store"]  # nothing overtook
    engine.release.set()
    assert slow.result(20) == [b"", True]
    assert queued.result(20) is True
    assert [name for name, _ in engine.ran] == [
        "prepare_store",
        "blocking op",
        "commit_retrieve",
    ]
    assert engine.ran[2][1].startswith("mp-affinity-0")  # queued behind it, same slot

    # the slot is idle again: inline once more
    assert client.call("commit_retrieve", _key("c"), 1) is True
    assert engine.ran[3] == ("commit_retrieve", "mq-server-thread")


def test_request_teardown_is_answered_while_the_normal_pool_is_busy(served):
    engine, client = served
    # both normal-pool threads (max_cpu_workers=2) block in a clear
    clears = [client.submit("clear", True) for _ in range(2)]
    assert client.call("free_lookup_locks", _key("a"), 1, timeout=10) is None
    assert client.call("end_session", "a", timeout=10) is None
    assert engine.ran == [
        ("free_lookup_locks", "mq-server-thread"),
        ("end_session", "mq-server-thread"),
    ]
    engine.release.set()
    assert [f.result(20) for f in clears] == [[b"", True]] * 2
