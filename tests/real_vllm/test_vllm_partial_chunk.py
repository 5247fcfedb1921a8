"""partial_chunk inside a REAL vLLM (``vllm-cpu``): with 32-token blocks (its CPU attention
needs a multiple of 32) and the server's 256-token chunks, a prompt's tail past its last
whole chunk is stored and reused, so our hit is as long as vLLM's own prefix-cache hit
(block-granular), and the output is identical.

Run by ``nox -s vllm``; skipped where vLLM is not installed."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (run `nox -s vllm`)")

from real_vllm.test_vllm_cpu_e2e import GEN, run_vllm, same_output
from real_vllm.test_vllm_cpu_e2e import model_dir as _model_dir

from lmcache.integration.vllm.offline_runner import server_counters
from lmcache.integration.vllm.tiny_model import prompt_token_ids

model_dir = _model_dir  # the same tiny model (built once, cached)

CHUNK, BLOCK = 256, 32
PROMPT = prompt_token_ids(700, seed=21)
HIT = 672  # 700 floored to the block: two whole chunks (512) and a 160-token tail


def test_real_vllm_hit_is_block_granular_and_identical(model_dir, lmcache_server_module):
    srv = lmcache_server_module(
        "--l1-size-gb", "1", "--chunk-size", str(CHUNK), "--shm-name", f"vllm_pc_{os.getpid()}"
    )
    reqs = [{"label": "cold", "tokens": PROMPT, **GEN}, {"label": "hit", "tokens": PROMPT, **GEN}]
    ref = run_vllm(model_dir, reqs, prefix_caching=True, block_size=BLOCK)
    assert ref[1]["num_cached_tokens"] == HIT  # vLLM's own prefix cache, block for block

    before = server_counters(srv.http_url)["lmcache_mp_l1_write_chunks_total"]
    reqs[1]["wait_stored_chunks"] = {"http_url": srv.http_url, "at_least": before + 3}
    cold, hit = run_vllm(
        model_dir,
        reqs,
        block_size=BLOCK,
        connector={"port": srv.port, "transfer_mode": "engine_driven"},
        server_http=srv.http_url,
    )
    assert same_output(cold, ref[0])
    # two whole chunks and the tail came from the server: 672 tokens, as vLLM's own hit
    assert hit["server"]["lookup_hit_tokens"] == HIT
    assert hit["server"]["num_chunks_loaded"] == 3
    assert same_output(hit, ref[1])
