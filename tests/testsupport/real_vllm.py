"""Helpers of the real-vLLM tests (tests/real_vllm): the tiny model's folder and one
vLLM engine run in its own process (:mod:`lmcache.integration.vllm.offline_runner`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from lmcache.integration.vllm.offline_runner import parse_result
from lmcache.integration.vllm.tiny_model import TinyLlama, build_tiny_llama

RUN_TIMEOUT_S = 420


def tiny_model_dir(name: str, spec: TinyLlama) -> str:
    """The tiny random Llama ``spec`` in ``$LMCACHE_TEST_CACHE/name`` (built once)."""
    cache = Path(os.environ.get("LMCACHE_TEST_CACHE", Path.home() / ".cache" / "lmcache-tests"))
    return str(build_tiny_llama(cache / name, spec))


def run_vllm(
    model_dir: str,
    requests: list[dict[str, Any]],
    env: dict[str, str],
    timeout: float = RUN_TIMEOUT_S,
    **spec: Any,
) -> list[dict[str, Any]]:
    """Run ``requests`` in a new vLLM process (offline runner ``spec`` keys as keywords,
    ``env`` added to this process's environment); the per-request results."""
    spec = {"model": model_dir, "max_model_len": 2048, "requests": requests, **spec}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmcache.integration.vllm.offline_runner",
            "--spec",
            json.dumps(spec),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"vLLM run failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
    return parse_result(proc.stdout + proc.stderr)["requests"]
