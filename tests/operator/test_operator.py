"""The operator against the local cluster, end to end: kubectl in, pods running real agents and ranks, HTTP out.

One cluster and operator per module (starting them is the slow part); each test leaves no deployment behind.
"""

from __future__ import annotations

import json
import shutil
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kopf")
pytest.importorskip("kmock")

from shardwise.agents.runtime.oracle import complete
from shardwise.devcluster.session import LocalSession

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "tiny-moe.yaml").read_text())
READY_S = 240


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    with LocalSession(tmp_path_factory.mktemp("operator"), nodes=2, gpus_per_node=4,
                      operator_args=("--gang-timeout", "120"),
                      operator_env={"SHARDWISE_EPLB_CHECK_SECONDS": "2"}) as s:
        yield s


def manifest(name: str, eplb: dict[str, Any] | None = None, **parallelism: int) -> str:
    body = json.loads(json.dumps(EXAMPLE))
    body["metadata"]["name"] = name
    body["spec"]["parallelism"].update(parallelism)
    body["spec"]["eplb"].update(eplb or {})
    return yaml.safe_dump(body)


def apply(s: LocalSession, text: str) -> None:
    s.kubectl("apply", "--validate=false", "-f", "-", input=text)


def wait_available(s: LocalSession, name: str, *, world_above: int = 0) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        st = s.status(name)
        ok = (st.get("phase") == "Running" and int(st.get("worldGeneration") or 0) > world_above
              and s.condition(name, "Available") == "True")
        return st if ok else None

    try:
        return s.wait_for(ready, READY_S, f"{name} Available")  # type: ignore[no-any-return]
    except AssertionError:
        print(s.operator_log.read_text()[-4000:])
        raise


def pods(s: LocalSession, name: str) -> list[dict[str, Any]]:
    out = s.get("pods", namespace="default") or {}
    return [p for p in out.get("items", []) if p["metadata"].get("labels", {}).get("shardwise.io/deployment") == name]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def assert_serves_like_the_oracle(status: dict[str, Any]) -> None:
    want = complete("tiny-moe", 0, "The operator", 8)["token_ids"]
    assert status["endpoints"], status
    for url in status["endpoints"]:
        assert post(url, {"prompt": "The operator", "max_tokens": 8})["token_ids"] == want


def delete(s: LocalSession, name: str) -> None:
    s.kubectl("delete", "inferencedeployment", name, "--wait=true", timeout=120)
    s.wait_for(lambda: not pods(s, name), 60, f"the pods of {name} to go")


def test_apply_becomes_available_and_serves_like_the_oracle(session: LocalSession) -> None:
    s = session
    apply(s, manifest("alpha"))
    st = wait_available(s, "alpha")
    assert st["ready"] == "2/2" and st["dpa"] == 2 and st["worldSize"] == 4
    assert [(p["name"], p["ranks"], p["ready"]) for p in st["pods"]] == [("alpha-0", [0, 1], True),
                                                                            ("alpha-1", [2, 3], True)]
    assert_serves_like_the_oracle(st)
    # what it owns: every object labelled and owned by the deployment
    uid = s.get("inferencedeployments.shardwise.io", "alpha")["metadata"]["uid"]
    for kind, name in [("pod", "alpha-0"), ("pod", "alpha-1"), ("service", "alpha"), ("service", "alpha-workers"),
                       ("configmap", "alpha-plan"), ("secret", "alpha-agent-token"), ("pdb", "alpha")]:
        obj = s.get(kind, name)
        assert obj is not None, f"{kind}/{name} missing"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
        assert obj["metadata"]["labels"]["shardwise.io/deployment"] == "alpha"
    plan = json.loads(s.get("configmap", "alpha-plan")["data"]["plan.json"])
    assert plan["worldSize"] == 4
    events = s.get("events")["items"]
    reasons = {e["reason"] for e in events if e["involvedObject"]["name"] == "alpha"}
    assert {"Provisioning", "WorldConfigured", "Available"} <= reasons, reasons
    # a deleted worker pod is recreated and the world re-formed
    world = st["worldGeneration"]
    s.kubectl("delete", "pod", "alpha-1", "--wait=false")
    st = wait_available(s, "alpha", world_above=world)
    assert_serves_like_the_oracle(st)
    delete(s, "alpha")
    left = [f"{kind}/{name}" for kind, name in [("service", "alpha"), ("configmap", "alpha-plan"),
                                                 ("secret", "alpha-agent-token"), ("pdb", "alpha")]
            if s.get(kind, name) is not None]
    assert not left, f"left behind after delete: {left}"


def test_a_layout_change_rolls_to_a_new_world(session: LocalSession) -> None:
    s = session
    apply(s, manifest("beta"))
    world = wait_available(s, "beta")["worldGeneration"]
    s.kubectl("scale", "inferencedeployment", "beta", "--replicas", "1")
    st = wait_available(s, "beta", world_above=world)
    assert st["dpa"] == 1 and st["ready"] == "1/1" and len(pods(s, "beta")) == 1
    assert_serves_like_the_oracle(st)
    delete(s, "beta")


def test_an_invalid_spec_never_becomes_pods(session: LocalSession) -> None:
    s = session
    apply(s, manifest("gamma", tp=3))
    s.wait_for(lambda: s.condition("gamma", "Available") == "False", 60, "gamma InvalidSpec")
    cond = next(c for c in s.status("gamma")["conditions"] if c["type"] == "Available")
    assert cond["reason"] == "InvalidSpec"
    assert "tp=3" in cond["message"] or "tp" in cond["message"], cond
    assert s.status("gamma")["phase"] == "Failed"
    assert not pods(s, "gamma")
    delete(s, "gamma")


def test_an_operator_killed_mid_creation_resumes_without_duplicates(session: LocalSession) -> None:
    s = session
    apply(s, manifest("delta"))
    s.wait_for(lambda: pods(s, "delta"), 60, "delta's first pods")
    s.kill_operator(signal.SIGKILL)
    s.start_operator()
    st = wait_available(s, "delta")
    names = sorted(p["metadata"]["name"] for p in pods(s, "delta"))
    assert names == ["delta-0", "delta-1"]
    assert_serves_like_the_oracle(st)
    delete(s, "delta")


def test_eplb_moves_experts_live_from_measured_load(session: LocalSession) -> None:
    s = session
    apply(s, manifest("eps", eplb={"balanceThreshold": 1.0, "intervalSeconds": 3600}))
    st = wait_available(s, "eps")
    prompts = ["skewed load " * 3, "more tokens to route", "a third request"]
    for i, prompt in enumerate(prompts):  # routed tokens fill the agents' load windows
        post(st["endpoints"][i % 2], {"prompt": prompt, "max_tokens": 16})

    def rebalanced() -> dict[str, Any] | None:
        e = s.status("eps").get("eplb") or {}
        return e if e.get("lastRebalanceTime") and not e.get("inProgress") else None

    e = s.wait_for(rebalanced, 120, "a rebalance of eps")
    assert e["mapGeneration"] >= 1 and e["slotsMoved"] > 0 and e["bytesMoved"] > 0
    assert e["balanceAfter"] < e["balanceBefore"] and not e.get("lastError")
    assert_serves_like_the_oracle(s.status("eps"))
    events = [ev for ev in s.get("events")["items"] if ev["involvedObject"]["name"] == "eps"]
    assert any(ev["reason"] == "Rebalanced" and "map generation" in ev["message"] for ev in events)
    delete(s, "eps")
