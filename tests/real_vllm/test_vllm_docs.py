"""docs/vllm.md "vLLM on CPU": its offline script runs as written against a real server
(``nox -s vllm``; skipped without vLLM). Only the server port is changed to a free one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (run `nox -s vllm`)")

from lmcache.integration.vllm.offline_runner import server_counters
from lmcache.integration.vllm.tiny_model import (
    TinyLlama,
    build_tiny_llama,
    prompt_token_ids,
    word,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
MARK = "<!-- tested: tests/real_vllm/test_vllm_docs.py -->"
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def doc_script() -> str:
    text = DOC.read_text()
    found = re.search(re.escape(MARK) + r"\s*```python\n(.*?)```", text, re.S)
    assert found, f"{DOC} lost its tested script (the {MARK} block)"
    return found.group(1)


def test_the_docs_offline_script_stores_then_a_new_process_hits(tmp_path, lmcache_server):
    cache = Path(os.environ.get("LMCACHE_TEST_CACHE", Path.home() / ".cache" / "lmcache-tests"))
    model = build_tiny_llama(cache / "tiny-llama-2l", TinyLlama())
    srv = lmcache_server("--l1-size-gb", "0.5", "--shm-name", f"vllm_doc_{os.getpid()}")
    script = doc_script()
    assert '"lmcache.mp.port": "5555"' in script
    (tmp_path / "offline.py").write_text(
        script.replace('"lmcache.mp.port": "5555"', f'"lmcache.mp.port": "{srv.port}"')
    )
    prompt = tmp_path / "long-prompt.txt"
    prompt.write_text(" ".join(word(t) for t in prompt_token_ids(700, seed=21)))

    def run() -> str:
        proc = subprocess.run(
            [sys.executable, str(tmp_path / "offline.py"), str(model), str(prompt)],
            capture_output=True,
            text=True,
            timeout=420,
            env={**os.environ, **ENV},
        )
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        return proc.stdout

    first = run()
    stored = server_counters(srv.http_url)["lmcache_mp_l1_write_chunks_total"]
    assert stored >= 2  # 700 tokens: two 256-token chunks
    second = run()
    loaded = server_counters(srv.http_url)["lmcache_mp_num_chunks_loaded_total"]
    assert loaded >= 2  # the new process took the prefix from the server
    assert completion(second) == completion(first) != ""


def completion(stdout: str) -> str:
    """The text the script printed: the tiny model's words (vLLM logs to stdout too)."""
    lines = [ln.strip() for ln in stdout.splitlines() if re.fullmatch(r"\s*(w\d+\s*)+", ln)]
    return lines[-1] if lines else ""
