"""``lmcache bench server --baselines``: what the run's numbers compare against, measured on
this host: the RPC ``noop`` round trip of the server under test, a bare ZeroMQ REQ/REP round
trip (in this process, and to a second process), and a 64 MiB memcpy (torch, and one libc
memcpy)."""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from typing import Any

# A REP echo in a process of its own: the same topology as the RPC (client and server are
# separate processes, each with its own ZeroMQ I/O thread).
_ECHO_CHILD = """
import sys, zmq
rep = zmq.Context.instance().socket(zmq.REP)
print(rep.bind_to_random_port("tcp://127.0.0.1"), flush=True)
while True:
    msg = rep.recv()
    if msg == b"stop":
        rep.send(b"")
        break
    rep.send(msg)
"""


def _stats(samples: list[float], nbytes: int) -> dict[str, float]:
    s = sorted(samples)
    p50 = s[len(s) // 2]
    p99 = s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]
    out = {"p50_ms": p50 * 1e3, "p99_ms": p99 * 1e3, "mean_ms": sum(s) / len(s) * 1e3}
    if nbytes:
        out["gbps"] = nbytes / p50 / 1e9 if p50 > 0 else 0.0
    return out


def _bare_round_trips(req: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        req.send(b"x")
        req.recv()
        out.append(time.perf_counter() - t0)
    return out


def measure_baselines(client: Any) -> dict[str, Any]:
    """Reference numbers for ``lmcache bench server``: the server's no-op RPC through
    ``client``, bare ZeroMQ REQ/REP round trips (one process and two) and 64 MiB host
    memcpy (all threads and one), each as ``_stats`` of its timings."""
    import subprocess

    import torch
    import zmq

    ctx = zmq.Context.instance()
    rep = ctx.socket(zmq.REP)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def echo() -> None:
        while not stop.is_set():
            if rep.poll(100):
                rep.send(rep.recv())

    th = threading.Thread(target=echo, daemon=True)
    th.start()
    req = ctx.socket(zmq.REQ)
    req.connect(f"tcp://127.0.0.1:{port}")
    child = subprocess.Popen([sys.executable, "-c", _ECHO_CHILD], stdout=subprocess.PIPE, text=True)
    req_x = ctx.socket(zmq.REQ)
    req_x.setsockopt(zmq.RCVTIMEO, 10000)
    try:
        assert child.stdout is not None
        req_x.connect(f"tcp://127.0.0.1:{int(child.stdout.readline())}")
        rtts, zrtts, xrtts = [], [], []
        # Blocks of the three alternate, so a host whose speed drifts weighs on all alike.
        for _ in range(10):
            for _ in range(50):
                t0 = time.perf_counter()
                client.noop()
                rtts.append(time.perf_counter() - t0)
            zrtts += _bare_round_trips(req, 50)
            xrtts += _bare_round_trips(req_x, 50)
        req_x.send(b"stop")
        req_x.recv()
    finally:
        req_x.close(0)
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        stop.set()
        th.join()
        req.close(0)
        rep.close(0)
    a = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    b = torch.empty_like(a)
    mts, one_thread = [], []
    for _ in range(20):
        t0 = time.perf_counter()
        b.copy_(a)  # torch may split it across its intra-op threads
        mts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ctypes.memmove(b.data_ptr(), a.data_ptr(), a.numel())  # one libc memcpy
        one_thread.append(time.perf_counter() - t0)
    return {
        "rpc_noop": _stats(rtts, 0),
        "bare_zmq_req_rep": _stats(zrtts, 0),
        "bare_zmq_req_rep_two_processes": _stats(xrtts, 0),
        "memcpy_64MiB": _stats(mts, 64 << 20),
        "memcpy_64MiB_one_thread": _stats(one_thread, 64 << 20),
    }
