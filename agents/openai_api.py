"""The OpenAI API as the engines speak it: request validation and response shapes, with no I/O.

Endpoints (served by `shardwise.agents.http`):

    POST /v1/completions       prompt: text, token ids, or a list of either (one choice per prompt)
    POST /v1/chat/completions  messages rendered with the checkpoint's chat template
    GET  /v1/models            the one served model

Sampling: `temperature` (0 is greedy; default 1, or the checkpoint's generation_config.json), `top_p`,
`top_k` (vLLM's extension; 0 or -1 for all), `seed` (the same seed gives the same tokens on any layout),
`max_tokens` (`max_completion_tokens` for chat; default: what is left of maxModelLen for chat, 16 for
completions, as OpenAI), `stop` (strings, up to 4: the text ends before the first one and finish_reason is
"stop"), `stop_token_ids` and `ignore_eos` (vLLM's extensions), `stream` with `stream_options.include_usage`.
Each choice carries `token_ids` (the generated ids, as vLLM's `return_token_ids` does) so clients and tests
compare exactly. Fields of the API that change nothing here (`user`, `metadata`, penalties of 0, `n` of 1,
`logprobs` null, ...) are accepted; fields asking for what the runtime does not do (`n` > 1, `logprobs`,
`echo`, `suffix`, a `logit_bias`, non-zero penalties, tools) are refused with 400 naming the field, rather
than silently ignored. Unknown fields are ignored (SDKs add their own).

Errors use OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`; 400 for a bad request, 404
for an unknown model, 503 with Retry-After while no group can take the request, 500 for a request lost with
its group. `finish_reason` is "stop", "length", "aborted" (an abort or an abort-mode scale-down) or, in a
stream, an error event.
"""

from __future__ import annotations

import json
import math
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_STOP = 4
MAX_PROMPTS = 64
MAX_MESSAGES = 4096

