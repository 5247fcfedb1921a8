"""MPClient's ways of receiving a reply, against a ROUTER the test answers by hand.

``call`` sends and receives in the calling thread while it holds the socket (a blocking
ZeroMQ receive, at most ``_FAST_WAIT_S``); replies to other requests that it receives go
to their futures; other threads' requests still go out while it waits; a slower reply
falls back to the polling thread; the polling thread watches the socket again for
asynchronous requests after any number of synchronous calls; and ``call`` busy-polls for a
reply only as long as replies to that op come within its window (``SpinPolicy``).
"""

from __future__ import annotations

import threading

import msgspec
import pytest
import zmq
from testsupport.waiting import eventually

from lmcache.v1.multiprocess import protocol as P
from lmcache.v1.multiprocess.client import (
    SPIN_ENV,
    LMCacheTimeoutError,
    MPClient,
    RemoteError,
    SpinPolicy,
)


class _HandRouter:
    """A server that answers only when the test says so."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.url = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    def request(self, timeout_s: float = 10.0) -> list[bytes]:
        assert self.sock.poll(int(timeout_s * 1000)), "no request arrived"
        return self.sock.recv_multipart()

    def answer(self, req: list[bytes], value: object = None) -> None:
        frames = req[:3]
        if value is not None:
            frames.append(msgspec.msgpack.encode(value) if not isinstance(value, bytes) else value)
        self.sock.send_multipart(frames)

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture
def router():
    r = _HandRouter()
    yield r
    r.close()


@pytest.fixture
def client(router):
    c = MPClient(router.url, default_timeout=10)
    yield c
    c.close()


def _op_of(req: list[bytes]) -> object:
    return msgspec.msgpack.decode(req[2])


def _call_in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_call_gets_its_reply_and_resolves_replies_to_other_requests(router, client):
    seen = []
    fut = client.submit("noop")
    fut.add_done_callback(lambda f: seen.append(f.result(0)))
    req_async = router.request()
    t, out = _call_in_thread(client.call, "get_chunk_size")
    req_sync = router.request()
    assert _op_of(req_async) == 24 and _op_of(req_sync) == 21
    router.answer(req_async, "A")  # arrives while the call holds the socket
    router.answer(req_sync, 256)
    t.join(10)
    assert out == {"value": 256}
    assert fut.result(5) == "A" and seen == ["A"]
    assert client.pending_count() == 0


def test_a_reply_slower_than_the_fast_window_still_arrives(router, client):
    t, out = _call_in_thread(client.call, "noop")
    req = router.request()
    threading.Event().wait(0.3)  # well past the 5 ms the call receives for itself
    router.answer(req, "late but fine")
    t.join(10)
    assert out == {"value": "late but fine"}
    assert client.pending_count() == 0


def test_other_threads_requests_go_out_while_a_call_waits(router, client):
    t, out = _call_in_thread(client.call, "noop")
    req_sync = router.request()
    fut = client.submit("get_chunk_size")  # from this thread, while the call waits
    req_async = router.request()
    assert _op_of(req_async) == 21
    router.answer(req_async, 256)
    assert fut.result(5) == 256
    assert t.is_alive()  # the call still waits for its own reply
    router.answer(req_sync, "OK")
    t.join(10)
    assert out == {"value": "OK"}


def test_call_timeout_forgets_the_request_and_a_late_reply_is_dropped(router, client):
    t, out = _call_in_thread(client.call, "noop", timeout=0.2)
    req = router.request()
    t.join(10)
    assert isinstance(out.get("error"), LMCacheTimeoutError)
    assert client.pending_count() == 0
    router.answer(req, "LATE")
    t2, out2 = _call_in_thread(client.call, "noop")
    req2 = router.request()
    assert req2[1] != req[1]
    router.answer(req2, "OK")
    t2.join(10)
    assert out2 == {"value": "OK"}


def test_call_raises_error_replies_and_rejects_a_wrong_op_echo(router, client):
    t, out = _call_in_thread(client.call, "noop")
    req = router.request()
    router.answer(req, P.encode(P.RemoteError("INTERNAL", "boom", True)))
    t.join(10)
    err = out.get("error")
    assert isinstance(err, RemoteError) and err.code == "INTERNAL" and err.message == "boom"
    t, out = _call_in_thread(client.call, "noop")
    req = router.request()
    router.sock.send_multipart([req[0], req[1], msgspec.msgpack.encode(21), b"\x01"])
    t.join(10)
    assert isinstance(out.get("error"), RemoteError) and out["error"].code == "BAD_REQUEST"


def test_async_replies_reach_their_callbacks_after_synchronous_calls(router, client):
    """Synchronous calls take the socket away from the polling thread; an asynchronous
    request afterwards must be watched again, or its callback would never run."""
    for i in range(5):
        t, out = _call_in_thread(client.call, "noop")
        router.answer(router.request(), i)
        t.join(10)
        assert out == {"value": i}
    done = threading.Event()
    fut = client.submit("noop")
    fut.add_done_callback(lambda f: done.set())
    router.answer(router.request(), "async")
    assert done.wait(10), "the polling thread never received the reply"
    assert fut.result(0) == "async"


def test_call_on_a_closed_client_raises(router):
    c = MPClient(router.url, default_timeout=1)
    c.close()
    with pytest.raises(ConnectionError):
        c.call("noop")


def test_spin_policy_backs_an_op_off_exponentially_and_a_caught_reply_resets_it():
    policy = SpinPolicy(500)
    pattern = []
    for _ in range(200):
        if policy.should_poll(b"store"):
            pattern.append("P")
            policy.record(b"store", caught=False)
        else:
            pattern.append(".")
    polls = [i for i, x in enumerate(pattern) if x == "P"]
    gaps = [b - a - 1 for a, b in zip(polls, polls[1:], strict=False)]
    assert gaps[:8] == [1, 2, 4, 8, 16, 32, 64, 64]  # calls skipped after each miss
    assert policy.should_poll(b"noop")  # per op: another op still polls
    while not policy.should_poll(b"store"):
        pass
    policy.record(b"store", caught=True)
    assert all(policy.should_poll(b"store") for _ in range(10))  # a catch resets the penalty
    stats = policy.stats()
    assert stats["spin_us"] == 500 and stats["caught"] == 1
    assert stats["polled"] == len(polls) + 1 and stats["skipped"] == pattern.count(".") + 64
    off = SpinPolicy(0)
    assert not any(off.should_poll(b"noop") for _ in range(5))
    assert off.stats()["skipped"] == 0  # off is not skipping


def test_call_polls_for_a_quick_reply_and_backs_off_after_a_missed_window(router):
    c = MPClient(router.url, default_timeout=10, spin_us=1e6)
    try:
        t, out = _call_in_thread(c.call, "noop")  # the first call may find the socket unopened
        router.answer(router.request(), "warm-up")
        t.join(10)
        c.spin = SpinPolicy(1e6)
        t, out = _call_in_thread(c.call, "noop")
        router.answer(router.request(), "quick")  # well within the 1 s window
        t.join(10)
        assert out == {"value": "quick"}
        assert (c.spin.polled, c.spin.caught) == (1, 1)
        c.spin = SpinPolicy(200)
        t, out = _call_in_thread(c.call, "noop")
        req = router.request()
        eventually(lambda: c.spin.polled == 1, "the call to give up polling")
        router.answer(req, "slow")  # only after the window is over: a miss
        t.join(10)
        assert out == {"value": "slow"} and (c.spin.polled, c.spin.caught) == (1, 0)
        t, out = _call_in_thread(c.call, "noop")
        router.answer(router.request(), "not polled")
        t.join(10)
        assert out == {"value": "not polled"} and c.spin.skipped == 1 and c.spin.polled == 1
        t, out = _call_in_thread(c.call, "get_chunk_size")  # another op polls as before
        req = router.request()
        eventually(lambda: c.spin.polled == 2, "the other op to poll")
        router.answer(req, 256)
        t.join(10)
        assert out == {"value": 256}
    finally:
        c.close()


@pytest.mark.parametrize(
    ("env", "arg", "named"),
    [
        ("fast", None, SPIN_ENV),
        ("-5", None, SPIN_ENV),
        (None, -1.0, "spin_us"),
        (None, 2e6, "spin_us"),
    ],
)
def test_a_bad_spin_window_is_refused_with_its_source_and_the_fix(monkeypatch, env, arg, named):
    if env is None:
        monkeypatch.delenv(SPIN_ENV, raising=False)
    else:
        monkeypatch.setenv(SPIN_ENV, env)
    with pytest.raises(ValueError, match=rf"{named}=.*0\.\.1e\+06.* 0 to never busy-poll"):
        MPClient("tcp://127.0.0.1:1", spin_us=arg)


def test_the_spin_window_comes_from_the_environment(monkeypatch, router):
    monkeypatch.setenv(SPIN_ENV, "0")
    c = MPClient(router.url, default_timeout=10)
    try:
        t, out = _call_in_thread(c.call, "noop")
        router.answer(router.request(), "x")
        t.join(10)
        assert out == {"value": "x"} and c.spin.stats()["polled"] == 0
    finally:
        c.close()
    monkeypatch.setenv(SPIN_ENV, " ")
    c = MPClient(router.url, default_timeout=10)
    c.close()
    assert c.spin.stats()["spin_us"] == 500
