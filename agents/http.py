"""The serving endpoint of the DPA groups a pod leads (port 8000): the OpenAI API, and the agent's own routes.

    POST /v1/completions, /v1/chat/completions, GET /v1/models   OpenAI's API (`shardwise.agents.openai_api`)
    POST /v1/abort    {"request_id": str} -> {"request_id", "aborted": bool}     (404 when not in flight)
    GET  /v1/stats    the pod's statistics (JSON)
    (both with the agent token, `Authorization: Bearer <token>`; the OpenAI routes with the deployment's API
    key when it has one, as vLLM's --api-key; the health routes open, for the kubelet's probes)
    GET  /healthz     200 once every local rank serves (also /health, as vLLM names it)
    GET  /livez       200 while the agent process runs its poller (the liveness probe), else 503

A request's id is `request_id` in the body or the `X-Request-Id` header (generated otherwise); it is what
/v1/abort names. An id still in flight is refused with 409 (`request_id_in_flight`); once its request has ended
the id is free again (the pod forgets ended requests after a minute). Bodies must carry a Content-Length of at
most 1 MiB; a client that sends nothing for CLIENT_TIMEOUT_S is disconnected. Every malformed request gets an
OpenAI-shaped 400, and a group that cannot take a request (queue full, draining, switching) answers 503 with
Retry-After. The pod picks the least-loaded DPA group it leads, unless the router names one in `X-Shardwise-Group`
(503 when this pod does not lead it, as after a renumbering recovery).
"""

from __future__ import annotations

import functools
import json
import queue
import secrets
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from shardwise.agents import openai_api as oai
from shardwise.agents.auth import bearer_ok
from shardwise.agents.runtime.pool import DuplicateRequest, RankPool, Refused
from shardwise.agents.runtime.tokenizer import ChatUnsupported

from shardwise import checkpoint

if TYPE_CHECKING:
    from shardwise.agents.agent import Agent

MAX_BODY = 1 << 20
REQUEST_TIMEOUT_S = 600
CLIENT_TIMEOUT_S = 30


@functools.lru_cache(maxsize=16)
def _model_facts(model: str, weights_dir: str | None) -> tuple[int, tuple[float, float, int]]:
    """(vocabulary size, sampling defaults) of a served model, read once from its files."""
    arch = checkpoint.model_architecture(model, weights_dir)
    return arch.vocab_size, checkpoint.sampling_defaults(weights_dir)


def defaults_of(agent: Agent, pool: RankPool) -> oai.Defaults:
    vocab, (temperature, top_p, top_k) = _model_facts(pool.spec.model, pool.spec.weights_dir)
    return oai.Defaults(model=agent.config.served_model_name or pool.spec.model or "model",
                        max_model_len=agent.config.max_model_len, vocab_size=vocab,
                        temperature=temperature, top_p=top_p, top_k=top_k)


class Run:
    """One prompt in flight: its events, its text as released, and how it ended."""

    def __init__(self, pool: RankPool, prompt: list[int], params: oai.Params, rid: str,
                 group: int | None = None) -> None:
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.pool, self.prompt, self.rid = pool, prompt, rid
        self.text = oai.TextStream(pool.codec.decode, params.stop)
        self.tokens: list[int] = []
        self.finish: str | None = None
        self.error: str | None = None
        stop = (() if params.ignore_eos else pool.codec.eos_ids) + params.stop_token_ids
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        sampling = (params.temperature, params.top_p, params.top_k, seed % (1 << 62))
        pool.submit(prompt, params.max_tokens, group, rid=rid, listener=lambda kind, v: self.events.put((kind, v)),
                    stop_ids=tuple(stop), sampling=sampling)
        self.world = pool.spec.generation  # the world generation that took it (X-Shardwise-World)

    def pieces(self) -> Any:
        """Yield (text, token id) as tokens arrive; afterwards `finish` or `error` says how it ended."""
        while True:
            try:
                kind, value = self.events.get(timeout=REQUEST_TIMEOUT_S)
            except queue.Empty:
                kind, value = "error", f"timed out after {REQUEST_TIMEOUT_S} s"
            if kind == "token":
                if self.text.stopped:
                    continue  # produced after a stop string, before the abort took effect
                self.tokens.append(int(value))
                piece = self.text.push(int(value))
                if self.text.stopped:
                    self.pool.abort(self.rid)
                yield piece, int(value)
                continue
            if kind == "done":
                self.finish = "stop" if self.text.stopped else str(value)
                rest = self.text.rest()
                if rest:
                    yield rest, None
            elif kind == "refused":
                self.error = f"refused: {value}"
            else:
                self.error = str(value)
            return

    @property
    def full_text(self) -> str:
        """The whole text once done: up to the stop string when one was met."""
        return str(self.text.decode(self.tokens))[:self.text.sent]


