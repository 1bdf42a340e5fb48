"""The OpenAI API as a user meets it: `shardwise run --model DIR` on TP 2 x DPA 2 over 2 agents serves a
transformers-made checkpoint, and the official `openai` client (no retries: it sees every error a user would)
gets transformers' greedy tokens, chat through the checkpoint's template, streams, seeded sampling, stop
strings, and OpenAI-shaped errors for bad input; raw sockets check what no SDK sends."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from shardwise.agents.localrun import shardwise_command  # noqa: E402

from tests.checkpoints import greedy, make_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow
START_S = 240


AGENT_TOKEN = "openai-test-token"


class Served:
    def __init__(self, directory: Path, urls: list[str], router: str = "") -> None:
        self.directory, self.urls, self.name, self.router = directory, urls, directory.name, router
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(directory))

    def client(self, i: int = 0) -> Any:
        return openai.OpenAI(base_url=self.urls[i] + "/v1", api_key="unused", max_retries=0, timeout=120)

    def ids(self, text: str) -> list[int]:
        return list(self.tok(text)["input_ids"])

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))


def serve(directory: Path) -> Iterator[Served]:
    proc = subprocess.Popen([*shardwise_command(), "run", "--model", str(directory), "--tp", "2", "--dpa", "2",
                             "--agents", "2", "--max-model-len", "128"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True,
                            env={**os.environ, "SHARDWISE_AGENT_TOKEN": AGENT_TOKEN})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or []], daemon=True).start()
    urls: list[str] = []
    router = ""
    deadline = time.monotonic() + START_S
    try:
        while True:
            assert proc.poll() is None, "shardwise run exited"
            line = lines.get(timeout=max(0.1, deadline - time.monotonic())).strip()
            if line.startswith("serving "):
                urls.append(line.split()[1])
            if line.startswith("router "):
                router = line.split()[1]
            if line == "ready":
                break
        assert len(urls) == 2 and router  # each agent leads one DPA group; the router is in front of both
        yield Served(directory, urls, router)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    family = request.param
    extra = {"num_local_experts": 8} if family == "mixtral" else {"num_experts": 8}  # 8 experts over ep 4
    directory = make_checkpoint(tmp_path_factory.mktemp("ckpt") / f"tiny-{family}", family, **extra)
    yield from serve(directory)


def test_completions_from_every_group_equal_transformers_greedy_tokens(served: Served) -> None:
    for i in range(2):
        r = served.client(i).completions.create(model=served.name, prompt="hello world", max_tokens=10,
                                                temperature=0)
        choice = r.choices[0]
        want = greedy(served.directory, served.ids("hello world"), 10)
        assert choice.model_extra["token_ids"] == want
        assert choice.text == served.tok.decode(want, skip_special_tokens=True)
        assert choice.finish_reason == ("stop" if len(want) < 10 else "length")
        assert r.usage.prompt_tokens == len(served.ids("hello world")) and r.usage.completion_tokens == len(want)
        assert r.model == served.name and r.object == "text_completion" and r.id.startswith("cmpl-")


def test_the_router_of_shardwise_run_serves_both_groups(served: Served) -> None:
    c = openai.OpenAI(base_url=served.router + "/v1", api_key="unused", max_retries=0, timeout=120)
    for prompt in ("hello world", "through the router"):
        r = c.completions.with_raw_response.create(model=served.name, prompt=prompt, max_tokens=6, temperature=0)
        assert r.parse().choices[0].model_extra["token_ids"] == greedy(served.directory, served.ids(prompt), 6)
        assert r.headers["X-Shardwise-Group"] in ("0", "1")
        assert r.headers["X-Shardwise-World"].isdigit()  # the world generation that took it


def test_token_id_prompts_and_batches_get_one_choice_each(served: Served) -> None:
    prompts = [[5, 17, 100, 42], [9, 3, 250]]
    r = served.client().completions.create(model=served.name, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    for c, p in zip(r.choices, prompts, strict=True):
        assert c.model_extra["token_ids"] == greedy(served.directory, p, 8)


def test_chat_renders_the_checkpoints_template_as_transformers_does(served: Served) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello shardwise"}]
    r = served.client(1).chat.completions.create(model=served.name, messages=messages, max_tokens=8, temperature=0)
    prompt = served.chat_ids(messages)
    want = greedy(served.directory, prompt, 8)
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == served.tok.decode(want, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(prompt) and r.object == "chat.completion"


def test_a_stream_carries_the_same_tokens_and_ends_with_done(served: Served) -> None:
    c = served.client()
    chunks = list(c.completions.create(model=served.name, prompt="attention groups", max_tokens=9, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    ids = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra["token_ids"]]
    want = greedy(served.directory, served.ids("attention groups"), 9)
    assert ids == want
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == served.tok.decode(want,
                                                                                        skip_special_tokens=True)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(want)
    stream = c.chat.completions.create(model=served.name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, temperature=0, stream=True)
    deltas = [ch.choices[0].delta for ch in stream]
    assert deltas[0].role == "assistant"
    text = "".join(d.content or "" for d in deltas)
    assert text == served.tok.decode(greedy(served.directory, served.chat_ids([{"role": "user", "content": "hi"}]),
                                            5), skip_special_tokens=True)


def test_a_seed_gives_the_same_sample_on_every_group_and_another_seed_another(served: Served) -> None:
    def sample(i: int, seed: int) -> list[int]:
        r = served.client(i).completions.create(model=served.name, prompt="the quick brown fox", max_tokens=16,
                                                temperature=1.5, seed=seed, extra_body={"ignore_eos": True})
        return list(r.choices[0].model_extra["token_ids"])

    first = sample(0, 7)
    assert sample(1, 7) == first  # another DPA group (other ranks, other batch): the same draws
    assert sample(0, 8) != first
    assert first != greedy(served.directory, served.ids("the quick brown fox"), 16)


def test_a_stop_string_ends_the_text_before_it(served: Served) -> None:
    c = served.client()
    full = c.completions.create(model=served.name, prompt="hello", max_tokens=20, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0]
    text = full.text
    stop = next((ch for ch in text[1:len(text) // 2] if ch != "\ufffd"), None)  # random weights: odd bytes
    assert stop is not None, text
    cut = c.completions.create(model=served.name, prompt="hello", max_tokens=20, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]
    n = len(cut.model_extra["token_ids"])
    assert cut.model_extra["token_ids"] == full.model_extra["token_ids"][:n] and n < 20


def test_models_lists_the_served_model(served: Served) -> None:
    models = served.client().models.list()
    assert [m.id for m in models.data] == [served.name]
    assert models.data[0].model_extra["max_model_len"] == 128


@pytest.mark.parametrize("kwargs,status,param", [
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
    ({"prompt": list(range(120)), "max_tokens": 16}, 400, "max_tokens"),
    ({"prompt": [1, 5000]}, 400, "prompt"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "n": 2}, 400, "n"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
])
def test_bad_requests_get_openai_shaped_errors_naming_the_parameter(served: Served, kwargs: dict[str, Any],
                                                                    status: int, param: str) -> None:
    args = {"model": served.name, **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        served.client().completions.create(**args)
    assert e.value.status_code == status
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == param and body["message"] and "\n" not in body["message"]


def raw(url: str, request: bytes, timeout: float = 30) -> tuple[int, dict[str, Any]]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data:
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                               if h.lower().startswith(b"content-length:")), None)
                if length is not None and len(body) >= length:
                    break
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.partition(b"\r\n\r\n")[2] or b"{}")


def post_raw(body: bytes, length: str | None = None) -> bytes:
    n = str(len(body)) if length is None else length
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
            + f"Content-Length: {n}\r\n\r\n".encode() + body)


@pytest.mark.parametrize("request_bytes,status,fragment", [
    (post_raw(b"{not json"), 400, "not JSON"),
    (post_raw(b'{"prompt": "\\ud800"}'), 400, "unpaired surrogate"),
    (post_raw(b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"), 400, "nests too deeply"),
    (post_raw(b"\xff\xfe"), 400, "not UTF-8"),
    (post_raw(b"{}", length="-1"), 400, "Content-Length must be a non-negative integer"),
    (post_raw(b"", length=str(2 << 20)), 413, "exceeds"),
    (post_raw(b'["a list"]'), 400, "must be a JSON object"),
])
def test_malformed_http_gets_an_answer_and_never_a_hung_connection(served: Served, request_bytes: bytes,
                                                                   status: int, fragment: str) -> None:
    code, body = raw(served.urls[0], request_bytes)
    assert code == status and fragment in body["error"]["message"], body
    assert body["error"]["type"] == "invalid_request_error"


def test_a_client_that_sends_all_of_a_too_large_body_before_reading_gets_the_413(served: Served) -> None:
    """As urllib, requests and the OpenAI client do: the pod reads and drops the refused body (up to 16 MiB, for
    up to a second) so that the client reads the answer, not a broken pipe (8 MiB is more than the sockets
    buffer)."""
    big = urllib.request.Request(served.urls[0] + "/v1/completions", b"x" * (8 << 20),
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(big, timeout=30)
    assert e.value.code == 413 and "exceeds" in json.loads(e.value.read())["error"]["message"]


def test_a_request_id_is_refused_while_in_flight_and_free_again_once_its_request_ended(served: Served) -> None:
    url = served.urls[0]
    long = json.dumps({"prompt": "a long one", "max_tokens": 100, "ignore_eos": True, "temperature": 0,
                       "request_id": "same-id"}).encode()
    answer: dict[str, Any] = {}
    first = threading.Thread(target=lambda: answer.update(r=raw(url, post_raw(long), timeout=120)), daemon=True)
    first.start()
    try:
        deadline = time.monotonic() + 60
        stats = urllib.request.Request(url + "/v1/stats", headers={"Authorization": f"Bearer {AGENT_TOKEN}"})
        while json.loads(urllib.request.urlopen(stats, timeout=10).read()).get("runningRequests", 0) < 1:
            first.join(0.05)  # polls the stats until the long request runs (ends early if it already answered)
            assert first.is_alive() and time.monotonic() < deadline, ("the long request never ran", answer)
        again = json.dumps({"prompt": "x", "max_tokens": 2, "request_id": "same-id"}).encode()
        code, body = raw(url, post_raw(again))
        assert code == 409 and body["error"]["code"] == "request_id_in_flight", body
    finally:
        first.join(120)
    assert answer["r"][0] == 200, answer
    short = json.dumps({"prompt": "again", "max_tokens": 4, "temperature": 0, "request_id": "same-id"}).encode()
    code, body = raw(url, post_raw(short))
    assert code == 200 and body["choices"][0]["token_ids"] == greedy(served.directory, served.ids("again"), 4), body
