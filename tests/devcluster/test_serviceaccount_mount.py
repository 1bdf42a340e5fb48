"""A pod's ServiceAccount as a kubelet gives it: a token bound to the pod, the API's CA and the namespace, mounted
at /var/run/secrets/kubernetes.io/serviceaccount in the container's own mount namespace, so that the kubernetes
client's `load_incluster_config()` connects over TLS as the pod's ServiceAccount, judged by RBAC; the token is
replaced before it expires and the running container sees the new one; `automountServiceAccountToken: false`
mounts nothing; the machine's kubeconfig never reaches a container."""

from __future__ import annotations

import hashlib
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")
pytest.importorskip("kubernetes")

from shardwise.devcluster import kubelet
from shardwise.devcluster.aiokube import load_kubeconfig
from shardwise.devcluster.apiserver import APIServer
from shardwise.devcluster.cluster import Cluster

from tests.devcluster.test_nodes import Api, container, pod

pytestmark = pytest.mark.slow

SA = kubelet.SERVICE_ACCOUNT_DIR
TOKEN_S = 10  # the pods' tokens: replaced after 8 s, expired after 10 s
# What the pod runs: the in-cluster client, as an operator in a pod uses it; then it reports each new token it sees
# at the mount path (its digest) until it is stopped. A workload's own loop: it polls the file it serves from.
IN_CLUSTER = f"""
import hashlib, json, os, time
from kubernetes import client, config
config.load_incluster_config()
v1 = client.CoreV1Api()
namespace = open("{SA}/namespace").read()
print("host", client.Configuration.get_default_copy().host, flush=True)
print("pods", json.dumps(sorted(p.metadata.name for p in v1.list_namespaced_pod(namespace).items)), flush=True)
try:
    v1.list_node()
except client.ApiException as e:
    print("nodes", e.status, json.loads(e.body)["message"], flush=True)
print("kubeconfig", "KUBECONFIG" in os.environ, os.path.exists(os.path.expanduser("~/.kube/config")), flush=True)
seen = None
while True:
    token = open("{SA}/token").read()
    if token != seen:
        seen = token
        config.load_incluster_config()  # the client re-reads the file each minute: a 10 s token needs it now
        v1 = client.CoreV1Api()
        answer = len(v1.list_namespaced_pod(namespace).items)
        print("token", hashlib.sha256(token.encode()).hexdigest()[:16], answer, flush=True)
    time.sleep(0.1)
"""


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def eventually(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)  # polling a process's output
    return value


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A HOME with a kubeconfig in ~/.kube, as a developer's machine has: no container may see it."""
    folder = tmp_path_factory.mktemp("home")
    (folder / ".kube").mkdir()
    (folder / ".kube" / "config").write_text("apiVersion: v1\nkind: Config\n")
    return folder


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, home: Path) -> Iterator[tuple[APIServer, Api, Cluster]]:
    if kubelet.mount_namespace_problem() is not None:
        pytest.skip(f"no mount namespaces here: {kubelet.mount_namespace_problem()}")
    state = tmp_path_factory.mktemp("sa")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KUBECONFIG", str(home / ".kube" / "config"))
        patch.setenv("HOME", str(home))
        with APIServer(min_token_seconds=1) as server:
            config = server.write_kubeconfig(state / "kubeconfig")
            with Cluster(load_kubeconfig(config), nodes=1, gpus_per_node=0, lease_interval=0.3, stop_grace=2.0,
                         state_dir=state / "nodes", token_seconds=TOKEN_S) as nodes:
                yield server, Api(server.url), nodes


