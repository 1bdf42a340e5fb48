"""Built-in kinds the chart ships besides the workloads: NetworkPolicy (networking.k8s.io/v1) and
PodDisruptionBudget (policy/v1) are discovered, stored, listed, watched, printed, deleted and garbage-collected by
their ownerReferences like any kind (stored only: no policy is enforced)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kmock")

from tests.devcluster.apiclient import Client

POLICIES = "/apis/networking.k8s.io/v1/namespaces/default/networkpolicies"
BUDGETS = "/apis/policy/v1/namespaces/default/poddisruptionbudgets"
CMS = "/api/v1/namespaces/default/configmaps"


def network_policy(name: str, **metadata: Any) -> dict[str, Any]:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": name, **metadata},
            "spec": {"podSelector": {"matchLabels": {"app": "web"},
                                     "matchExpressions": [{"key": "tier", "operator": "In", "values": ["b", "a"]},
                                                          {"key": "legacy", "operator": "DoesNotExist"}]},
                     "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": {}}]}]}}


def test_kubectl_api_resources_lists_network_policies_and_pod_disruption_budgets(kubectl: Callable[..., str]) -> None:
    rows = {line.split()[0]: line.split()[1:] for line in kubectl("api-resources").splitlines()[1:]}
    assert rows["networkpolicies"] == ["netpol", "networking.k8s.io/v1", "true", "NetworkPolicy"]
    assert rows["poddisruptionbudgets"] == ["pdb", "policy/v1", "true", "PodDisruptionBudget"]


def test_a_network_policy_is_stored_listed_watched_and_goes_with_its_owner(api: Client) -> None:
    owner = api.create(CMS, {"metadata": {"name": "owner"}})
    version = api.get(POLICIES)["metadata"]["resourceVersion"]
    with api.watch(POLICIES, resourceVersion=version) as stream:
        reference = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}
        created = api.create(POLICIES, network_policy("web", ownerReferences=[reference]))
        assert created["kind"] == "NetworkPolicy" and created["spec"]["policyTypes"] == ["Ingress"]
        assert api.names(POLICIES) == ["web"]
        assert api.names("/apis/networking.k8s.io/v1/networkpolicies") == ["web"]
        api.ok("DELETE", f"{CMS}/owner")
        events = [json.loads(stream.readline()) for _ in range(2)]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "web"), ("DELETED", "web")]
    assert api.call("GET", f"{POLICIES}/web")[0] == 404


def test_a_network_policy_and_a_pod_disruption_budget_are_deleted_and_printed_as_kubectl_prints_them(
        kubectl: Callable[..., str], api: Client, tmp_path: Path) -> None:
    budget = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "db"},
              "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "db"}}}}
    manifest = tmp_path / "objects.yaml"
    manifest.write_text(yaml.safe_dump_all([network_policy("web"), network_policy("all") | {"spec": {
        "podSelector": {}}}, budget]))
    kubectl("apply", "-f", str(manifest))
    assert [line.split()[:2] for line in kubectl("get", "netpol").splitlines()] == [
        ["NAME", "POD-SELECTOR"], ["all", "<none>"], ["web", "app=web,!legacy,tier"]]
    assert "tier in (a,b)" in kubectl("get", "netpol", "web")
    api.patch(f"{BUDGETS}/db/status", {"status": {"disruptionsAllowed": 2}})
    assert kubectl("get", "pdb").splitlines()[1].split()[:4] == ["db", "1", "N/A", "2"]
    kubectl("delete", "-f", str(manifest))
    assert api.names(POLICIES) == [] and api.names(BUDGETS) == []
