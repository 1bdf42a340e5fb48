"""The operator against the local cluster, end to end: kubectl in, pods running real agents and ranks, HTTP out.

One cluster and operator per module (starting them is the slow part); each test leaves no deployment behind.
"""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

pytest.importorskip("kopf")
pytest.importorskip("kmock")

from shardwise.devcluster.session import LocalSession

from tests.conftest import shardwise_command
from tests.operator.common import (
    apply,
    assert_serves_like_the_oracle,
    delete,
    events,
    local_session,
    manifest,
    oracle,
    pods,
    post,
    router_pod,
    token,
    wait_available,
    wait_status,
)

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    yield from local_session(tmp_path_factory, "operator", operator_args=("--gang-timeout", "120"),
                             operator_env={"SHARDWISE_EPLB_CHECK_SECONDS": "2"})


def test_apply_becomes_available_and_serves_like_the_oracle(session: LocalSession) -> None:
    s = session
    apply(s, manifest("alpha"))
    st = wait_available(s, "alpha")
    assert st["ready"] == "2/2" and st["dpa"] == 2 and st["worldSize"] == 4
    assert [(p["name"], p["ranks"], p["ready"]) for p in st["pods"]] == [("alpha-0", [0, 1], True),
                                                                            ("alpha-1", [2, 3], True)]
    assert_serves_like_the_oracle(st)
    router = router_pod(s, "alpha")
    assert st["url"] == f"http://{router['status']['podIP']}:8000"  # the local cluster's Services have no address
    owner = router["metadata"]["ownerReferences"][0]  # the router Deployment's ReplicaSet made it
    assert owner["kind"] == "ReplicaSet" and owner["name"].startswith("alpha-router-"), owner
    wide = s.kubectl("get", "idep", "alpha", "-o", "wide")
    assert "URL" in wide.splitlines()[0] and st["url"] in wide, wide
    header, row = wide.splitlines()[0].split(), wide.splitlines()[1].split()
    assert header[:8] == ["NAME", "PHASE", "DESIRED", "DPA", "READY", "MODEL", "REASON", "AGE"], wide
    # (the answers above are measured load: the EPLB controller may be moving experts, a serving phase too)
    assert row[1] in ("Running", "Rebalancing"), wide
    assert row[:1] + row[2:7] == ["alpha", "2", "2", "2/2", "tiny-moe", "Serving"] and row[9] == "reference", wide
    # what it owns: every object labelled and owned by the deployment
    uid = s.get("inferencedeployments.shardwise.io", "alpha")["metadata"]["uid"]
    for kind, name in [("pod", "alpha-0"), ("pod", "alpha-1"), ("service", "alpha"), ("service", "alpha-workers"),
                       ("configmap", "alpha-plan"), ("secret", "alpha-agent-token"), ("pdb", "alpha"),
                       ("deployment", "alpha-router")]:
        obj = s.get(kind, name)
        assert obj is not None, f"{kind}/{name} missing"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
        assert obj["metadata"]["labels"]["shardwise.io/deployment"] == "alpha"
    plan = json.loads(s.get("configmap", "alpha-plan")["data"]["plan.json"])
    assert plan["worldSize"] == 4
    reasons = {e["reason"] for e in events(s, "alpha")}
    assert {"Provisioning", "WorldConfigured", "Available"} <= reasons, reasons
    # a deleted worker pod: the survivors re-form the world, then a new pod restores the size
    world = st["worldGeneration"]
    s.kubectl("delete", "pod", "alpha-1", "--wait=false")
    st = wait_status(s, "alpha", lambda st: (st.get("elastic") or {}).get("operation") == "ScaleUp"
                     and st["elastic"].get("phase") == "Done" and st.get("dpa") == 2 and st.get("phase") == "Running",
                     "alpha recovered and restored to dpa 2")
    assert st["worldGeneration"] == world + 2  # recovered (dpa 1), then scaled up (dpa 2)
    reasons = [e["reason"] for e in events(s, "alpha")]
    assert "RecoveryStarted" in reasons and "Recovered" in reasons and "ScaledUp" in reasons, reasons
    assert_serves_like_the_oracle(st)
    delete(s, "alpha")
    left = [f"{kind}/{name}" for kind, name in [("service", "alpha"), ("configmap", "alpha-plan"),
                                                 ("secret", "alpha-agent-token"), ("pdb", "alpha")]
            if s.get(kind, name) is not None]
    assert not left, f"left behind after delete: {left}"


