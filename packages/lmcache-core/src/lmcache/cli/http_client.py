"""The admin commands' HTTP calls to ``lmcache server`` (and to an engine): urllib only,
so ``lmcache describe/kvcache/quota/ping`` start without loading torch or an HTTP stack."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from lmcache.cli.errors import CLIError

# LMCache 0.5.6's defaults: the MP server's HTTP API and vLLM's OpenAI server.
DEFAULT_URLS = {"kvcache": "http://localhost:8080", "engine": "http://localhost:8000"}


def base_url(url: str) -> str:
    """``host:port`` or a full URL -> ``http(s)://host:port`` without a trailing slash."""
    url = url.strip()
    if not url.startswith(("http://", "https://")):
        url = f"http://{url}"
    return url.rstrip("/")


def call(method: str, url: str, body: Any = None, timeout: float = 10.0) -> Any:
    """One request; the decoded JSON reply. Failures raise CLIError (exit 1) naming the URL
    and what the server said."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        raise CLIError(f"{method} {url}: HTTP {exc.code}: {_server_message(exc)}", 1) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise CLIError(
            f"cannot reach {url} ({reason}); is `lmcache server` running there? (--url)", 1
        ) from None
    try:
        return json.loads(raw.decode() or "null")
    except ValueError:
        raise CLIError(f"{method} {url}: the reply is not JSON: {raw[:200]!r}", 1) from None


def get_text(url: str, timeout: float = 10.0) -> str | None:
    """The body of a GET, or None when the URL does not answer 200."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url), timeout=timeout) as resp:
            return resp.read().decode(errors="replace") if resp.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


def probe(url: str, timeout: float = 10.0) -> tuple[bool, float, str | None]:
    """GET ``url``: (answered 200, round trip in ms, why not)."""
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(urllib.request.Request(url), timeout=timeout) as resp:
            ok, why = resp.status == 200, None if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        ok, why = False, f"HTTP {exc.code}: {exc.reason}"
    except (urllib.error.URLError, OSError) as exc:
        ok, why = False, f"cannot connect to {url}: {getattr(exc, 'reason', exc)}"
    return ok, (time.monotonic() - t0) * 1000, why


def _server_message(exc: urllib.error.HTTPError) -> str:
    try:
        text = exc.read().decode(errors="replace")
    except OSError:
        return str(exc.reason)
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:500] or str(exc.reason)
    if isinstance(body, dict):
        for key in ("error", "message", "detail"):
            if body.get(key):
                return str(body[key])
    return text.strip()[:500]
