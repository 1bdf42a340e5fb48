"""ownerReference garbage collection in the local API server through real HTTP: background, foreground and orphan
deletion, dependents with other owners or their own finalizers, namespaces, and the watch events of each step."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kmock")

from shardwise.devcluster.apiserver import APIServer

from tests.devcluster import apiclient

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "inferencedeployments.shardwise.io.yaml"
EXAMPLE = ROOT / "examples" / "tiny-moe.yaml"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
NAMESPACES = "/api/v1/namespaces"


def cms(namespace: str = "default") -> str:
    return f"/api/v1/namespaces/{namespace}/configmaps"


PODS = "/api/v1/namespaces/default/pods"
SERVICES = "/api/v1/namespaces/default/services"
IDEPS = "/apis/shardwise.io/v1alpha1/namespaces/default/inferencedeployments"


class Client(apiclient.Client):
    """The shared client plus what these tests watch for; PATCH here is a merge patch."""

    def call(self, method: str, path: str, body: Any = None, *, content_type: str | None = None,
             **params: Any) -> tuple[int, Any]:
        default = apiclient.MERGE if method == "PATCH" else "application/json"
        return super().call(method, path, body, content_type=content_type or default, **params)

    def exists(self, path: str) -> bool:
        return self.call("GET", path)[0] == 200

    def revision(self) -> str:
        return str(self.ok("GET", NAMESPACES)["metadata"]["resourceVersion"])

    def events(self, path: str, since: str, count: int) -> list[tuple[str, str, bool]]:
        """The next `count` events after resourceVersion `since`: (type, name, marked for deletion)."""
        query = urllib.parse.urlencode({"watch": "true", "resourceVersion": since})
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=5) as stream:
            events = [json.loads(stream.readline()) for _ in range(count)]
        return [(e["type"], e["object"]["metadata"]["name"], "deletionTimestamp" in e["object"]["metadata"])
                for e in events]


@pytest.fixture
def api() -> Iterator[Client]:
    server = APIServer()
    try:
        yield Client(server.start())
    finally:
        server.stop()


def ref(owner: dict[str, Any], *, block: bool = False) -> dict[str, Any]:
    found = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
             "uid": owner["metadata"]["uid"], "controller": True}
    return {**found, "blockOwnerDeletion": True} if block else found


def configmap(api: Client, name: str, *owners: dict[str, Any], namespace: str = "default", block: bool = False,
              **meta: Any) -> dict[str, Any]:
    metadata = {"name": name, "ownerReferences": [ref(owner, block=block) for owner in owners], **meta}
    return dict(api.ok("POST", cms(namespace), {"metadata": metadata, "data": {"a": "1"}}))


def test_a_background_delete_removes_the_dependents_after_the_owner_recursively(api: Client) -> None:
    owner = configmap(api, "owner")
    child = configmap(api, "child", owner)
    configmap(api, "grandchild", child)
    configmap(api, "bystander")
    since = api.revision()
    status, _ = api.call("DELETE", f"{cms()}/owner")
    assert status == 200
    assert not api.exists(f"{cms()}/child") and not api.exists(f"{cms()}/grandchild")
    assert api.exists(f"{cms()}/bystander")
    assert api.events(cms(), since, 3) == [("DELETED", "owner", False), ("DELETED", "child", False),
                                          ("DELETED", "grandchild", False)]


def test_a_dependent_with_another_live_owner_is_kept_and_loses_only_the_reference_to_the_deleted_owner(
        api: Client) -> None:
    first, second = configmap(api, "first"), configmap(api, "second")
    configmap(api, "shared", first, second)
    since = api.revision()
    api.ok("DELETE", f"{cms()}/first")
    shared = api.ok("GET", f"{cms()}/shared")
    assert [r["name"] for r in shared["metadata"]["ownerReferences"]] == ["second"]
    assert api.events(cms(), since, 2) == [("DELETED", "first", False), ("MODIFIED", "shared", False)]
    api.ok("DELETE", f"{cms()}/second")
    assert not api.exists(f"{cms()}/shared")


def test_a_foreground_delete_keeps_the_owner_marked_until_its_blocking_dependents_are_gone(api: Client) -> None:
    owner = configmap(api, "owner")
    configmap(api, "held", owner, block=True, finalizers=["example.com/hold"])
    configmap(api, "free", owner)
    since = api.revision()
    status, marked = api.call("DELETE", f"{cms()}/owner", {"propagationPolicy": "Foreground"})
    assert status == 202 and marked["metadata"]["finalizers"] == ["foregroundDeletion"]
    assert marked["metadata"]["deletionTimestamp"]
    assert api.ok("GET", f"{cms()}/owner")["metadata"]["deletionTimestamp"]
    assert api.ok("GET", f"{cms()}/held")["metadata"]["deletionTimestamp"] and not api.exists(f"{cms()}/free")
    api.ok("PATCH", f"{cms()}/held", {"metadata": {"finalizers": None}})
    assert not api.exists(f"{cms()}/held") and not api.exists(f"{cms()}/owner")
    assert api.events(cms(), since, 5) == [("MODIFIED", "owner", True), ("MODIFIED", "held", True),
                                          ("DELETED", "free", False), ("DELETED", "held", True),
                                          ("DELETED", "owner", True)]


def test_a_foreground_delete_in_the_query_without_dependents_marks_then_deletes_the_owner(api: Client) -> None:
    configmap(api, "alone")
    since = api.revision()
    api.ok("DELETE", f"{cms()}/alone", propagationPolicy="Foreground")
    assert not api.exists(f"{cms()}/alone")
    assert api.events(cms(), since, 2) == [("MODIFIED", "alone", True), ("DELETED", "alone", True)]


def test_an_orphan_delete_keeps_the_dependents_without_their_reference_to_the_owner(api: Client) -> None:
    owner = configmap(api, "owner")
    configmap(api, "child", owner)
    since = api.revision()
    api.ok("DELETE", f"{cms()}/owner", {"propagationPolicy": "Orphan"})
    assert not api.exists(f"{cms()}/owner")
    assert "ownerReferences" not in api.ok("GET", f"{cms()}/child")["metadata"]
    assert api.events(cms(), since, 3) == [("MODIFIED", "owner", True), ("MODIFIED", "child", False),
                                          ("DELETED", "owner", True)]


def test_an_orphan_delete_by_the_deprecated_orphan_dependents_query_keeps_the_dependents(api: Client) -> None:
    owner = configmap(api, "owner")
    configmap(api, "child", owner)
    api.ok("DELETE", f"{cms()}/owner", orphanDependents="true")
    assert api.exists(f"{cms()}/child") and not api.exists(f"{cms()}/owner")


def test_an_unknown_or_doubly_given_propagation_policy_is_invalid_and_deletes_nothing(api: Client) -> None:
    configmap(api, "owner")
    assert api.call("DELETE", f"{cms()}/owner", {"propagationPolicy": "Sideways"})[0] == 422
    assert api.call("DELETE", f"{cms()}/owner", {"propagationPolicy": "Orphan", "orphanDependents": True})[0] == 422
    assert api.exists(f"{cms()}/owner")


def test_a_dependent_with_its_own_finalizer_only_gets_a_deletion_timestamp(api: Client) -> None:
    owner = configmap(api, "owner")
    configmap(api, "held", owner, finalizers=["example.com/hold"])
    api.ok("DELETE", f"{cms()}/owner")
    held = api.ok("GET", f"{cms()}/held")
    assert held["metadata"]["deletionTimestamp"] and held["metadata"]["finalizers"] == ["example.com/hold"]


def test_a_namespaced_owner_only_touches_dependents_in_its_own_namespace(api: Client) -> None:
    api.ok("POST", NAMESPACES, {"metadata": {"name": "other"}})
    owner = configmap(api, "owner")
    configmap(api, "here", owner)
    configmap(api, "there", owner, namespace="other")
    api.ok("DELETE", f"{cms()}/owner")
    assert not api.exists(f"{cms()}/here") and api.exists(f"{cms('other')}/there")


def test_a_cluster_scoped_owner_collects_dependents_in_every_namespace(api: Client) -> None:
    api.ok("POST", NAMESPACES, {"metadata": {"name": "other"}})
    owner = api.ok("POST", NAMESPACES, {"metadata": {"name": "owner-ns"}})
    configmap(api, "here", owner)
    configmap(api, "there", owner, namespace="other")
    api.ok("DELETE", f"{NAMESPACES}/owner-ns")
    assert not api.exists(f"{cms()}/here") and not api.exists(f"{cms('other')}/there")


def test_an_inference_deployment_owns_pods_services_and_config_maps_across_kinds(api: Client) -> None:
    api.ok("POST", CRDS, yaml.safe_load(CRD_FILE.read_text()))
    owner = api.ok("POST", IDEPS, yaml.safe_load(EXAMPLE.read_text()))
    name = owner["metadata"]["name"]
    owned = {"ownerReferences": [ref(owner, block=True)]}
    api.ok("POST", PODS, {"metadata": {"name": "rank-0", **owned},
                          "spec": {"containers": [{"name": "main", "image": "busybox"}]}})
    api.ok("POST", SERVICES, {"metadata": {"name": "ranks", **owned}, "spec": {"ports": [{"port": 80}]}})
    configmap(api, "plan", owner, block=True)
    since = api.revision()
    api.ok("DELETE", f"{IDEPS}/{name}", {"propagationPolicy": "Foreground"})
    for path in (f"{IDEPS}/{name}", f"{PODS}/rank-0", f"{SERVICES}/ranks", f"{cms()}/plan"):
        assert not api.exists(path), path
    assert api.events(IDEPS, since, 2) == [("MODIFIED", name, True), ("DELETED", name, True)]
    assert api.events(PODS, since, 1) == [("DELETED", "rank-0", False)]


def test_a_dependent_created_after_its_owner_is_gone_is_collected(api: Client) -> None:
    """A controller's create that raced its owner's deletion: Kubernetes' collector deletes the dependent whose
    owners do not exist; one with a live owner among them stays."""
    owner = configmap(api, "owner")
    api.call("DELETE", f"{cms()}/owner")
    configmap(api, "late", owner)
    assert not api.exists(f"{cms()}/late")
    live = configmap(api, "live")
    configmap(api, "mixed", owner, live)
    assert api.exists(f"{cms()}/mixed")