def make_handler(agent: Agent, token: str, api_key: str = "") -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "shardwise-agent"
        timeout = CLIENT_TIMEOUT_S

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

        def _error(self, e: oai.ApiError) -> None:
            self._json(e.status, e.body(), e.headers)

        def _require(self, secret: str, what: str, code: str) -> None:
            """401 unless the request carries `Authorization: Bearer <secret>` (the body, if any, is not read:
            the connection closes after the answer)."""
            if not bearer_ok(self.headers.get("Authorization"), secret):
                self.close_connection = True
                raise oai.ApiError(401, f"{what}: send 'Authorization: Bearer <{what}>'", code=code)

        def _require_token(self) -> None:
            self._require(token, "agent token", "invalid_token")

        def _require_key(self) -> None:
            if api_key:
                self._require(api_key, "API key", "invalid_api_key")

        def do_GET(self) -> None:
            try:
                self._get()
            except oai.ApiError as e:
                self._error(e)

        def _get(self) -> None:
            if self.path in ("/healthz", "/health"):
                ok = agent.pool is not None and agent.health().status in (3, 4)  # SERVING or PAUSED
                self._json(200 if ok else 503, {"ok": ok})
            elif self.path == "/livez":
                alive, why = agent.alive()
                self._json(200 if alive else 503, {"alive": alive, "status": why})
            elif self.path == "/v1/models":
                self._require_key()
                pool = agent.pool
                if pool is None:
                    self._error(oai.ApiError(503, "not configured yet", headers={"Retry-After": "5"}))
                    return
                self._json(200, oai.models_body(defaults_of(agent, pool), pool.spec.weights_dir or pool.spec.model))
            elif self.path == "/v1/stats":
                from google.protobuf.json_format import MessageToDict

                self._require_token()
                self._json(200, MessageToDict(agent.stats()))
            else:
                self._error(oai.ApiError(404, f"no route {self.path}", code="not_found"))

        def do_POST(self) -> None:
            try:
                routes: dict[str, Callable[[], None]] = {"/v1/completions": lambda: self._complete(chat=False),
                                                         "/v1/chat/completions": lambda: self._complete(chat=True),
                                                         "/v1/abort": self._abort}
                path = self.path.split("?")[0]
                route = routes.get(path)
                if route is None:
                    oai.read_body(self, MAX_BODY)
                    raise oai.ApiError(404, f"no route {self.path}", code="not_found")
                if path == "/v1/abort":
                    self._require_token()
                else:
                    self._require_key()
                route()
            except oai.ApiError as e:
                self._error(e)

        def _abort(self) -> None:
            data = oai.parse_json(oai.read_body(self, MAX_BODY))
            rid = data.get("request_id", data.get("id"))
            if not isinstance(rid, str):
                raise oai.bad('the body must be {"request_id": "<request id>"}', "request_id")
            aborted = agent.pool.abort(rid) if agent.pool else False
            self._json(200 if aborted else 404, {"request_id": rid, "aborted": aborted})

        def _complete(self, *, chat: bool) -> None:
            data = oai.parse_json(oai.read_body(self, MAX_BODY))
            pool = agent.pool
            if pool is None:
                raise oai.ApiError(503, "not configured yet", headers={"Retry-After": "5"})
            d = defaults_of(agent, pool)
            header_id = self.headers.get("X-Request-Id")
            req = oai.parse_chat(data, d, header_id) if chat else oai.parse_completion(data, d, header_id)
            try:
                if chat:
                    prompts = [pool.codec.chat(req.messages, add_generation_prompt=req.add_generation_prompt)]
                else:
                    prompts = [p if isinstance(p, list) else pool.codec.encode(p) for p in req.prompts]
            except ChatUnsupported as e:
                raise oai.bad(str(e), "messages" if chat else "prompt") from e
            except Exception as e:  # a chat template that raises (raise_exception) or does not render
                raise oai.bad(f"the chat template could not be rendered: {e}", "messages") from e
            params = [oai.check_length(p, req.params, d, chat=chat) for p in prompts]
            rid = req.request_id or secrets.token_hex(8)
            group = self._group(pool)
            runs: list[Run] = []
            try:
                for i, (p, prm) in enumerate(zip(prompts, params, strict=True)):
                    runs.append(Run(pool, p, prm, rid if len(prompts) == 1 else f"{rid}-{i}", group))
            except Refused as e:
                for r in runs:
                    pool.abort(r.rid)
                if isinstance(e, DuplicateRequest):
                    raise oai.ApiError(409, str(e), param="request_id", code="request_id_in_flight") from e
                raise oai.ApiError(503, str(e), headers={"Retry-After": "1"}) from e
            answer_id = oai.new_id(chat)
            if req.params.stream:
                self._stream(answer_id, d.model, runs, chat=chat, include_usage=req.params.include_usage)
            else:
                self._answer(answer_id, d.model, runs, chat=chat)

        def _group(self, pool: RankPool) -> int | None:
            """The DPA group the router chose (X-Shardwise-Group); None: the least loaded this pod leads."""
            raw = self.headers.get("X-Shardwise-Group")
            if raw is None:
                return None
            if not raw.strip().isdigit():
                raise oai.bad(f"X-Shardwise-Group must be a group number, got {raw!r}")
            group = int(raw)
            if group not in pool.leader_groups():
                raise oai.ApiError(503, f"DPA group {group} is not led by this pod (it leads "
                                        f"{pool.leader_groups()})", headers={"Retry-After": "1"})
            return group

        def _answer(self, answer_id: str, model: str, runs: list[Run], *, chat: bool) -> None:
            choices = []
            for i, run in enumerate(runs):
                for _ in run.pieces():
                    pass
                if run.error is not None:
                    for r in runs[i + 1:]:
                        r.pool.abort(r.rid)
                    if run.error.startswith("refused: ") and not run.tokens:
                        raise oai.ApiError(503, run.error.removeprefix("refused: "), headers={"Retry-After": "1"})
                    raise oai.ApiError(500, f"request {run.rid} failed: {run.error}", code="request_lost")
                choices.append(oai.choice(i, run.full_text, run.tokens, run.finish, chat=chat))
            prompt_tokens = sum(len(r.prompt) for r in runs)
            self._json(200, oai.completion_body(answer_id, model, choices, prompt_tokens,
                                                sum(len(r.tokens) for r in runs), chat=chat),
                       {"X-Request-Id": runs[0].rid, "X-Shardwise-World": str(runs[0].world)})

        def _stream(self, answer_id: str, model: str, runs: list[Run], *, chat: bool, include_usage: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("X-Request-Id", runs[0].rid)
            self.send_header("X-Shardwise-World", str(runs[0].world))
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            try:
                for i, run in enumerate(runs):
                    first = True
                    for piece, token in run.pieces():
                        ids = [token] if token is not None else []
                        self._event(oai.chunk_body(answer_id, model, [oai.choice(
                            i, piece, ids, None, chat=chat, delta=True, first=first)], chat=chat))
                        first = False
                    if run.error is not None:
                        self._event(oai.error_body(f"request {run.rid} failed: {run.error}", "server_error",
                                                   code="request_lost"))
                        break
                    self._event(oai.chunk_body(answer_id, model, [oai.choice(
                        i, "", [], run.finish, chat=chat, delta=True, first=first)], chat=chat))
                if include_usage:
                    body = oai.chunk_body(answer_id, model, [], chat=chat)
                    body["usage"] = oai.usage(sum(len(r.prompt) for r in runs), sum(len(r.tokens) for r in runs))
                    self._event(body)
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):  # the client left: end its requests
                for r in runs:
                    if r.finish is None and agent.pool is not None:
                        agent.pool.abort(r.rid)

        def _event(self, payload: dict[str, Any]) -> None:
            self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
            self.wfile.flush()

    return Handler


def serve(agent: Agent, host: str, port: int, *, token: str, api_key: str = "") -> ThreadingHTTPServer:
    """Serve in a thread: the control routes need the agent `token`, the OpenAI routes `api_key` when one is set."""
    server = oai.QuietServer((host, port), make_handler(agent, token, api_key))
    threading.Thread(target=server.serve_forever, daemon=True, name="http").start()
    return server
