"""Server-side printing on the local API server: the Tables `kubectl get` asks for, with a CRD's printer columns,
the pod and node columns kubectl shows from a real server, the object each row carries, ages, and watches."""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
import yaml

pytest.importorskip("kmock")

from shardwise.devcluster import tables

from tests.devcluster.apiclient import CRD_FILE, EXAMPLE, Client

TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io," \
        "application/json"
PODS = "/api/v1/namespaces/default/pods"
NODES = "/api/v1/nodes"
CMS = "/api/v1/namespaces/default/configmaps"

Kubectl = Callable[..., str]


def rows(output: str) -> list[list[str]]:
    """kubectl's table output as cells (columns split on runs of two or more spaces)."""
    return [[cell for cell in line.split("  ") if cell.strip()] for line in output.splitlines()]


def cells(output: str) -> list[list[str]]:
    return [[cell.strip() for cell in row] for row in rows(output)]


@pytest.fixture
def idep(kubectl: Kubectl) -> Kubectl:
    """kubectl with the CRD and tiny-moe applied, and a status written as the operator writes it."""
    kubectl("apply", "-f", str(CRD_FILE))
    kubectl("apply", "-f", str(EXAMPLE))
    kubectl("patch", "idep", "tiny-moe", "--subresource=status", "--type=merge", "-p",
            json.dumps({"status": {"phase": "Ready", "dpa": 1, "worldSize": 2, "ready": "1/1", "model": "tiny-moe",
                                   "engine": {"name": "reference"}, "conditions": [
                                       {"type": "Progressing", "status": "True", "reason": "Scaling"},
                                       {"type": "Available", "status": "True", "reason": "Serving"}]}}))
    return kubectl


def test_kubectl_get_shows_the_crd_printer_columns_with_the_objects_status(idep: Kubectl) -> None:
    printed = cells(idep("get", "idep"))
    assert printed[0] == ["NAME", "PHASE", "DESIRED", "DPA", "READY", "MODEL", "REASON", "AGE"]
    assert printed[1][:7] == ["tiny-moe", "Ready", "2", "1", "1/1", "tiny-moe", "Serving"]
    assert printed[1][7].endswith("s")
    wide = cells(idep("get", "idep", "-o", "wide"))
    assert wide[0][-3:] == ["WORLD", "ENGINE", "URL"] and wide[1][8:10] == ["2", "reference"]


def test_kubectl_get_as_yaml_or_json_still_gets_whole_objects(idep: Kubectl) -> None:
    as_yaml = yaml.safe_load(idep("get", "idep", "-o", "yaml"))
    assert (as_yaml["kind"], as_yaml["items"][0]["spec"]["parallelism"]["tp"]) == ("List", 2)
    as_json = json.loads(idep("get", "idep", "tiny-moe", "-o", "json"))
    assert (as_json["kind"], as_json["status"]["phase"]) == ("InferenceDeployment", "Ready")


def test_kubectl_get_pods_shows_ready_status_restarts_and_with_wide_ip_and_node(api: Client, kubectl: Kubectl) -> None:
    api.create(PODS, {"metadata": {"name": "p"}, "spec": {"nodeName": "n1", "containers": [
        {"name": "main", "image": "i"}, {"name": "side", "image": "i"}]}})
    assert cells(kubectl("get", "pods"))[1][:4] == ["p", "0/2", "Pending", "0"]
    api.patch(f"{PODS}/p/status", {"status": {"phase": "Running", "podIP": "10.1.0.7", "containerStatuses": [
        {"name": "main", "ready": True, "restartCount": 1, "state": {"running": {}}},
        {"name": "side", "ready": False, "restartCount": 2, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
         "lastState": {"terminated": {"exitCode": 1, "finishedAt": "2020-01-01T00:00:00Z"}}}]}})
    printed = cells(kubectl("get", "pods", "-o", "wide"))
    assert printed[0] == ["NAME", "READY", "STATUS", "RESTARTS", "AGE", "IP", "NODE", "NOMINATED NODE",
                          "READINESS GATES"]
    assert [printed[1][i] for i in (0, 1, 2, 5, 6)] == ["p", "1/2", "CrashLoopBackOff", "10.1.0.7", "n1"]
    assert re.fullmatch(r"3 \(\d+y\w* ago\)", printed[1][3])  # with the age of the last restart, years ago


def test_kubectl_get_nodes_shows_status_roles_and_version(api: Client, kubectl: Kubectl) -> None:
    api.create(NODES, {"metadata": {"name": "n1", "labels": {"node-role.kubernetes.io/gpu": ""}}})
    api.patch(f"{NODES}/n1/status", {"status": {"conditions": [{"type": "Ready", "status": "True"}],
                                                "nodeInfo": {"kubeletVersion": "v1.32.0-devcluster"}}})
    printed = cells(kubectl("get", "nodes"))
    assert printed[0] == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    assert [printed[1][i] for i in (0, 1, 2, 4)] == ["n1", "Ready", "gpu", "v1.32.0-devcluster"]