# fields of the API that, set to anything but these values, ask for behaviour the runtime lacks
UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "logprobs": (None, False, 0),
    "top_logprobs": (None, 0), "logit_bias": (None, {}), "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0), "tools": (None, []), "functions": (None, []),
    "response_format": (None, {"type": "text"}), "min_tokens": (None, 0), "repetition_penalty": (None, 1, 1.0),
}


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP status, message, type, the offending parameter and a code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("authentication_error" if status == 401 else "invalid_request_error" if status < 500
                             else "service_unavailable" if status == 503 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


REFUSED_BODY_DRAIN_BYTES = 16 << 20
REFUSED_BODY_DRAIN_S = 1.0


def drain_refused_body(connection: socket.socket, rfile: Any, length: int) -> None:
    """Read and drop what a client sends of a body refused for its size (at most REFUSED_BODY_DRAIN_BYTES, for
    at most REFUSED_BODY_DRAIN_S): a client that writes its whole body before it reads (most do) then reads the
    413 instead of a broken pipe. The caller answers, then closes the connection."""
    left = min(length, REFUSED_BODY_DRAIN_BYTES)
    deadline = time.monotonic() + REFUSED_BODY_DRAIN_S
    before = connection.gettimeout()
    try:
        while left > 0 and (remaining := deadline - time.monotonic()) > 0:
            connection.settimeout(remaining)
            chunk = rfile.read1(min(left, 1 << 16))
            if not chunk:
                return
            left -= len(chunk)
    except OSError:  # a timeout or a reset: the answer is sent anyway
        return
    finally:
        connection.settimeout(before)


class QuietServer(ThreadingHTTPServer):
    """A client that goes away mid-request (a probe's timeout, a cancelled stream) is not an error to print: the
    pod's, the router's and the vLLM agent's servers log only real failures."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def read_body(handler: BaseHTTPRequestHandler, max_body: int) -> bytes:
    """The request's body, by its Content-Length, of at most `max_body` bytes. A chunked body (411), a missing
    or malformed length (400) or a body too large (413, once what the client sends of it is drained) raises
    ApiError and marks the connection to be closed after the answer."""
    raw = handler.headers.get("Content-Length")
    if handler.headers.get("Transfer-Encoding"):
        handler.close_connection = True
        raise ApiError(411, "send the body with a Content-Length (chunked bodies are not accepted)")
    if raw is None or not raw.strip().isdigit():
        handler.close_connection = True
        raise bad(f"Content-Length must be a non-negative integer, got {raw!r}")
    n = int(raw)
    if n > max_body:
        handler.close_connection = True
        drain_refused_body(handler.connection, handler.rfile, n)
        raise ApiError(413, f"the body of {n} bytes exceeds {max_body} bytes")
    return handler.rfile.read(n)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True)
class Defaults:
    """What the served model brings: its name, length limit, vocabulary and sampling defaults."""

    model: str
    max_model_len: int
    vocab_size: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass(frozen=True)
class Params:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[list[int] | str]  # token ids, or text to tokenize (with the model's special tokens)
    params: Params
    request_id: str | None
    chat: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)
    add_generation_prompt: bool = True


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise bad(f"the body is not UTF-8: {e.reason} at byte {e.start}") from e
    except json.JSONDecodeError as e:
        raise bad(f"the body is not JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    except RecursionError as e:
        raise bad("the body nests too deeply") from e
    if not isinstance(data, dict):
        raise bad("the body must be a JSON object")
    _check_text(data, "body", 0)
    return data


def _check_text(value: Any, where: str, depth: int) -> None:
    """Strings must be encodable (JSON admits escaped lone surrogates, which no tokenizer takes)."""
    if depth > 64:
        raise bad("the body nests too deeply")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad(f"{where} holds an unpaired surrogate (\\u{ord(value[e.start]):04x})", where) from e
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where, depth + 1)
            _check_text(v, f"{k}" if where == "body" else f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{where}[{i}]", depth + 1)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(data: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = data.get(key)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or not lo <= v <= hi:
        raise bad(f"{key} must be a number within {lo:g}..{hi:g}, got {v!r}", key)
    return float(v)


def _check_model(data: dict[str, Any], d: Defaults) -> None:
    model = data.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise bad(f"model must be a string, got {model!r}", "model")
    if model != d.model:
        raise ApiError(404, f"the model {model!r} does not exist; this endpoint serves {d.model!r}", param="model",
                       code="model_not_found")


def _check_unsupported(data: dict[str, Any]) -> None:
    for key, allowed in UNSUPPORTED_UNLESS.items():
        if key in data and data[key] not in allowed:
            raise bad(f"{key}={json.dumps(data[key])[:80]} is not supported by this runtime", key)


def _params(data: dict[str, Any], d: Defaults, prompt_len: int, *, chat: bool) -> Params:
    key = "max_completion_tokens" if chat and data.get("max_completion_tokens") is not None else "max_tokens"
    room = d.max_model_len - prompt_len
    max_tokens = data.get(key)
    if max_tokens is None:
        max_tokens = room if chat else min(16, max(room, 1))
    if not _is_int(max_tokens) or max_tokens < 1:
        raise bad(f"{key} must be a positive integer, got {max_tokens!r}", key)
    if prompt_len + max_tokens > d.max_model_len:
        raise bad(f"the prompt ({prompt_len} tokens) plus {key} ({max_tokens}) exceeds the model's maximum length "
                  f"maxModelLen={d.max_model_len}", key)
    temperature = _number(data, "temperature", d.temperature, 0.0, 2.0)
    top_p = _number(data, "top_p", d.top_p, 0.0, 1.0)
    if top_p <= 0:
        raise bad("top_p must be greater than 0", "top_p")
    top_k = data.get("top_k", d.top_k)
    if top_k is None:
        top_k = d.top_k
    if not _is_int(top_k) or top_k < -1:
        raise bad(f"top_k must be an integer >= -1, got {top_k!r}", "top_k")
    seed = data.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**64):
        raise bad(f"seed must be an integer, got {seed!r}", "seed")
    stop = data.get("stop")
    stops: list[str] = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if stop is not None and (not isinstance(stop, str | list) or not all(isinstance(s, str) and s for s in stops)):
        raise bad("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise bad(f"stop takes at most {MAX_STOP} strings, got {len(stops)}", "stop")
    stop_ids = data.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(_is_int(t) and 0 <= t < d.vocab_size for t in stop_ids):
        raise bad(f"stop_token_ids must be token ids within 0..{d.vocab_size - 1}", "stop_token_ids")
    ignore_eos = data.get("ignore_eos", False)
    stream = data.get("stream", False)
    for name, flag in (("ignore_eos", ignore_eos), ("stream", stream)):
        if not isinstance(flag, bool):
            raise bad(f"{name} must be true or false, got {flag!r}", name)
    options = data.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    return Params(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=max(top_k, 0), seed=seed,
                  stop=tuple(stops), stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos, stream=stream,
                  include_usage=bool(options.get("include_usage", False)))


def _request_id(data: dict[str, Any], header: str | None) -> str | None:
    rid = data.get("request_id", header)
    if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 128):
        raise bad("request_id must be a non-empty string of at most 128 characters", "request_id")
    return rid


def _token_ids(value: list[Any], d: Defaults, where: str) -> list[int]:
    if not value or not all(_is_int(t) for t in value):
        raise bad(f"{where} must be text, or a non-empty list of token ids", "prompt")
    out = [int(t) for t in value]
    wrong = [t for t in out if not 0 <= t < d.vocab_size]
    if wrong:
        raise bad(f"{where}: token ids must be within 0..{d.vocab_size - 1}, got {wrong[:3]}", "prompt")
    return out


def parse_completion(data: dict[str, Any], d: Defaults, header_id: str | None = None) -> CompletionRequest:
    """A /v1/completions request; prompts given as text are tokenized by the caller (their length is
    checked again then)."""
    _check_model(data, d)
    _check_unsupported(data)
    prompt = data.get("prompt")
    prompts: list[list[int] | str]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [_token_ids(prompt, d, "prompt")]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise bad(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}", "prompt")
        prompts = [p if isinstance(p, str) else _token_ids(p, d, f"prompt[{i}]") for i, p in enumerate(prompt)]
    else:
        raise bad("prompt must be text, a list of token ids, or a list of either", "prompt")
    longest = max((len(p) for p in prompts if isinstance(p, list)), default=0)
    return CompletionRequest(prompts, _params(data, d, longest, chat=False), _request_id(data, header_id))


def parse_chat(data: dict[str, Any], d: Defaults, header_id: str | None = None) -> CompletionRequest:
    _check_model(data, d)
    _check_unsupported(data)
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise bad(f"messages must be a non-empty list of at most {MAX_MESSAGES} messages", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a role", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content: only text parts are supported", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be text", "messages")
        out.append({**m, "content": content})
    add = data.get("add_generation_prompt", True)
    if not isinstance(add, bool):
        raise bad("add_generation_prompt must be true or false", "add_generation_prompt")
    return CompletionRequest([], _params(data, d, 0, chat=True), _request_id(data, header_id), chat=True,
                             messages=out, add_generation_prompt=add)


def check_length(prompt: list[int], params: Params, d: Defaults, *, chat: bool) -> Params:
    """Once the prompt is tokens: it must leave room for max_tokens (chat's default fills what is left)."""
    if not prompt:
        raise bad("the prompt is empty after tokenization", "prompt")
    room = d.max_model_len - len(prompt)
    if room < 1 or len(prompt) + params.max_tokens > d.max_model_len:
        if chat and room >= 1 and params.max_tokens == d.max_model_len:  # the default: fill what is left
            return Params(**{**params.__dict__, "max_tokens": room})
        raise bad(f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) exceeds the model's "
                  f"maximum length maxModelLen={d.max_model_len}", "max_tokens")
    return params


# ------------------------------------------------------------------------------------------- responses
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, choices: list[dict[str, Any]], prompt_tokens: int,
                    completion_tokens: int, *, chat: bool) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}


