"""Fuzzing the HTTP servers on a real socket: a pod's serving port and the router. Whatever bytes a client sends
(any method, path, header, Content-Length or body, cut short or not), the server answers with an HTTP status or
closes the connection within a bound: no request hangs a connection or kills the server, and it keeps serving
the next client."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("torch")

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from shardwise.agents import http as agent_http
from shardwise.agents import router as agent_router
from shardwise.agents.proto import agent_pb2 as pb

TOKEN = "http-fuzz-token"
ANSWER_S = 40.0  # above the servers' 30 s limit for a client that stops sending


class Unconfigured:
    """An agent with no world yet: every route's checks run, none reaches a rank."""

    pool = None

    def alive(self) -> tuple[bool, str]:
        return True, "waiting for Configure"

    def stats(self) -> Any:
        return pb.StatsResponse()


@pytest.fixture(scope="module", params=["pod", "router"])
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    if request.param == "pod":
        web = agent_http.serve(Unconfigured(), "127.0.0.1", 0, token=TOKEN, api_key="")  # type: ignore[arg-type]
        try:
            yield web.server_address[1]
        finally:
            web.shutdown()
            web.server_close()
    else:
        running = agent_router.start(agent_router.Options(token=TOKEN, retry_s=0.5), "127.0.0.1", 0)
        try:
            yield running.port
        finally:
            running.close()


paths = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/abort", "/v1/stats",
                         "/healthz", "/livez", "/v1/router", "/v1/router/routes", "/", "/v1/../etc", "*"]) | st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=30).map(lambda p: "/" + p)
methods = st.sampled_from(["GET", "POST"]) | st.sampled_from(["PUT", "DELETE", "HEAD", "OPTIONS", "PATCH", "BREW"])
lengths = st.sampled_from(["0", "-1", "5", "1048577", "99999999999999999999", "abc", "", " 3", "1,2"])
json_bodies = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["prompt", "messages", "max_tokens", "model", "stream", "request_id", "groups", "x"]),
        inner, max_size=4), max_leaves=10).map(lambda v: __import__("json").dumps(v).encode())
bodies = json_bodies | st.binary(max_size=200) | st.just(b'{"prompt": "\\ud800"}') | st.just(b"[" * 5000)


@st.composite
def raw_requests(draw: st.DrawFn) -> bytes:
    method, path, body = draw(methods), draw(paths), draw(bodies)
    headers = ["Host: fuzz"]
    choice = draw(st.sampled_from(["exact", "declared", "chunked", "none", "garbage line"]))
    if choice == "exact":
        headers.append(f"Content-Length: {len(body)}")
    elif choice == "declared":  # a length that may not match the body: short, long, negative, not a number
        headers.append(f"Content-Length: {draw(lengths)}")
    elif choice == "chunked":
        headers.append("Transfer-Encoding: chunked")
    elif choice == "garbage line":
        headers.append(draw(st.text(max_size=40)).replace("\r", "").replace("\n", ""))
    if draw(st.booleans()):
        headers.append(f"Authorization: Bearer {draw(st.sampled_from([TOKEN, '', 'wrong', 'x' * 5000]))}")
    headers.append("Content-Type: " + draw(st.sampled_from(["application/json", "text/plain", ""])))
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(h + "\r\n" for h in headers) + "Connection: close\r\n\r\n"
    return head.encode("utf-8", "surrogateescape") + body


def exchange(port: int, data: bytes) -> bytes:
    """Send the request (then stop sending) and read until the server closes or answers; raise on a hang."""
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_S) as s:
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server answered and closed before the whole request was sent (a head it refused)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return out
            except TimeoutError as e:
                raise AssertionError(f"no answer and no close within {ANSWER_S} s to {data[:200]!r}") from e
            if not chunk:
                return out
            out += chunk


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=raw_requests())
def test_any_bytes_get_an_http_answer_or_a_close_and_never_a_hang(port: int, data: bytes) -> None:
    reply = exchange(port, data)
    if reply:
        status_line = reply.split(b"\r\n", 1)[0]
        assert status_line.startswith(b"HTTP/1."), f"not HTTP: {reply[:100]!r}"
        code = int(status_line.split()[1])
        assert 200 <= code < 600 and code != 500, f"{status_line!r} to {data[:200]!r}"
        event(f"HTTP {code}")
    else:
        event("closed without an answer")


def test_after_the_fuzzing_the_server_still_answers(port: int) -> None:
    reply = exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert reply.split(b"\r\n", 1)[0].split()[1] in (b"200", b"503")