def test_a_layout_written_by_the_search_applies_and_becomes_available(session: LocalSession) -> None:
    s = session
    search = [*shardwise_command(), "plan", "--search", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "4"]
    front = json.loads(subprocess.run([*search, "-o", "json"], capture_output=True, text=True, check=True,
                                      timeout=120).stdout)["front"]
    pick = next(i for i, p in enumerate(front, 1) if p["pp"] == 1 and p["cp"] == 1 and p["moeTp"] == 1)
    out = subprocess.run([*search, "-o", "manifest", "--pick", str(pick), "--name", "searched"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    apply(s, out.stdout)
    st = wait_available(s, "searched")
    row = front[pick - 1]
    assert st["dpa"] == row["dpa"] and st["worldSize"] == 4, st
    code, body = post(st["url"], {"prompt": "The operator", "max_tokens": 4})
    assert code == 200 and len(body["token_ids"]) == 4, body  # bfloat16, as searched: not the float64 oracle
    delete(s, "searched")


SHAPE = {"labels": {"team": "search"}, "annotations": {"example.com/owner": "ml-platform"}, "shmSize": "1Gi",
         "volumes": [{"name": "cache", "emptyDir": {}}], "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
         "imagePullSecrets": ["regcred"], "priorityClassName": "inference",
         "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
             {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}]}}},
         "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                        "whenUnsatisfiable": "ScheduleAnyway"}]}


def test_the_pod_shape_of_the_spec_appears_in_the_worker_pods(session: LocalSession) -> None:
    s = session
    body = yaml.safe_load(manifest("shaped"))
    body["spec"]["runtime"] = {"image": "corp/shardwise-agent:2", "pod": SHAPE}
    apply(s, yaml.safe_dump(body))
    st = wait_available(s, "shaped")
    assert_serves_like_the_oracle(st)
    for pod in pods(s, "shaped"):
        meta, spec = pod["metadata"], pod["spec"]
        agent = spec["containers"][0]
        assert meta["labels"]["team"] == "search" and meta["annotations"]["example.com/owner"] == "ml-platform"
        assert agent["image"] == "corp/shardwise-agent:2"  # the spec's image, not the operator's default
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}} in spec["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in agent["volumeMounts"]
        assert {"name": "cache", "mountPath": "/cache"} in agent["volumeMounts"]
        assert spec["imagePullSecrets"] == [{"name": "regcred"}] and spec["priorityClassName"] == "inference"
        assert spec["affinity"] == SHAPE["affinity"]
        assert spec["topologySpreadConstraints"] == SHAPE["topologySpreadConstraints"]
    delete(s, "shaped")


def test_a_layout_change_rolls_to_a_new_world(session: LocalSession) -> None:
    s = session
    apply(s, manifest("beta"))
    world = wait_available(s, "beta")["worldGeneration"]
    s.kubectl("patch", "inferencedeployment", "beta", "--type", "merge", "-p",
              json.dumps({"spec": {"parallelism": {"tp": 1}}}))  # 2 ranks: one pod of 2 GPUs
    st = wait_available(s, "beta", world_above=world)
    assert st["worldSize"] == 2 and st["ready"] == "1/1"
    s.wait_for(lambda: len(pods(s, "beta")) == 1, 60, "the old pods to go")
    assert [p["ranks"] for p in st["pods"]] == [[0, 1]]
    assert_serves_like_the_oracle(st)
    assert "Provisioning" in [e["reason"] for e in events(s, "beta")]
    delete(s, "beta")


# a stand-in definition of the Gateway API Inference Extension's InferencePool (its group, version and names; no
# schema), as a cluster that has the extension installed serves it
POOL_CRD = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: inferencepools.inference.networking.k8s.io}
spec:
  group: inference.networking.k8s.io
  scope: Namespaced
  names: {kind: InferencePool, plural: inferencepools, singular: inferencepool, listKind: InferencePoolList}
  versions:
  - name: v1
    served: true
    storage: true
    schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
