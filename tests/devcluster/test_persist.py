"""Objects kept across restarts of the local cluster (`shardwise dev up --persist`): the API server's snapshot and
restore, what a restart keeps, and the state file written atomically. `dev up --persist` end to end is in
test_dev.py."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.devcluster.apiclient import CRD_FILE, CRDS, EXAMPLE, Client

pytest.importorskip("kmock")

from shardwise.devcluster import dev
from shardwise.devcluster.apiserver import APIServer

CMS = "/api/v1/namespaces/default/configmaps"
IDS = "/apis/shardwise.io/v1alpha1/namespaces/default/inferencedeployments"
Serve = Callable[..., tuple[APIServer, Client]]


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Start API servers (options go to the emulator), each with a client; every one is stopped at teardown."""
    servers: list[APIServer] = []

    def _serve(**options: Any) -> tuple[APIServer, Client]:
        server = APIServer(**options)
        servers.append(server)
        return server, Client(server.start())

    yield _serve
    for server in servers:
        server.stop()


def populated(serve: Serve) -> tuple[APIServer, Client]:
    """A server with the CRD, an InferenceDeployment, and a ConfigMap it owns with a finalizer."""
    server, api = serve()
    api.create(CRDS, yaml.safe_load(CRD_FILE.read_text()))
    owner = api.create(IDS, yaml.safe_load(EXAMPLE.read_text()))
    api.create(CMS, {"metadata": {"name": "settings", "finalizers": ["example.com/keep"],
                                  "ownerReferences": [{"apiVersion": "shardwise.io/v1alpha1",
                                                       "kind": "InferenceDeployment", "name": "tiny-moe",
                                                       "uid": owner["metadata"]["uid"]}]},
                     "data": {"a": "1"}})
    api.patch(f"{CMS}/settings", {"data": {"a": "2"}})
    return server, api


def restored(serve: Serve, snapshot: dict[str, Any]) -> tuple[APIServer, Client]:
    """A server started from a snapshot as `dev up --persist` reads it: through JSON."""
    return serve(restore=json.loads(json.dumps(snapshot)))


def entry(group: str, plural: str, name: str, uid: str, owners: tuple[str, ...] = ()) -> dict[str, Any]:
    """A snapshot entry."""
    metadata: dict[str, Any] = {"name": name, "uid": uid, "resourceVersion": "1",
                                "ownerReferences": [{"uid": owner, "name": owner} for owner in owners]}
    return {"resource": [group, "v1", plural], "object": {"metadata": metadata}}


def test_a_restored_server_serves_every_object_as_it_was_metadata_included(serve: Serve) -> None:
    server, before = populated(serve)
    _, after = restored(serve, server.snapshot())
    for path in (f"{CMS}/settings", f"{IDS}/tiny-moe", "/api/v1/namespaces/default",
                 f"{CRDS}/inferencedeployments.shardwise.io"):
        assert after.get(path) == before.get(path), path  # uid, resourceVersion, managedFields, finalizers, ...
    assert after.get("/api/v1/namespaces/default/configmaps/settings")["metadata"]["managedFields"]
    kinds = [entry["kind"] for entry in after.get("/apis/shardwise.io/v1alpha1")["resources"]]
    assert "InferenceDeployment" in kinds  # the CRD was restored first, so its resource is served


def test_writes_after_a_restore_take_resource_versions_after_the_snapshots_counter(serve: Serve) -> None:
    server, before = populated(serve)
    before.create(CMS, {"metadata": {"name": "gone"}})
    before.ok("DELETE", f"{CMS}/gone")  # the counter moved past every stored object's resourceVersion
    snapshot = server.snapshot()
    old = int(before.get(f"{CMS}/settings")["metadata"]["resourceVersion"])
    assert snapshot["revision"] > old
    _, after = restored(serve, snapshot)
    patched = after.patch(f"{CMS}/settings", {"data": {"a": "3"}})
    created = after.create(CMS, {"metadata": {"name": "new"}})
    assert snapshot["revision"] < int(patched["metadata"]["resourceVersion"]) < int(
        created["metadata"]["resourceVersion"])
    assert int(after.get(CMS)["metadata"]["resourceVersion"]) == int(created["metadata"]["resourceVersion"])


