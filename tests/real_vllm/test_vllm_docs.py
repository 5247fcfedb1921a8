"""docs/vllm.md "vLLM on CPU": its offline script and its ``vllm serve`` command run as written
against a real server (``nox -s vllm``; skipped without vLLM). Only the ports (and the model
folder) are changed."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (run `nox -s vllm`)")

from lmcache.integration.vllm.offline_runner import server_counters, wait_stored
from lmcache.integration.vllm.tiny_model import (
    TinyLlama,
    build_tiny_llama,
    prompt_token_ids,
    word,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
MARK = "<!-- tested: tests/real_vllm/test_vllm_docs.py -->"
SERVE_MARK = "<!-- tested: tests/real_vllm/test_vllm_docs.py (vllm serve) -->"
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


def doc_serve_block() -> str:
    found = re.search(re.escape(SERVE_MARK) + r"\s*```bash\n(.*?)```", DOC.read_text(), re.S)
    assert found, f"{DOC} lost its tested `vllm serve` block (the {SERVE_MARK} block)"
    return found.group(1)


def parse_serve_block(block: str) -> tuple[dict[str, str], list[str]]:
    """The block's ``export`` line and its one command (backslash continuations joined)."""
    env: dict[str, str] = {}
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line)
        if not words:
            continue
        if words[0] == "export":
            env.update(w.split("=", 1) for w in words[1:])
        else:
            commands.append(words)
    assert len(commands) == 1, commands
    return env, commands[0]


def test_the_docs_vllm_serve_command_serves_and_hits(tmp_path, lmcache_server):
    import httpx
    from testsupport.ports import free_port

    cache = Path(os.environ.get("LMCACHE_TEST_CACHE", Path.home() / ".cache" / "lmcache-tests"))
    model = str(build_tiny_llama(cache / "tiny-llama-2l", TinyLlama()))
    srv = lmcache_server("--l1-size-gb", "0.5", "--shm-name", f"vllm_doc_serve_{os.getpid()}")
    env, cmd = parse_serve_block(doc_serve_block())
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    assert cmd[:4] == ["python", "-m", "lmcache.integration.vllm.vllm_cli", "serve"]
    port = free_port()
    swap = {"python": sys.executable, "./my-model": model, "8000": str(port)}
    cmd = [
        swap.get(w, w).replace('"lmcache.mp.port":"5555"', f'"lmcache.mp.port":"{srv.port}"')
        for w in cmd
    ]
    assert f'"lmcache.mp.port":"{srv.port}"' in cmd[-1]
    log = open(tmp_path / "vllm.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [*cmd, "--host", "127.0.0.1"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env, "LMCACHE_TRACK_USAGE": "false"},
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-4000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "vllm.log").read_text()[-4000:]
            time.sleep(0.5)
        prompt = " ".join(word(t) for t in prompt_token_ids(700, seed=22))
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
        first = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert first.status_code == 200, first.text
        wait_stored(srv.http_url, 2)  # 700 tokens: two 256-token chunks
        second = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert second.status_code == 200, second.text
        assert server_counters(srv.http_url)["lmcache_mp_num_chunks_loaded_total"] >= 2
        assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"] != ""
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
