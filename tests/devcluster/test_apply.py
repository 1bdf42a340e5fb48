"""Server-side apply on the local API server, through `kubectl apply --server-side` and raw HTTP: create, update,
field managers and their conflicts, removal of omitted fields, and the status and generation rules of other
writes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kmock")

from tests.devcluster.apiclient import APPLY, CRD_FILE, EXAMPLE, MERGE, Client

CM = "/api/v1/namespaces/default/configmaps"
IDEPS = "/apis/shardwise.io/v1alpha1/namespaces/default/inferencedeployments"
PODS = "/api/v1/namespaces/default/pods"

Kubectl = Callable[..., str]


def configmap(name: str = "settings", **data: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}


@pytest.fixture
def manifest(tmp_path: Path) -> Callable[[dict[str, Any]], str]:
    """Write an object to a YAML file; returns its path."""
    count = 0

    def write(obj: dict[str, Any]) -> str:
        nonlocal count
        count += 1
        path = tmp_path / f"manifest-{count}.yaml"
        path.write_text(yaml.safe_dump(obj))
        return str(path)

    return write


def ssa(kubectl: Kubectl, path: str, *args: str, check: bool = True) -> str:
    return kubectl("apply", "--server-side", "--validate=false", "-f", path, *args, check=check)


def managers(api: Client, path: str) -> dict[str, dict[str, Any]]:
    return {entry["manager"]: entry for entry in api.get(path)["metadata"].get("managedFields", [])}


# -- kubectl ----------------------------------------------------------------------------------------------------


def test_kubectl_server_side_apply_creates_then_updates_a_config_map_and_records_its_manager(
        api: Client, kubectl: Kubectl, manifest: Callable[[dict[str, Any]], str]) -> None:
    assert ssa(kubectl, manifest(configmap(a="1"))) == "configmap/settings serverside-applied"
    created = api.get(f"{CM}/settings")
    ssa(kubectl, manifest(configmap(a="2", b="3")))
    updated = api.get(f"{CM}/settings")
    assert updated["data"] == {"a": "2", "b": "3"}
    assert int(updated["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    entry = managers(api, f"{CM}/settings")["kubectl"]
    assert (entry["operation"], entry["apiVersion"], entry["fieldsType"]) == ("Apply", "v1", "FieldsV1")
    assert entry["fieldsV1"] == {"f:data": {"f:a": {}, "f:b": {}}}
    assert entry["time"]


def test_applying_the_same_configuration_again_writes_nothing(api: Client, kubectl: Kubectl,
                                                              manifest: Callable[[dict[str, Any]], str]) -> None:
    path = manifest(configmap(a="1"))
    ssa(kubectl, path)
    before = api.get(f"{CM}/settings")
    ssa(kubectl, path)
    assert api.get(f"{CM}/settings") == before


def test_kubectl_server_side_apply_creates_and_updates_an_inference_deployment_with_generation_and_status_rules(
        api: Client, kubectl: Kubectl, manifest: Callable[[dict[str, Any]], str]) -> None:
    ssa(kubectl, str(CRD_FILE))
    example = yaml.safe_load(EXAMPLE.read_text())
    assert ssa(kubectl, str(EXAMPLE)) == "inferencedeployment.shardwise.io/tiny-moe serverside-applied"
    kubectl("patch", "idep", "tiny-moe", "--subresource=status", "--type=merge", "-p", '{"status": {"dpa": 2}}')
    example["spec"]["parallelism"]["dpa"] = 3
    example["status"] = {"dpa": 99}  # status has its own subresource: applying the object ignores it
    ssa(kubectl, manifest(example))
    obj = api.get(f"{IDEPS}/tiny-moe")
    assert (obj["spec"]["parallelism"]["dpa"], obj["metadata"]["generation"], obj["status"]) == (3, 2, {"dpa": 2})
    ssa(kubectl, manifest({"apiVersion": example["apiVersion"], "kind": example["kind"],
                           "metadata": {"name": "tiny-moe"}, "status": {"phase": "Ready"}}),
        "--subresource=status", "--field-manager=operator")
    obj = api.get(f"{IDEPS}/tiny-moe")
    assert (obj["status"], obj["metadata"]["generation"]) == ({"dpa": 2, "phase": "Ready"}, 2)
    status_entry = managers(api, f"{IDEPS}/tiny-moe")["operator"]
    assert (status_entry["subresource"], status_entry["fieldsV1"]) == ("status", {"f:status": {"f:phase": {}}})


def test_a_field_another_manager_applied_differently_is_a_conflict_until_forced(
        api: Client, kubectl: Kubectl, manifest: Callable[[dict[str, Any]], str]) -> None:
    ssa(kubectl, manifest(configmap(a="1", b="2")), "--field-manager", "a")
    error = ssa(kubectl, manifest(configmap(a="9")), "--field-manager", "b", check=False)
    assert 'Apply failed with 1 conflict: conflict with "a": .data.a' in error
    assert api.get(f"{CM}/settings")["data"] == {"a": "1", "b": "2"}
    ssa(kubectl, manifest(configmap(a="9")), "--field-manager", "b", "--force-conflicts")
    assert api.get(f"{CM}/settings")["data"] == {"a": "9", "b": "2"}
    owned = {name: entry["fieldsV1"]["f:data"] for name, entry in managers(api, f"{CM}/settings").items()}
    assert owned == {"a": {"f:b": {}}, "b": {"f:a": {}}}


def test_a_field_an_applier_omits_is_removed_unless_another_manager_owns_it(
        api: Client, kubectl: Kubectl, manifest: Callable[[dict[str, Any]], str]) -> None:
    ssa(kubectl, manifest(configmap(a="1", b="2", c="3")), "--field-manager", "a")
    ssa(kubectl, manifest(configmap(c="3")), "--field-manager", "b")  # the same value: b co-owns c
    ssa(kubectl, manifest(configmap(a="1")), "--field-manager", "a")
    assert api.get(f"{CM}/settings")["data"] == {"a": "1", "c": "3"}


def test_server_side_apply_takes_over_what_client_side_apply_managed(
        api: Client, kubectl: Kubectl, manifest: Callable[[dict[str, Any]], str]) -> None:
    kubectl("apply", "-f", manifest(configmap(a="1", b="2")))
    assert managers(api, f"{CM}/settings")["kubectl-client-side-apply"]["operation"] == "Update"
    ssa(kubectl, manifest(configmap(a="1")))  # kubectl moves the client-side fields to its apply entry first
    assert api.get(f"{CM}/settings")["data"] == {"a": "1"}


# -- HTTP -------------------------------------------------------------------------------------------------------


def test_a_conflict_answers_409_with_a_cause_per_field(api: Client) -> None:
    api.ok("PATCH", f"{CM}/settings", configmap(a="1", b="2"), content_type=APPLY, fieldManager="a")
    status, answer = api.call("PATCH", f"{CM}/settings", configmap(a="5", b="6"), content_type=APPLY,
                              fieldManager="b")
    assert (status, answer["reason"]) == (409, "Conflict")
    assert answer["details"]["causes"] == [
        {"type": "FieldManagerConflict", "message": 'conflict with "a"', "field": ".data.a"},
        {"type": "FieldManagerConflict", "message": 'conflict with "a"', "field": ".data.b"}]


def test_an_apply_conflicts_with_what_an_ordinary_write_set(api: Client) -> None:
    api.ok("PATCH", f"{CM}/settings", configmap(a="1"), content_type=APPLY, fieldManager="a")
    api.ok("PATCH", f"{CM}/settings", {"data": {"a": "2"}}, content_type=MERGE, fieldManager="editor")
    status, answer = api.call("PATCH", f"{CM}/settings", configmap(a="3"), content_type=APPLY, fieldManager="a")
    assert status == 409
    assert answer["message"] == 'Apply failed with 1 conflict: conflict with "editor" using v1: .data.a'


def test_an_apply_body_may_be_yaml_and_creates_in_the_urls_namespace(api: Client) -> None:
    body = b"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: settings\ndata:\n  when: 2025-01-01T00:00:00Z\n"
    status, created = api.call("PATCH", f"{CM}/settings", body, content_type=APPLY, fieldManager="a")
    assert status == 201
    assert (created["metadata"]["namespace"], created["data"]) == ("default", {"when": "2025-01-01T00:00:00Z"})


@pytest.mark.parametrize(("body", "params", "status", "message"), [
    pytest.param(configmap(a="1"), {}, 422, "fieldManager: Required value", id="no field manager"),
    pytest.param({"metadata": {"name": "settings"}}, {"fieldManager": "a"}, 400, "must set apiVersion and kind",
                 id="no kind"),
    pytest.param({**configmap(), "kind": "Secret"}, {"fieldManager": "a"}, 400, "this URL serves v1, Kind=ConfigMap",
                 id="another kind"),
    pytest.param(configmap("other"), {"fieldManager": "a"}, 400, "does not match the name on the URL",
                 id="another name"),
    pytest.param({**configmap(), "metadata": {"name": "settings", "managedFields": []}}, {"fieldManager": "a"}, 400,
                 "metadata.managedFields must be nil", id="managed fields in the configuration"),
])
def test_a_malformed_apply_is_refused_with_what_is_wrong(api: Client, body: dict[str, Any], params: dict[str, str],
                                                         status: int, message: str) -> None:
    answer = api.call("PATCH", f"{CM}/settings", body, content_type=APPLY, **params)
    assert answer[0] == status
    assert message in answer[1]["message"]


def test_containers_merge_by_name_between_managers_and_tolerations_are_replaced_whole(api: Client) -> None:
    def pod(containers: list[dict[str, Any]], tolerations: list[dict[str, Any]]) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
                "spec": {"containers": containers, "tolerations": tolerations}}

    api.ok("PATCH", f"{PODS}/p", pod([{"name": "main", "image": "a", "env": [{"name": "X", "value": "1"}]}],
                                     [{"key": "a"}]), content_type=APPLY, fieldManager="a")
    merged = api.ok("PATCH", f"{PODS}/p", pod([{"name": "main", "env": [{"name": "Y", "value": "2"}]},
                                               {"name": "side", "image": "s"}], [{"key": "b"}]),
                    content_type=APPLY, fieldManager="b", force="true")
    assert merged["spec"]["containers"] == [
        {"name": "main", "image": "a", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]},
        {"name": "side", "image": "s"}]
    assert merged["spec"]["tolerations"] == [{"key": "b"}]