def test_a_watch_from_before_the_restore_is_gone_and_one_from_the_restored_revision_sees_new_changes(
        serve: Serve) -> None:
    server, _ = populated(serve)
    snapshot = server.snapshot()
    _, after = restored(serve, snapshot)
    with after.watch(CMS, resourceVersion=str(snapshot["revision"] - 1)) as stream:
        (event,) = [json.loads(line) for line in stream]
    assert (event["type"], event["object"]["code"]) == ("ERROR", 410)
    with after.watch(CMS, resourceVersion=str(snapshot["revision"])) as stream:
        after.create(CMS, {"metadata": {"name": "new"}})
        event = json.loads(stream.readline())
    assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "new")


@pytest.mark.parametrize(("snapshot", "message"), [
    ({"format": 99, "objects": []}, "not a snapshot of format 1"),
    ({"format": 1, "objects": [{"resource": ["", "v1", "configmaps"], "object": {"metadata": {"name": "a"}}}]},
     "object 0: metadata lacks uid, resourceVersion"),
    ({"format": 1, "objects": [{"resource": "configmaps", "object": {}}]},
     "object 0: resource must be [GROUP, VERSION, PLURAL]"),
    ({"format": 1, "objects": [entry("", "configmaps", "c", "1"), entry("", "configmaps", "c", "2")]},
     "an object is in the snapshot twice"),
], ids=["an unknown format", "an object without uid and resourceVersion", "a resource that is not a triple",
        "an object twice"])
def test_a_malformed_snapshot_is_refused_before_the_server_starts_and_says_what_is_wrong(
        snapshot: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as failure:
        APIServer(restore=snapshot)
    assert message in str(failure.value)


KEPT_CASES = [
    ("a ConfigMap, a custom resource and a Lease that no node owns are kept",
     [entry("", "configmaps", "c", "c"), entry("shardwise.io", "inferencedeployments", "i", "i"),
      entry("coordination.k8s.io", "leases", "leader", "l")], {"c", "i", "l"}),
    ("Pods, Nodes and Events are dropped",
     [entry("", "pods", "p", "p"), entry("", "nodes", "n", "n"), entry("", "events", "e", "e"),
      entry("events.k8s.io", "events", "e2", "e2")], set()),
    ("a node's Lease goes with its Node, and what only a Pod owns goes with the Pod, transitively",
     [entry("", "nodes", "n", "n"), entry("coordination.k8s.io", "leases", "n", "l", owners=("n",)),
      entry("", "pods", "p", "p"), entry("", "configmaps", "c", "c", owners=("p",)),
      entry("", "secrets", "s", "s", owners=("c",))], set()),
    ("an object with another kept owner, or an owner that was never there, is kept",
     [entry("", "pods", "p", "p"), entry("", "configmaps", "owner", "o"),
      entry("", "configmaps", "c", "c", owners=("p", "o")), entry("", "configmaps", "d", "d", owners=("absent",))],
     {"o", "c", "d"}),
]


@pytest.mark.parametrize(("case", "entries", "kept"), KEPT_CASES, ids=[case[0] for case in KEPT_CASES])
def test_a_restart_keeps_what_no_node_or_pod_process_stood_for(case: str, entries: list[dict[str, Any]],
                                                                kept: set[str]) -> None:
    snapshot = {"format": 1, "revision": 7, "objects": entries}
    result = dev.kept_across_restarts(snapshot)
    assert {e["object"]["metadata"]["uid"] for e in result["objects"]} == kept
    assert result["revision"] == 7


def test_objects_are_written_whole_and_read_back(tmp_path: Path) -> None:
    assert dev.load_objects(tmp_path) is None  # a first run starts empty
    snapshot = {"format": 1, "revision": 3, "objects": [entry("", "configmaps", "c", "c")]}
    dev.save_objects(tmp_path, snapshot)
    assert dev.load_objects(tmp_path) == snapshot
    assert sorted(p.name for p in tmp_path.iterdir()) == [dev.OBJECTS]  # no temporary file left
    (tmp_path / dev.OBJECTS).write_text('{"format": 1, "objects": [')
    with pytest.raises(ValueError, match="not JSON"):
        dev.load_objects(tmp_path)
