"""The validating admission webhook, served by every operator replica: the leader and the standbys waiting for
the Lease alike, so the webhook Service may send a review to any ready replica (admission is pure: it plans the
spec and needs no API call, no leadership).

`POST /validate-inferencedeployment` takes an `admission.k8s.io/v1` AdmissionReview and answers one: allowed,
or refused with code 422 and the planner's messages (`invalid InferenceDeployment: FIELD: MESSAGE; ...`). A
change through the scale subresource (`kubectl scale`, an HPA) is the deployment's spec at the new dpa, read
from the API and planned the same way, so a size outside minDpa..maxDpa is refused there too.
The body is bounded (MAX_BODY_BYTES; a missing or negative Content-Length is refused), a client that sends
nothing for CLIENT_TIMEOUT_S is dropped, and every malformed review gets a 400 that says what is wrong. TLS
from the certificate and key files unless told to serve plain HTTP (tests and local development); the
handshake happens on the connection's own thread, so a slow client holds no other.
"""

from __future__ import annotations

import copy
import json
import logging
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .reconcile import spec_errors

log = logging.getLogger("shardwise.operator.webhook")

PATH = "/validate-inferencedeployment"
MAX_BODY_BYTES = 3 << 20  # the API server's own request limit is 3 MiB
CLIENT_TIMEOUT_S = 10.0


Fetch = Callable[[str, str], "dict[str, Any] | None"]  # (namespace, name) -> the InferenceDeployment or None


def _scale_errors(request: dict[str, Any], fetch: Fetch | None) -> tuple[list[str], list[str]]:
    """(errors, warnings) of a change through the scale subresource (`kubectl scale`, an HPA): the parent's spec
    at the new dpa, planned as a spec update would be (minDpa..maxDpa, expert slots, the world-size cap)."""
    replicas = ((request.get("object") or {}).get("spec") or {}).get("replicas")
    if not isinstance(replicas, int) or isinstance(replicas, bool):
        return [f"spec.replicas must be an integer, got {replicas!r}"], []
    namespace, name = str(request.get("namespace") or ""), str(request.get("name") or "")
    try:
        parent = fetch(namespace, name) if fetch else None
    except Exception as e:  # the API unreachable: the operator still checks the spec it reads
        return [], [f"could not read {namespace}/{name} to check the scale ({str(e)[:120]}); the operator checks it"]
    if parent is None:
        return [], []
    spec = copy.deepcopy(parent.get("spec") or {})
    spec.setdefault("parallelism", {})["dpa"] = replicas
    errors = spec_errors(spec)[2]
    return [f"scale to {replicas}: {e}" for e in errors], []


def review_answer(review: Any, fetch: Fetch | None = None) -> dict[str, Any]:
    """The AdmissionReview answering `review`; ValueError says what makes `review` malformed. `fetch` reads the
    InferenceDeployment a scale-subresource review is about."""
    if not isinstance(review, dict) or not isinstance(review.get("request"), dict):
        raise ValueError("not an AdmissionReview: no request object")
    request = review["request"]
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ValueError("the AdmissionReview's request has no uid")
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    obj = request.get("object")
    if request.get("operation") in ("CREATE", "UPDATE"):
        if request.get("subResource") == "scale":
            errors, warnings = _scale_errors(request, fetch)
            if warnings:
                response["warnings"] = warnings
        else:
            errors = spec_errors(obj.get("spec") if isinstance(obj, dict) else None)[2]
        if errors:
            response = {"uid": uid, "allowed": False, "status": {
                "code": 422, "reason": "Invalid", "message": "invalid InferenceDeployment: " + "; ".join(errors)}}
    return {"apiVersion": review.get("apiVersion") or "admission.k8s.io/v1", "kind": "AdmissionReview",
            "response": response}


class _Handler(BaseHTTPRequestHandler):
    timeout = CLIENT_TIMEOUT_S  # per socket operation: a silent client is dropped
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()  # the socket's timeout
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()  # on this connection's thread, bounded by the timeout

    def do_POST(self) -> None:
        if self.path.split("?")[0] != PATH:
            return self._send(404, {"message": f"no webhook at {self.path}; the webhook is {PATH}"})
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return self._send(411, {"message": "a review needs a Content-Length"})
        if not 0 < length <= MAX_BODY_BYTES:
            return self._send(413 if length > 0 else 400,
                              {"message": f"Content-Length {length} is outside 1..{MAX_BODY_BYTES}"})
        try:
            fetch = self.server.fetch if isinstance(self.server, _Server) else None
            answer = review_answer(json.loads(self.rfile.read(length)), fetch)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            return self._send(400, {"message": f"malformed AdmissionReview: {str(e)[:200]}"})
        self._send(200, answer)

    def do_GET(self) -> None:
        self._send(405, {"message": f"POST an AdmissionReview to {PATH}"})

    def _send(self, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fetch: Fetch | None = None

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("webhook connection from %s failed", client_address, exc_info=True)  # a failed handshake, a reset


def serve(host: str, port: int, cert: str | None, key: str | None, insecure: bool = False,
          fetch: Fetch | None = None) -> ThreadingHTTPServer:
    """Start the webhook server on a thread of its own; `shutdown()` on the result stops it. `fetch` reads an
    InferenceDeployment for reviews of its scale subresource (without it those are allowed)."""
    if not insecure and not (cert and key):
        raise ValueError("the webhook serves HTTPS: give its certificate and key files (or --webhook-insecure)")
    server = _Server((host, port), _Handler)
    server.fetch = fetch
    if not insecure:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(str(cert), str(key))
        server.socket = context.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    threading.Thread(target=server.serve_forever, name="webhook", daemon=True).start()
    log.info("admission webhook on %s://%s:%d%s", "http" if insecure else "https", host, port, PATH)
    return server
