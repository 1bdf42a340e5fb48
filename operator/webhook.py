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
import os
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


class Certificate:
    """The webhook's TLS context, loaded again when its certificate or key file changes.

    cert-manager or the chart's documented rotation replaces the Secret's files in the pod (the kubelet swaps the
    mounted folder) and the caBundle with them; a context loaded once would keep the old certificate until the
    operator restarts, and every InferenceDeployment write would fail with an unknown authority. Each new
    connection gets the context of the files as they are (checked by modification time, size and inode)."""

    def __init__(self, cert: str, key: str) -> None:
        self.cert, self.key = cert, key
        self._lock = threading.Lock()
        self._stamp: tuple[tuple[int, int, int], ...] = ()
        self._context: ssl.SSLContext | None = None
        self.loads = 0
        self.context()  # a certificate that cannot be read fails the start, not the first review

    def _files(self) -> tuple[tuple[int, int, int], ...]:
        stats = (os.stat(self.cert), os.stat(self.key))
        return tuple((s.st_mtime_ns, s.st_size, s.st_ino) for s in stats)

    def context(self) -> ssl.SSLContext:
        with self._lock:
            try:
                stamp = self._files()
            except OSError:
                if self._context is None:
                    raise
                return self._context  # in the middle of a swap: keep serving the last certificate
            if self._context is None or stamp != self._stamp:
                context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                try:
                    context.load_cert_chain(self.cert, self.key)
                except (OSError, ssl.SSLError):
                    if self._context is None:
                        raise
                    log.warning("webhook certificate %s could not be loaded; keeping the last one", self.cert)
                    return self._context
                self._context, self._stamp = context, stamp
                self.loads += 1
                if self.loads > 1:
                    log.info("webhook certificate %s reloaded", self.cert)
            return self._context


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fetch: Fetch | None = None
    certificate: Certificate | None = None

    def get_request(self) -> tuple[Any, Any]:
        sock, address = self.socket.accept()
        if self.certificate is None:
            return sock, address
        return self.certificate.context().wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

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
        try:
            server.certificate = Certificate(str(cert), str(key))
        except BaseException:
            server.server_close()
            raise
    threading.Thread(target=server.serve_forever, name="webhook", daemon=True).start()
    log.info("admission webhook on %s://%s:%d%s", "http" if insecure else "https", host, port, PATH)
    return server
