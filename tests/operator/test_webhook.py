"""The admission webhook of `shardwise operator`, over HTTP as an API server calls it: invalid layouts are refused
with the planner's messages, valid ones allowed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kopf")
pytest.importorskip("kmock")

from shardwise.devcluster.apiserver import APIServer
from shardwise.devcluster.session import LocalSession

from tests.conftest import shardwise_command
from tests.devcluster.apiclient import CRD_FILE, CRDS, Client

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "tiny-moe.yaml").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def webhook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("webhook")
    port, health = free_port(), free_port()
    with APIServer() as server:
        config = server.write_kubeconfig(tmp / "kubeconfig")
        Client(server.url).create(CRDS, yaml.safe_load(CRD_FILE.read_text()))  # kopf serves known resources only
        log = open(tmp / "operator.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen([*shardwise_command(), "operator", "--kubeconfig", str(config), "--webhook-port",
                                 str(port), "--webhook-insecure", "--health-port", str(health)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}/validate-inferencedeployment"

            def answers() -> bool:
                try:
                    review(url, "CREATE", EXAMPLE)
                    return True
                except (urllib.error.URLError, ConnectionError):
                    assert proc.poll() is None, (tmp / "operator.log").read_text()[-3000:]
                    return False

            LocalSession.wait_for(answers, 60, "the webhook server")
            scaled = {**EXAMPLE, "metadata": {"name": "scaled", "namespace": "default"}}
            Client(server.url).create("/apis/shardwise.io/v1alpha1/namespaces/default/inferencedeployments", scaled)
            with urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=5) as r:
                assert r.status == 200
            yield url
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
            log.close()


def review(url: str, operation: str, obj: dict[str, Any]) -> dict[str, Any]:
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "1234", "kind": {"group": "shardwise.io", "version": "v1alpha1", "kind": "InferenceDeployment"},
        "resource": {"group": "shardwise.io", "version": "v1alpha1", "resource": "inferencedeployments"},
        "requestKind": {"group": "shardwise.io", "version": "v1alpha1", "kind": "InferenceDeployment"},
        "requestResource": {"group": "shardwise.io", "version": "v1alpha1", "resource": "inferencedeployments"},
        "name": obj["metadata"]["name"], "namespace": "default", "operation": operation,
        "userInfo": {"username": "tester"}, "object": {**obj, "metadata": {**obj["metadata"], "namespace": "default"}},
        "oldObject": None, "dryRun": False, "options": None}}
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["response"]  # type: ignore[no-any-return]


def with_parallelism(**par: int) -> dict[str, Any]:
    obj = json.loads(json.dumps(EXAMPLE))
    obj["spec"]["parallelism"].update(par)
    return obj


def test_a_valid_layout_is_allowed(webhook: str) -> None:
    answer = review(webhook, "CREATE", EXAMPLE)
    assert answer["allowed"] is True and answer["uid"] == "1234"


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
def test_an_invalid_layout_is_refused_with_the_planners_message(webhook: str, operation: str) -> None:
    answer = review(webhook, operation, with_parallelism(tp=3))
    assert answer["allowed"] is False
    message = answer["status"]["message"]
    assert message.startswith("invalid InferenceDeployment: ") and "tp" in message and "3" in message
    assert answer["status"]["code"] == 422


def scale_review(url: str, name: str, replicas: Any) -> dict[str, Any]:
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "5678", "kind": {"group": "autoscaling", "version": "v1", "kind": "Scale"},
        "resource": {"group": "shardwise.io", "version": "v1alpha1", "resource": "inferencedeployments"},
        "subResource": "scale", "name": name, "namespace": "default", "operation": "UPDATE",
        "object": {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": name},
                   "spec": {"replicas": replicas}}}}
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["response"]  # type: ignore[no-any-return]


def test_kubectl_scale_outside_min_and_max_dpa_is_refused_like_a_spec_update(webhook: str) -> None:
    low, high = EXAMPLE["spec"]["elastic"]["minDpa"], EXAMPLE["spec"]["elastic"]["maxDpa"]
    refused = scale_review(webhook, "scaled", high + 1)
    assert refused["allowed"] is False and refused["status"]["code"] == 422
    assert f"scale to {high + 1}: spec.parallelism.dpa: dpa={high + 1} is outside elastic.minDpa..maxDpa = " \
           f"{low}..{high}" in refused["status"]["message"], refused
    assert scale_review(webhook, "scaled", high)["allowed"] is True
    assert scale_review(webhook, "scaled", "many")["allowed"] is False
    assert scale_review(webhook, "not-there", 1000)["allowed"] is True  # nothing to check it against


def test_a_schema_error_is_refused_with_the_field_path(webhook: str) -> None:
    answer = review(webhook, "CREATE", with_parallelism(dpa=0))
    assert answer["allowed"] is False
    assert "spec.parallelism.dpa" in answer["status"]["message"]


def raw_post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    import http.client
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.putrequest("POST", u.path, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


@pytest.mark.parametrize("body,headers,status,fragment", [
    (b"{}", {"Content-Length": "-1"}, 400, "Content-Length -1 is outside"),
    (b"{}", {}, 411, "needs a Content-Length"),
    (b"not json", {"Content-Length": "8"}, 400, "malformed AdmissionReview"),
    (b'"\\ud800"', {"Content-Length": "8"}, 400, "not an AdmissionReview"),
    (b'{"request": {}}', {"Content-Length": "15"}, 400, "has no uid"),
    (b"[" * 100_000 + b"]" * 100_000, {"Content-Length": "200000"}, 400, "malformed AdmissionReview"),
])
def test_a_malformed_review_gets_a_400_that_says_why(webhook: str, body: bytes, headers: dict[str, str],
                                                     status: int, fragment: str) -> None:
    code, answer = raw_post(webhook, body, {"Content-Type": "application/json", **headers})
    assert code == status and fragment in answer["message"], (code, answer)
    assert review(webhook, "CREATE", EXAMPLE)["allowed"] is True  # and the server still answers


def test_every_replica_admits_the_standby_too(tmp_path: Path) -> None:
    """Two replicas with leader election behind one webhook Service: a review reaching the standby is answered."""
    ports = [free_port(), free_port()]
    with APIServer() as server:
        config = server.write_kubeconfig(tmp_path / "kubeconfig")
        Client(server.url).create(CRDS, yaml.safe_load(CRD_FILE.read_text()))
        procs, logs = [], []
        try:
            for i, port in enumerate(ports):
                logs.append(tmp_path / f"operator-{i}.log")
                with open(logs[-1], "wb") as out:
                    procs.append(subprocess.Popen(
                        [*shardwise_command(), "operator", "--kubeconfig", str(config), "--webhook-port", str(port),
                         "--webhook-insecure", "--leader-election-name", "lead", "--leader-election-namespace",
                         "default"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                        env={**os.environ, "POD_NAME": f"op-{i}"}))
            LocalSession.wait_for(lambda: any("operator: leading" in log.read_text() for log in logs), 60, "a leader")
            standby = next(i for i, log in enumerate(logs) if "operator: leading" not in log.read_text())
            LocalSession.wait_for(lambda: "waiting for the lease" in logs[standby].read_text(), 30, "the standby")
            url = f"http://127.0.0.1:{ports[standby]}/validate-inferencedeployment"
            assert review(url, "CREATE", EXAMPLE)["allowed"] is True
            refused = review(url, "UPDATE", with_parallelism(tp=3))
            assert refused["allowed"] is False and refused["status"]["code"] == 422
            assert "operator: leading" not in logs[standby].read_text()  # it answered as a standby
        finally:
            for p in procs:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(30)
