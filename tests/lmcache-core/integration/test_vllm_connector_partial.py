"""The connector with ``partial_chunk`` (its default) in vLLM's call order against a real
``lmcache server``: a prompt's tail past its last whole chunk is stored and reused at vLLM
block granularity (docs/vllm.md, "Chunks and blocks")."""

from __future__ import annotations

import time

import httpx
import pytest
from lmc_vllm_harness import Engine

OFF = {"lmcache.mp.partial_chunk": "false"}


def tokens(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 1 for i in range(n)]


def l1(srv) -> dict:
    return httpx.get(srv.http_url + "/status", timeout=5).json()["storage_manager"]["l1"]


def no_locks(srv) -> bool:
    """No lookup lock outlives its request (end_session may still be on its way)."""
    deadline = time.monotonic() + 10
    while int(l1(srv)["read_locked_count"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(l1(srv)["read_locked_count"]) == 0


def stores(e: Engine, rid: str) -> list[tuple[int, int]]:
    return [
        (r.op.start, r.op.end)
        for m in e.metas
        for r in m.requests
        if r.direction == "STORE" and r.request_id == rid
    ]


@pytest.fixture
def engines(shared_server):
    made: list[Engine] = []
    r = httpx.post(
        shared_server.http_url + "/cache/clear", json={"tier": "l1", "force": True}, timeout=10
    )
    assert r.status_code == 200

    def make(**kw) -> Engine:
        e = Engine(port=shared_server.port, num_blocks=256, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def test_3000_token_prompt_hits_2992_tokens_byte_identical(shared_server, engines):
    prompt = tokens(3000)
    cold = engines()
    cold.add_request("a", prompt)
    cold.run()
    # 11 whole chunks and the tail (3000 floored to the 16-token block) in one store
    assert stores(cold, "a") == [(0, 2992)]

    warm = engines()
    warm.add_request("b", prompt)
    warm.run()
    assert warm.match_results["b"][-1] == (2992, False)  # vLLM's prefix cache would reuse 2992
    assert warm.loaded_ok["b"] == 2992  # every loaded token byte-identical
    assert stores(warm, "b") == []  # the tail is there already

    # the next turn: the prompt grows; chunk 11 becomes whole and the new tail goes along
    turn = engines()
    turn.add_request("c", prompt + tokens(100, seed=7))
    turn.run()
    assert turn.match_results["c"][-1] == (2992, False)
    assert turn.loaded_ok["c"] == 2992
    assert stores(turn, "c") == [(2816, 3088)]

    # with the feature off the same prompt reuses whole chunks only (LMCache 0.5.6)
    old = engines(extra=OFF)
    old.add_request("d", prompt)
    old.run()
    assert old.match_results["d"][-1] == (2816, False)
    assert old.loaded_ok["d"] == 2816
    for rid, e in (("b", warm), ("c", turn), ("d", old)):
        assert not e.load_failed, rid
    assert no_locks(shared_server)


def test_prompt_shorter_than_a_chunk_reuses_its_blocks(shared_server, engines):
    prompt = tokens(200, seed=3)
    cold = engines()
    cold.add_request("s", prompt)
    cold.run()
    assert stores(cold, "s") == [(0, 192)]
    warm = engines()
    warm.add_request("t", prompt)
    warm.run()
    assert warm.match_results["t"][-1] == (192, False)
    assert warm.loaded_ok["t"] == 192
    # a hit that covers the whole prompt still leaves vLLM its last token to compute
    exact = engines()
    exact.add_request("u", prompt[:192])
    exact.run()
    assert exact.match_results["u"][-1] == (176, False)
    assert exact.loaded_ok["u"] == 176
    assert no_locks(shared_server)


@pytest.mark.parametrize("mla", [False, True])
def test_tp2_and_mla_tp2_load_the_tail_on_every_rank(shared_server, engines, mla):
    prompt = tokens(600, seed=11 + mla)
    cold = engines(tp=2, mla=mla)
    cold.add_request("p", prompt)
    cold.run()
    assert stores(cold, "p") == [(0, 592)]
    warm = engines(tp=2, mla=mla)
    warm.add_request("q", prompt)
    warm.run()
    assert warm.match_results["q"][-1] == (592, False)
    assert warm.loaded_ok["q"] == 592  # on both ranks (MLA: both read rank 0's copy)
    assert not warm.load_failed
    assert no_locks(shared_server)