@pytest.fixture
def ns(cluster: tuple[APIServer, Api, Cluster]) -> str:
    name = f"sa-{uuid.uuid4().hex[:8]}"
    cluster[1].ok("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    return name


def test_an_in_cluster_client_connects_as_the_pods_account_and_sees_its_token_replaced(
        cluster: tuple[APIServer, Api, Cluster], ns: str) -> None:
    server, api, nodes = cluster
    rbac = "/apis/rbac.authorization.k8s.io/v1"
    api.ok("POST", f"/api/v1/namespaces/{ns}/serviceaccounts", {"metadata": {"name": "lister"}})
    api.ok("POST", f"{rbac}/namespaces/{ns}/roles", {"metadata": {"name": "lister"}, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]})
    api.ok("POST", f"{rbac}/namespaces/{ns}/rolebindings", {
        "metadata": {"name": "lister"}, "roleRef": {"kind": "Role", "name": "lister"},
        "subjects": [{"kind": "ServiceAccount", "name": "lister", "namespace": ns}]})
    pods = f"/api/v1/namespaces/{ns}/pods"
    created = api.ok("POST", pods, pod("client", container("main", sys.executable, "-c", IN_CLUSTER),
                                       serviceAccountName="lister"))
    log = lambda: nodes.log(ns, "client") if (nodes.state_dir / "logs").exists() else ""  # noqa: E731
    eventually(lambda: "token " in log(), 60, "the pod's first API call with its token")
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in log().splitlines() if " " in line}
    assert lines["host"] == server.secure_url  # KUBERNETES_SERVICE_HOST/PORT: the API's HTTPS port
    assert json.loads(lines["pods"]) == ["client"]
    assert lines["nodes"] == (f'403 nodes is forbidden: User "system:serviceaccount:{ns}:lister" cannot list '
                              'resource "nodes" in API group "" at the cluster scope')
    assert lines["kubeconfig"] == "False False"  # neither $KUBECONFIG nor ~/.kube/config reached it
    folder = nodes.state_dir / "pods" / created["metadata"]["uid"] / "serviceaccount"
    assert (folder / "namespace").read_text() == ns
    assert (folder / "ca.crt").read_bytes() == server.credentials.ca_pem
    first = (folder / "token").read_text()
    # the kubelet replaces the token at 80% of its life; the container sees the new file through its mount
    eventually(lambda: (folder / "token").read_text() != first, 3 * TOKEN_S, "the token's replacement")
    second = (folder / "token").read_text()
    eventually(lambda: f"token {digest(second)} 1" in log(), 10, "the container to use the new token")
    # the first token expires with its time; the pod's current one works
    secure = f"{server.secure_url}/api/v1/namespaces/{ns}/pods"
    eventually(lambda: _status(secure, first, server) == 401, 2 * TOKEN_S, "the first token to expire")
    assert _status(secure, (folder / "token").read_text(), server) == 200
    api.ok("DELETE", f"{pods}/client")
    api.wait(pods, "client", lambda p: p is None)


def test_a_pod_that_does_not_automount_gets_no_token_and_the_default_account_is_used_otherwise(
        cluster: tuple[APIServer, Api, Cluster], ns: str) -> None:
    _, api, nodes = cluster
    pods = f"/api/v1/namespaces/{ns}/pods"
    check = f"test -e {SA}/token && echo mounted || echo absent"
    api.ok("POST", pods, pod("off", container("main", "sh", "-c", check), restartPolicy="Never",
                             automountServiceAccountToken=False))
    api.ok("POST", pods, pod("on", container("main", "sh", "-c", f"cat {SA}/namespace; echo; {check}"),
                             restartPolicy="Never"))
    for name in ("off", "on"):
        done = api.wait(pods, name, lambda p: ((p or {}).get("status") or {}).get("phase") == "Succeeded")
        assert done is not None
    assert nodes.log(ns, "off").split() == ["absent"]
    assert nodes.log(ns, "on").split() == [ns, "mounted"]


def _status(url: str, token: str, server: APIServer) -> int:
    import ssl
    import urllib.error
    import urllib.request

    context = ssl.create_default_context(cadata=server.credentials.ca_pem.decode())
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return e.code


def test_without_mount_namespaces_a_path_under_the_account_folder_is_rewritten_as_volumes_are(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kubelet, "mount_namespace_problem", lambda: "not root (a test's stand-in)")
    with APIServer() as server:
        config = server.write_kubeconfig(tmp_path / "kubeconfig")
        with Cluster(load_kubeconfig(config), nodes=1, gpus_per_node=0, lease_interval=0.3, stop_grace=2.0,
                     state_dir=tmp_path / "nodes") as nodes:
            api = Api(server.url)
            pods = "/api/v1/namespaces/default/pods"
            api.ok("POST", pods, pod("plain", container("main", "sh", "-c", 'cat "$1"; echo; test -e "$2" && echo '
                                                        "token", "sh", f"{SA}/namespace", f"{SA}/token"),
                                     restartPolicy="Never"))
            done = api.wait(pods, "plain", lambda p: ((p or {}).get("status") or {}).get("phase") == "Succeeded")
            assert done is not None
            # the arguments were rewritten to the pod's folder, which holds the files
            assert nodes.log("default", "plain").split() == ["default", "token"]