"""


def test_an_inference_pool_of_the_leaders_is_kept_where_its_crd_is_installed(session: LocalSession) -> None:
    s = session
    apply(s, POOL_CRD)
    try:
        apply(s, manifest("pool"))
        st = wait_available(s, "pool")
        kind = "inferencepools.inference.networking.k8s.io"
        pool = s.wait_for(lambda: s.get(kind, "pool"), 60, "the operator to make the InferencePool")
        assert pool["metadata"]["ownerReferences"][0]["name"] == "pool"
        match = pool["spec"]["selector"]["matchLabels"]
        leaders = [p for p in pods(s, "pool") if match.items() <= p["metadata"]["labels"].items()]
        assert sorted(f"http://{p['status']['podIP']}:{pool['spec']['targetPorts'][0]['number']}"
                      for p in leaders) == sorted(st["endpoints"])
        assert pool["spec"]["endpointPickerRef"]["name"] == "pool-epp"
        delete(s, "pool")
        s.wait_for(lambda: s.get(kind, "pool") is None, 60, "the InferencePool to go with its deployment")
    finally:
        s.kubectl("delete", "crd", "inferencepools.inference.networking.k8s.io", "--wait=true", check=False)
    # the CRD gone while the operator still believes it present: a deployment is served all the same
    apply(s, manifest("nopool"))
    assert_serves_like_the_oracle(wait_available(s, "nopool"))
    delete(s, "nopool")


def test_an_api_key_guards_the_router_and_every_pod_and_the_pods_credentials_are_files(
        session: LocalSession) -> None:
    """With spec.runtime.apiKeySecret the OpenAI API answers only with the key, through the router and on each
    pod alike (a client going around the router needs it too); the pods' control routes take the agent token;
    neither secret is in any container's environment: both are files of Secret volumes."""
    s = session
    apply(s, yaml.safe_dump({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keyed-api"},
                             "stringData": {"key": "sk-keyed-123"}}))
    body = yaml.safe_load(manifest("keyed"))
    body["spec"]["runtime"] = {"apiKeySecret": {"name": "keyed-api", "key": "key"}}
    apply(s, yaml.safe_dump(body))
    st = wait_available(s, "keyed")
    for url in [*st["endpoints"], st["url"]]:
        code, answer = post(url, {"prompt": "guarded", "max_tokens": 8})
        assert code == 401 and "API key" in answer["error"], (url, code, answer)
        assert post(url, {"prompt": "guarded", "max_tokens": 8}, api_key="sk-wrong")[0] == 401
        code, answer = post(url, {"prompt": "guarded", "max_tokens": 8}, api_key="sk-keyed-123")
        assert code == 200 and answer["token_ids"] == oracle("guarded", 8), (url, code, answer)
    stats = st["endpoints"][0] + "/v1/stats"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(stats, headers={"Authorization": "Bearer sk-keyed-123"}),
                               timeout=10)
    assert refused.value.code == 401  # the API key is not the agent token
    ask = urllib.request.Request(stats, headers={"Authorization": f"Bearer {token(s, 'keyed')}"})
    with urllib.request.urlopen(ask, timeout=10) as r:
        assert "groups" in json.loads(r.read())
    for p in [*pods(s, "keyed"), router_pod(s, "keyed")]:
        container = p["spec"]["containers"][0]
        assert not [e["name"] for e in container["env"] if "secretKeyRef" in (e.get("valueFrom") or {})], p
        assert {v["name"] for v in p["spec"]["volumes"]} >= {"agent-token", "api-key"}
    delete(s, "keyed")
    s.kubectl("delete", "secret", "keyed-api")


def test_an_invalid_spec_never_becomes_pods(session: LocalSession) -> None:
    s = session
    apply(s, manifest("gamma", tp=3))
    s.wait_for(lambda: s.condition("gamma", "Available") == "False", 60, "gamma InvalidSpec")
    cond = next(c for c in s.status("gamma")["conditions"] if c["type"] == "Available")
    assert cond["reason"] == "InvalidSpec"
    assert "spec.parallelism.tp: numHeads=4 is not divisible by tp=3" in cond["message"], cond
    assert s.status("gamma")["phase"] == "Failed"
    assert not pods(s, "gamma")
    delete(s, "gamma")


