"""The router's route table as the operator derives it from a deployment's status and pods: one entry per DPA
group at its leader pod, nothing for pods that are gone, no new requests for groups that leave or are not ready;
and the InferencePool of the leaders for a Gateway API endpoint picker."""

from __future__ import annotations

from typing import Any

import pytest
from shardwise.controllers.routes import Leader, table
from shardwise.operator import builders as b
from shardwise.operator import routing
from shardwise.operator.kube import KubeError
from shardwise.operator.routing import leaders

from shardwise.api import InferenceDeploymentSpec

OWNER: dict[str, Any] = {"apiVersion": "shardwise.io/v1alpha1", "kind": "InferenceDeployment",
                         "metadata": {"name": "web", "namespace": "ml", "uid": "u-1"}}


def spec(tp: int = 2, dpa: int = 2, gpus_per_node: int = 2, engine: str = "reference") -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({
        "model": {"preset": "tiny-moe"}, "hardware": {"gpu": "cpu", "gpusPerNode": gpus_per_node},
        "parallelism": {"tp": tp, "dpa": dpa}, "runtime": {"engine": engine}})


def pod(i: int, *, ready: bool = True, role: str = "leader", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"web-{i}", "labels": {b.LABEL_POD_INDEX: str(i), b.LABEL_ROLE: role}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"podIP": f"10.0.0.{i + 1}", "phase": "Running", "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}


def status(layout: dict[int, list[int]], dpa: int, world: int = 3) -> dict[str, Any]:
    return {"worldGeneration": world, "configuredWorld": world, "worldDpa": dpa,
            "pods": [{"name": f"web-{i}", "index": i, "ranks": r} for i, r in layout.items()]}


def test_each_group_is_served_at_its_leader_pod() -> None:
    st = status({0: [0, 1], 1: [2, 3]}, 2)
    got = leaders(spec(), st, [pod(0), pod(1)])
    assert got == [Leader("http://10.0.0.1:8000", (0,), True), Leader("http://10.0.0.2:8000", (1,), True)]


def test_a_pod_that_leads_two_groups_has_both() -> None:
    st = status({0: [0, 1, 2, 3]}, 2)
    assert leaders(spec(gpus_per_node=4), st, [pod(0)]) == [Leader("http://10.0.0.1:8000", (0, 1), True)]


def test_leaving_unready_and_gone_pods() -> None:
    st = status({0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]}, 4)
    got = leaders(spec(dpa=4), st, [pod(0), pod(1, ready=False), pod(3, deleting=True), pod(2)], leaving=[2])
    assert [(x.groups, x.admitting) for x in got] == [((0,), True), ((1,), False), ((2,), False)]


def test_a_world_being_formed_has_no_routes() -> None:
    st = {**status({0: [0, 1]}, 1), "configuredWorld": 2}
    assert leaders(spec(dpa=1), st, [pod(0)]) == []


def test_vllm_pods_that_serve_the_api_are_routed_by_pod() -> None:
    st = status({0: [0, 1], 1: [2, 3]}, 2)
    got = leaders(spec(engine="vllm"), st, [pod(0), pod(1, role="worker")])
    assert got == [Leader("http://10.0.0.1:8000", (0,), True)]


def test_the_table_is_versioned_by_its_content() -> None:
    one = table("m", 3, [Leader("http://a:8000", (1,), True), Leader("http://b:8000", (0,), False)])
    assert [g["group"] for g in one["groups"]] == [0, 1] and one["groups"][0] == {
        "group": 0, "url": "http://b:8000", "admitting": False}
    again = table("m", 3, [Leader("http://b:8000", (0,), False), Leader("http://a:8000", (1,), True)])
    assert again["version"] == one["version"]
    assert table("m", 3, [Leader("http://b:8000", (0,), True)])["version"] != one["version"]


def test_the_inference_pool_selects_the_leaders_on_port_8000() -> None:
    pool = b.build_inference_pool(OWNER)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["name"] == "web"
    assert pool["spec"]["selector"]["matchLabels"] == {**b.selector("web"), "shardwise.io/role": "leader"}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["endpointPickerRef"] == {"name": "web-epp", "port": {"number": 9002}, "failureMode": "FailOpen"}
    named = b.build_inference_pool(OWNER, b.BuildOptions(endpoint_picker="gw-epp:9100"))
    assert named["spec"]["endpointPickerRef"]["name"] == "gw-epp" and named["spec"]["endpointPickerRef"]["port"] == {
        "number": 9100}


def test_the_network_policy_admits_only_the_deployments_own_peers() -> None:
    pol = b.build_network_policy(OWNER, b.BuildOptions(network_policy_namespace="shardwise-system"))
    spec = pol["spec"]
    assert pol["kind"] == "NetworkPolicy" and spec["policyTypes"] == ["Ingress"]
    assert spec["podSelector"]["matchLabels"] == b.selector("web")
    peers, router, operator, metrics = spec["ingress"]
    assert peers == {"from": [{"podSelector": {"matchLabels": b.selector("web")}}]}  # every port: collectives
    assert router["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert router["from"][0] == {"podSelector": {"matchLabels": b.router_selector("web")}}
    assert router["from"][1] == {"namespaceSelector": {"matchLabels": {"shardwise.io/gateway": "true"}}}
    assert operator["from"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "shardwise-system"}}
    assert {p["port"] for p in operator["ports"]} == {50051, 8000}
    assert metrics == {"ports": [{"protocol": "TCP", "port": 9090}]}  # from anywhere: Prometheus


class _NoAnswerKube:
    """The API server down: every request fails as the operator's client reports it (status 0)."""

    def __init__(self, status: int) -> None:
        self.status, self.calls = status, 0

    def request(self, method: str, path: str) -> Any:
        self.calls += 1
        raise KubeError(self.status, "the API server did not answer GET: Connection refused")


class _PoolHost:
    def __init__(self, kube: Any) -> None:
        self.kube, self.pool_api = kube, None

    @property
    def build(self) -> b.BuildOptions:
        return b.BuildOptions()


def test_an_api_server_that_does_not_answer_the_pool_look_up_does_not_fail_the_step_and_is_asked_again() -> None:
    host = _PoolHost(_NoAnswerKube(0))
    obj = {"metadata": {"name": "d", "namespace": "default", "uid": "u"}}
    routing.ensure_pool(host, obj)  # no exception: the InferencePool is an extra
    routing.ensure_pool(host, obj)
    assert host.pool_api is None and host.kube.calls == 2  # nothing concluded from no answer: asked again


def test_a_refused_pool_look_up_still_fails_the_step() -> None:
    with pytest.raises(KubeError):
        routing.ensure_pool(_PoolHost(_NoAnswerKube(403)), {"metadata": {"name": "d", "namespace": "default"}})