@pytest.mark.parametrize(("include", "expect"), [
    ("", {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1"}),
    ("Object", {"kind": "ConfigMap", "apiVersion": "v1"}),
    ("None", None),
])
def test_each_row_carries_its_object_as_include_object_asks(api: Client, include: str,
                                                            expect: dict[str, str] | None) -> None:
    api.create(CMS, {"metadata": {"name": "c"}, "data": {"a": "1", "b": "2"}})
    params = {"includeObject": include} if include else {}
    table = api.ok("GET", CMS, accept=TABLE, **params)
    assert (table["kind"], table["apiVersion"]) == ("Table", "meta.k8s.io/v1")
    assert [c["name"] for c in table["columnDefinitions"]] == ["Name", "Data", "Age"]
    row = table["rows"][0]
    assert row["cells"][:2] == ["c", 2]
    if expect is None:
        assert "object" not in row
    else:
        assert {key: row["object"][key] for key in expect} == expect
        assert row["object"]["metadata"]["name"] == "c"


def test_an_unknown_include_object_is_a_bad_request(api: Client) -> None:
    assert api.call("GET", CMS, accept=TABLE, includeObject="Everything")[0] == 400


def test_a_single_object_is_a_table_of_one_row(api: Client) -> None:
    api.create(CMS, {"metadata": {"name": "c"}})
    table = api.ok("GET", f"{CMS}/c", accept=TABLE)
    assert [row["cells"][0] for row in table["rows"]] == ["c"]


def test_a_table_watch_sends_column_definitions_with_its_first_event_only(api: Client) -> None:
    api.create(CMS, {"metadata": {"name": "a"}})
    api.create(CMS, {"metadata": {"name": "b"}})
    with api.watch(CMS, accept=TABLE) as stream:
        events = [json.loads(stream.readline()) for _ in range(2)]
    assert [event["object"]["kind"] for event in events] == ["Table", "Table"]
    assert [event["object"]["rows"][0]["cells"][0] for event in events] == ["a", "b"]
    assert ["columnDefinitions" in event["object"] for event in events] == [True, False]


@pytest.mark.parametrize(("accept", "version"), [
    (TABLE, "v1"),
    ("application/json;as=Table;v=v1beta1;g=meta.k8s.io, application/json", "v1beta1"),
    ("application/json, application/json;as=Table;v=v1;g=meta.k8s.io", None),
    ("application/json;as=PartialObjectMetadataList;v=v1;g=meta.k8s.io,application/json", None),
    ("application/vnd.kubernetes.protobuf, */*", None),
    ("", None),
])
def test_a_table_is_served_when_the_accept_header_prefers_one(accept: str, version: str | None) -> None:
    assert tables.wanted_version(accept) == version


@pytest.mark.parametrize(("seconds", "printed"), [
    (-5, "<invalid>"), (-1, "0s"), (5, "5s"), (119, "119s"), (150, "2m30s"), (180, "3m"), (20 * 60, "20m"),
    (2 * 3600, "120m"), (3 * 3600 + 5 * 60, "3h5m"), (4 * 3600, "4h"), (30 * 3600, "30h"), (4 * 86400, "4d"),
    (4 * 86400 + 7200, "4d2h"), (30 * 86400, "30d"), (3 * 365 * 86400 + 10 * 86400, "3y10d"),
    (10 * 365 * 86400, "10y"),
])
def test_ages_print_as_kubectl_prints_them(seconds: int, printed: str) -> None:
    assert tables.human_duration(seconds) == printed


@pytest.mark.parametrize(("path", "expect"), [
    (".status.phase", "Ready"),
    (".status.groups[1].name", "g1"),
    ("{.metadata.labels['app.kubernetes.io/name']}", "x"),
    (".status.missing.deeper", None),
    (".status.groups[5].name", None),
    ('.status.groups[?(@.name=="g1")].size', 2),
    (".status.groups[?(@.name=='g9')].size", None),
])
def test_printer_column_json_paths_read_their_simple_forms(path: str, expect: Any) -> None:
    obj = {"metadata": {"labels": {"app.kubernetes.io/name": "x"}},
           "status": {"phase": "Ready", "groups": [{"name": "g0"}, {"name": "g1", "size": 2}]}}
    assert tables.json_path(obj, path) == expect


def test_printer_columns_type_their_cells_and_print_dates_as_ages() -> None:
    columns = tables.columns_for("Thing", [
        {"name": "Count", "type": "integer", "jsonPath": ".status.count"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Since", "type": "date", "jsonPath": ".status.since"},
        {"name": "Bad", "type": "integer", "jsonPath": ".status.phase"},
        {"name": "Detail", "type": "string", "jsonPath": ".status.detail", "priority": 1},
    ])
    now = datetime.datetime(2025, 1, 1, 12, 0, tzinfo=datetime.UTC)
    obj = {"metadata": {"name": "t"}, "status": {"count": 3.0, "phase": "Up", "since": "2025-01-01T11:57:00Z"}}
    table = tables.table([obj], columns, version="v1", now=now)
    assert table["rows"][0]["cells"] == ["t", 3, "Up", "3m", None, None]
    assert [c["priority"] for c in table["columnDefinitions"]] == [0, 0, 0, 0, 0, 1]
