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


def sw(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*shardwise_command(), "dev", *args], capture_output=True, text=True, timeout=180, cwd=cwd)


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
        subprocess.run([*kubectl, "apply", "-f", str(tmp_path / "pod.yaml")], check=True,
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
            applied = kubectl("apply", "-f", str(manifest))
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


SECRET_READER = """
apiVersion: v1
kind: Secret
metadata: {name: token}
data: {token: czNjcmV0}
---
apiVersion: v1
kind: Pod
metadata: {name: reader}
spec:
  restartPolicy: Never
  volumes: [{name: token, secret: {secretName: token}}]
  containers:
  - name: reader
    image: ignored-by-the-local-nodes
    command: ["sh", "-c", "cat $TOKEN_FILE"]
    env: [{name: TOKEN_FILE, value: /var/run/secrets/app/token}]
    volumeMounts: [{name: token, mountPath: /var/run/secrets/app}]
"""


@pytest.mark.slow
@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")
def test_dev_up_with_its_default_relative_state_dir_gives_pods_paths_that_work_from_their_own_folder(
        tmp_path: Path) -> None:
    """A user's first `shardwise dev up` in a project folder: the state goes to .shardwise/dev there, and a pod's
    file paths (a Secret volume named by an environment variable, as the agent token is) resolve from the pod's
    own working directory."""
    assert KUBECTL is not None
    state = tmp_path / ".shardwise" / "dev"
    up = sw("up", "--nodes", "1", "--gpus-per-node", "1", cwd=tmp_path)
    try:
        assert up.returncode == 0, up.stderr
        assert f"kubeconfig  {state / 'kubeconfig'}" in up.stdout
        kubectl = [KUBECTL, "--kubeconfig", str(state / "kubeconfig"), "--cache-dir", str(tmp_path / "cache")]
        subprocess.run([*kubectl, "apply", "-f", "-"], input=SECRET_READER, check=True,
                       capture_output=True, text=True, timeout=60)
        done = subprocess.run([*kubectl, "wait", "--for=jsonpath={.status.phase}=Succeeded", "pod/reader",
                               "--timeout=60s"], capture_output=True, text=True, timeout=90)
        logs = sw("logs", "reader", cwd=tmp_path)
        assert done.returncode == 0, (done.stderr, logs.stdout)
        assert logs.stdout == "s3cret"
    finally:
        down = sw("down", cwd=tmp_path)
    assert down.stdout.strip() == "stopped"


def test_the_clusters_paths_are_absolute_whatever_the_working_directory(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.devcluster.cluster import Cluster
    from shardwise.devcluster.session import LocalSession

    monkeypatch.chdir(tmp_path)
    cluster = Cluster("http://127.0.0.1:1", state_dir="rel/nodes", nodes=1, gpus_per_node=1)
    assert cluster.kubelet_config.state_dir == tmp_path / "rel" / "nodes"
    session = LocalSession("rel/session")
    assert session.kubeconfig == tmp_path / "rel" / "session" / "kubeconfig"
    assert session.operator_log.is_absolute()


def test_dev_up_refuses_a_state_dir_it_cannot_write_and_names_it(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    state = tmp_path / "file" / "dev"
    up = sw("up", "--nodes", "1", "--gpus-per-node", "1", "--state-dir", str(state))
    assert up.returncode == 2
    assert up.stderr == f"error: --state-dir {state} cannot be written: Not a directory\n"


def test_the_local_nodes_find_the_vllm_environment_without_a_variable(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.devcluster import cluster

    first, second = tmp_path / "a", tmp_path / "b"
    assert cluster.vllm_python([first, second]) is None
    python = second / ".venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    assert cluster.vllm_python([first, second]) == str(python)
    monkeypatch.chdir(second)  # the working directory the cluster starts in is one of the places looked at
    monkeypatch.delenv(cluster.VLLM_PYTHON, raising=False)
    found = cluster.vllm_python()
    built = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"  # what `make install` built
    assert found == str(built if built.exists() else python)
    assert cluster.process_env()[cluster.VLLM_PYTHON] == found  # the pods get it
    monkeypatch.setenv(cluster.VLLM_PYTHON, "/opt/vllm/bin/python")
    assert cluster.process_env()[cluster.VLLM_PYTHON] == "/opt/vllm/bin/python"  # a user's choice stands
