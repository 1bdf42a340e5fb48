"""The router as a client meets it: `shardwise router` in front of two real agents (DPA 2 over 2 pods) serving a
transformers-made checkpoint. The official `openai` client (no retries) and raw HTTP get transformers' greedy
tokens through the one URL; the choice follows the groups' load; a group that refuses or is gone is skipped
without the client seeing it; a request a group accepted and lost fails explicitly, never twice; bad input gets
OpenAI-shaped errors; a router stopped mid-stream ends the stream with an error event."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from shardwise.agents.client import AgentClient, RouterClient  # noqa: E402
from shardwise.agents.localrun import LocalDeployment, shardwise_command  # noqa: E402

from tests.checkpoints import greedy, make_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow
START_S = 240
TOKEN = "router-test-token"
LONG = 120  # tokens: a request that runs for seconds on 2 cores


class Router:
    """One `shardwise router` process, stopped by PID."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*shardwise_command(), "router", "--deployment", "t", "--port", "0", "--metrics-port", "0", *args],
            env={**os.environ, "SHARDWISE_AGENT_TOKEN": TOKEN, **(env or {})}, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout or []], daemon=True).start()
        line = lines.get(timeout=60)
        assert line.startswith("router for t on "), line
        fields = line.split()
        self.url, self.metrics = fields[4], int(fields[-1])

    def routes(self, urls: list[str], model: str, admitting: list[bool] | None = None) -> None:
        RouterClient(self.url, TOKEN).put_routes({"model": model, "groups": [
            {"group": i, "url": u, "admitting": (admitting or [True] * len(urls))[i]} for i, u in enumerate(urls)]})

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


class Served:
    def __init__(self, directory: Path, dep: LocalDeployment) -> None:
        from transformers import AutoTokenizer

        self.directory, self.dep, self.name = directory, dep, directory.name
        self.urls = [ap.http for ap in dep.procs]
        self.tok = AutoTokenizer.from_pretrained(str(directory))

    def ids(self, text: str) -> list[int]:
        return list(self.tok(text)["input_ids"])

    def want(self, text: str, n: int) -> list[int]:
        return greedy(self.directory, self.ids(text), n)


@contextlib.contextmanager
def deployment(directory: Path) -> Iterator[Served]:
    dep = LocalDeployment(model=directory.name, weights=str(directory), tp=1, dpa=2, pp=1, agents=2,
                          max_model_len=256, served_model_name=directory.name, log=lambda _: None, token=TOKEN)
    try:
        dep.start(START_S)
        yield Served(directory, dep)
    finally:
        dep.stop()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-qwen3", "qwen3_moe", num_experts=4)


@pytest.fixture(scope="module")
def served(checkpoint: Path) -> Iterator[Served]:
    with deployment(checkpoint) as s:
        yield s


@pytest.fixture
def router(served: Served) -> Iterator[Router]:
    r = Router()
    r.routes(served.urls, served.name)
    try:
        yield r
    finally:
        r.stop()


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
         timeout: float = 120) -> tuple[int, dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps({"temperature": 0, **body}).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), dict(e.headers)


def stream_events(url: str, body: dict[str, Any], started: threading.Event | None = None) -> list[Any]:
    req = urllib.request.Request(url + "/v1/completions", json.dumps({"temperature": 0, "stream": True, **body})
                                 .encode(), {"Content-Type": "application/json"})
    events: list[Any] = []
    with urllib.request.urlopen(req, timeout=180) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
            if started is not None:
                started.set()
    return events


def metric(port: int, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)  # polling a condition with a deadline


