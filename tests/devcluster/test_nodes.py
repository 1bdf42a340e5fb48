"""Process-backed nodes and the scheduler against the local API server, through HTTP only: nodes register Ready
with their GPUs and renew their Leases; pods are placed by their requests and run as local processes on their own
loopback IPs, become Ready by their probes, restart with back-off, stop on deletion and leave their logs."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")

from shardwise.devcluster.apiserver import APIServer
from shardwise.devcluster.cluster import Cluster
from shardwise.devcluster.podstatus import Backoff

pytestmark = pytest.mark.slow

GPU = "nvidia.com/gpu"
SERVER = ("import os, http.server as h\n"
          "class Hello(h.BaseHTTPRequestHandler):\n"
          "    def do_GET(self):\n"
          "        body = ('hello from ' + os.environ['POD_NAME']).encode()\n"
          "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
          "    def log_message(self, *args): pass\n"
          "print('serving', os.environ['POD_NAME'], os.environ['POD_NAMESPACE'], os.environ['NODE'],\n"
          "      os.environ['POD_IP'], os.environ['MY_IP'], os.environ['TEAM'], os.environ['OWNER'], flush=True)\n"
          "h.HTTPServer((os.environ['POD_IP'], 8080), Hello).serve_forever()\n")


class Api:
    """Just enough of a Kubernetes client over urllib, with waits that follow watch streams."""

    def __init__(self, url: str) -> None:
        self.url = url

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def ok(self, method: str, path: str, body: Any = None) -> Any:
        status, answer = self.call(method, path, body)
        assert 200 <= status < 300, (status, answer)
        return answer

    def wait(self, collection: str, name: str, holds: Callable[[dict[str, Any] | None], bool],
             timeout: float = 15.0) -> dict[str, Any] | None:
        """The object once `holds(obj)` (None: the object is gone), following a watch until the deadline."""
        deadline = time.monotonic() + timeout
        status, obj = self.call("GET", f"{collection}/{name}")
        current = obj if status == 200 else None
        version = self.ok("GET", collection)["metadata"]["resourceVersion"] if current is None else \
            current["metadata"]["resourceVersion"]
        while not holds(current):
            left = deadline - time.monotonic()
            assert left > 0, f"{collection}/{name} never got there; last seen: {json.dumps(current)[:2000]}"
            query = urllib.parse.urlencode({"watch": "true", "resourceVersion": version,
                                            "timeoutSeconds": max(1, int(left)),
                                            "fieldSelector": f"metadata.name={name}"})
            with urllib.request.urlopen(f"{self.url}{collection}?{query}", timeout=left + 1) as stream:
                for line in stream:
                    event = json.loads(line)
                    version = event["object"]["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED"):
                        current = event["object"]
                    elif event["type"] == "DELETED":
                        current = None
                    if holds(current):
                        break
        return current


def condition(pod: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    conditions = ((pod or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def container_status(pod: dict[str, Any] | None, index: int = 0) -> dict[str, Any]:
    statuses = ((pod or {}).get("status") or {}).get("containerStatuses") or []
    return statuses[index] if len(statuses) > index else {}


def pid_of(pod: dict[str, Any], index: int = 0) -> int:
    return int(container_status(pod, index)["containerID"].removeprefix("process://"))


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def pod(name: str, *containers: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"team": "serving"},
                                                            "annotations": {"owner": "alice"}},
            "spec": {"containers": list(containers), **spec}}


def container(name: str, *command: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "image": "ignored:latest", "command": list(command), **fields}


def gpus(count: int) -> dict[str, Any]:
    return {"resources": {"limits": {GPU: count}}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Api, Cluster]]:
    with APIServer() as server:
        nodes = Cluster(server.url, nodes=2, gpus_per_node=2, state_dir=tmp_path_factory.mktemp("nodes"),
                        backoff=Backoff(base=0.2, cap=1.0), lease_interval=0.3, stop_grace=2.0)
        with nodes:
            yield Api(server.url), nodes


@pytest.fixture
def ns(cluster: tuple[Api, Cluster]) -> Iterator[str]:
    """A fresh namespace; its pods are deleted, and waited for, after the test."""
    api, _ = cluster
    name = f"t-{uuid.uuid4().hex[:8]}"
    api.ok("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    yield name
    pods = f"/api/v1/namespaces/{name}/pods"
    for item in api.ok("DELETE", pods)["items"]:
        api.wait(pods, item["metadata"]["name"], lambda obj: obj is None)


def test_nodes_register_ready_with_their_gpus_and_renew_their_leases(cluster: tuple[Api, Cluster]) -> None:
    api, nodes = cluster
    listed = {n["metadata"]["name"]: n for n in api.ok("GET", "/api/v1/nodes")["items"]}
    assert sorted(listed) == nodes.node_names == ["node-0", "node-1"]
    for name, node in listed.items():
        assert condition(node, "Ready")["status"] == "True"
        assert node["status"]["capacity"][GPU] == node["status"]["allocatable"][GPU] == "2"
        assert {"cpu", "memory", "pods"} <= set(node["status"]["capacity"])
        assert node["metadata"]["labels"]["kubernetes.io/hostname"] == name
    leases = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
    first = api.ok("GET", f"{leases}/node-0")
    assert first["spec"]["holderIdentity"] == "node-0"
    renewed = api.wait(leases, "node-0", lambda lease: lease is not None
                       and lease["spec"]["renewTime"] != first["spec"]["renewTime"])
    assert renewed is not None and renewed["spec"]["renewTime"] > first["spec"]["renewTime"]


def test_http_server_pods_become_ready_answer_on_their_own_ips_and_stop_when_deleted(
        cluster: tuple[Api, Cluster], ns: str) -> None:
    api, nodes = cluster
    pods = f"/api/v1/namespaces/{ns}/pods"
    env = [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} for name, path in (
        ("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace"), ("NODE", "spec.nodeName"),
        ("MY_IP", "status.podIP"), ("TEAM", "metadata.labels['team']"), ("OWNER", "metadata.annotations['owner']"))]
    probe = {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}
    for name, node in (("web-a", "node-0"), ("web-b", "node-1")):  # the same port, one per node
        server = container("web", "python3", "-c", SERVER, env=env, ports=[{"name": "http", "containerPort": 8080}],
                           readinessProbe=probe)
        api.ok("POST", pods, pod(name, server, nodeSelector={"kubernetes.io/hostname": node}))
    ready = {name: api.wait(pods, name, lambda p: condition(p, "Ready").get("status") == "True")
             for name in ("web-a", "web-b")}

    ips = {name: p["status"]["podIP"] for name, p in ready.items() if p is not None}
    assert ips["web-a"].startswith("127.0.1.") and ips["web-b"].startswith("127.0.2.")
    for name, p in ready.items():
        assert p is not None and p["status"]["phase"] == "Running"
        assert container_status(p)["ready"] is True and container_status(p)["state"].keys() == {"running"}
        with urllib.request.urlopen(f"http://{ips[name]}:8080/", timeout=5) as response:
            assert response.read() == f"hello from {name}".encode()
        node = p["spec"]["nodeName"]
        assert nodes.log(ns, name).splitlines()[0] == (
            f"serving {name} {ns} {node} {ips[name]} {ips[name]} serving alice")

    pid = pid_of(ready["web-a"] or {})
    assert not gone(pid)
    api.ok("DELETE", f"{pods}/web-a")
    api.wait(pods, "web-a", lambda p: p is None)
    assert gone(pid)  # the node deletes the pod only once its process has ended


def test_a_crashing_container_is_restarted_with_backoff(cluster: tuple[Api, Cluster], ns: str) -> None:
    api, nodes = cluster
    pods = f"/api/v1/namespaces/{ns}/pods"
    api.ok("POST", pods, pod("crash", container("main", "sh", "-c", "echo boom; exit 3")))
    backing_off = api.wait(pods, "crash", lambda p: container_status(p).get("state", {}).get("waiting", {})
                           .get("reason") == "CrashLoopBackOff")
    assert "back-off 0.2s restarting failed container=main" in container_status(backing_off)["state"]["waiting"][
        "message"]
    assert condition(backing_off, "Ready")["status"] == "False"
    restarted = api.wait(pods, "crash", lambda p: container_status(p).get("restartCount", 0) >= 2)
    assert restarted is not None and restarted["status"]["phase"] == "Running"
    last = container_status(restarted)["lastState"]["terminated"]
    assert (last["exitCode"], last["reason"]) == (3, "Error")
    assert nodes.log(ns, "crash", previous=True) == "boom\n"  # one log file per run


@pytest.mark.parametrize(("policy", "script", "phase", "exit_code"), [
    ("OnFailure", "exit 0", "Succeeded", 0),
    ("Never", "exit 3", "Failed", 3),
])
def test_a_container_that_is_not_restarted_ends_the_pod(cluster: tuple[Api, Cluster], ns: str, policy: str,
                                                       script: str, phase: str, exit_code: int) -> None:
    api, _ = cluster
    pods = f"/api/v1/namespaces/{ns}/pods"
    api.ok("POST", pods, pod("once", container("main", "sh", "-c", script), restartPolicy=policy))
    done = api.wait(pods, "once", lambda p: (p or {}).get("status", {}).get("phase") == phase)
    state = container_status(done)
    assert state["state"]["terminated"]["exitCode"] == exit_code and state["restartCount"] == 0


def test_secret_configmap_and_emptydir_volumes_are_folders_the_container_finds_at_its_mount_paths(
        cluster: tuple[Api, Cluster], ns: str) -> None:
    api, nodes = cluster
    base = f"/api/v1/namespaces/{ns}"
    api.ok("POST", f"{base}/secrets", {"metadata": {"name": "creds"}, "stringData": {"token": "s3cret", "other": "x"}})
    api.ok("POST", f"{base}/configmaps", {"metadata": {"name": "conf"}, "data": {"a.txt": "from a configmap"}})
    # (paths reach a process through its environment and arguments: a path written inside a script is not moved)
    script = ('cat "$TOKEN_FILE"; echo; cat "$CONF/a.txt"; echo; ls "$CREDS"; echo hi > "$CACHE/f"; '
              'cat "$CACHE/f"; stat -c %a "$TOKEN_FILE"; sleep 60')
    volumes = [{"name": "creds", "secret": {"secretName": "creds", "items": [{"key": "token", "path": "token"}],
                                            "defaultMode": 0o440}},
               {"name": "conf", "configMap": {"name": "conf"}}, {"name": "cache", "emptyDir": {}}]
    mounts = [{"name": "creds", "mountPath": "/var/run/creds", "readOnly": True},
              {"name": "conf", "mountPath": "/etc/conf"}, {"name": "cache", "mountPath": "/cache"}]
    api.ok("POST", f"{base}/pods", pod("vols", container(
        "main", "sh", "-c", script, volumeMounts=mounts,
        env=[{"name": "TOKEN_FILE", "value": "/var/run/creds/token"}, {"name": "CACHE", "value": "/cache"},
             {"name": "CONF", "value": "/etc/conf"}, {"name": "CREDS", "value": "/var/run/creds"}]),
        volumes=volumes))
    api.wait(f"{base}/pods", "vols", lambda p: container_status(p).get("ready") is True)
    deadline = time.monotonic() + 15
    while "440" not in nodes.log(ns, "vols"):
        assert time.monotonic() < deadline, nodes.log(ns, "vols")
        time.sleep(0.1)  # the process writes its log as it goes
    # the listed key only, under its path; the configMap's every key; a writable emptyDir; the item's mode
    assert nodes.log(ns, "vols").split("\n")[:5] == ["s3cret", "from a configmap", "token", "hi", "440"]


def test_a_container_whose_secret_volume_is_missing_waits_with_the_reason(cluster: tuple[Api, Cluster],
                                                                          ns: str) -> None:
    api, _ = cluster
    pods = f"/api/v1/namespaces/{ns}/pods"
    api.ok("POST", pods, pod("nosecret", container("main", "sleep", "60",
                                                   volumeMounts=[{"name": "s", "mountPath": "/s"}]),
                             volumes=[{"name": "s", "secret": {"secretName": "absent"}}]))
    waiting = api.wait(pods, "nosecret", lambda p: container_status(p).get("state", {}).get("waiting", {})
                       .get("reason") == "CreateContainerConfigError")
    assert "Secret 'absent' not found" in container_status(waiting)["state"]["waiting"]["message"]


def test_a_pod_that_fits_no_node_stays_pending_with_the_reason(cluster: tuple[Api, Cluster], ns: str) -> None:
    api, _ = cluster
    pods = f"/api/v1/namespaces/{ns}/pods"
    api.ok("POST", pods, pod("big", container("main", "sleep", "3600", **gpus(3))))
    waiting = api.wait(pods, "big", lambda p: condition(p, "PodScheduled").get("reason") == "Unschedulable")
    assert waiting is not None
    assert condition(waiting, "PodScheduled")["status"] == "False"
    assert condition(waiting, "PodScheduled")["message"] == "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    assert waiting["status"]["phase"] == "Pending" and not waiting["spec"].get("nodeName")


def test_gpus_are_not_booked_twice_and_a_waiting_pod_is_placed_when_they_free_up(
        cluster: tuple[Api, Cluster], ns: str) -> None:
    api, _ = cluster
    pods = f"/api/v1/namespaces/{ns}/pods"
    for name in ("g1", "g2", "g3"):
        api.ok("POST", pods, pod(name, container("main", "sleep", "3600", **gpus(2))))
    bound = {name: api.wait(pods, name, lambda p: (p or {}).get("status", {}).get("phase") == "Running")
             for name in ("g1", "g2")}
    assert {p["spec"]["nodeName"] for p in bound.values() if p} == {"node-0", "node-1"}
    waiting = api.wait(pods, "g3", lambda p: condition(p, "PodScheduled").get("reason") == "Unschedulable")
    assert condition(waiting, "PodScheduled")["message"] == "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."

    api.ok("DELETE", f"{pods}/g1")
    placed = api.wait(pods, "g3", lambda p: (p or {}).get("status", {}).get("phase") == "Running")
    assert placed is not None and placed["spec"]["nodeName"] == (bound["g1"] or {})["spec"]["nodeName"]
    assert condition(placed, "PodScheduled")["status"] == "True"


def test_init_containers_tcp_and_exec_probes(cluster: tuple[Api, Cluster], ns: str) -> None:
    api, nodes = cluster
    pods = f"/api/v1/namespaces/{ns}/pods"
    tcp = container("tcp", "python3", "-m", "http.server", "--bind", "$(POD_IP)", "9090",
                    readinessProbe={"tcpSocket": {"port": 9090}, "periodSeconds": 1})
    exec_ = container("exec", "sleep", "3600", readinessProbe={"exec": {"command": ["test", "-f", "made-by-init"]},
                                                               "periodSeconds": 1})
    init = container("init", "sh", "-c", "echo initialising; touch made-by-init")
    api.ok("POST", pods, pod("probed", tcp, exec_, initContainers=[init]))
    ready = api.wait(pods, "probed", lambda p: condition(p, "Ready").get("status") == "True")
    assert ready is not None and condition(ready, "Initialized")["status"] == "True"
    assert ready["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    assert [s["ready"] for s in ready["status"]["containerStatuses"]] == [True, True]
    assert nodes.log(ns, "probed", "init") == "initialising\n"


def test_a_failing_liveness_probe_restarts_the_container(cluster: tuple[Api, Cluster], ns: str) -> None:
    api, _ = cluster
    pods = f"/api/v1/namespaces/{ns}/pods"
    doomed = container("main", "sleep", "3600",
                       livenessProbe={"exec": {"command": ["false"]}, "periodSeconds": 1, "failureThreshold": 1})
    api.ok("POST", pods, pod("doomed", doomed))
    restarted = api.wait(pods, "doomed", lambda p: container_status(p).get("restartCount", 0) >= 1)
    assert container_status(restarted)["lastState"]["terminated"]["exitCode"] == 143  # SIGTERM


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace_period(cluster: tuple[Api, Cluster],
                                                                         ns: str) -> None:
    api, nodes = cluster
    pods = f"/api/v1/namespaces/{ns}/pods"
    # it says so on each SIGTERM and goes on (its short sleeps let the shell run the trap at once)
    stubborn = container("main", "sh", "-c", "trap 'echo ignored TERM' TERM; echo started; "
                         "while :; do sleep 0.1; done")
    api.ok("POST", pods, pod("stubborn", stubborn, terminationGracePeriodSeconds=1))
    running = api.wait(pods, "stubborn", lambda p: container_status(p).get("state", {}).get("running") is not None)
    pid = pid_of(running or {})
    logged(nodes, ns, "stubborn", "started")  # its trap is set (a process that has not run yet dies of the SIGTERM)
    api.ok("DELETE", f"{pods}/stubborn")
    api.wait(pods, "stubborn", lambda p: p is None)
    assert "ignored TERM" in nodes.log(ns, "stubborn")  # it outlived the SIGTERM: the SIGKILL after the grace ended it
    assert gone(pid)


def logged(nodes: Cluster, ns: str, name: str, text: str, timeout: float = 15.0) -> str:
    """The pod's log once it holds `text`."""
    deadline = time.monotonic() + timeout
    while text not in (log := nodes.log(ns, name)):
        assert time.monotonic() < deadline, f"{text!r} not in the log of {name}: {log!r}"
        time.sleep(0.05)  # polling the container's log file, not synchronising
    return log


