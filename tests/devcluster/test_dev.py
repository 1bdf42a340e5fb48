"""`shardwise dev` as a user runs it: up, kubectl against it, a pod's log, status, down with nothing left; objects
kept across down and up with --persist, and gone without it."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any, cast

import pytest

from tests.conftest import shardwise_command
from tests.devcluster.apiclient import CRD_FILE, EXAMPLE

KUBECTL = shutil.which("kubectl")
POD = """
apiVersion: v1
kind: Pod
metadata: {name: hello}
spec:
  restartPolicy: Never
  containers:
  - name: hello
    image: ignored-by-the-local-nodes
    command: ["sh", "-c", "echo hello from $POD_IP"]
    env: [{name: POD_IP, valueFrom: {fieldRef: {fieldPath: status.podIP}}}]
"""


def sw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*shardwise_command(), "dev", *args], capture_output=True, text=True, timeout=180)


@pytest.mark.slow
@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")
def test_dev_up_serves_kubectl_runs_a_pod_and_down_leaves_nothing(tmp_path: Path) -> None:
    state = tmp_path / "dev"
    assert KUBECTL is not None
    up = sw("up", "--nodes", "2", "--gpus-per-node", "2", "--state-dir", str(state))
    try:
        assert up.returncode == 0, up.stderr
        kubeconfig = state / "kubeconfig"
        kubectl = [KUBECTL, "--kubeconfig", str(kubeconfig)]
        nodes = subprocess.run([*kubectl, "get", "nodes", "-o", "json"], capture_output=True, text=True, timeout=60)
        items = json.loads(nodes.stdout)["items"]
        assert sorted(n["metadata"]["name"] for n in items) == ["node-0", "node-1"]
        assert {n["status"]["capacity"]["nvidia.com/gpu"] for n in items} == {"2"}
        (tmp_path / "pod.yaml").write_text(POD)
        subprocess.run([*kubectl, "apply", "--validate=false", "-f", str(tmp_path / "pod.yaml")], check=True,
                       capture_output=True, timeout=60)
        done = subprocess.run([*kubectl, "wait", "--for=jsonpath={.status.phase}=Succeeded", "pod/hello",
                               "--timeout=60s"], capture_output=True, text=True, timeout=90)
        assert done.returncode == 0, done.stderr
        logs = sw("logs", "hello", "--state-dir", str(state))
        assert logs.returncode == 0 and logs.stdout.startswith("hello from 127.0.")
        status = json.loads(sw("status", "--state-dir", str(state)).stdout)
        assert status["running"] and status["nodesReady"] == ["node-0", "node-1"]
        pid, port = status["pid"], int(status["api"].rsplit(":", 1)[1])
    finally:
        down = sw("down", "--state-dir", str(state))
    assert down.returncode == 0 and down.stdout.strip() == "stopped"
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    with socket.socket() as s:  # nothing listens on the API port any more (TIME_WAIT allowed, as for servers)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
    assert json.loads(sw("status", "--state-dir", str(state)).stdout) == {"running": False}


CONFIGMAP = """
apiVersion: v1
kind: ConfigMap
metadata: {name: settings}
data: {a: "1"}
"""
SLEEPER = """
apiVersion: v1
kind: Pod
metadata: {name: sleeper}
spec:
  containers: [{name: main, image: ignored-by-the-local-nodes, command: ["sleep", "60"]}]
"""
KEPT = ("configmap/settings", "inferencedeployments.shardwise.io/tiny-moe")


@pytest.mark.slow
@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")
def test_dev_up_persist_keeps_objects_across_down_and_up_and_a_plain_up_starts_empty(tmp_path: Path) -> None:
    state = tmp_path / "dev"
    assert KUBECTL is not None
    (tmp_path / "cm.yaml").write_text(CONFIGMAP)
    (tmp_path / "pod.yaml").write_text(SLEEPER)

    def up(*flags: str) -> None:
        done = sw("up", "--nodes", "1", "--gpus-per-node", "1", "--state-dir", str(state), *flags)
        assert done.returncode == 0, done.stderr

    def kubectl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([KUBECTL, "--kubeconfig", str(state / "kubeconfig"), "--cache-dir",
                               str(tmp_path / "cache"), *args], capture_output=True, text=True, timeout=60)

    def get(name: str) -> dict[str, Any]:
        done = kubectl("get", name, "-o", "json")
        assert done.returncode == 0, done.stderr
        return cast(dict[str, Any], json.loads(done.stdout)["metadata"])

    try:
        up("--persist")
        for manifest in (tmp_path / "cm.yaml", CRD_FILE, EXAMPLE, tmp_path / "pod.yaml"):
            applied = kubectl("apply", "--validate=false", "-f", str(manifest))  # the emulator serves no OpenAPI
            assert applied.returncode == 0, applied.stderr
        before = {name: get(name) for name in KEPT}
        assert sw("down", "--state-dir", str(state)).stdout.strip() == "stopped"
        counter = json.loads((state / "objects.json").read_text())["revision"]

        up("--persist")
        for name in KEPT:
            after = get(name)
            assert [after[key] for key in ("uid", "resourceVersion", "creationTimestamp", "generation")] == [
                before[name][key] for key in ("uid", "resourceVersion", "creationTimestamp", "generation")], name
        touched = kubectl("annotate", "configmap/settings", "touched=yes", "-o", "jsonpath={.metadata.resourceVersion}")
        assert touched.returncode == 0 and int(touched.stdout) > counter
        assert "NotFound" in kubectl("get", "pod/sleeper").stderr  # pods are not kept: their owners recreate them
        assert get("node/node-0")["name"] == "node-0"  # registered again by the node
        assert sw("down", "--state-dir", str(state)).stdout.strip() == "stopped"

        up()
        for name in ("configmap/settings", "crd/inferencedeployments.shardwise.io"):
            assert "NotFound" in kubectl("get", name).stderr, name
        assert "doesn't have a resource type" in kubectl("get", KEPT[1]).stderr  # its CRD is gone
        assert not (state / "objects.json").exists()
    finally:
        sw("down", "--state-dir", str(state))
    assert json.loads(sw("status", "--state-dir", str(state)).stdout) == {"running": False}