def choice(index: int, text: str, token_ids: list[int], finish_reason: str | None, *, chat: bool,
           delta: bool = False, first: bool = False) -> dict[str, Any]:
    if not chat:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason,
                "token_ids": token_ids}
    if delta:
        part: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": part, "logprobs": None, "finish_reason": finish_reason,
                "token_ids": token_ids}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason, "token_ids": token_ids}


def chunk_body(rid: str, model: str, choices: list[dict[str, Any]], *, chat: bool) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices}


def models_body(d: Defaults, root: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": d.model, "object": "model", "created": int(time.time()),
                                        "owned_by": "shardwise", "root": root, "max_model_len": d.max_model_len}]}


class TextStream:
    """Text of a growing list of tokens, released in pieces: a piece never ends inside a multi-byte character
    (decoders return U+FFFD there until the rest arrives), and the text stops before the first stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]) -> None:
        self.decode, self.stops = decode, stops
        self.tokens: list[int] = []
        self.sent = 0
        self.stopped = False

    def push(self, token: int) -> str:
        """Add a token; returns the new text it makes releasable (possibly empty). While stop strings are set,
        the last len(longest stop) - 1 characters are held back: they may yet begin a stop string."""
        self.tokens.append(token)
        text = self.decode(self.tokens)
        for s in self.stops:
            at = text.find(s)
            if at >= 0:
                self.stopped = True
                text = text[:at]
        end = len(text)
        if not self.stopped:
            if text.endswith("\ufffd"):
                return ""
            end -= max((len(s) for s in self.stops), default=1) - 1
        piece = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece

    def rest(self) -> str:
        """At the end: whatever was held back."""
        if self.stopped:
            return ""
        text = self.decode(self.tokens)
        piece, self.sent = text[self.sent:], len(text)
        return piece
