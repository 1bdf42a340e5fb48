"""kopf, the framework the shardwise operator runs on, against the local API server: a registry of its own, on a
test CRD (`kopftest.example.com` Widgets, with a status subresource), logs in, sees a create and an update, writes
status through the status subresource, keeps its progress and diff base in annotations, and stops on its stop flag.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.devcluster.apiclient import CRDS, Client

kopf = pytest.importorskip("kopf", reason="kopf is not installed (the `operator` extra)")
pytest.importorskip("kmock")

GROUP = "kopftest.example.com"
WIDGETS = f"/apis/{GROUP}/v1/namespaces/default/widgets"
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": f"widgets.{GROUP}"},
    "spec": {"group": GROUP, "scope": "Namespaced",
             "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
             "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object",
                                                          "x-kubernetes-preserve-unknown-fields": True}}}]},
}
WAIT_S = 30


@pytest.fixture
def api() -> Iterator[Client]:
    from shardwise.devcluster.apiserver import APIServer

    with APIServer() as server:
        client = Client(server.url)
        client.create(CRDS, CRD)
        yield client


def registry_for(url: str) -> Any:
    """A private registry: annotation storage set at startup, login to the emulator (which checks no
    credentials), `status.phase = Seen` on create, `status.updates` counted on spec updates."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=GROUP, key="last-handled-configuration")
        settings.process.ultimate_exiting_timeout = None  # kopf must never SIGKILL the test process's thread

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=url)

    @kopf.on.create(GROUP, "v1", "widgets", registry=registry)
    def created(patch: kopf.Patch, **_: Any) -> None:
        patch.status["phase"] = "Seen"

    @kopf.on.update(GROUP, "v1", "widgets", field="spec", registry=registry)
    def updated(status: kopf.Status, patch: kopf.Patch, **_: Any) -> None:
        patch.status["updates"] = int(status.get("updates") or 0) + 1

    return registry


@pytest.fixture
def operator(api: Client) -> Iterator[threading.Thread]:
    """kopf in a background thread on its own loop, standalone (no peering); stopped by its flag at teardown."""
    stop = threading.Event()
    registry = registry_for(api.url)
    thread = threading.Thread(target=asyncio.run, name="kopf", daemon=True, args=(kopf.operator(
        registry=registry, standalone=True, clusterwide=True, stop_flag=stop),))
    thread.start()
    yield thread
    stop.set()
    thread.join(WAIT_S)
    assert not thread.is_alive(), "kopf did not stop on its stop flag"


def await_widget(api: Client, name: str, condition: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
    """The widget once it meets the condition: its current state, then its changes, from a watch that the server
    ends after WAIT_S seconds."""
    query = urllib.parse.urlencode({"watch": "true", "fieldSelector": f"metadata.name={name}",
                                    "timeoutSeconds": WAIT_S})
    with urllib.request.urlopen(f"{api.url}{WIDGETS}?{query}", timeout=WAIT_S + 5) as stream:
        for line in stream:
            event = json.loads(line)
            if event["type"] in ("ADDED", "MODIFIED") and condition(event["object"]):
                return dict(event["object"])
    raise AssertionError(f"no {what} within {WAIT_S} s")


@pytest.mark.slow
def test_kopf_handles_a_create_and_a_spec_update_and_keeps_its_progress_in_annotations(
        api: Client, operator: threading.Thread) -> None:
    api.create(WIDGETS, {"apiVersion": f"{GROUP}/v1", "kind": "Widget", "metadata": {"name": "w1"},
                         "spec": {"size": 1}})
    seen = await_widget(api, "w1", lambda w: w.get("status", {}).get("phase") == "Seen", "status.phase Seen")
    assert operator.is_alive()
    assert f"{GROUP}/last-handled-configuration" in seen["metadata"]["annotations"]
    assert any(entry.get("subresource") == "status" for entry in seen["metadata"]["managedFields"])

    api.patch(f"{WIDGETS}/w1", {"spec": {"size": 2}})
    updated = await_widget(api, "w1", lambda w: w.get("status", {}).get("updates") == 1, "status.updates 1")
    assert updated["status"]["phase"] == "Seen"
    assert json.loads(updated["metadata"]["annotations"][f"{GROUP}/last-handled-configuration"])["spec"] == {
        "size": 2}
