"""What the connector does on the scheduler's critical path under online serving (issue 29):
the first ``get_num_new_matched_tokens`` of a request waits (boundedly) for its lookup
instead of costing the request an engine step, and a prompt whose every loadable token
vLLM's own prefix cache holds is not looked up, locked, stored again or given a session.
Driven in vLLM's call order against a real ``lmcache server``."""

from __future__ import annotations

import os
import threading

import httpx
import pytest
from lmc_vllm_harness import Engine

from lmcache.integration.vllm import scheduler_adapter
from lmcache.v1 import cpu_affinity


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(n)]


@pytest.fixture
def server(shared_server):
    r = httpx.post(
        shared_server.http_url + "/cache/clear", json={"tier": "l1", "force": True}, timeout=10
    )
    assert r.status_code == 200
    return shared_server


@pytest.fixture
def engines(server):
    made: list[Engine] = []

    def make(**kw) -> Engine:
        # whole chunks only: these tests count chunk ranges; test_vllm_connector_partial.py
        # covers the partial_chunk tails, on by default
        kw["extra"] = {"lmcache.mp.partial_chunk": "false", **(kw.get("extra") or {})}
        e = Engine(port=server.port, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def spy_ops(engine: Engine) -> list[str]:
    """The ops the scheduler's connector sends (pings aside)."""
    sent: list[str] = []
    client = engine.scheduler.scheduler_adapter.link.client
    real = client.submit

    def submit(op, *payloads):
        if op != "ping":
            sent.append(op)
        return real(op, *payloads)

    client.submit = submit
    return sent


def store(engines, prompt: list[int]) -> None:
    cold = engines()
    cold.add_request("cold", prompt)
    cold.run()
    assert cold.match_results["cold"][-1] == (0, False)


def test_first_ask_waits_for_the_lookup_instead_of_costing_a_step(server, engines, monkeypatch):
    # generous, so a loaded test host still answers within it (the default is 20 ms)
    monkeypatch.setattr(scheduler_adapter, "LOOKUP_WAIT_S", 10.0)
    prompt = tokens(600, seed=71)
    store(engines, prompt)
    warm = engines()
    warm.add_request("w", prompt)
    warm.run()
    # no "ask again" (None, True): the hit is known on the first call and loaded at once
    assert warm.match_results["w"] == [(512, False)]
    assert warm.loaded_ok["w"] == 512


def test_a_lookup_left_unanswered_still_answers_ask_again(server, engines, monkeypatch):
    """The wait gives up on a reply that brings no progress (as a lookup whose result never
    comes): the request is asked about again on later steps, as before."""
    monkeypatch.setattr(scheduler_adapter, "LOOKUP_WAIT_S", 10.0)
    prompt = tokens(600, seed=72)
    store(engines, prompt)
    warm = engines()
    adapter = warm.scheduler.scheduler_adapter
    adapter._advance_lookup = lambda t: None  # replies arrive but are never read
    warm.add_request("u", prompt)
    warm.step()
    assert warm.match_results["u"] == [(None, True)]
    warm.abort("u")
    warm.run()


def test_vllm_prefix_cache_holding_every_loadable_token_skips_the_server(server, engines):
    prompt = tokens(600, seed=73)
    store(engines, prompt)
    e = engines()
    sent = spy_ops(e)
    # vLLM's prefix cache holds 512 tokens: all the server could give (two 256-token chunks)
    e.add_request("apc", prompt, apc_tokens=512)
    e.run()
    assert e.match_results["apc"] == [(0, False)]
    # no lookup (nor locks to free), no second store of what vLLM computed, no session
    assert "lookup" not in sent and "free_lookup_locks" not in sent
    assert "end_session" not in sent
    assert not [r for m in e.metas for r in m.requests]
    assert e.finished_results["apc"] is False

    # holding less than that, the request is looked up and the rest is loaded
    e.add_request("part", prompt, apc_tokens=256)
    e.run()
    assert e.match_results["part"][-1] == (256, False)
    assert "lookup" in sent
    assert e.loaded_ok["part"] == 512  # [256, 512) loaded, byte-identical


def test_with_partial_chunk_the_skip_needs_vllm_to_hold_the_tail_too(server, engines):
    """With tails (the default) the server can give up to the prompt's last whole block, so
    vLLM holding only the whole chunks is no reason to skip the lookup."""
    partial = {"lmcache.mp.partial_chunk": "true"}
    prompt = tokens(600, seed=75)
    cold = engines(extra=partial)
    cold.add_request("cold", prompt)
    cold.run()
    e = engines(extra=partial)
    sent = spy_ops(e)
    e.add_request("chunks", prompt, apc_tokens=512)
    e.run()
    assert e.match_results["chunks"][-1] == (80, False)  # the tail [512, 592) comes from us
    assert "lookup" in sent
    sent.clear()
    e.add_request("all", prompt, apc_tokens=592)
    e.run()
    assert e.match_results["all"] == [(0, False)]
    assert "lookup" not in sent


def test_a_prompt_past_vllm_prefix_cache_still_stores_its_new_chunks(server, engines):
    """Skipping the lookup skips re-storing what vLLM's prefix cache held, not the chunks
    computed after it."""
    prompt = tokens(600, seed=74)
    store(engines, prompt[:300])  # the server holds chunk 0 only
    e = engines()
    e.add_request("more", prompt, apc_tokens=256)  # vLLM holds chunk 0: the lookup still runs
    e.run()
    stores = [(r.op.start, r.op.end) for m in e.metas for r in m.requests if r.direction == "STORE"]
    assert stores == [(256, 512)]


def test_worker_threads_move_to_the_cores_vllm_left_spare(monkeypatch):
    """A worker pinned narrower than its parent (vLLM's CPU worker on its compute cores)
    starts our threads on the parent's other cores; unpinned, they stay where they are."""
    parent = {0, 1, 2, 3}
    masks = {os.getpid(): {0}, os.getppid(): parent, 4242: {1}, 4243: set(parent)}
    moved: dict[int, set[int]] = {}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(masks[pid]))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: moved.update({pid: cpus}))
    monkeypatch.setattr(cpu_affinity, "_children", lambda pid: [os.getpid(), 4242, 4243])
    monkeypatch.setattr(cpu_affinity, "_enabled", False)

    assert cpu_affinity.move_to_spare_cpus() == frozenset()  # not enabled: nothing moves
    assert moved == {}
    cpu_affinity.enable()
    # another rank's worker (4242) computes on CPU 1; 4243 is not pinned
    assert cpu_affinity.spare_cpus() == {2, 3}
    got: list[frozenset[int]] = []
    t = threading.Thread(target=lambda: got.append(cpu_affinity.move_to_spare_cpus()))
    t.start()
    t.join()
    assert got == [frozenset({2, 3})] and moved == {0: frozenset({2, 3})}

    masks[os.getpid()] = set(parent)  # not pinned narrower than the parent
    assert cpu_affinity.spare_cpus() == frozenset()
