"""The local cluster's Deployment and ReplicaSet controllers: the rollout's steps as a table, then real Deployments
whose pods run as processes: they come up to their replicas, roll to a new template within maxSurge and
maxUnavailable with a server answering throughout, scale, replace a deleted pod, and go with their Deployment."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")

from shardwise.devcluster.apiserver import APIServer, write_kubeconfig
from shardwise.devcluster.cluster import Cluster
from shardwise.devcluster.deployments import SetSeen, rolling_bounds, rollout, template_hash
from shardwise.devcluster.podstatus import Backoff

from tests.devcluster.test_nodes import Api


@pytest.mark.parametrize(("strategy", "rolling", "desired", "bounds"), [
    ("RollingUpdate", {}, 4, (1, 1)),  # 25% of 4
    ("RollingUpdate", {}, 1, (1, 0)),  # the surge rounds up, the unavailable down
    ("RollingUpdate", {"maxSurge": 0, "maxUnavailable": 0}, 3, (0, 1)),
    ("RollingUpdate", {"maxSurge": "50%", "maxUnavailable": 2}, 5, (3, 2)),
])
def test_surge_and_unavailable_are_counts_or_percentages(strategy: str, rolling: dict[str, Any], desired: int,
                                                         bounds: tuple[int, int]) -> None:
    d = {"spec": {"replicas": desired, "strategy": {"type": strategy, "rollingUpdate": rolling}}}
    assert rolling_bounds(d) == bounds


NEW, OLD = "web-new", "web-old"


@pytest.mark.parametrize(("desired", "strategy", "surge", "unavailable", "sets", "want"), [
    # a first rollout: the new set takes every replica
    (3, "RollingUpdate", 1, 0, [SetSeen(NEW, 0, 0, 0, True)], {NEW: 3}),
    # a roll with maxSurge 1, maxUnavailable 0: one new pod first, the old ones stay until it is available
    (2, "RollingUpdate", 1, 0, [SetSeen(OLD, 2, 2, 2, False), SetSeen(NEW, 0, 0, 0, True)], {NEW: 1}),
    (2, "RollingUpdate", 1, 0, [SetSeen(OLD, 2, 2, 2, False), SetSeen(NEW, 1, 1, 0, True)], {}),
    (2, "RollingUpdate", 1, 0, [SetSeen(OLD, 2, 2, 2, False), SetSeen(NEW, 1, 1, 1, True)], {OLD: 1}),
    (2, "RollingUpdate", 1, 0, [SetSeen(OLD, 1, 1, 1, False), SetSeen(NEW, 1, 1, 1, True)], {NEW: 2}),
    (2, "RollingUpdate", 1, 0, [SetSeen(OLD, 1, 1, 1, False), SetSeen(NEW, 2, 2, 2, True)], {OLD: 0}),
    # maxUnavailable 1: an old pod goes at once
    (2, "RollingUpdate", 0, 1, [SetSeen(OLD, 2, 2, 2, False), SetSeen(NEW, 0, 0, 0, True)], {OLD: 1}),
    # old pods that are not available go first, within the budget
    (2, "RollingUpdate", 0, 1, [SetSeen(OLD, 2, 2, 0, False), SetSeen(NEW, 0, 0, 0, True)], {OLD: 1}),
    # an old set scaled down whose surplus pod is still there: nothing more goes until it has
    (2, "RollingUpdate", 1, 0, [SetSeen(OLD, 1, 2, 2, False), SetSeen(NEW, 1, 1, 1, True)], {}),
    # Recreate: the old pods all go, and only then the new ones come
    (2, "Recreate", 0, 2, [SetSeen(OLD, 2, 2, 2, False), SetSeen(NEW, 0, 0, 0, True)], {OLD: 0}),
    (2, "Recreate", 0, 2, [SetSeen(OLD, 0, 1, 0, False), SetSeen(NEW, 0, 0, 0, True)], {}),
    (2, "Recreate", 0, 2, [SetSeen(OLD, 0, 0, 0, False), SetSeen(NEW, 0, 0, 0, True)], {NEW: 2}),
    # scaled during a roll
    (1, "RollingUpdate", 1, 0, [SetSeen(OLD, 0, 0, 0, False), SetSeen(NEW, 3, 3, 3, True)], {NEW: 1}),
])
def test_a_rollout_step_keeps_within_the_surge_and_the_unavailable_budget(
        desired: int, strategy: str, surge: int, unavailable: int, sets: list[SetSeen], want: dict[str, int]) -> None:
    assert rollout(desired, strategy, surge, unavailable, sets) == want


def test_the_same_template_has_the_same_hash_and_another_another() -> None:
    a = {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "c", "image": "x:1"}]}}
    b = json.loads(json.dumps(a))
    assert template_hash(a) == template_hash(b) and len(template_hash(a)) == 10
    b["spec"]["containers"][0]["image"] = "x:2"
    assert template_hash(a) != template_hash(b)


SERVER = ("import os, http.server as h\n"
          "class Hello(h.BaseHTTPRequestHandler):\n"
          "    def do_GET(self):\n"
          "        body = (os.environ['VERSION'] + ' ' + os.environ['POD_NAME']).encode()\n"
          "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
          "    def log_message(self, *args): pass\n"
          "h.HTTPServer((os.environ['POD_IP'], 8080), Hello).serve_forever()\n")


def deployment(name: str, version: str, replicas: int = 2) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}},
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                     "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{
                         "name": "web", "image": "ignored:latest", "command": ["python3", "-c", SERVER],
                         "env": [{"name": "VERSION", "value": version},
                                 {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                                 {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                         "readinessProbe": {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1}}]}}}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Api, Path]]:
    tmp = tmp_path_factory.mktemp("deployments")
    with APIServer() as server, Cluster(server.url, nodes=1, gpus_per_node=0, state_dir=tmp / "state",
                                        backoff=Backoff(base=0.2, cap=1.0), stop_grace=2.0):
        yield Api(server.url), write_kubeconfig(tmp / "kubeconfig", server.url)


@pytest.fixture
def ns(cluster: tuple[Api, Path]) -> Iterator[str]:
    api, _ = cluster
    name = f"d-{uuid.uuid4().hex[:8]}"
    api.ok("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    yield name
    api.call("DELETE", f"/api/v1/namespaces/{name}")


def pods_of(api: Api, ns: str, app: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = api.ok("GET", f"/api/v1/namespaces/{ns}/pods?labelSelector=app%3D{app}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (pod.get("status") or {}).get("conditions")
               or [])


def answers(pods: list[dict[str, Any]]) -> set[str]:
    out = set()
    for p in pods:
        if ready(p):
            with urllib.request.urlopen(f"http://{p['status']['podIP']}:8080/", timeout=5) as r:
                out.add(r.read().decode().split()[0])
    return out


@pytest.mark.slow
def test_a_deployment_comes_up_rolls_within_its_budget_scales_and_goes(cluster: tuple[Api, Path], ns: str) -> None:
    api, _ = cluster
    deps = f"/apis/apps/v1/namespaces/{ns}/deployments"
    api.ok("POST", deps, deployment("web", "v1"))

    def available(want: int, generation: int) -> Any:
        return lambda d: d is not None and (d.get("status") or {}).get("observedGeneration") == generation and \
            (d["status"].get("availableReplicas"), d["status"].get("updatedReplicas"),
             d["status"].get("replicas")) == (want, want, want)

    d = api.wait(deps, "web", available(2, 1), timeout=60)
    assert d is not None and d["metadata"]["annotations"]["deployment.kubernetes.io/revision"] == "1"
    first = pods_of(api, ns, "web")
    assert len(first) == 2 and answers(first) == {"v1"}
    owner = first[0]["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "ReplicaSet" and owner["controller"] is True and owner["name"].startswith("web-")

    # a new template rolls: never more than 3 pods, never fewer than 2 ready, each ready one answers
    status, _ = api.call("PUT", f"{deps}/web", {**deployment("web", "v2"), "metadata": {
        "name": "web", "resourceVersion": d["metadata"]["resourceVersion"]}})
    assert status == 200
    seen_versions: set[str] = set()

    def rolled(d: dict[str, Any] | None) -> bool:
        live = pods_of(api, ns, "web")
        assert len(live) <= 3, [p["metadata"]["name"] for p in live]  # maxSurge 1
        assert sum(ready(p) for p in live) >= 2, [(p["metadata"]["name"], ready(p), p["status"].get("phase"),
                                                   p["metadata"]["ownerReferences"][0]["name"]) for p in live]
        seen_versions.update(answers(live))
        return available(2, 2)(d)  # type: ignore[no-any-return]

    api.wait(deps, "web", rolled, timeout=90)
    assert answers(pods_of(api, ns, "web")) == {"v2"} and "v2" in seen_versions
    sets = api.ok("GET", f"/apis/apps/v1/namespaces/{ns}/replicasets")["items"]
    assert sorted((s["spec"]["replicas"], s["metadata"]["annotations"]["deployment.kubernetes.io/revision"])
                  for s in sets) == [(0, "1"), (2, "2")]

    # scaled through the scale subresource, as kubectl scale does
    status, body = api.call("PUT", f"{deps}/web/scale", {"apiVersion": "autoscaling/v1", "kind": "Scale",
                                                          "metadata": {"name": "web", "namespace": ns},
                                                          "spec": {"replicas": 3}})
    assert status == 200, body
    api.wait(deps, "web", available(3, 3), timeout=60)

    # a deleted pod is replaced
    victim = pods_of(api, ns, "web")[0]["metadata"]["name"]
    api.ok("DELETE", f"/api/v1/namespaces/{ns}/pods/{victim}")
    api.wait(deps, "web", lambda d: d is not None and d["status"].get("availableReplicas") == 3 and
             victim not in {p["metadata"]["name"] for p in pods_of(api, ns, "web")}, timeout=60)

    # the Deployment goes, and its ReplicaSets and pods with it
    api.ok("DELETE", f"{deps}/web")
    api.wait(f"/api/v1/namespaces/{ns}/pods", victim, lambda p: p is None, timeout=30)
    assert api.wait(deps, "web", lambda d: d is None, timeout=30) is None
    for s in sets:
        api.wait(f"/apis/apps/v1/namespaces/{ns}/replicasets", s["metadata"]["name"], lambda s: s is None, timeout=30)
    assert pods_of(api, ns, "web") == []


@pytest.mark.slow
def test_kubectl_rollout_status_follows_a_deployment(cluster: tuple[Api, Path], ns: str) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    api, kubeconfig = cluster
    api.ok("POST", f"/apis/apps/v1/namespaces/{ns}/deployments", deployment("hello", "v1", replicas=1))
    done = subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig), "-n", ns, "rollout", "status",
                           "deployment/hello", "--timeout=60s"], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert 'deployment "hello" successfully rolled out' in done.stdout
    table = subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig), "-n", ns, "get", "deploy", "hello"],
                           capture_output=True, text=True, timeout=30)
    assert table.returncode == 0 and "1/1" in table.stdout, table
