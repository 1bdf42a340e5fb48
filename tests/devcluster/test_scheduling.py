"""The scheduler's decisions (scheduling.py), as pure functions: quantities, requests, filters, the choice of a
node and the message of a pod that fits nowhere."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
from shardwise.devcluster.scheduling import (
    place,
    pod_requests,
    schedulable,
    unschedulable_condition,
    usage,
)

from shardwise.api import parse_quantity

GPU = "nvidia.com/gpu"


def node(name: str, *, gpus: int = 4, labels: dict[str, str] | None = None, taints: list[dict[str, str]] | None = None,
         ready: bool = True, unschedulable: bool = False) -> dict[str, Any]:
    capacity = {"cpu": "8", "memory": "32Gi", "pods": "110", GPU: str(gpus)}
    return {"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
            "spec": {"taints": taints or [], "unschedulable": unschedulable},
            "status": {"capacity": capacity, "allocatable": capacity,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def pod(name: str = "p", *, gpus: int = 0, cpu: str | None = None, **spec: Any) -> dict[str, Any]:
    limits = {GPU: gpus} if gpus else {}
    requests = {"cpu": cpu} if cpu else {}
    return {"metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
            "spec": {"containers": [{"name": "main", "resources": {"limits": limits, "requests": requests}}], **spec},
            "status": {"phase": "Pending"}}


def bound(name: str, node_name: str, gpus: int, phase: str = "Running") -> dict[str, Any]:
    p = pod(name, gpus=gpus, nodeName=node_name)
    p["status"]["phase"] = phase
    return p


@pytest.mark.parametrize(("text", "value"), [
    ("500m", Fraction(1, 2)), ("2", Fraction(2)), ("1.5", Fraction(3, 2)), ("16Gi", Fraction(16 * 2**30)),
    ("1k", Fraction(1000)), ("1e3", Fraction(1000)), ("250M", Fraction(250_000_000)), (3, Fraction(3)),
])
def test_quantities_parse_as_kubernetes_writes_them(text: str | int, value: Fraction) -> None:
    assert parse_quantity(text) == value


def test_a_malformed_quantity_is_refused() -> None:
    with pytest.raises(ValueError, match="invalid quantity"):
        parse_quantity("12 cores")


def test_a_limit_stands_for_a_missing_request_and_init_containers_count_at_their_largest() -> None:
    p = pod(gpus=2, cpu="1")
    p["spec"]["initContainers"] = [{"name": "init", "resources": {"requests": {"cpu": "3"}}}]
    assert pod_requests(p) == {GPU: 2, "cpu": 3, "pods": 1}


@pytest.mark.parametrize(("case", "the_pod", "nodes", "used", "placed", "message"), [
    ("the least allocated node wins", pod(gpus=1), [node("a"), node("b")], {"a": {GPU: Fraction(2)}}, "b", ""),
    ("ties go to the first name", pod(gpus=1), [node("b"), node("a")], {}, "a", ""),
    ("GPUs in use are not booked again", pod(gpus=3), [node("a"), node("b")],
     {"a": {GPU: Fraction(2)}, "b": {GPU: Fraction(4)}}, None,
     "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."),
    ("a node selector picks the node", pod(nodeSelector={"pool": "big"}),
     [node("a"), node("b", labels={"pool": "big"})], {}, "b", ""),
    ("an untolerated taint keeps the pod off", pod(), [node("a", taints=[{"key": "gpu", "value": "h100",
                                                                        "effect": "NoSchedule"}])],
     {}, None, "0/1 nodes are available: 1 node(s) had untolerated taint {gpu: h100}."),
    ("a toleration lets it on", pod(tolerations=[{"key": "gpu", "operator": "Exists"}]),
     [node("a", taints=[{"key": "gpu", "value": "h100", "effect": "NoSchedule"}])], {}, "a", ""),
    ("a PreferNoSchedule taint does not filter", pod(),
     [node("a", taints=[{"key": "x", "effect": "PreferNoSchedule"}])], {}, "a", ""),
    ("a node that is not Ready is tainted not-ready", pod(), [node("a", ready=False)], {}, None,
     "0/1 nodes are available: 1 node(s) had untolerated taint {node.kubernetes.io/not-ready: }."),
    ("a cordoned node is unschedulable", pod(), [node("a", unschedulable=True)], {}, None,
     "0/1 nodes are available: 1 node(s) were unschedulable."),
    ("reasons are counted and sorted", pod(gpus=8, nodeSelector={"pool": "big"}),
     [node("a"), node("b", labels={"pool": "big"}), node("c", labels={"pool": "big"})], {}, None,
     "0/3 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, 2 Insufficient nvidia.com/gpu."),
    ("no nodes at all", pod(), [], {}, None, "no nodes available to schedule pods"),
    ("required node affinity", pod(affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["x", "y"]}]}]}}}),
     [node("a", labels={"pool": "z"}), node("b", labels={"pool": "y"})], {}, "b", ""),
])
def test_placement(case: str, the_pod: dict[str, Any], nodes: list[dict[str, Any]], used: dict[str, Any],
                   placed: str | None, message: str) -> None:
    decision = place(the_pod, nodes, used)
    assert (decision.node, decision.message) == (placed, message), case


def test_usage_counts_bound_and_assumed_pods_but_not_terminated_ones() -> None:
    pods = [bound("a", "n1", 2), bound("b", "n1", 1, phase="Succeeded"), pod("c", gpus=1)]
    assert usage(pods, {"uid-c": "n2"}) == {"n1": {GPU: 2, "pods": 1}, "n2": {GPU: 1, "pods": 1}}


@pytest.mark.parametrize(("spec", "expected"), [
    ({}, True), ({"schedulerName": "shardwise"}, True), ({"schedulerName": "other"}, False),
    ({"nodeName": "n1"}, False),
])
def test_the_scheduler_takes_unbound_pods_that_ask_for_it(spec: dict[str, Any], expected: bool) -> None:
    assert schedulable(pod(**spec), ("default-scheduler", "shardwise")) is expected


def test_the_unschedulable_condition_is_written_only_when_it_changes() -> None:
    p = pod()
    first = unschedulable_condition(p, "0/1 nodes are available: 1 Too many pods.", "2026-01-01T00:00:00Z")
    assert first is not None and first["reason"] == "Unschedulable"
    p["status"]["conditions"] = [first]
    assert unschedulable_condition(p, first["message"], "2026-01-01T00:01:00Z") is None
    changed = unschedulable_condition(p, "0/2 nodes are available: 2 Too many pods.", "2026-01-01T00:02:00Z")
    assert changed is not None and changed["lastTransitionTime"] == "2026-01-01T00:00:00Z"