def running(url: str) -> int:
    """What the group's stats say runs now: a snapshot its agent takes about once a second, so a request that
    just ended may still count in it (wait for `idle` before counting a new one)."""
    ask = urllib.request.Request(url + "/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(ask, timeout=10) as r:
        return int(json.loads(r.read()).get("runningRequests", 0))


def idle(urls: list[str]) -> None:
    wait_for(lambda: all(running(u) == 0 for u in urls), 30, "the groups' stats to show nothing running")


# ------------------------------------------------------------------------------------------ serving


def test_the_openai_client_gets_transformers_tokens_through_the_one_url(served: Served, router: Router) -> None:
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for prompt in ("hello world", "the router", "a third prompt"):
        r = client.completions.create(model=served.name, prompt=prompt, max_tokens=8, temperature=0)
        assert r.choices[0].model_extra["token_ids"] == served.want(prompt, 8)
    assert client.models.list().data[0].id == served.name
    events = stream_events(router.url, {"model": served.name, "prompt": "streamed", "max_tokens": 8})
    assert events[-1] == "[DONE]"
    ids = [t for e in events[:-1] for t in e["choices"][0].get("token_ids") or []]
    assert ids == served.want("streamed", 8)
    assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")


def test_requests_go_to_the_group_that_can_start_them_soonest(served: Served, router: Router) -> None:
    # a long request on one group: the next ones go to the other, idle group (the least outstanding work)
    answer: dict[str, Any] = {}
    idle(served.urls)
    t = threading.Thread(target=lambda: answer.update(r=post(router.url, {"prompt": "long", "max_tokens": LONG})))
    t.start()
    wait_for(lambda: sum(running(u) for u in served.urls) == 1, 30, "the long request to run")
    busy = next(str(i) for i, u in enumerate(served.urls) if running(u))
    groups = []  # the group of each short request answered while the long one was still running
    for i in range(4):
        group = post(router.url, {"prompt": f"short {i}", "max_tokens": 2})[2]["X-Shardwise-Group"]
        if "r" in answer:
            break  # the long request ended (a slow machine): later requests may go anywhere
        groups.append(group)
    t.join(180)
    assert answer["r"][0] == 200 and answer["r"][2]["X-Shardwise-Group"] == busy
    assert groups and set(groups) == {str(1 - int(busy))}, groups
    assert answer["r"][1]["choices"][0]["token_ids"] == served.want("long", LONG)


def test_round_robin_takes_each_group_in_turn(served: Served) -> None:
    r = Router("--policy", "round-robin")
    try:
        r.routes(served.urls, served.name)
        groups = [post(r.url, {"prompt": "x", "max_tokens": 1})[2]["X-Shardwise-Group"] for _ in range(4)]
        assert groups in (["0", "1", "0", "1"], ["1", "0", "1", "0"])
    finally:
        r.stop()


def test_prefix_affinity_keeps_a_prompt_prefix_on_one_group(served: Served) -> None:
    r = Router("--prefix-affinity")
    try:
        r.routes(served.urls, served.name)
        # prompts that share their first block (64 characters) share a group while it has headroom
        for prefix in ("You are a helpful assistant who answers in one short sentence. ",
                       "Summarise the following text for a reader who has two minutes: "):
            groups = {post(r.url, {"prompt": prefix + f"question {i}", "max_tokens": 1})[2]["X-Shardwise-Group"]
                      for i in range(4)}
            assert len(groups) == 1, (prefix, groups)
    finally:
        r.stop()


def test_a_group_that_refuses_or_is_gone_is_skipped_unseen(served: Served) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens: connection refused
    r = Router()
    try:
        r.routes([dead, served.urls[1]], served.name)
        for i in range(3):
            code, body, headers = post(r.url, {"prompt": f"around {i}", "max_tokens": 4})
            assert code == 200 and headers["X-Shardwise-Group"] == "1"
            assert body["choices"][0]["token_ids"] == served.want(f"around {i}", 4)
        assert metric(r.metrics, "shardwise_router_retries_total", reason="connect") >= 1
        # a group the operator marks as not admitting gets nothing; with none admitting the client hears so
        r.routes(served.urls, served.name, admitting=[False, True])
        assert {post(r.url, {"prompt": "x", "max_tokens": 1})[2]["X-Shardwise-Group"] for _ in range(3)} == {"1"}
    finally:
        r.stop()
    r = Router("--retry-seconds", "0.5")
    try:
        r.routes(served.urls, served.name, admitting=[False, False])
        code, body, headers = post(r.url, {"prompt": "x", "max_tokens": 1})
        assert code == 503 and body["error"]["code"] == "no_group" and headers["Retry-After"] == "1"
        with urllib.request.urlopen(r.url + "/v1/router", timeout=10) as resp:
            assert [g["admitting"] for g in json.loads(resp.read())["groups"]] == [False, False]
    finally:
        r.stop()


# ------------------------------------------------------------------------------------------ bad input


def test_bad_input_gets_openai_shaped_errors(served: Served, router: Router) -> None:
    code, body, _ = post(router.url, {"model": "nope", "prompt": "x"})
    assert code == 404 and body["error"]["code"] == "model_not_found" and served.name in body["error"]["message"]
    raw = urllib.request.Request(router.url + "/v1/completions", b"{not json", {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(raw, timeout=30)
    assert e.value.code == 400 and "not JSON" in json.loads(e.value.read())["error"]["message"]
    big = urllib.request.Request(router.url + "/v1/completions", b"x" * (8 << 20))  # all sent before reading
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(big, timeout=30)
    assert e.value.code == 413 and "exceeds" in json.loads(e.value.read())["error"]["message"]
    # the engine's own validation passes through unchanged
    code, body, _ = post(router.url, {"prompt": "x", "max_tokens": -3})
    assert code == 400 and body["error"]["param"] == "max_tokens"
    # the route table takes the agent token only
    with pytest.raises(urllib.error.HTTPError) as e:
        RouterClient(router.url, "wrong").put_routes({"groups": []})
    assert e.value.code == 401


def test_an_api_key_is_required_when_set(served: Served) -> None:
    r = Router(env={"SHARDWISE_API_KEY": "sk-test"})
    try:
        r.routes(served.urls, served.name)
        code, body, _ = post(r.url, {"prompt": "x", "max_tokens": 1})
        assert code == 401 and body["error"]["code"] == "invalid_api_key"
        code, body, _ = post(r.url, {"prompt": "x", "max_tokens": 1}, {"Authorization": "Bearer sk-wrong"})
        assert code == 401
        client = openai.OpenAI(base_url=r.url + "/v1", api_key="sk-test", max_retries=0, timeout=60)
        assert client.completions.create(model=served.name, prompt="key", max_tokens=3, temperature=0).choices[
            0].model_extra["token_ids"] == served.want("key", 3)
    finally:
        r.stop()


# ------------------------------------------------------------------------------------------ losses


def test_a_stopped_router_ends_what_it_accepted_explicitly(served: Served) -> None:
    """Requests still running when the router's drain time is over: the stream ends with an error event, the
    plain request gets a 502 that says why. (No drain time at all: with one, a quiet machine may finish LONG
    tokens within it.)"""
    r = Router("--drain-seconds", "0")
    r.routes(served.urls, served.name)
    started = threading.Event()
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(events=stream_events(
        r.url, {"prompt": "cut by the router", "max_tokens": LONG}, started)))
    plain = threading.Thread(target=lambda: out.update(plain=post(r.url, {"prompt": "also cut", "max_tokens": LONG})))
    idle(served.urls)
    t.start()
    plain.start()
    try:
        assert started.wait(60)
        wait_for(lambda: sum(running(u) for u in served.urls) == 2, 30, "both requests to run")
        assert r.stop() == 0
        t.join(60)
        plain.join(60)
    finally:
        r.stop(signal.SIGKILL)
    code, body, _ = out["plain"]
    assert code == 502 and body["error"]["code"] == "request_lost" and "router shut down" in body["error"]["message"]
    events = out["events"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_lost", events[-3:]
    assert "router shut down" in events[-2]["error"]["message"]
    assert 0 < len(events) - 2 < LONG  # what came before the cut


def test_a_group_that_stops_admitting_gets_nothing_and_one_lost_fails_explicitly(checkpoint: Path) -> None:
    """Its own deployment: group 0 drains (as a scale-down's leaving group does) while the router still lists it,
    then group 1's pod dies with a request."""
    from shardwise.agents.proto import agent_pb2 as pb

    with deployment(checkpoint) as served:
        r = Router("--retry-seconds", "2")
        try:
            r.routes(served.urls, served.name)
            held: dict[str, Any] = {}
            # long enough to be seen running in the stats, a snapshot taken about once a second
            t = threading.Thread(target=lambda: held.update(r=post(served.urls[0], {"prompt": "held",
                                                                                      "max_tokens": LONG})))
            t.start()
            wait_for(lambda: running(served.urls[0]) == 1, 30, "a request to run on group 0")
            with AgentClient(served.dep.procs[0].grpc, served.dep.token) as c:
                generation = c.generation()
                drain = threading.Thread(target=lambda: c.call("Drain", pb.DrainRequest(
                    generation=generation, deadline_ms=120_000), 180))
                drain.start()
                wait_for(lambda: post(served.urls[0], {"prompt": "x", "max_tokens": 1})[0] == 503, 30,
                         "group 0 to stop admitting")
                for i in range(3):  # refused by group 0 (503, or its stats say so): served by group 1, unseen
                    code, body, headers = post(r.url, {"prompt": f"elsewhere {i}", "max_tokens": 3})
                    assert code == 200 and headers["X-Shardwise-Group"] == "1", (code, body)
                    assert body["choices"][0]["token_ids"] == served.want(f"elsewhere {i}", 3)
                t.join(120)
                drain.join(180)
            assert held["r"][0] == 200 and held["r"][1]["choices"][0]["token_ids"] == served.want("held", LONG)

            lost: dict[str, Any] = {}
            idle(served.urls)  # the short requests above are over in the stats too: a 1 now is the long one
            t = threading.Thread(target=lambda: lost.update(r=post(r.url, {"prompt": "lost", "max_tokens": LONG},
                                                                     timeout=240)))
            t.start()
            wait_for(lambda: running(served.urls[1]) == 1, 30, "the long request to run on group 1")
            os.killpg(served.dep.procs[1].proc.pid, signal.SIGKILL)  # the pod of group 1 is gone, with its ranks
            t.join(240)
            code, body, _ = lost["r"]
            assert code == 502 and body["error"]["code"] == "request_lost", (code, body)
            assert served.urls[1] in body["error"]["message"] and "not retried" in body["error"]["message"]
            assert metric(r.metrics, "shardwise_router_requests_total", group="1", code="lost") == 1
            # no group is left to take a request: the client hears so once the retry deadline passes
            code, body, headers = post(r.url, {"prompt": "after", "max_tokens": 3})
            assert code == 503 and body["error"]["code"] == "no_group" and headers["Retry-After"] == "1"
        finally:
            r.stop()