def test_a_world_whose_pods_exit_at_start_backs_off_and_says_why(session: LocalSession) -> None:
    """A setting the agent refuses (here an environment variable of the spec) makes every pod exit at start: the
    operator names the pod and the agent's own error from the pod's termination message, in a condition and an
    event, and forms the next world only after 10 s, then 20 s (no storm of pods)."""
    s = session
    body = yaml.safe_load(manifest("crashy"))
    body["spec"]["runtime"] = {"env": [{"name": "SHARDWISE_GRPC_PORT", "value": "not-a-port"}]}
    apply(s, yaml.safe_dump(body))
    st = wait_status(s, "crashy", lambda st: (st.get("crashLoop") or {}).get("crashes", 0) >= 2,
                     "two exits in a row", timeout=120)
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "CrashLoopBackOff", degraded
    assert "exited 1: error: Invalid value for '--grpc-port'" in degraded["message"], degraded
    assert "(exit 2 in a row; the world forms again in 20 s)" in degraded["message"], degraded
    said = [e["message"] for e in events(s, "crashy") if e["reason"] == "PodExited"]
    assert said and "not-a-port" in said[0], said
    assert st["worldGeneration"] <= 3 and st["phase"] in ("Pending", "Recovering"), st
    delete(s, "crashy")


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
    assert any(ev["reason"] == "Rebalanced" and "map generation" in ev["message"] for ev in events(s, "eps"))
    # the mark of a rebalance whose operator process died mid-way, its deadline far off: the next check clears it
    # (it would hold the deployment in Rebalancing, and any scale back, until that deadline). First the checks are
    # made quiet: at threshold 1.0 any check may rebalance again, and its own end would clear the mark.
    s.kubectl("patch", "idep", "eps", "--type=merge", "-p", json.dumps({"spec": {"eplb": {"balanceThreshold": 50}}}))
    wait_status(s, "eps", lambda st: "within the threshold 50" in str((st.get("eplb") or {}).get("lastCheck"))
                and not st["eplb"].get("inProgress"), "a check under the new threshold", timeout=60)
    s.kubectl("patch", "idep", "eps", "--subresource=status", "--type=merge", "-p", json.dumps(
        {"status": {"eplb": {"inProgress": True, "inProgressDeadline": "2099-01-01T00:00:00Z"}}}))
    st = wait_status(s, "eps", lambda st: not (st.get("eplb") or {}).get("inProgress") and st["phase"] == "Running",
                     "the left mark cleared", timeout=60)
    assert any(ev["reason"] == "RebalanceInterrupted" for ev in events(s, "eps"))  # sent before the mark goes
    assert_serves_like_the_oracle(st, "after the left mark was cleared")
    delete(s, "eps")


def test_a_scaled_world_is_balanced_from_measured_load_whatever_the_threshold(session: LocalSession) -> None:
    """Neither the threshold nor the interval is ever due here: each new world (the first, then the scaled one)
    is what makes the EPLB controller decide on the measured load, as soon as it has some: it rebalances through
    the executor when that helps, else records that no better placement exists, never "within the threshold"."""
    s = session
    apply(s, manifest("epw", eplb={"balanceThreshold": 100.0, "intervalSeconds": 3600}))
    st = wait_available(s, "epw")
    post(st["endpoints"][0], {"prompt": "load for the first world", "max_tokens": 16})
    first = s.wait_for(lambda: (e := s.status("epw").get("eplb") or {}).get("world") == st["worldGeneration"]
                       and not e.get("inProgress") and e, 120, "epw's first world to be balanced")
    # (lastCheck is the latest check's, every 2 s here; worldDecision keeps the first one for this world)
    assert "within the threshold" not in first["worldDecision"], first
    assert any(ev["reason"] == "Rebalanced" for ev in events(s, "epw"))  # round robin vs skewed load: it moves
    s.kubectl("scale", "inferencedeployment", "epw", "--replicas", "4")
    grown = wait_status(s, "epw", lambda x: x.get("dpa") == 4 and x.get("phase") == "Running"
                        and (x.get("elastic") or {}).get("phase") == "Done", "epw scaled up to 4")
    post(grown["endpoints"][0], {"prompt": "load for the scaled world", "max_tokens": 16})
    e = s.wait_for(lambda: (e := s.status("epw").get("eplb") or {}).get("world") == grown["worldGeneration"]
                   and not e.get("inProgress") and e, 120, "epw's scaled world to be balanced")
    assert "within the threshold" not in e["worldDecision"], e  # decided on the merits of the new world's map
    assert e["mapGeneration"] > first["mapGeneration"]  # the scale-up's carried map (and any rebalance after it)
    assert_serves_like_the_oracle(s.status("epw"), "after the scaled world was balanced")
    delete(s, "epw")
