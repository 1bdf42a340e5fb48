"""The local API server through real HTTP: discovery, metadata, writes and their conflicts, patches, selectors,
status and scale subresources, finalizers, watches, and kubectl against it."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kmock")

from shardwise.devcluster.apiserver import APIServer

from tests.devcluster.apiclient import CRD_FILE, CRDS, EXAMPLE, JSON_PATCH, MERGE, STRATEGIC, Client

CMS = "/api/v1/namespaces/default/configmaps"
PODS = "/api/v1/namespaces/default/pods"
SERVICES = "/api/v1/namespaces/default/services"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
IDEPS = "/apis/shardwise.io/v1alpha1/namespaces/default/inferencedeployments"


def read_events(stream: Any, count: int) -> list[tuple[str, str]]:
    events = [json.loads(stream.readline()) for _ in range(count)]
    return [(event["type"], event["object"]["metadata"].get("name", "")) for event in events]


def read_all(stream: Any) -> list[dict[str, Any]]:
    """Every event until the server ends the stream."""
    return [json.loads(line) for line in stream]


def configmap(name: str, labels: dict[str, str] | None = None, **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}, **meta}, "data": {"a": "1"}}


def pod(name: str, labels: dict[str, str] | None = None, node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "main", "image": "busybox"}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def inference_deployment() -> dict[str, Any]:
    return dict(yaml.safe_load(EXAMPLE.read_text()))


# -- discovery ------------------------------------------------------------------------------------------------


def test_core_discovery_reports_v1_with_namespaces_pods_and_the_pod_status_subresource(api: Client) -> None:
    assert api.get("/api")["versions"] == ["v1"]
    core = api.get("/api/v1")
    assert core["groupVersion"] == "v1"
    names = {resource["name"] for resource in core["resources"]}
    assert {"namespaces", "pods", "pods/status", "services", "configmaps", "events", "nodes"} <= names


@pytest.mark.parametrize(("group_version", "plural", "kind"), [
    ("apps/v1", "deployments", "Deployment"),
    ("coordination.k8s.io/v1", "leases", "Lease"),
    ("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget"),
    ("apiextensions.k8s.io/v1", "customresourcedefinitions", "CustomResourceDefinition"),
])
def test_group_discovery_serves_the_groups_the_project_uses(api: Client, group_version: str, plural: str,
                                                            kind: str) -> None:
    groups = {group["name"]: group for group in api.get("/apis")["groups"]}
    assert groups[group_version.split("/")[0]]["preferredVersion"]["groupVersion"] == group_version
    listed = {resource["name"]: resource for resource in api.get(f"/apis/{group_version}")["resources"]}
    assert listed[plural]["kind"] == kind


def test_an_applied_crd_is_discoverable_with_status_and_scale_subresources_and_goes_with_its_crd(
        api: Client) -> None:
    assert api.call("GET", "/apis/shardwise.io/v1alpha1")[0] == 404
    crd = api.create(CRDS, yaml.safe_load(CRD_FILE.read_text()))
    assert {c["type"] for c in crd["status"]["conditions"] if c["status"] == "True"} == {"NamesAccepted",
                                                                                         "Established"}
    assert "shardwise.io" in {group["name"] for group in api.get("/apis")["groups"]}
    resources = {r["name"]: r for r in api.get("/apis/shardwise.io/v1alpha1")["resources"]}
    assert resources["inferencedeployments"]["shortNames"] == ["idep"]
    assert resources["inferencedeployments"]["namespaced"] is True
    assert resources["inferencedeployments/status"]["kind"] == "InferenceDeployment"
    assert (resources["inferencedeployments/scale"]["group"], resources["inferencedeployments/scale"]["kind"]) == (
        "autoscaling", "Scale")
    api.create(IDEPS, inference_deployment())

    api.ok("DELETE", f"{CRDS}/inferencedeployments.shardwise.io")
    assert api.call("GET", "/apis/shardwise.io/v1alpha1")[0] == 404
    assert api.call("GET", IDEPS)[0] == 404


def test_lists_carry_kind_api_version_and_resource_version_and_namespaces_start_with_the_defaults(
        api: Client) -> None:
    namespaces = api.get("/api/v1/namespaces")
    assert (namespaces["kind"], namespaces["apiVersion"]) == ("NamespaceList", "v1")
    assert int(namespaces["metadata"]["resourceVersion"]) >= 4
    assert {"default", "kube-system", "kube-public", "kube-node-lease"} <= set(api.names("/api/v1/namespaces"))
    assert api.get("/api/v1/namespaces/default")["status"]["phase"] == "Active"
    leases = api.get(LEASES)
    assert (leases["kind"], leases["apiVersion"], leases["items"]) == ("LeaseList", "coordination.k8s.io/v1", [])


# -- metadata -------------------------------------------------------------------------------------------------


def test_a_created_object_gets_uid_creation_timestamp_generation_one_and_a_numeric_resource_version(
        api: Client) -> None:
    created = api.create(CMS, configmap("one", uid="client-made", resourceVersion=None))
    meta = created["metadata"]
    assert len(meta["uid"]) == 36 and meta["uid"] != "client-made"
    assert meta["creationTimestamp"].endswith("Z")
    assert meta["generation"] == 1
    assert int(meta["resourceVersion"]) > 0
    assert (created["kind"], created["apiVersion"]) == ("ConfigMap", "v1")
    assert api.get(f"{CMS}/one") == created


def test_every_write_of_any_kind_takes_the_next_resource_version_of_one_global_counter(api: Client) -> None:
    versions = [
        api.create(CMS, configmap("a"))["metadata"]["resourceVersion"],
        api.create(PODS, pod("p"))["metadata"]["resourceVersion"],
        api.patch(f"{CMS}/a", {"data": {"b": "2"}})["metadata"]["resourceVersion"],
        api.patch(f"{PODS}/p/status", {"status": {"phase": "Running"}})["metadata"]["resourceVersion"],
    ]
    numbers = [int(version) for version in versions]
    assert numbers == list(range(numbers[0], numbers[0] + 4))
    assert api.get(CMS)["metadata"]["resourceVersion"] == versions[-1]


def test_a_write_that_changes_nothing_keeps_the_resource_version(api: Client) -> None:
    created = api.create(CMS, configmap("same"))
    again = api.patch(f"{CMS}/same", {"data": {"a": "1"}})
    assert again["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]


def test_generation_moves_on_spec_changes_only(crd_api: Client) -> None:
    name = f"{IDEPS}/tiny-moe"
    assert crd_api.create(IDEPS, inference_deployment())["metadata"]["generation"] == 1
    assert crd_api.patch(name, {"metadata": {"labels": {"team": "a"}}})["metadata"]["generation"] == 1
    assert crd_api.patch(f"{name}/status", {"status": {"phase": "Ready"}})["metadata"]["generation"] == 1
    assert crd_api.patch(name, {"spec": {"serving": {"maxModelLen": 128}}})["metadata"]["generation"] == 2


def test_generate_name_makes_distinct_names_from_the_prefix(api: Client) -> None:
    names = {api.create(PODS, {"metadata": {"generateName": "worker-"}, "spec": {}})["metadata"]["name"]
             for _ in range(3)}
    assert len(names) == 3
    assert all(name.startswith("worker-") and len(name) == len("worker-") + 5 for name in names)


def test_the_namespace_comes_from_the_url_which_must_name_an_existing_namespace(api: Client) -> None:
    api.create("/api/v1/namespaces", {"metadata": {"name": "other"}})
    created = api.create("/api/v1/namespaces/other/configmaps", configmap("c"))
    assert created["metadata"]["namespace"] == "other"
    assert api.call("POST", "/api/v1/namespaces/other/configmaps", configmap("d", namespace="default"))[0] == 400
    status, answer = api.call("POST", "/api/v1/namespaces/missing/configmaps", configmap("e"))
    assert (status, answer["reason"]) == (404, "NotFound")


# -- writes, conflicts and patches ------------------------------------------------------------------------------


def test_creating_an_existing_name_is_a_conflict(api: Client) -> None:
    api.create(CMS, configmap("dup"))
    status, answer = api.call("POST", CMS, configmap("dup"))
    assert (status, answer["reason"]) == (409, "AlreadyExists")


@pytest.mark.parametrize("write", ["put", "merge patch", "json patch", "strategic merge patch"])
def test_a_write_carrying_a_stale_resource_version_is_a_conflict(api: Client, write: str) -> None:
    stale = api.create(CMS, configmap("c"))
    fresh = api.patch(f"{CMS}/c", {"data": {"a": "2"}})
    old = stale["metadata"]["resourceVersion"]
    requests = {
        "put": ("PUT", {**stale, "data": {"a": "3"}}, "application/json"),
        "merge patch": ("PATCH", {"metadata": {"resourceVersion": old}, "data": {"a": "3"}}, MERGE),
        "json patch": ("PATCH", [{"op": "replace", "path": "/metadata/resourceVersion", "value": old}], JSON_PATCH),
        "strategic merge patch": ("PATCH", {"metadata": {"resourceVersion": old}}, STRATEGIC),
    }
    method, body, content_type = requests[write]
    status, answer = api.call(method, f"{CMS}/c", body, content_type=content_type)
    assert (status, answer["reason"]) == (409, "Conflict")
    assert api.get(f"{CMS}/c") == fresh


def test_a_failed_json_patch_test_is_unprocessable_and_changes_nothing(api: Client) -> None:
    created = api.create(CMS, configmap("c"))
    patch = [{"op": "test", "path": "/data/a", "value": "2"}, {"op": "replace", "path": "/data/a", "value": "3"}]
    status, _ = api.call("PATCH", f"{CMS}/c", patch, content_type=JSON_PATCH)
    assert status == 422
    assert api.get(f"{CMS}/c") == created


def test_a_json_patch_applies_its_operations_in_order(api: Client) -> None:
    api.create(CMS, configmap("c"))
    patch = [{"op": "test", "path": "/data/a", "value": "1"}, {"op": "add", "path": "/data/b", "value": "2"},
             {"op": "remove", "path": "/data/a"}]
    assert api.patch(f"{CMS}/c", patch, JSON_PATCH)["data"] == {"b": "2"}


def test_a_merge_patch_replaces_lists_and_deletes_keys_set_to_null(api: Client) -> None:
    api.create(PODS, {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "a"}, {"name": "b"}]}})
    patched = api.patch(f"{PODS}/p", {"metadata": {"labels": {"x": "1"}},
                                      "spec": {"containers": [{"name": "c"}]}})
    assert patched["spec"]["containers"] == [{"name": "c"}]
    assert "labels" not in api.patch(f"{PODS}/p", {"metadata": {"labels": None}})["metadata"]


CONTAINERS = [{"name": "a", "image": "x:1", "env": [{"name": "A", "value": "1"}],
               "ports": [{"containerPort": 80, "name": "http"}]},
              {"name": "b", "image": "y:1"}]


@pytest.mark.parametrize(("path", "body", "patch", "expect"), [
    pytest.param(PODS, {"spec": {"containers": CONTAINERS}},
                 {"spec": {"containers": [{"name": "a", "image": "x:2", "env": [{"name": "B", "value": "2"}]}]}},
                 {"spec": {"containers": [
                     {"name": "a", "image": "x:2", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                      "ports": [{"containerPort": 80, "name": "http"}]},
                     {"name": "b", "image": "y:1"}]}},
                 id="pod containers merge by name and their env by name"),
    pytest.param(PODS, {"spec": {"containers": CONTAINERS}},
                 {"spec": {"containers": [{"name": "a", "ports": [{"containerPort": 80, "protocol": "TCP"},
                                                                  {"containerPort": 9090}]}]}},
                 {"spec": {"containers": [
                     {**CONTAINERS[0], "ports": [{"containerPort": 80, "name": "http", "protocol": "TCP"},
                                                 {"containerPort": 9090}]}, CONTAINERS[1]]}},
                 id="container ports merge by containerPort"),
    pytest.param(PODS, {"spec": {"containers": CONTAINERS}},
                 {"spec": {"containers": [{"name": "b", "$patch": "delete"}]}},
                 {"spec": {"containers": [CONTAINERS[0]]}},
                 id="a $patch delete directive removes a container"),
    pytest.param(SERVICES, {"spec": {"ports": [{"port": 80, "name": "http"}, {"port": 9090, "name": "metrics"}]}},
                 {"spec": {"ports": [{"port": 9090, "targetPort": 9091}]}},
                 {"spec": {"ports": [{"port": 80, "name": "http"},
                                     {"port": 9090, "name": "metrics", "targetPort": 9091}]}},
                 id="service ports merge by port"),
    pytest.param(CMS, {"data": {"a": "1", "b": "2"}}, {"data": {"b": None, "c": "3"}},
                 {"data": {"a": "1", "c": "3"}}, id="configmap data merges and null deletes"),
    pytest.param(LEASES, {"spec": {"holderIdentity": "x", "leaseDurationSeconds": 15}},
                 {"spec": {"holderIdentity": "y", "renewTime": "2025-01-01T00:00:00.000000Z"}},
                 {"spec": {"holderIdentity": "y", "leaseDurationSeconds": 15,
                           "renewTime": "2025-01-01T00:00:00.000000Z"}},
                 id="lease spec merges"),
    pytest.param(CMS, {"metadata": {"finalizers": ["a"]}}, {"metadata": {"finalizers": ["b"]}},
                 {"metadata": {"finalizers": ["a", "b"]}}, id="finalizers merge as a set"),
])
def test_a_strategic_merge_patch_merges_lists_item_by_item_by_their_merge_keys(
        api: Client, path: str, body: dict[str, Any], patch: dict[str, Any], expect: dict[str, Any]) -> None:
    api.create(path, {**body, "metadata": {"name": "o", **body.get("metadata", {})}})
    patched = api.patch(f"{path}/o", patch, STRATEGIC)
    for section, value in expect.items():
        got = patched[section]
        assert ({key: got.get(key) for key in value} if section == "metadata" else got) == value


def test_a_strategic_merge_patch_of_a_custom_resource_is_an_unsupported_media_type(crd_api: Client) -> None:
    crd_api.create(IDEPS, inference_deployment())
    status, _ = crd_api.call("PATCH", f"{IDEPS}/tiny-moe", {"spec": {}}, content_type=STRATEGIC)
    assert status == 415


def test_put_replaces_the_object_but_not_its_server_owned_metadata(api: Client) -> None:
    created = api.create(CMS, configmap("c"))
    body = {**created, "data": {"z": "9"}}
    body["metadata"] = {**created["metadata"], "uid": "forged", "creationTimestamp": "2000-01-01T00:00:00Z"}
    replaced = api.ok("PUT", f"{CMS}/c", body)
    assert replaced["data"] == {"z": "9"}
    assert replaced["metadata"]["uid"] == created["metadata"]["uid"]
    assert replaced["metadata"]["creationTimestamp"] == created["metadata"]["creationTimestamp"]
    assert int(replaced["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])


def test_a_collection_delete_removes_only_the_selected_objects(api: Client) -> None:
    for name, tier in (("a", "web"), ("b", "web"), ("c", "db")):
        api.create(CMS, configmap(name, {"tier": tier}))
    deleted = api.ok("DELETE", CMS, labelSelector="tier=web")
    assert deleted["kind"] == "ConfigMapList"
    assert sorted(item["metadata"]["name"] for item in deleted["items"]) == ["a", "b"]
    assert api.names(CMS) == ["c"]


# -- selectors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("selector", "expect"), [
    ("tier=web", ["a", "b"]),
    ("tier==web", ["a", "b"]),
    ("tier!=web", ["c", "d"]),
    ("tier in (web,db)", ["a", "b", "c"]),
    ("tier notin (web)", ["c", "d"]),
    ("tier", ["a", "b", "c"]),
    ("!tier", ["d"]),
    ("tier=web,track=canary", ["b"]),
    ("tier in (web, db),!track", ["a", "c"]),
])
def test_label_selectors_select_as_in_kubernetes(api: Client, selector: str, expect: list[str]) -> None:
    labels = {"a": {"tier": "web"}, "b": {"tier": "web", "track": "canary"}, "c": {"tier": "db"}, "d": {}}
    for name, value in labels.items():
        api.create(CMS, configmap(name, value))
    assert api.names(CMS, labelSelector=selector) == expect


@pytest.mark.parametrize(("path", "selector", "expect"), [
    (PODS, "metadata.name=a", ["a"]),
    ("/api/v1/pods", "metadata.namespace=other", ["z"]),
    (PODS, "status.phase=Running", ["b"]),
    (PODS, "status.phase!=Running", ["a", "c"]),
    (PODS, "spec.nodeName=node-1", ["c"]),
    (PODS, "spec.nodeName=", ["a", "b"]),
    (PODS, "spec.nodeName=,status.phase=Pending", ["a"]),
])
def test_field_selectors_select_by_name_namespace_phase_and_node(api: Client, path: str, selector: str,
                                                                 expect: list[str]) -> None:
    api.create("/api/v1/namespaces", {"metadata": {"name": "other"}})
    api.create("/api/v1/namespaces/other/pods", pod("z"))
    for name, node in (("a", None), ("b", None), ("c", "node-1")):
        api.create(PODS, pod(name, node=node))
    api.patch(f"{PODS}/b/status", {"status": {"phase": "Running"}})
    assert api.names(path, fieldSelector=selector) == expect


@pytest.mark.parametrize("params", [
    {"fieldSelector": "spec.containers=x"},
    {"fieldSelector": "metadata.name"},
    {"labelSelector": "tier in web"},
    {"labelSelector": "a=b=c"},
])
def test_a_malformed_or_unsupported_selector_is_a_bad_request(api: Client, params: dict[str, str]) -> None:
    assert api.call("GET", PODS, **params)[0] == 400


# -- status and scale subresources ----------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "make", "spec_patch"), [
    (PODS, lambda: pod("o"), {"spec": {"nodeName": "node-1"}}),
    (IDEPS, lambda: {**inference_deployment(), "metadata": {"name": "o"}}, {"spec": {"parallelism": {"dpa": 4}}}),
])
def test_a_write_to_the_object_ignores_status_and_a_write_to_status_ignores_the_rest(
        crd_api: Client, path: str, make: Callable[[], dict[str, Any]], spec_patch: dict[str, Any]) -> None:
    created = crd_api.create(path, {**make(), "status": {"phase": "Forged"}})
    assert created.get("status", {}).get("phase") != "Forged"
    main = crd_api.patch(f"{path}/o", {**spec_patch, "status": {"phase": "Main"}})
    assert main.get("status") == created.get("status")
    assert main["spec"] != created["spec"]
    status = crd_api.patch(f"{path}/o/status", {"spec": created["spec"], "status": {"phase": "Status"},
                                                "metadata": {"labels": {"x": "y"}}})
    assert status["status"]["phase"] == "Status"
    assert status["spec"] == main["spec"]
    assert "x" not in (status["metadata"].get("labels") or {})


def test_the_scale_subresource_reads_and_writes_the_paths_the_crd_declares(crd_api: Client) -> None:
    crd_api.create(IDEPS, inference_deployment())
    crd_api.patch(f"{IDEPS}/tiny-moe/status", {"status": {"dpa": 2, "selector": "app=tiny-moe"}})
    scale = crd_api.get(f"{IDEPS}/tiny-moe/scale")
    assert (scale["kind"], scale["apiVersion"]) == ("Scale", "autoscaling/v1")
    assert scale["spec"] == {"replicas": 2}
    assert scale["status"] == {"replicas": 2, "selector": "app=tiny-moe"}

    scaled = crd_api.patch(f"{IDEPS}/tiny-moe/scale", {"spec": {"replicas": 3}})
    assert scaled["spec"]["replicas"] == 3
    obj = crd_api.get(f"{IDEPS}/tiny-moe")
    assert (obj["spec"]["parallelism"]["dpa"], obj["metadata"]["generation"]) == (3, 2)

    stale = {**scale, "spec": {"replicas": 1}}
    assert crd_api.call("PUT", f"{IDEPS}/tiny-moe/scale", stale)[0] == 409
    assert crd_api.call("PATCH", f"{IDEPS}/tiny-moe/scale", {"spec": {"replicas": -1}}, content_type=MERGE)[0] == 422


def test_the_crds_cel_rules_refuse_a_write_scale_included(crd_api: Client) -> None:
    """x-kubernetes-validations are enforced by the server itself, as Kubernetes does, so a spec outside the
    bounds never reaches the operator even where no admission webhook runs."""
    too_many = inference_deployment()
    too_many["spec"]["parallelism"]["dpa"] = 5  # maxDpa is 4
    code, body = crd_api.call("POST", IDEPS, too_many)
    assert (code, body["reason"]) == (422, "Invalid"), body
    assert body["message"] == ('inferencedeployments.shardwise.io "tiny-moe" is invalid: spec.parallelism.dpa: '
                               'Invalid value: "object": parallelism.dpa must lie within elastic.minDpa..maxDpa'), body
    assert crd_api.call("GET", f"{IDEPS}/tiny-moe")[0] == 404

    crd_api.create(IDEPS, inference_deployment())
    code, body = crd_api.call("PATCH", f"{IDEPS}/tiny-moe/scale", {"spec": {"replicas": 9}}, content_type=MERGE)
    assert code == 422 and "parallelism.dpa must lie within" in body["message"], body
    code, body = crd_api.call("PATCH", f"{IDEPS}/tiny-moe", {"spec": {"parallelism": {"tp": 2048}}},
                              content_type=MERGE)
    assert code == 422 and "pp*dpa*cp*tp must be at most 2048 ranks" in body["message"], body
    code, body = crd_api.call("PATCH", f"{IDEPS}/tiny-moe", {"spec": {"elastic": {"minDpa": 3, "maxDpa": 2}}},
                              content_type=MERGE)
    assert code == 422 and "spec.elastic.minDpa: Invalid value" in body["message"], body
    assert "elastic.minDpa must not exceed elastic.maxDpa" in body["message"]
    assert crd_api.get(f"{IDEPS}/tiny-moe")["spec"]["parallelism"] == {"tp": 2, "dpa": 2}  # nothing stored
    # what the rules allow is stored, and a status write is never checked against them
    assert crd_api.patch(f"{IDEPS}/tiny-moe/scale", {"spec": {"replicas": 4}})["spec"]["replicas"] == 4
    crd_api.patch(f"{IDEPS}/tiny-moe/status", {"status": {"dpa": 4}})


# -- finalizers and deletion ----------------------------------------------------------------------------------


def test_a_delete_only_marks_an_object_with_finalizers_and_removing_the_last_finalizer_deletes_it(
        api: Client) -> None:
    created = api.create(CMS, configmap("held", finalizers=["example.com/a", "example.com/b"]))
    with api.watch(CMS, resourceVersion=created["metadata"]["resourceVersion"]) as stream:
        status, marked = api.call("DELETE", f"{CMS}/held")
        assert status == 202 and marked["metadata"]["deletionTimestamp"]
        assert api.get(f"{CMS}/held")["metadata"]["deletionTimestamp"] == marked["metadata"]["deletionTimestamp"]
        refused = api.call("PATCH", f"{CMS}/held", {"metadata": {"finalizers": ["x", "example.com/a"]}},
                           content_type=MERGE)
        assert refused[0] == 422
        api.patch(f"{CMS}/held", {"metadata": {"finalizers": ["example.com/b"]}})
        assert api.call("GET", f"{CMS}/held")[0] == 200
        api.patch(f"{CMS}/held", {"metadata": {"finalizers": None}})
        assert api.call("GET", f"{CMS}/held")[0] == 404
        assert read_events(stream, 3) == [("MODIFIED", "held"), ("MODIFIED", "held"), ("DELETED", "held")]


def test_a_pod_bound_to_a_node_waits_for_its_node_to_finish_a_graceful_delete(api: Client) -> None:
    api.create(PODS, pod("bound", node="node-1"))
    status, marked = api.call("DELETE", f"{PODS}/bound")
    assert (status, marked["metadata"]["deletionGracePeriodSeconds"]) == (202, 30)
    assert api.ok("DELETE", f"{PODS}/bound", {"gracePeriodSeconds": 0})
    assert api.call("GET", f"{PODS}/bound")[0] == 404


# -- watches --------------------------------------------------------------------------------------------------


def test_a_watch_from_a_resource_version_sends_only_later_changes_including_those_made_before_it_opened(
        api: Client) -> None:
    api.create(CMS, configmap("before"))
    listed = api.get(CMS)["metadata"]["resourceVersion"]
    api.create(CMS, configmap("between"))
    api.patch(f"{CMS}/before", {"data": {"b": "2"}})
    with api.watch(CMS, resourceVersion=listed) as stream:
        assert stream.headers["Content-Type"].startswith("application/json")
        assert read_events(stream, 2) == [("ADDED", "between"), ("MODIFIED", "before")]
        api.ok("DELETE", f"{CMS}/between")
        assert read_events(stream, 1) == [("DELETED", "between")]


def test_a_watch_without_a_resource_version_starts_with_the_current_objects(api: Client) -> None:
    api.create(CMS, configmap("old"))
    with api.watch(CMS) as stream:
        assert read_events(stream, 1) == [("ADDED", "old")]
        api.create(CMS, configmap("new"))
        assert read_events(stream, 1) == [("ADDED", "new")]


@pytest.mark.parametrize(("path", "selector", "body", "patches"), [
    (CMS, {"labelSelector": "tier=web"}, configmap("c", {"tier": "db"}),
     [("", {"metadata": {"labels": {"tier": "web"}}}), ("", {"data": {"x": "1"}}),
      ("", {"metadata": {"labels": {"tier": "db"}}})]),
    (PODS, {"fieldSelector": "status.phase=Running"}, pod("c"),
     [("/status", {"status": {"phase": "Running"}}), ("", {"metadata": {"labels": {"x": "1"}}}),
      ("/status", {"status": {"phase": "Succeeded"}})]),
])
def test_a_selective_watch_sees_objects_enter_and_leave_its_selection(
        api: Client, path: str, selector: dict[str, str], body: dict[str, Any],
        patches: list[tuple[str, dict[str, Any]]]) -> None:
    start = api.create(path, body)["metadata"]["resourceVersion"]
    with api.watch(path, resourceVersion=start, **selector) as stream:
        api.create(path, {**body, "metadata": {**body["metadata"], "name": "other"}})
        for subresource, patch in patches:
            api.patch(f"{path}/c{subresource}", patch)
        assert read_events(stream, 3) == [("ADDED", "c"), ("MODIFIED", "c"), ("DELETED", "c")]


def test_timeout_seconds_ends_the_watch_and_bookmarks_come_only_when_asked(start: Callable[..., Client]) -> None:
    api = start(bookmark_interval=0.3)
    with api.watch(CMS, resourceVersion="1", timeoutSeconds=1) as stream:
        api.create(CMS, configmap("during"))  # after the watch began: seen only if the server has not ended it
        events = read_all(stream)  # to the end of the stream: the server ends it (at timeoutSeconds)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "during")]
    revision = api.create(CMS, configmap("c"))["metadata"]["resourceVersion"]
    with api.watch(CMS, resourceVersion=revision, timeoutSeconds=1, allowWatchBookmarks="true") as stream:
        events = read_all(stream)
    assert len(events) >= 2 and {event["type"] for event in events} == {"BOOKMARK"}
    assert events[-1]["object"]["metadata"]["resourceVersion"] == revision
    assert events[-1]["object"]["kind"] == "ConfigMap"


def test_a_watch_from_a_resource_version_older_than_the_retained_history_is_gone(
        start: Callable[..., Client]) -> None:
    api = start(history_limit=3)
    versions = [api.create(CMS, configmap(f"c{i}"))["metadata"]["resourceVersion"] for i in range(5)]
    with api.watch(CMS, resourceVersion=versions[0]) as stream:
        (event,) = read_all(stream)
    assert event["type"] == "ERROR"
    assert (event["object"]["code"], event["object"]["reason"]) == (410, "Expired")
    with api.watch(CMS, resourceVersion=versions[2]) as stream:
        assert read_events(stream, 2) == [("ADDED", "c3"), ("ADDED", "c4")]


# -- the server -----------------------------------------------------------------------------------------------


def test_stop_ends_open_watches_and_frees_the_port() -> None:
    server = APIServer()
    api = Client(server.start())
    try:
        stream = api.watch(CMS, resourceVersion="1")
    finally:
        server.stop()
    assert stream.read() == b""
    with APIServer(port=server.port) as again:  # the next `dev up` can take the same port
        assert Client(again.url).get("/api")["versions"] == ["v1"]


# -- kubectl --------------------------------------------------------------------------------------------------


def test_kubectl_applies_the_crd_and_an_inference_deployment_then_selects_patches_scales_and_deletes_it(
        kubectl: Callable[..., str]) -> None:
    kubectl("apply", "-f", str(CRD_FILE))
    assert kubectl("api-resources", "--api-group=shardwise.io", "-o", "name") == "inferencedeployments.shardwise.io"
    kubectl("apply", "-f", str(EXAMPLE))
    assert kubectl("get", "idep").splitlines()[1].split()[0] == "tiny-moe"
    assert kubectl("get", "idep", "-o", "name") == "inferencedeployment.shardwise.io/tiny-moe"
    kubectl("label", "idep", "tiny-moe", "team=a")
    assert kubectl("get", "idep", "-l", "team=a", "-o", "name") == "inferencedeployment.shardwise.io/tiny-moe"
    assert kubectl("get", "idep", "-l", "team notin (a)", "-o", "name") == ""
    kubectl("patch", "idep", "tiny-moe", "--subresource=status", "--type=merge", "-p",
            '{"status": {"phase": "Ready", "dpa": 2}}')
    assert kubectl("get", "idep", "tiny-moe", "-o", "jsonpath={.status.phase}") == "Ready"
    kubectl("scale", "idep", "tiny-moe", "--replicas", "3")
    assert kubectl("get", "idep", "tiny-moe", "-o", "jsonpath={.spec.parallelism.dpa}") == "3"
    kubectl("delete", "idep", "tiny-moe")
    assert "NotFound" in kubectl("get", "idep", "tiny-moe", check=False)


def test_kubectl_get_watch_streams_the_changes_it_sees(kubectl: Callable[..., str], tmp_path: Path) -> None:
    manifest = tmp_path / "cm.yaml"
    manifest.write_text(yaml.safe_dump({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "w"},
                                        "data": {"a": "1"}}))
    kubectl("apply", "-f", str(manifest))
    watcher = subprocess.Popen(["kubectl", "--kubeconfig", str(tmp_path / "kubeconfig"), "get", "configmaps",
                                "-w", "--output-watch-events", "--request-timeout=10s"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert watcher.stdout is not None
        assert watcher.stdout.readline().split() == ["EVENT", "NAME", "DATA", "AGE"]  # the server's Table
        assert watcher.stdout.readline().split()[:2] == ["ADDED", "w"]  # the watch is open now
        kubectl("patch", "configmap", "w", "-p", '{"data": {"a": "2"}}')
        kubectl("delete", "configmap", "w")
        seen = [watcher.stdout.readline().split()[:2] for _ in range(2)]
    finally:
        watcher.kill()
        watcher.wait()
    assert seen == [["MODIFIED", "w"], ["DELETED", "w"]]


def test_a_secrets_string_data_is_stored_as_base64_data(api: Client) -> None:
    path = "/api/v1/namespaces/default/secrets"
    api.create(path, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "token"},
                      "data": {"old": "b2xk"}, "stringData": {"token": "s3cret"}})
    stored = api.get(f"{path}/token")
    assert "stringData" not in stored
    assert stored["data"] == {"old": "b2xk", "token": "czNjcmV0"}
    api.patch(f"{path}/token", {"stringData": {"token": "new"}})
    assert api.get(f"{path}/token")["data"]["token"] == "bmV3"
