"""The HTTP servers of the pod, the router and the vLLM agent (`openai_api.QuietServer`): a client that goes
away mid-request is not logged as an error (a readiness probe that times out did that every few seconds, a
traceback each time, burying the real failures); a handler that fails still is."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest
from shardwise.agents import openai_api as oai


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/fails":
            raise ValueError("a handler's own bug")
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[oai.QuietServer]:
    srv = oai.QuietServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(10)


def ask(srv: oai.QuietServer, data: bytes, *, reset: bool) -> None:
    """Send `data`; with `reset` close with a TCP reset (as a client killed mid-request), else read the answer."""
    with socket.create_connection(srv.server_address[:2], timeout=10) as s:  # type: ignore[arg-type]
        s.sendall(data)
        if reset:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            s.recv(1024)


def test_a_client_reset_mid_request_is_not_logged_and_a_failing_handler_is(
        server: oai.QuietServer, capsys: pytest.CaptureFixture[str]) -> None:
    for _ in range(3):
        ask(server, b"GET /healthz HTTP/1.1\r\nHost: x\r\n", reset=True)  # headers never finished
    ask(server, b"GET /fails HTTP/1.1\r\nHost: x\r\n\r\n", reset=False)
    err = capsys.readouterr().err
    assert "ConnectionResetError" not in err
    assert "ValueError: a handler's own bug" in err
