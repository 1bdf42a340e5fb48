"""What the operator costs the API server: its reconcile steps read from a watch-fed cache, so deployments whose
state does not change cost no request at all, and a change costs only the writes it makes."""

from __future__ import annotations

import json
import re
import socket
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

pytest.importorskip("kopf")
pytest.importorskip("kmock")

from shardwise.devcluster.session import LocalSession

from tests.operator.common import EXAMPLE, local_session

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PORT = free_port()


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    """An API server and the operator, no nodes: every pod stays Pending, every deployment provisioning."""
    yield from local_session(tmp_path_factory, "requests", nodes=0, operator_args=("--metrics-port", str(PORT)))


def metrics() -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = {name: float(re.search(rf"^shardwise_operator_{name}_total ([0-9.e+]+)$", text, re.M).group(1))  # type: ignore[union-attr]
             for name in ("reconciles", "api_requests", "api_discovery_requests")}
    # the operator asks every 15 s whether the InferencePool API is served (one request, whatever the deployments)
    return {"reconciles": found["reconciles"], "api_requests": found["api_requests"] - found["api_discovery_requests"]}


def manifests(n: int) -> str:
    docs = []
    for i in range(n):
        body: dict[str, Any] = json.loads(json.dumps(EXAMPLE))
        body["metadata"]["name"] = f"idle-{i}"
        docs.append(body)
    return yaml.safe_dump_all(docs)


def pod_names(s: LocalSession) -> set[str]:
    return {p["metadata"]["name"] for p in (s.get("pods") or {}).get("items", [])
            if p["metadata"]["name"].startswith("idle-")}


def test_deployments_waiting_for_their_pods_cost_no_api_request_and_a_lost_pod_only_its_writes(
        session: LocalSession) -> None:
    s = session
    s.wait_for(lambda: _answers(), 60, "the operator's metrics")
    s.kubectl("apply", "-f", "-", input=manifests(3), timeout=60)
    want = {f"idle-{i}-{j}" for i in range(3) for j in range(2)}  # tiny-moe: 2 pods each
    s.wait_for(lambda: pod_names(s) >= want, 60, "every pod created")
    s.wait_for(lambda: all((d.get("status") or {}).get("phase") == "Provisioning"
                           for d in (s.get("inferencedeployments.shardwise.io") or {}).get("items", [])),
               30, "every deployment's status written")
    # settled: from here every step sees the same deployments and pods
    s.wait_for(lambda: settled(s), 60, "a step with nothing to do")
    before = metrics()
    for i in range(9):
        touch(s, i % 3)
    s.wait_for(lambda: metrics()["reconciles"] >= before["reconciles"] + 9, 60, "nine more steps")
    after = metrics()
    assert after["api_requests"] == before["api_requests"], (before, after)

    # a pod deleted by hand: the operator sees it through its watch and makes it again, paying for its writes only:
    # the pod's create, and the status that says why the new pod waits (the scheduler finds no node for it)
    s.kubectl("delete", "pod", "idle-1-1", "--wait=true", timeout=60)
    s.wait_for(lambda: "idle-1-1" in pod_names(s), 30, "the pod made again")

    def says_why() -> bool:
        conds = {c["type"]: c for c in s.status("idle-1").get("conditions") or []}
        return "pod idle-1-1 unschedulable: " in (conds.get("Progressing") or {}).get("message", "")

    s.wait_for(says_why, 60, "the status to say why the new pod waits")
    s.wait_for(lambda: settled(s), 60, "a step with nothing to do")
    spent = metrics()["api_requests"] - after["api_requests"]
    # the create, and at most one status write for each state of the pods a step sees (the old pod going, the new
    # one made, the new one found unschedulable); no read: the steps read from the cache
    assert 2 <= spent <= 4, spent
    s.kubectl("delete", "inferencedeployments.shardwise.io", "--all", "--wait=true", timeout=120)


_touches = iter(range(1_000_000))


def touch(s: LocalSession, i: int) -> None:
    """Wake idle-I's step with a change of one of its pods that the deployment does not depend on (an annotation
    of someone else's): the step finds nothing to do."""
    s.kubectl("annotate", "pod", f"idle-{i}-0", f"example.com/touched={next(_touches)}", "--overwrite")


def settled(s: LocalSession) -> bool:
    """A step woken by `touch` made no request (steps still finishing earlier work may have)."""
    first = metrics()
    touch(s, 0)
    s.wait_for(lambda: metrics()["reconciles"] > first["reconciles"], 30, "a step")
    return metrics()["api_requests"] == first["api_requests"]


def _answers() -> bool:
    try:
        metrics()
        return True
    except OSError:
        return False
