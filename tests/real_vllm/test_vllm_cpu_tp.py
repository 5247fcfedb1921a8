"""Tensor parallelism for real: vLLM CPU with ``tensor_parallel_size=2`` through the connector.

vLLM runs one worker process per TP rank (its ``mp`` executor, gloo between the ranks), each
pinned to one core (``VLLM_CPU_OMP_THREADS_BIND=0|1``: vLLM's default ``auto`` binding wants one
NUMA node per rank and stops on a one-node host). Each rank registers with the server as KV
worker ``rank`` of 2 and stores and loads its own half of the KV heads; the scheduler's lookup
counts a chunk only when every rank stored it. Checked here: the tokens and logprobs equal
vLLM alone with the same TP (cold run: vLLM without a cache; hits: vLLM's own prefix-cache hit),
and the server hands each of the two ranks its own chunks, in the same and in a new process.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (run `nox -s vllm`)")

from prometheus_client.parser import text_string_to_metric_families
from testsupport.ports import free_port
from testsupport.real_vllm import run_vllm, tiny_model_dir
from testsupport.waiting import eventually

from lmcache.integration.vllm.offline_runner import stored_chunks
from lmcache.integration.vllm.tiny_model import TinyLlama, prompt_token_ids

TP = 2
needs_a_core_per_rank = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < TP,
    reason=f"tensor parallelism on vLLM CPU pins one core per rank: needs {TP} cores",
)

CHUNK = 256
PROMPT_TOKENS = 600  # two whole chunks (512) for us, four 128-token blocks (512) for vLLM
CACHED_TOKENS = 512
CHUNKS = CACHED_TOKENS // CHUNK
GEN = {"max_tokens": 6, "logprobs": 5}
# 4 query and 2 KV heads: each rank holds 2 query heads and 1 KV head
MODEL = TinyLlama(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2)
# one core per rank, for vLLM alone and with the connector alike (docs/vllm.md, "Tensor parallelism")
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
SPEC = {"tensor_parallel_size": TP, "enforce_eager": True}
PROMPT = prompt_token_ids(PROMPT_TOKENS, seed=29)
# PROMPT and 300 tokens more: its hit loads [0, 512) and stores [512, 768) in the same step, so
# the ranks run their failed-load agreement (a collective over vLLM's TP group) in that step
LONGER = PROMPT + prompt_token_ids(300, seed=30)


def vllm_tp_shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("vllm_dist_") and "cpushm" in n}


@pytest.fixture(scope="module", autouse=True)
def remove_vllm_tp_shm() -> Iterator[None]:
    """vLLM's CPU all-reduce (``_CPUSHMDistributed``) leaves its two 4 MiB ``/dev/shm`` segments
    behind when vLLM kills its workers at shutdown: remove those our runs made."""
    before = vllm_tp_shm()
    yield
    for name in vllm_tp_shm() - before:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/dev/shm", name))


@pytest.fixture(scope="module")
def model_dir() -> str:
    return tiny_model_dir("tiny-llama-2l", MODEL)


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[str, dict]:
    """vLLM alone with the same TP and its prefix cache: the prompt, the longer prompt and the
    prompt again; the last two hit vLLM's cache for the same 512 tokens as ours."""
    requests = [
        {"label": "cold", "tokens": PROMPT, **GEN},
        {"label": "longer", "tokens": LONGER, **GEN},
        {"label": "hit", "tokens": PROMPT, **GEN},
    ]
    results = {
        r["label"]: r for r in run_vllm(model_dir, requests, ENV, prefix_caching=True, **SPEC)
    }
    assert results["longer"]["num_cached_tokens"] == CACHED_TOKENS
    assert results["hit"]["num_cached_tokens"] == CACHED_TOKENS
    return results


@pytest.fixture(scope="module")
def server(lmcache_server_module):
    return lmcache_server_module(
        "--l1-size-gb", "1", "--chunk-size", str(CHUNK), "--shm-name", f"vllm_tp_{os.getpid()}"
    )


