"""The API server's `pods/NAME/binding` subresource, as a scheduler uses it: a Binding sets the pod's node and its
PodScheduled condition once; a second binding, a missing pod or a Binding without a node are refused."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("kmock")

from shardwise.devcluster.apiserver import APIServer

PODS = "/api/v1/namespaces/default/pods"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with APIServer() as server:
        yield server.url


def call(url: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def binding(pod: str, node: str | None) -> dict[str, Any]:
    target = {"apiVersion": "v1", "kind": "Node", **({"name": node} if node else {})}
    return {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod}, "target": target}


def new_pod(url: str, name: str) -> dict[str, Any]:
    status, pod = call(url, "POST", PODS, {"metadata": {"name": name},
                                          "spec": {"containers": [{"name": "main", "image": "x"}]}})
    assert status == 201, pod
    return pod


def test_a_binding_sets_the_node_and_the_scheduled_condition(url: str) -> None:
    new_pod(url, "bind-me")
    status, answer = call(url, "POST", f"{PODS}/bind-me/binding", binding("bind-me", "node-0"))
    assert (status, answer["kind"], answer["status"]) == (201, "Status", "Success")
    _, pod = call(url, "GET", f"{PODS}/bind-me")
    assert pod["spec"]["nodeName"] == "node-0"
    scheduled = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
    assert [c["status"] for c in scheduled] == ["True"]


def test_a_bound_pod_cannot_be_bound_again(url: str) -> None:
    new_pod(url, "bound-once")
    assert call(url, "POST", f"{PODS}/bound-once/binding", binding("bound-once", "node-0"))[0] == 201
    status, answer = call(url, "POST", f"{PODS}/bound-once/binding", binding("bound-once", "node-1"))
    assert (status, answer["reason"]) == (409, "Conflict")
    assert 'already assigned to node "node-0"' in answer["message"]


@pytest.mark.parametrize(("path", "body", "code"), [
    (f"{PODS}/missing/binding", binding("missing", "node-0"), 404),
    (f"{PODS}/no-target/binding", binding("no-target", None), 422),
    (f"{PODS}/no-target/eviction", {"apiVersion": "policy/v1", "kind": "Eviction"}, 405),
])
def test_bindings_that_cannot_apply_are_refused(url: str, path: str, body: dict[str, Any], code: int) -> None:
    if call(url, "GET", f"{PODS}/no-target")[0] == 404:
        new_pod(url, "no-target")
    assert call(url, "POST", path, body)[0] == code
    assert not call(url, "GET", f"{PODS}/no-target")[1]["spec"].get("nodeName")
