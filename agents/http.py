"""The completions endpoint of the DPA groups a pod leads (port 8000).

    POST /v1/completions   {"prompt": str | [int], "max_tokens": int, "stream": bool, "id": str?}
        -> {"id", "token_ids", "text", "finish_reason"}                    (finish_reason: length|stop|aborted)
        stream: server-sent events, one `data: {"id", "token_id", "text"}` per token, then
        `data: {"id", "token_ids", "text", "finish_reason"}` and `data: [DONE]`
    POST /v1/abort         {"id": str} -> {"id", "aborted": bool}
    GET  /v1/stats         the pod's statistics (JSON)
    GET  /healthz          200 once every local rank serves

A malformed request gets 400 with a one-line reason; a group that cannot take a request (queue full,
draining) answers 503 with `Retry-After`. The pod picks the least-loaded DPA group it leads.
"""

from __future__ import annotations

import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from shardwise.agents.runtime import tokenizer
from shardwise.agents.runtime.pool import Refused, WorldError

from shardwise.presets import model_preset

if TYPE_CHECKING:
    from shardwise.agents.agent import Agent

MAX_BODY = 1 << 20
REQUEST_TIMEOUT_S = 600


class BadRequest(Exception):
    pass


def parse_completion(body: bytes, vocab: int, max_len: int) -> tuple[list[int], int, bool, str | None]:
    """(prompt ids, max_tokens, stream, id) of a completions request; BadRequest with one line otherwise."""
    try:
        data = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not JSON: {e.msg if isinstance(e, json.JSONDecodeError) else e}") from e
    if not isinstance(data, dict):
        raise BadRequest("body must be a JSON object")
    unknown = set(data) - {"prompt", "max_tokens", "stream", "id"}
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token ids must be within 0..{vocab - 1}, got {bad[:3]}")
    else:
        raise BadRequest("prompt must be a string or a non-empty list of token ids")
    max_tokens = data.get("max_tokens", 16)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if len(ids) + max_tokens > max_len:
        raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds maxModelLen={max_len}")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false")
    rid = data.get("id")
    if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 128):
        raise BadRequest("id must be a non-empty string of at most 128 characters")
    return ids, max_tokens, stream, rid


def make_handler(agent: Agent) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "shardwise-agent"

        def log_message(self, format: str, *args: Any) -> None:  # access log off; errors still reach stderr
            return

        def _json(self, code: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> bytes:
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                raise BadRequest(f"body of {n} bytes exceeds {MAX_BODY}")
            return self.rfile.read(n)

        def do_GET(self) -> None:
            if self.path == "/healthz":
                ok = agent.pool is not None and agent.health().status in (3, 4)  # SERVING or PAUSED
                self._json(200 if ok else 503, {"ok": ok})
            elif self.path == "/v1/stats":
                from google.protobuf.json_format import MessageToDict

                self._json(200, MessageToDict(agent.stats()))
            else:
                self._json(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            try:
                if self.path == "/v1/completions":
                    self._complete()
                elif self.path == "/v1/abort":
                    data = json.loads(self._body() or b"{}")
                    if not isinstance(data, dict) or not isinstance(data.get("id"), str):
                        raise BadRequest('body must be {"id": "<request id>"}')
                    aborted = agent.pool.abort(data["id"]) if agent.pool else False
                    self._json(200 if aborted else 404, {"id": data["id"], "aborted": aborted})
                else:
                    self._json(404, {"error": f"no route {self.path}"})
            except BadRequest as e:
                self._json(400, {"error": str(e)})
            except json.JSONDecodeError as e:
                self._json(400, {"error": f"body is not JSON: {e.msg}"})

        def _complete(self) -> None:
            pool = agent.pool
            if pool is None:
                self._json(503, {"error": "not configured yet"}, {"Retry-After": "5"})
                return
            vocab = model_preset(pool.spec.model).vocab_size
            ids, max_tokens, stream, rid = parse_completion(self._body(), vocab, agent.config.max_model_len)
            events: queue.Queue[tuple[str, Any]] = queue.Queue()
            try:
                rid = pool.submit(ids, max_tokens, rid=rid, listener=lambda kind, v: events.put((kind, v)))
            except Refused as e:
                self._json(503, {"error": str(e)}, {"Retry-After": "1"})
                return
            if stream:
                self._stream(rid, events)
                return
            try:
                result = pool.result(rid, REQUEST_TIMEOUT_S)
            except Refused as e:
                self._json(503, {"error": str(e)}, {"Retry-After": "1"})
                return
            except WorldError as e:
                self._json(500, {"id": rid, "error": str(e)})
                return
            self._json(200, result)

        def _stream(self, rid: str, events: queue.Queue[tuple[str, Any]]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            tokens: list[int] = []
            while True:
                try:
                    kind, value = events.get(timeout=REQUEST_TIMEOUT_S)
                except queue.Empty:
                    kind, value = "done", "error: timed out"
                if kind == "token":
                    tokens.append(value)
                    self._event({"id": rid, "token_id": value, "text": tokenizer.decode([value])})
                    continue
                final: dict[str, Any] = {"id": rid, "token_ids": tokens, "text": tokenizer.decode(tokens)}
                final["finish_reason" if kind == "done" else "error"] = value
                self._event(final)
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                return

        def _event(self, payload: dict[str, Any]) -> None:
            self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            self.wfile.flush()

    return Handler


def serve(agent: Agent, host: str, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(agent))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="http").start()
    return server
