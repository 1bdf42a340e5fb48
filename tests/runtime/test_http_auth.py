"""Credentials on a pod's HTTP port, on a real server socket: the control routes (/v1/abort, /v1/stats) take the
agent token, the OpenAI routes take the deployment's API key when it has one, the probes' routes take nothing.
The agent behind it is not configured yet (no ranks), which is all the checks before a route need."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")

from shardwise.agents import http as agent_http
from shardwise.agents.proto import agent_pb2 as pb

TOKEN, KEY = "the-agent-token", "the-api-key"


class Unconfigured:
    """An agent that has no world yet (what `shardwise agent` is before the operator's Configure)."""

    pool = None

    def alive(self) -> tuple[bool, str]:
        return True, "waiting for Configure"

    def stats(self) -> Any:
        return pb.StatsResponse()


@pytest.fixture(params=["with an API key", "without one"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[int, str]]:
    key = KEY if request.param == "with an API key" else ""
    web = agent_http.serve(Unconfigured(), "127.0.0.1", 0, token=TOKEN, api_key=key)  # type: ignore[arg-type]
    try:
        yield web.server_address[1], key
    finally:
        web.shutdown()
        web.server_close()


def call(port: int, method: str, path: str, secret: str | None = None, body: Any = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {secret}"} if secret else {})}
        conn.request(method, path, body=data, headers=headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"null")
    finally:
        conn.close()


@pytest.mark.parametrize(("method", "path", "body"), [("GET", "/v1/stats", None),
                                                      ("POST", "/v1/abort", {"request_id": "someone-elses"})])
def test_the_control_routes_refuse_anyone_without_the_agent_token(server: tuple[int, str], method: str, path: str,
                                                                  body: Any) -> None:
    port, key = server
    for secret in (None, "guess", key or None):  # the API key is not the agent token
        code, answer = call(port, method, path, secret, body)
        assert (code, answer["error"]["code"]) == (401, "invalid_token"), answer
    code, answer = call(port, method, path, TOKEN, body)
    assert code != 401, answer  # past the check (the unconfigured agent then answers for itself)


@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/completions", {"model": "m", "prompt": "hi"}),
    ("POST", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("GET", "/v1/models", None)])
def test_the_openai_routes_take_the_api_key_when_the_deployment_has_one(server: tuple[int, str], method: str,
                                                                        path: str, body: Any) -> None:
    port, key = server
    code, answer = call(port, method, path, None, body)
    if key:
        assert (code, answer["error"]["code"]) == (401, "invalid_api_key"), answer
        assert call(port, method, path, TOKEN, body)[0] == 401  # the agent token is not an API key
        code, answer = call(port, method, path, key, body)
    assert code == 503 and "not configured yet" in answer["error"]["message"], answer  # past the check


def test_the_probes_need_no_credential(server: tuple[int, str]) -> None:
    port, _ = server
    assert call(port, "GET", "/livez") == (200, {"alive": True, "status": "waiting for Configure"})
    assert call(port, "GET", "/healthz") == (503, {"ok": False})