def per_worker(http_url: str, counter: str) -> dict[str, float]:
    """A server counter by its ``worker_id`` label (a worker's instance id)."""
    with urllib.request.urlopen(http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == counter and "worker_id" in sample.labels:
                wid = sample.labels["worker_id"]
                out[wid] = out.get(wid, 0.0) + sample.value
    return out


def loaded_by_worker_since(server, before: dict[str, float]) -> dict[str, float]:
    now = per_worker(server.http_url, "lmcache_mp_num_chunks_loaded_total")
    return {w: n - before.get(w, 0.0) for w, n in now.items() if n - before.get(w, 0.0)}


def same_output(got: dict, want: dict) -> bool:
    return got["token_ids"] == want["token_ids"] and got["logprobs"] == want["logprobs"]


@needs_a_core_per_rank
def test_tp2_each_rank_stores_and_loads_its_shard_and_tokens_match_vllm_alone(
    model_dir, reference, server
):
    connector = {"port": server.port, "transfer_mode": "engine_driven"}
    before = per_worker(server.http_url, "lmcache_mp_num_chunks_loaded_total")
    cold, longer = run_vllm(
        model_dir,
        [
            {"label": "cold", "tokens": PROMPT, **GEN},
            {
                "label": "longer",
                "tokens": LONGER,
                **GEN,
                # both ranks' stores landed: a lookup counts a chunk only when all ranks have it
                "wait_stored_chunks": {"http_url": server.http_url, "at_least": TP * CHUNKS},
            },
        ],
        ENV,
        connector=connector,
        server_http=server.http_url,
        **SPEC,
    )
    assert cold["server"]["num_chunks_loaded"] == 0
    assert cold["server"]["l1_write_chunks"] == TP * CHUNKS  # each rank stored its shard
    assert same_output(cold, reference["cold"])
    assert longer["server"]["lookup_hit_tokens"] == CACHED_TOKENS
    assert longer["server"]["num_chunks_loaded"] == TP * CHUNKS
    assert same_output(longer, reference["longer"])
    # both ranks of this engine loaded their own two chunks
    assert sorted(loaded_by_worker_since(server, before).values()) == [CHUNKS] * TP
    # and both stored the longer prompt's third chunk and its tail [768, 896) up to its last
    # whole 128-token block (partial_chunk): its load succeeded on every rank
    eventually(
        lambda: stored_chunks(server.http_url) == TP * (CHUNKS + 2),
        f"both ranks stored chunk [512, 768) and the tail ({TP * (CHUNKS + 2)} objects in all)",
        timeout=30,
    )

    before = per_worker(server.http_url, "lmcache_mp_num_chunks_loaded_total")
    (again,) = run_vllm(
        model_dir,
        [{"label": "new-process", "tokens": PROMPT, **GEN}],
        ENV,
        connector=connector,
        server_http=server.http_url,
        **SPEC,
    )
    assert again["server"]["num_chunks_loaded"] == TP * CHUNKS
    assert same_output(again, reference["hit"])
    assert sorted(loaded_by_worker_since(server, before).values()) == [CHUNKS] * TP


# One TP rank of a real vLLM process group (gloo on loopback): what the connector's failed-load
# agreement answers on this rank.
AGREEMENT_RANK = textwrap.dedent(
    """
    import json, sys
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        init_distributed_environment, initialize_model_parallel)
    from lmcache.integration.vllm.lmcache_mp_connector import _tp_failed_load_agreement

    rank, port, failed_here = int(sys.argv[1]), sys.argv[2], set(json.loads(sys.argv[3]))
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=2, rank=rank, local_rank=rank, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tensor_model_parallel_size=2)
    agree = _tp_failed_load_agreement(2)
    print("AGREED", json.dumps(sorted(agree(["a", "b", "c"], failed_here))), flush=True)
    """
)


def test_failed_load_agreement_is_the_union_over_vllms_tp_group():
    """A synchronous load that failed on one rank drops the stores of that step on every rank
    (tests/lmcache-core/integration: test_tp_ranks_drop_stores_...); here the collective that
    tells the ranks, over a real vLLM TP group of two processes."""
    port = free_port()
    env = {**os.environ, "VLLM_DIST_IDENT": f"vllm_dist_lmc_tp_{os.getpid()}"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", AGREEMENT_RANK, str(rank), str(port), json.dumps(failed)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank, failed in enumerate([["a"], ["c"]])
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]
        agreed = [line for line in out.splitlines() if line.startswith("AGREED ")]
        assert agreed == ['AGREED ["a", "c"]'], out[-4000:]
