"""Run vLLM offline (``vllm.LLM``) in this process, with or without ``LMCacheMPConnector``.

One process is one vLLM engine, so "a new process hits the cache" is a new run of this
module. The end-to-end session (``nox -s vllm``) and ``lmcache bench vllm`` drive it:

    python -m lmcache.integration.vllm.offline_runner --spec '{...}'

The spec (JSON):

* ``model``: a model folder (e.g. from :mod:`lmcache.integration.vllm.tiny_model`);
* ``connector``: null for plain vLLM, else ``{"port": 5555, "host": "tcp://127.0.0.1",
  "transfer_mode": "engine_driven" | "lmcache_driven"}`` (more ``lmcache.mp.*`` keys in
  ``extra``);
* ``prefix_caching``: vLLM's own prefix cache (default false: every hit is ours);
* ``server_http``: the server's HTTP URL: each request then reports what the server's
  counters did during it (``chunks_loaded``, ``lookup_hit_tokens``, ``l1_write_chunks``);
* ``kv_events_config``: vLLM's ``--kv-events-config`` as an object (optional; vLLM then
  publishes its KV events, ours from ``take_events`` among them);
* ``max_model_len``, ``dtype``, ``enforce_eager``, ``block_size`` (vLLM's tokens per KV block)
  (optional);
* ``tensor_parallel_size`` (optional, default 1): vLLM's ``--tensor-parallel-size``; above 1
  vLLM runs one worker process per rank (its ``mp`` executor);
* ``requests``: ``[{"label", "tokens": [ids], "max_tokens": 1, "logprobs": 0,
  "wait_stored_chunks": {"http_url", "at_least"}}]``, run one after another; the wait
  (before the request) polls the server's ``/metrics`` until
  ``lmcache_mp_l1_write_chunks_total`` reaches ``at_least``, so a hit in the same
  process does not race the store of the request before.

The last stdout line is ``LMCACHE_RUNNER_RESULT <json>``: per request its label,
generated token ids, the logprob of each generated token and of the top candidates, and
the wall time of its ``generate`` call (with ``max_tokens`` 1 that is the time to first
token, prefill included).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from typing import Any

RESULT_PREFIX = "LMCACHE_RUNNER_RESULT "
CONNECTOR_MODULE = "lmcache.integration.vllm.lmcache_mp_connector"


def kv_transfer_config(connector: dict[str, Any]) -> dict[str, Any]:
    extra = {
        "lmcache.mp.host": connector.get("host", "tcp://127.0.0.1"),
        "lmcache.mp.port": str(connector["port"]),
    }
    if connector.get("transfer_mode"):
        extra["lmcache.mp.mp_transfer_mode"] = connector["transfer_mode"]
    extra.update(connector.get("extra") or {})
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


COUNTERS = (
    "lmcache_mp_l1_write_chunks_total",
    "lmcache_mp_num_chunks_loaded_total",
    "lmcache_mp_lookup_hit_tokens_total",
)


def server_counters(http_url: str) -> dict[str, float]:
    """Totals (over all label sets) of the server counters a run reports, from ``/metrics``."""
    with urllib.request.urlopen(http_url.rstrip("/") + "/metrics", timeout=5) as r:
        text = r.read().decode()
    totals = dict.fromkeys(COUNTERS, 0.0)
    for m in re.finditer(r"^(lmcache_mp_\w+_total)(?:\{[^}]*\})? (\S+)$", text, re.M):
        if m.group(1) in totals:
            totals[m.group(1)] += float(m.group(2))
    return totals


def stored_chunks(http_url: str) -> float:
    return server_counters(http_url)["lmcache_mp_l1_write_chunks_total"]


def wait_stored(http_url: str, at_least: float, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while stored_chunks(http_url) < at_least:
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the server at {http_url} stored fewer than {at_least} chunks in {timeout} s"
            )
        time.sleep(0.05)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "tokenizer": spec["model"],
        "dtype": spec.get("dtype", "bfloat16"),
        "max_model_len": int(spec.get("max_model_len", 4096)),
        "enable_prefix_caching": bool(spec.get("prefix_caching", False)),
        "seed": 0,
        "enforce_eager": bool(spec.get("enforce_eager", False)),
    }
    tp = int(spec.get("tensor_parallel_size", 1))
    if tp > 1:
        kwargs["tensor_parallel_size"] = tp
        kwargs["distributed_executor_backend"] = "mp"
    if spec.get("block_size"):  # vLLM's --block-size (tokens per KV block)
        kwargs["block_size"] = int(spec["block_size"])
    if spec.get("connector"):
        kwargs["kv_transfer_config"] = kv_transfer_config(spec["connector"])
    if spec.get("kv_events_config"):  # vLLM's --kv-events-config, as a JSON object
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**spec["kv_events_config"])
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - t0
    out = []
    for req in spec["requests"]:
        wait = req.get("wait_stored_chunks")
        if wait:
            wait_stored(wait["http_url"], float(wait["at_least"]))
        params = SamplingParams(
            temperature=0.0,
            max_tokens=int(req.get("max_tokens", 1)),
            logprobs=int(req.get("logprobs", 0)) or None,
            ignore_eos=True,
        )
        http_url = spec.get("server_http")
        before = server_counters(http_url) if http_url else {}
        t0 = time.perf_counter()
        result = llm.generate(
            [TokensPrompt(prompt_token_ids=list(req["tokens"]))], params, use_tqdm=False
        )[0]
        seconds = time.perf_counter() - t0
        completion = result.outputs[0]
        logprobs = []
        for token, candidates in zip(completion.token_ids, completion.logprobs or [], strict=False):
            logprobs.append(
                {
                    "token": float(candidates[token].logprob),
                    "top": {str(t): float(lp.logprob) for t, lp in candidates.items()},
                }
            )
        out.append(
            {
                "label": req.get("label", ""),
                "token_ids": list(completion.token_ids),
                "logprobs": logprobs,
                "seconds": seconds,
                # prompt tokens vLLM's own prefix cache supplied (None where vLLM omits it)
                "num_cached_tokens": getattr(result, "num_cached_tokens", None),
                # what the server did meanwhile: loads are done before vLLM computes, so
                # chunks_loaded is final; stores finish later (see wait_stored_chunks)
                "server": {
                    name.removeprefix("lmcache_mp_").removesuffix("_total"): now - before[name]
                    for name, now in (server_counters(http_url) if http_url else {}).items()
                },
            }
        )
    return {"startup_s": startup_s, "requests": out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="the run as JSON (see the module doc)")
    args = parser.parse_args(argv)
    result = run(json.loads(args.spec))
    sys.stdout.flush()
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


def parse_result(stdout: str) -> dict[str, Any]:
    """The result of a run from its stdout (the last ``LMCACHE_RUNNER_RESULT`` line)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise ValueError("the vLLM run printed no result line; see its output above")


if __name__ == "__main__":
    sys.exit(main())