def dead(pid: int) -> bool:
    """Gone, or a zombie that only waits for its reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_process_that_left_its_containers_group_dies_with_its_pod(cluster: tuple[Api, Cluster], ns: str) -> None:
    """A server the container starts in a session of its own (as vLLM's is started by the agent) is a process of
    the container all the same: deleting the pod kills it, as a runtime kills every process of the cgroup."""
    api, nodes = cluster
    pods = f"/api/v1/namespaces/{ns}/pods"
    # ($$$$: the kubelet expands $$ in a command to $, as Kubernetes does)
    escaper = container("main", "sh", "-c", "setsid sh -c 'echo child $$$$; exec sleep 3600' & wait")
    api.ok("POST", pods, pod("escaper", escaper, terminationGracePeriodSeconds=1))
    api.wait(pods, "escaper", lambda p: container_status(p).get("state", {}).get("running") is not None)
    # (said by the child itself once setsid made its session)
    child = int(logged(nodes, ns, "escaper", "child").split("child", 1)[1].split()[0])
    assert not dead(child) and os.getsid(child) == child  # its own session: the pod's process group lacks it
    api.ok("DELETE", f"{pods}/escaper")
    api.wait(pods, "escaper", lambda p: p is None)
    deadline = time.monotonic() + 10
    while not dead(child):
        assert time.monotonic() < deadline, f"process {child} outlived its pod"
        time.sleep(0.05)


def test_stopping_the_nodes_stops_their_processes(tmp_path: Path) -> None:
    with APIServer() as server:
        api = Api(server.url)
        with Cluster(server.url, nodes=1, state_dir=tmp_path, stop_grace=2.0) as nodes:
            api.ok("POST", "/api/v1/namespaces/default/pods", pod("sleeper", container("main", "sleep", "3600")))
            running = api.wait("/api/v1/namespaces/default/pods", "sleeper",
                               lambda p: (p or {}).get("status", {}).get("phase") == "Running")
            pid = pid_of(running or {})
            assert nodes.log("default", "sleeper") == ""
        assert gone(pid)
        node = api.ok("GET", "/api/v1/nodes/node-0")
        assert condition(node, "Ready")["status"] == "Unknown"


def test_a_lost_node_is_tainted_unreachable_its_pods_evicted_and_new_pods_go_elsewhere(
        tmp_path: Path) -> None:
    with APIServer() as server, Cluster(server.url, nodes=2, gpus_per_node=2, state_dir=tmp_path,
                                        lease_interval=0.3, stop_grace=2.0, node_grace=2.0) as nodes:
        api, pods = Api(server.url), "/api/v1/namespaces/default/pods"
        for name, node in (("victim", "node-1"), ("keeper", "node-0")):
            api.ok("POST", pods, pod(name, container("main", "sleep", "600"),
                                     nodeSelector={"kubernetes.io/hostname": node}))
        running = {name: api.wait(pods, name, lambda p: condition(p, "Ready").get("status") == "True")
                   for name in ("victim", "keeper")}
        pid = pid_of(running["victim"] or {})
        nodes.lose_node("node-1")
        assert gone(pid)  # powered off: its processes died with it ...
        victim = api.ok("GET", f"{pods}/victim")  # ... and nothing told the API
        assert victim["status"]["phase"] == "Running" and not victim["metadata"].get("deletionTimestamp")

        lost = api.wait("/api/v1/nodes", "node-1", lambda n: condition(n, "Ready").get("status") == "Unknown")
        assert lost is not None
        assert {(t["key"], t["effect"]) for t in lost["spec"]["taints"]} == {
            ("node.kubernetes.io/unreachable", "NoSchedule"), ("node.kubernetes.io/unreachable", "NoExecute")}
        # evicted: marked for deletion and not ready, but still in the API (no kubelet confirms the deletion)
        victim = api.wait(pods, "victim", lambda p: p is not None and bool(p["metadata"].get("deletionTimestamp"))
                          and condition(p, "Ready").get("status") == "False")
        assert victim is not None and victim["spec"]["nodeName"] == "node-1"
        keeper = api.ok("GET", f"{pods}/keeper")
        assert condition(keeper, "Ready")["status"] == "True" and not keeper["metadata"].get("deletionTimestamp")
        assert condition(api.ok("GET", "/api/v1/nodes/node-0"), "Ready")["status"] == "True"

        # a new pod that fits either node is placed on the one that is alive, and runs
        api.ok("POST", pods, pod("after", container("main", "sleep", "600", **gpus(2))))
        after = api.wait(pods, "after", lambda p: condition(p, "Ready").get("status") == "True")
        assert after is not None and after["spec"]["nodeName"] == "node-0"
        api.ok("DELETE", f"{pods}/victim", {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        api.wait(pods, "victim", lambda p: p is None)


def test_a_failed_containers_log_tail_is_its_termination_message_with_fallback_to_logs(
        cluster: tuple[Api, Cluster], ns: str) -> None:
    api, _ = cluster
    pods = f"/api/v1/namespaces/{ns}/pods"
    script = "import sys; print('starting'); print('cannot read the agent token from /x', file=sys.stderr); sys.exit(3)"
    api.ok("POST", pods, pod("failing", container("main", "python3", "-c", script,
                                                  terminationMessagePolicy="FallbackToLogsOnError"),
                             restartPolicy="Never"))
    api.ok("POST", pods, pod("silent", container("main", "python3", "-c", script), restartPolicy="Never"))
    done = api.wait(pods, "failing", lambda p: (p or {}).get("status", {}).get("phase") == "Failed")
    state = container_status(done)["state"]["terminated"]
    assert state["exitCode"] == 3 and state["message"].splitlines()[-1] == "cannot read the agent token from /x"
    plain = api.wait(pods, "silent", lambda p: (p or {}).get("status", {}).get("phase") == "Failed")
    assert "message" not in container_status(plain)["state"]["terminated"]  # the default policy: the file only
