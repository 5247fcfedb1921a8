"""Failures of the S3 endpoint: the circuit breaker (opens after refused connections, closes
after a successful probe, re-arms with a doubled delay), request timeouts, close() with
requests in flight, and warnings that do not flood the log."""

from __future__ import annotations

import logging
import socket
import threading

import pytest
from testsupport.ports import free_port

from lmcache.storage.s3.breaker import CLOSED, HALF_OPEN, MAX_OPEN_SECONDS, OPEN, CircuitBreaker


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_a_success_resets_the_count():
    b = CircuitBreaker(3, 30, clock=FakeClock())
    assert not b.record_failure() and not b.record_failure()
    b.record_success()
    assert not b.record_failure() and not b.record_failure()
    assert b.allow() and b.state == CLOSED
    assert b.record_failure()  # the third in a row opens it
    assert not b.allow() and b.state == OPEN
    assert not b.record_failure()  # already open: nothing changes


def test_breaker_probes_once_after_the_delay_and_reopens_with_a_doubled_delay():
    clock = FakeClock()
    b = CircuitBreaker(1, 30, clock=clock)
    b.record_failure()
    assert b.snapshot() == {"state": OPEN, "consecutive_failures": 1, "reopen_in_s": 30.0}
    clock.now += 29
    assert not b.take_probe()
    clock.now += 1
    assert b.take_probe() and b.state == HALF_OPEN
    assert not b.take_probe() and not b.allow()  # one probe at a time; requests still refused
    b.probe_failed()
    assert b.snapshot()["reopen_in_s"] == 60.0
    for _ in range(5):
        clock.now += MAX_OPEN_SECONDS
        assert b.take_probe()
        b.probe_failed()
    assert b.snapshot()["reopen_in_s"] == MAX_OPEN_SECONDS  # capped
    clock.now += MAX_OPEN_SECONDS
    assert b.take_probe()
    b.probe_succeeded()
    assert b.allow() and b.snapshot()["consecutive_failures"] == 0
    b.record_failure()  # re-armed, with the base delay again
    assert b.snapshot()["reopen_in_s"] == 30.0


def _spec(port: int, **extra):
    return {
        "s3_endpoint": f"http://127.0.0.1:{port}",
        "s3_addressing_style": "path",
        "s3_bucket": "lmcache-kv",
        "s3_region": "us-east-1",
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
        "s3_num_io_threads": 2,
        **extra,
    }


def test_breaker_opens_after_three_refused_connections_and_closes_after_a_probe(
    h, adapters, start_moto
):
    port = free_port()  # nothing listens here yet: connections are refused
    a = h.build("s3", **_spec(port, s3_circuit_reset_seconds=0.5))
    adapters.append(a)
    keys = [h.key(i) for i in range(3)]
    bm = h.lookup(a, keys, timeout=120)
    assert bm.popcount() == 0
    st = a.report_status()
    assert st["breaker"]["state"] in (OPEN, HALF_OPEN)
    assert st["healthy"] is False and st["is_healthy"] is False
    assert "CONNECTION_REFUSED" in st["last_error"]
    assert f"127.0.0.1:{port}/lmcache-kv" in st["last_error"]
    assert st["last_error_time"] is not None

    # While open, work fails at once without a request.
    assert not h.store(a, keys[:1], [h.make_obj(100)]).is_successful()
    assert h.load(a, keys[:1], [h.make_obj(100)]).popcount() == 0
    with pytest.raises(RuntimeError, match="circuit-broken"):
        a.list_l2_keys()

    server = start_moto(port)  # the endpoint comes back
    server.client().create_bucket(Bucket="lmcache-kv")
    assert h.wait_until(lambda: a.report_status()["breaker"]["state"] == CLOSED, 60)
    assert h.store(a, keys[:1], [h.make_obj(4096, seed=3)]).is_successful()
    assert h.lookup(a, keys[:2]).get_indices_list() == [0]
    st = a.report_status()
    assert st["healthy"] is True and st["last_success_time"] >= st["last_error_time"]


class SilentServer:
    """Accepts connections and reads requests but never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def silent_server():
    srv = SilentServer()
    yield srv
    srv.close()


def test_a_request_past_the_timeout_is_cancelled_and_counts_as_a_failure(
    h, adapters, silent_server
):
    spec = _spec(silent_server.port, s3_request_timeout_seconds=1, s3_max_connection_failures=10)
    a = h.build("s3", **spec)
    adapters.append(a)
    assert h.lookup(a, [h.key(1)], timeout=60).test(0) is False
    dst = h.make_obj(4096, seed=-1)
    before = bytes(dst.byte_array)
    assert h.load(a, [h.key(1)], [dst], timeout=60).test(0) is False
    assert bytes(dst.byte_array) == before
    st = a.report_status()
    assert "timed out after 1 s" in st["last_error"]
    assert st["breaker"]["consecutive_failures"] >= 2  # (the start-up bucket check times out too)
    assert st["in_flight_requests"] == 0


def test_close_with_requests_in_flight_returns(h, silent_server):
    a = h.build("s3", **_spec(silent_server.port))
    a.submit_load_task([h.key(i) for i in range(4)], [h.make_obj(1024) for _ in range(4)])
    assert h.wait_until(lambda: a.report_status()["in_flight_requests"] >= 4)
    a.close()
    assert a.report_status()["in_flight_requests"] == 0


def test_repeated_failures_do_not_flood_the_log(h, moto, adapters, caplog):
    a = h.build("s3", **moto.spec("never-created-bucket"))
    adapters.append(a)
    with caplog.at_level(logging.WARNING, logger="lmcache.storage.s3.adapter"):
        for i in range(20):
            assert not h.store(a, [h.key(i)], [h.make_obj(64)]).is_successful()
    warnings = [r for r in caplog.records if "s3: PUT" in r.getMessage()]
    assert 1 <= len(warnings) <= 2
    assert "HTTP 404 NoSuchBucket" in warnings[0].getMessage()
    assert f"{moto.endpoint}/never-created-bucket/" in warnings[0].getMessage()
