"""``lmcache query {engine,kvcache,coordinator}``: one request, one report.

``engine`` sends one prompt to an OpenAI-compatible server (vLLM) with streaming and
reports the answer, token counts, TTFT, TPOT, latency and decode throughput, as LMCache
0.5.6 does: ``/v1/completions`` first and ``/v1/chat/completions`` if that fails
(``--chat-first`` the other way round, ``--completions`` only the first). ``{NAME}`` in
``--prompt`` is replaced by the text of ``--documents NAME=PATH``; a bare ``PATH`` fills the
next unnamed placeholder, or is appended.

``kvcache`` (ours; a placeholder that does nothing in 0.5.6) asks a running ``lmcache
server`` how much of a token sequence it holds: the server looks it up, loading what an L2
tier has into L1 (``POST /cache/prefetches``), and the report gives the chunks found.

``coordinator`` reads an MP coordinator, which this version does not provide.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from lmcache.cli.errors import CLIError
from lmcache.cli.report import Report, add_output_args

_PLACEHOLDER = re.compile(r"\{(\w+)\}")
_COORDINATOR_APIS = (
    "directory",
    "health",
    "instances",
    "keys",
    "metrics",
    "prefetch",
    "quota",
    "quota-config",
    "usage",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    targets = parser.add_subparsers(dest="query_target", metavar="TARGET", required=True)

    engine = targets.add_parser("engine", help="send one request to an OpenAI-compatible API")
    engine.add_argument("--url", required=True, help="serving engine base URL")
    engine.add_argument(
        "--prompt", required=True, help="prompt text with optional {name} placeholders"
    )
    engine.add_argument("--model", default=None, metavar="ID", help="model id (default: first)")
    engine.add_argument(
        "--max-tokens", type=int, default=128, help="maximum completion tokens (default 128)"
    )
    engine.add_argument(
        "--timeout", type=float, default=30.0, help="HTTP timeout in seconds (default 30)"
    )
    engine.add_argument(
        "--documents",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="file text for {NAME} in --prompt; one or more NAME=PATH (or PATH) values",
    )
    engine.add_argument(
        "--path", dest="documents", action="extend", nargs="+", help=argparse.SUPPRESS
    )
    engine.add_argument("--completions", action="store_true", help="use /v1/completions only")
    engine.add_argument(
        "--chat-first",
        action="store_true",
        help="try /v1/chat/completions first, then /v1/completions",
    )
    add_output_args(engine)
    engine.set_defaults(func=_query_engine)

    kv = targets.add_parser(
        "kvcache", help="how much of a token sequence a running lmcache server holds (ours)"
    )
    kv.add_argument(
        "--url", default="http://localhost:8080", help="server HTTP API (default %(default)s)"
    )
    kv.add_argument("--model", default=None, help="model name the engine registered")
    kv.add_argument(
        "--token-ids",
        default=None,
        metavar="IDS",
        help="comma-separated token ids, or @FILE holding a JSON list of them",
    )
    kv.add_argument("--world-size", type=int, default=1, help="KV world size (default 1)")
    kv.add_argument("--cache-salt", default="", help="the requests' cache_salt (default none)")
    kv.add_argument(
        "--timeout", type=float, default=30.0, help="seconds to wait for the answer (default 30)"
    )
    add_output_args(kv)
    kv.set_defaults(func=_query_kvcache)

    coord = targets.add_parser("coordinator", help="read an MP coordinator (not provided)")
    coord.add_argument("--api", required=True, choices=_COORDINATOR_APIS, metavar="NAME")
    coord.add_argument("--url", default="http://127.0.0.1:9300")
    coord.add_argument("--instance", default=None)
    coord.add_argument("--cache-salt", default=None)
    coord.add_argument("--request-id", default=None)
    coord.add_argument("--limit", type=int, default=20)
    add_output_args(coord)
    coord.set_defaults(func=_query_coordinator)


# -- engine ------------------------------------------------------------------------------


def expand_prompt(prompt: str, documents: list[str]) -> str:
    """``{NAME}`` -> the text of ``NAME=PATH``; bare paths fill the remaining placeholders
    in order and the rest is appended on a new line."""
    named: dict[str, str] = {}
    plain: list[str] = []
    for item in documents:
        if "=" in item:
            name, path = (x.strip() for x in item.split("=", 1))
            if not name:
                raise CLIError(f"--documents {item!r} has an empty name; use NAME=PATH")
            named[name] = _read_document(path)
        else:
            plain.append(_read_document(item))
    wanted = list(dict.fromkeys(_PLACEHOLDER.findall(prompt)))
    for key in [k for k in wanted if k not in named]:
        if not plain:
            raise CLIError(f"--prompt uses {{{key}}}: define it with --documents {key}=PATH")
        named[key] = plain.pop(0)
    text = _PLACEHOLDER.sub(lambda m: named[m.group(1)], prompt)
    extra = "\n".join(plain).strip()
    return f"{text}\n{extra}" if text and extra else (text or extra)


def _read_document(path: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise CLIError(f"--documents file not found: {file}")
    return file.read_text(encoding="utf-8", errors="replace")


def _api_url(base: str, path: str) -> str:
    from lmcache.cli.http_client import base_url

    base = base_url(base)
    return f"{base if base.endswith('/v1') else base + '/v1'}/{path}"


def _first_model(base: str, timeout: float) -> str:
    from lmcache.cli.http_client import call

    data = (call("GET", _api_url(base, "models"), timeout=max(timeout, 5.0)) or {}).get("data")
    if not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise CLIError("GET /v1/models named no model; pass --model", 1)
    return str(data[0]["id"])


def _stream(url: str, body: dict[str, Any], timeout: float, chat: bool) -> dict[str, Any]:
    """POST with ``stream: true``; the answer text and the timing of its tokens."""
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    t0 = time.monotonic()
    first = None
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except ValueError:
                    continue
                if not isinstance(obj, dict):
                    continue
                if obj.get("error"):
                    raise RuntimeError(_error_text(obj["error"]))
                choice = (obj.get("choices") or [{}])[0]
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if piece:
                    first = first or time.monotonic()
                    pieces.append(str(piece))
                if obj.get("usage") is not None:
                    usage = obj["usage"]
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            text = _error_text(json.loads(text).get("error", text))
        except (ValueError, AttributeError):
            pass
        raise RuntimeError(f"POST {url}: HTTP {exc.code}: {text[:2000]}") from None
    except (urllib.error.URLError, OSError) as exc:  # nothing answers: no other route will
        raise CLIError(
            f"cannot reach {url} ({getattr(exc, 'reason', exc)}); is the engine running? (--url)",
            1,
        ) from None
    t1 = time.monotonic()
    if not pieces and usage is None:
        raise RuntimeError(f"POST {url}: empty response (no streamed chunks)")
    usage = usage or {}
    generated = usage.get("completion_tokens")
    generated = int(generated) if generated is not None else body["max_tokens"]
    decode = t1 - first if first is not None else 0.0
    return {
        "answer": "".join(pieces),
        "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        "output_tokens": generated,
        "ttft_ms": ((first or t1) - t0) * 1000,
        "tpot_ms_per_token": decode / generated * 1000 if generated > 0 and decode > 0 else 0.0,
        "total_latency_ms": (t1 - t0) * 1000,
        "throughput_tokens_per_s": generated / decode if decode > 0 else 0.0,
    }


def _error_text(err: Any) -> str:
    if isinstance(err, dict):
        msg = err.get("message") or err.get("detail") or json.dumps(err)
        kind = err.get("type") or err.get("code")
        return f"{kind}: {msg}" if isinstance(kind, str) and err.get("message") else str(msg)
    return str(err)


def _no_chat_template(exc: Exception) -> bool:
    return "chat template" in str(exc).lower() or "chat_template" in str(exc).lower()


def _query_engine(args: argparse.Namespace) -> int:
    prompt = expand_prompt(args.prompt, args.documents)
    model = args.model or _first_model(args.url, args.timeout)

    def send(chat: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        path = "chat/completions" if chat else "completions"
        return _stream(_api_url(args.url, path), body, args.timeout, chat)

    try:
        if args.completions:
            result = send(chat=False)
        elif args.chat_first:
            try:
                result = send(chat=True)
            except RuntimeError as exc:
                if not _no_chat_template(exc):
                    raise
                print("lmcache query: no chat template; retrying /v1/completions", file=sys.stderr)
                result = send(chat=False)
        else:
            try:
                result = send(chat=False)
            except RuntimeError as first:
                print(
                    "lmcache query: /v1/completions failed; retrying /v1/chat/completions",
                    file=sys.stderr,
                )
                try:
                    result = send(chat=True)
                except RuntimeError as second:
                    raise RuntimeError(f"{first}; then {second}") from None
    except RuntimeError as exc:
        raise CLIError(str(exc), 1) from None
    report = Report("Query Engine")
    report.add("model", "Model", model)
    report.add("answer", "Answer", result["answer"])
    report.add("prompt_tokens", "Input tokens", result["prompt_tokens"])
    report.add("output_tokens", "Output tokens", result["output_tokens"])
    latency = report.section("latency", "Latency Metrics")
    for key, label in (
        ("ttft_ms", "TTFT (ms)"),
        ("tpot_ms_per_token", "TPOT (ms/token)"),
        ("total_latency_ms", "Total latency (ms)"),
        ("throughput_tokens_per_s", "Throughput (tokens/s)"),
    ):
        latency.add(key, label, round(float(result[key]), 2))
    report.emit(args)
    return 0


# -- kvcache -----------------------------------------------------------------------------


def _token_ids(spec: str) -> list[int]:
    try:
        if spec.startswith("@"):
            ids = json.loads(Path(spec[1:]).read_text())
        else:
            ids = [int(x) for x in spec.replace(" ", "").split(",") if x]
        if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ValueError
    except (OSError, ValueError):
        raise CLIError(
            f"--token-ids {spec[:80]!r}: give comma-separated non-negative integers, "
            "or @FILE with a JSON list of them"
        ) from None
    return ids


def _query_kvcache(args: argparse.Namespace) -> int:
    from lmcache.cli.http_client import base_url, call

    if args.model is None and args.token_ids is None:
        # 0.5.6's `lmcache query kvcache` is a placeholder: it takes no flags and does nothing.
        print(
            "lmcache query kvcache: nothing to look up; pass --model NAME --token-ids IDS",
            file=sys.stderr,
        )
        return 0
    if args.model is None or args.token_ids is None:
        raise CLIError("lmcache query kvcache needs both --model and --token-ids")
    tokens = _token_ids(args.token_ids)
    url = base_url(args.url)
    body = {
        "model_name": args.model,
        "world_size": args.world_size,
        "token_ids": tokens,
        "cache_salt": args.cache_salt,
    }
    submitted = call("POST", f"{url}/cache/prefetches", body) or {}
    result = dict(submitted)
    request_id = submitted.get("request_id")
    deadline = time.monotonic() + args.timeout
    while request_id and result.get("status") not in ("completed", "noop"):
        if time.monotonic() > deadline:
            raise CLIError(f"the lookup of {request_id} did not finish in {args.timeout} s", 1)
        time.sleep(0.05)
        result = call("GET", f"{url}/cache/prefetches/{request_id}") or {}
    found, total = result.get("found_keys", 0), result.get("total_keys", 0)
    report = Report("Query KV Cache")
    report.add("model", "Model", args.model)
    report.add("num_tokens", "Tokens", len(tokens))
    report.add("status", "Status", result.get("status"))
    report.add("found_keys", "Chunks found", found)
    report.add("total_keys", "Chunks asked", total)
    report.add("hit_ratio", "Hit ratio", round(found / total, 4) if total else 0.0)
    report.emit(args)
    return 0


def _query_coordinator(args: argparse.Namespace) -> int:
    raise CLIError(
        "this version has no MP coordinator, so `lmcache query coordinator` has nothing to "
        "read; LMCache 0.5.6's CLI reads a 0.5.6 coordinator"
    )
