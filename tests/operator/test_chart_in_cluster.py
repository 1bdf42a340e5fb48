"""The Helm chart's operator in-cluster on the local cluster, as a user installs it on a real one: `shardwise dev
install-chart` renders charts/shardwise with Helm's engine and applies it; the operator runs as the chart's
Deployment, in a pod, with the chart's ServiceAccount (its token mounted where the in-cluster client reads it) and
only what the chart's RBAC grants (the local API server enforces it). No `shardwise operator` runs outside.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

pytest.importorskip("kopf")
pytest.importorskip("kmock")
pytest.importorskip("helm_python", reason="helm-python-sdk is in the dev extra: run `make install`")

from shardwise.devcluster.session import LocalSession

from tests.conftest import shardwise_command
from tests.operator.common import assert_serves_like_the_oracle, local_session, manifest

pytestmark = pytest.mark.slow

NAMESPACE = "shardwise-system"
ACCOUNT = f"system:serviceaccount:{NAMESPACE}:shardwise"
OPERATOR = "app.kubernetes.io/component=operator"


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    yield from local_session(tmp_path_factory, "chart", operator=False)


def in_namespace(name: str, **parallelism: int) -> str:
    body = yaml.safe_load(manifest(name, **parallelism))
    body["metadata"]["namespace"] = NAMESPACE
    return yaml.safe_dump(body)


def operator_pod(s: LocalSession) -> dict[str, Any]:
    pods = json.loads(s.kubectl("get", "pods", "-n", NAMESPACE, "-l", OPERATOR, "-o", "json"))["items"]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    return pods[0]  # type: ignore[no-any-return]


def test_the_charts_operator_runs_in_cluster_with_its_rbac_and_serves_like_the_oracle(session: LocalSession) -> None:
    s = session
    installed = subprocess.run([*shardwise_command(), "dev", "install-chart", "--kubeconfig", str(s.kubeconfig),
                                "--namespace", NAMESPACE, "--timeout", "120"],
                               capture_output=True, text=True, timeout=200)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "Deployment/shardwise" in installed.stdout and "ClusterRole/shardwise" in installed.stdout
    s.kubectl("wait", "--for=condition=Ready", "pod", "-l", OPERATOR, "-n", NAMESPACE, "--timeout=120s", timeout=150)
    pod = operator_pod(s)
    assert pod["spec"]["serviceAccountName"] == "shardwise"
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"  # the Deployment's, as on a cluster
    # the pod leads: its name holds the Lease the chart's Role lets it take
    lease = json.loads(s.kubectl("get", "lease", "shardwise-leader", "-n", NAMESPACE, "-o", "json"))
    assert lease["spec"]["holderIdentity"] == pod["metadata"]["name"]

    s.kubectl("apply", "-f", "-", input=in_namespace("incluster"))
    s.kubectl("wait", "--for=condition=Available", "inferencedeployment/incluster", "-n", NAMESPACE,
              "--timeout=240s", timeout=260)
    st = s.status("incluster", NAMESPACE)
    assert st["phase"] == "Running" and st["ready"] == "2/2", st
    assert_serves_like_the_oracle(st)
    # what it made, it made as its ServiceAccount, within the chart's grants: the NetworkPolicy too
    assert s.get("networkpolicy", "incluster-workers", NAMESPACE) is not None
    log = s.pod_log(pod["metadata"]["name"], NAMESPACE)
    assert "Forbidden" not in log and " 403" not in log, log[-3000:]

    # a grant taken away fails as on a real cluster: 403 with Kubernetes' message, in the deployment's events
    role = json.loads(s.kubectl("get", "clusterrole", "shardwise", "-o", "json"))
    kept = [rule for rule in role["rules"] if "networkpolicies" not in rule.get("resources", [])]
    assert len(kept) == len(role["rules"]) - 1
    s.kubectl("patch", "clusterrole", "shardwise", "--type=merge", "-p", json.dumps({"rules": kept}))
    s.kubectl("apply", "-f", "-", input=in_namespace("refused", tp=1, dpa=1))
    refusal = (f'networkpolicies.networking.k8s.io is forbidden: User "{ACCOUNT}" cannot create resource '
               f'"networkpolicies" in API group "networking.k8s.io" in the namespace "{NAMESPACE}"')

    def refused() -> bool:
        events = json.loads(s.kubectl("get", "events", "-n", NAMESPACE, "-o", "json"))["items"]
        return any(e["involvedObject"]["name"] == "refused" and refusal in e.get("message", "") for e in events)

    s.wait_for(refused, 60, "the operator's NetworkPolicy refused by RBAC")
    assert s.get("networkpolicy", "refused-workers", NAMESPACE) is None
    for name in ("refused", "incluster"):
        s.kubectl("delete", "inferencedeployment", name, "-n", NAMESPACE, "--wait=true", timeout=120)
