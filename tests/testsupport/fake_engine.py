"""A tiny OpenAI-compatible engine for CLI tests (``lmcache ping/describe/query engine``).

``with fake_engine() as url:`` serves, on a free loopback port, what those commands read
from vLLM: ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (``vllm:num_requests_running``)
and streamed ``POST /v1/completions`` / ``/v1/chat/completions`` answering ``ANSWER`` with
``usage`` in the last chunk. ``chat=False`` makes the chat route fail as an engine without
a chat template does.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "fake-model"
ANSWER = ["Hello", ",", " world"]
PROMPT_TOKENS = 7


def _handler(chat: bool, requests: list[dict]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_args) -> None:  # quiet
            pass

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                data = {"data": [{"id": MODEL, "max_model_len": 4096}]}
                self._send(200, json.dumps(data).encode())
            elif self.path == "/health":
                self._send(200, b"")
            elif self.path == "/metrics":
                text = f'vllm:num_requests_running{{model_name="{MODEL}"}} 2.0\n'
                self._send(200, text.encode(), "text/plain")
            else:
                self._send(404, b'{"error": "not found"}')

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            requests.append({"path": self.path, **body})
            is_chat = self.path == "/v1/chat/completions"
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self._send(404, b'{"error": "not found"}')
                return
            if is_chat and not chat:
                err = {
                    "error": {"message": "this model has no chat template", "type": "BadRequest"}
                }
                self._send(400, json.dumps(err).encode())
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for piece in ANSWER:
                choice = {"delta": {"content": piece}} if is_chat else {"text": piece}
                self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": len(ANSWER)}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler


@contextmanager
def fake_engine(chat: bool = True) -> Iterator[tuple[str, list[dict]]]:
    """(base URL, the POST bodies received)."""
    requests: list[dict] = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(chat, requests))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()
