"""shardwise on a real Kubernetes cluster (kind): the chart installed with Helm's SDK (helm-python-sdk), the
image built from this repository (`make kind-load`), tiny-moe served by real worker pods on nodes that advertise
nvidia.com/gpu (`make kind-up`), and its completions compared with the single-process oracle.

The tests run in file order and share one release and one tiny-moe (two of the three kind workers hold its
4 "GPUs"): an invalid layout is refused at apply; tiny-moe becomes Available and serves what the oracle
computes; a deleted worker pod comes back and serving resumes; the control plane paused for 30 s (`docker
pause`) leaves every pod in place and the operator running; a rank process killed in its pod is served around
and the same pod rejoins; the operator's pod deleted right after a scale-down is asked for, and its replacement
completes it; a node cut off the network (`docker network disconnect`) and a lost node (its container stopped
with `docker stop`) are each served around and their pod replaced on the third worker, the node connected or
started again after; deleting tiny-moe leaves no pod behind.
Everything waits on conditions with deadlines; every process a test starts, it stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from shardwise.agents.runtime import tokenizer

from shardwise.api import InferenceDeploymentSpec
from shardwise.planner import plan
from tests.conftest import shardwise_command

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is in the dev extra: run `make install`")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "shardwise"
CRD = CHART / "crds" / "inferencedeployments.shardwise.io.yaml"
EXAMPLE = ROOT / "examples" / "tiny-moe.yaml"
CONTEXT = f"kind-{os.environ.get('SHARDWISE_KIND_CLUSTER', 'shardwise')}"  # as in conftest.py
IMAGE = os.environ.get("SHARDWISE_E2E_IMAGE", "shardwise:0.1.0")  # what `make kind-load` built and loaded
RELEASE = "shardwise"
NAME = "tiny-moe"
WORKERS = f"shardwise.io/deployment={NAME},app.kubernetes.io/component=worker"
PROMPT = "The quick brown fox"
MAX_TOKENS = 8

INSTALL_TIMEOUT_S = 300
AVAILABLE_TIMEOUT_S = 600  # image start, weights generated from the seed, world configured
SERVE_TIMEOUT_S = 120
GONE_TIMEOUT_S = 180
POLL_S = 2.0

T = TypeVar("T")


# -- kubectl and waiting --------------------------------------------------------------------------------------

def kubectl(*args: str, stdin: str | None = None, check: bool = True,
            timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """kubectl against the kind cluster; a failure raises with kubectl's own message unless check=False."""
    done = subprocess.run(["kubectl", "--context", CONTEXT, *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def wait_for(what: str, probe: Callable[[], T | None], timeout: float,
             diagnose: Callable[[], str] = lambda: "") -> T:
    """Poll `probe` until it returns something truthy; past the deadline, fail with what the cluster shows."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout:.0f} s\n{diagnose()}")
        time.sleep(POLL_S)  # the pace of the poll, not a wait for an outcome


def diagnostics(namespace: str) -> str:
    """What someone debugging a failed run needs first: objects, conditions, pod states, operator log."""
    parts = []
    for args in (("get", "idep,pods,svc", "-o", "wide"), ("describe", "idep"),
                 ("logs", f"deployment/{RELEASE}", "--tail", "60")):
        shown = kubectl("-n", namespace, *args, check=False, timeout=30)
        parts.append(f"$ kubectl -n {namespace} {' '.join(args)}\n{shown.stdout}{shown.stderr}")
    return "\n".join(parts)


def conditions(namespace: str, name: str = NAME) -> dict[str, dict[str, Any]]:
    shown = kubectl("-n", namespace, "get", "idep", name, "-o", "jsonpath={.status.conditions}", check=False)
    if shown.returncode != 0 or not shown.stdout.strip():
        return {}
    return {c["type"]: c for c in json.loads(shown.stdout)}


def available(namespace: str) -> bool:
    return conditions(namespace).get("Available", {}).get("status") == "True"


def worker_pods(namespace: str) -> dict[str, dict[str, Any]]:
    """The worker pods of tiny-moe by name, terminating ones included."""
    shown = kubectl("-n", namespace, "get", "pods", "-l", WORKERS, "-o", "json")
    return {p["metadata"]["name"]: p for p in json.loads(shown.stdout)["items"]}


def ready(pod: dict[str, Any]) -> bool:
    return "deletionTimestamp" not in pod["metadata"] and any(
        c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def apply(doc: dict[str, Any], namespace: str, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    return kubectl("-n", namespace, "apply", "-f", "-", stdin=yaml.safe_dump(doc), check=check)


def apply_admitted(doc: dict[str, Any], namespace: str) -> subprocess.CompletedProcess[str]:
    """Apply once the webhook answers: right after the install its endpoints may lag the pod's readiness."""
    def attempt() -> subprocess.CompletedProcess[str] | None:
        done = apply(doc, namespace, check=False)
        unreachable = "failed calling webhook" in done.stderr
        return None if unreachable else done

    return wait_for("the admission webhook answers", attempt, SERVE_TIMEOUT_S, lambda: diagnostics(namespace))


# -- the serving path -----------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def port_forward(namespace: str, target: str, remote_port: int) -> Iterator[int]:
    """`kubectl port-forward` to a local port for the duration of the block; the process is stopped after."""
    local = free_port()
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(["kubectl", "--context", CONTEXT, "-n", namespace, "port-forward", target,
                                 f"{local}:{remote_port}"], stdout=subprocess.DEVNULL, stderr=errors, text=True)
        try:
            def listening() -> bool:
                if proc.poll() is not None:
                    errors.seek(0)
                    raise AssertionError(f"kubectl port-forward {target} exited: {errors.read().strip()}")
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", local), timeout=1):
                    return True
                return False

            wait_for(f"port-forward to {target}", listening, 30)
            yield local
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1, never through $http_proxy


def complete(port: int, prompt_ids: list[int], max_tokens: int) -> dict[str, Any] | None:
    """POST /v1/completions (agents/http.py: `prompt` is a string or token ids); None while not serving yet."""
    body = json.dumps({"prompt": prompt_ids, "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with LOCAL.open(request, timeout=60) as response:
            return dict(json.load(response))
    except urllib.error.HTTPError as e:
        if e.code == 503:  # not configured yet, or a world change in progress
            return None
        raise AssertionError(f"/v1/completions answered {e.code}: {e.read().decode(errors='replace')}") from e
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None  # the Service has no ready endpoint yet; kubectl port-forward reports it as a reset


def oracle_token_ids(prompt: str, max_tokens: int) -> list[int]:
    """`shardwise oracle`: the same weights (tiny-moe, seed 0 as spec.runtime.seed) in one local process."""
    done = subprocess.run([*shardwise_command(), "oracle", "--model", "tiny-moe", "--seed", "0", "--prompt", prompt,
                           "--max-tokens", str(max_tokens)], capture_output=True, text=True, timeout=300,
                          cwd=tempfile.gettempdir())
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout)["token_ids"])


def served_token_ids(namespace: str) -> list[int]:
    with port_forward(namespace, f"svc/{NAME}", 8000) as port:
        answer = wait_for(f"a completion from svc/{NAME}",
                          lambda: complete(port, tokenizer.encode(PROMPT), MAX_TOKENS), SERVE_TIMEOUT_S,
                          lambda: diagnostics(namespace))
    return list(answer["token_ids"])


# -- fixtures -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def namespace() -> Iterator[str]:
    name = f"shardwise-e2e-{secrets.token_hex(3)}"
    kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def release(namespace: str) -> Iterator[str]:
    """The chart, installed as an operator user would (webhook certificate generated by Helm), uninstalled after."""
    # Helm installs crds/ only when the CRD is absent; a cluster kept from an older checkout gets the current one.
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    repository, _, tag = IMAGE.rpartition(":")
    values = {"image": {"repository": repository, "tag": tag}, "webhook": {"certificate": {"mode": "helm"}}}
    with helm.Config(kube_context=CONTEXT, namespace=namespace) as cluster:
        try:
            cluster.install(CHART, RELEASE, values, namespace=namespace, wait="watcher", timeout=INSTALL_TIMEOUT_S)
        except helm.HelmError as e:
            cluster.uninstall(RELEASE, ignore_not_found=True, wait="watcher", timeout=120)
            raise AssertionError(f"helm install failed: {e}\n{diagnostics(namespace)}") from e
        try:
            yield RELEASE
        finally:
            cluster.uninstall(RELEASE, ignore_not_found=True, wait="watcher", timeout=120)


@pytest.fixture(scope="module")
def tiny_moe(release: str, namespace: str) -> Iterator[str]:
    """examples/tiny-moe.yaml applied with kubectl, Available; deleted after (if a test has not done it)."""
    applied = apply_admitted(yaml.safe_load(EXAMPLE.read_text()), namespace)
    assert applied.returncode == 0, applied.stderr
    wait_for(f"{NAME} Available=True", lambda: available(namespace), AVAILABLE_TIMEOUT_S,
             lambda: diagnostics(namespace))
    try:
        yield NAME
    finally:
        kubectl("-n", namespace, "delete", "idep", NAME, "--ignore-not-found", "--timeout=120s", check=False,
                timeout=150)


# -- the tests, in the order they run -------------------------------------------------------------------------

def test_an_invalid_layout_is_refused_at_apply_with_the_planners_messages(release: str, namespace: str) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "tiny-moe-tp3"
    doc["spec"]["parallelism"]["tp"] = 3  # 4 heads are not divisible by 3; 3 > gpusPerNode=2
    expected = [str(v) for v in plan(InferenceDeploymentSpec.model_validate(doc["spec"])).errors]
    assert expected, "the planner itself must refuse this layout"

    refused = apply_admitted(doc, namespace)
    assert refused.returncode != 0
    assert 'admission webhook "validate.inferencedeployments.shardwise.io" denied the request' in refused.stderr
    for message in expected:
        assert message in refused.stderr
    assert "NotFound" in kubectl("-n", namespace, "get", "idep", "tiny-moe-tp3", check=False).stderr


SHAPE = {"labels": {"team": "search"}, "annotations": {"example.com/owner": "ml-platform"}, "shmSize": "1Gi",
         "volumes": [{"name": "cache", "emptyDir": {"sizeLimit": "2Gi"}}],
         "volumeMounts": [{"name": "cache", "mountPath": "/cache"}], "imagePullSecrets": ["regcred"],
         "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
             {"matchExpressions": [{"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}]}]}}},
         "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                                        "whenUnsatisfiable": "ScheduleAnyway"}]}


def test_a_worker_pod_shape_passes_the_api_servers_own_validation_in_a_dry_run(release: str,
                                                                                namespace: str) -> None:
    from shardwise.operator import builders

    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = "tiny-moe-shaped"
    doc["spec"]["runtime"] = {"pod": SHAPE}
    admitted = kubectl("-n", namespace, "apply", "--dry-run=server", "-o", "json", "-f", "-",
                       stdin=yaml.safe_dump(doc))
    kept = json.loads(admitted.stdout)["spec"]["runtime"]["pod"]  # the CRD's schema prunes nothing of it
    assert kept["volumes"] == SHAPE["volumes"] and kept["affinity"] == SHAPE["affinity"]
    spec = InferenceDeploymentSpec.model_validate(doc["spec"])
    owner = {"apiVersion": "shardwise.io/v1alpha1", "kind": "InferenceDeployment",
             "metadata": {"name": doc["metadata"]["name"], "namespace": namespace, "uid": "0"}}
    pod = builders.build_pod(owner, spec, plan(spec), 0, 1)
    pod["metadata"].pop("ownerReferences")  # the owner exists only in the dry run above
    created = json.loads(kubectl("-n", namespace, "create", "--dry-run=server", "-o", "json", "-f", "-",
                                 stdin=json.dumps(pod)).stdout)
    assert created["spec"]["topologySpreadConstraints"] == SHAPE["topologySpreadConstraints"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in created["spec"]["containers"][0]["volumeMounts"]
    assert created["metadata"]["labels"]["team"] == "search"


def test_tiny_moe_becomes_available_and_serves_what_the_oracle_computes(tiny_moe: str, namespace: str) -> None:
    pods = worker_pods(namespace)
    assert len(pods) == 2 and all(ready(p) for p in pods.values()), diagnostics(namespace)
    for pod in pods.values():
        [worker] = pod["spec"]["containers"]
        assert worker["resources"]["requests"]["nvidia.com/gpu"] in ("2", 2)
    assert served_token_ids(namespace) == oracle_token_ids(PROMPT, MAX_TOKENS)


def test_a_deleted_worker_pod_is_recreated_and_serving_resumes(tiny_moe: str, namespace: str) -> None:
    before = worker_pods(namespace)
    victim = sorted(before)[-1]
    old_uid = before[victim]["metadata"]["uid"]
    kubectl("-n", namespace, "delete", "pod", victim, "--wait=false")

    def recreated() -> bool:  # by a pod of another name while the deleted one may still be terminating
        live = [p for p in worker_pods(namespace).values() if ready(p)]
        return len(live) == 2 and old_uid not in {p["metadata"]["uid"] for p in live}

    wait_for(f"{victim} replaced by a Ready pod", recreated, AVAILABLE_TIMEOUT_S, lambda: diagnostics(namespace))
    wait_for(f"{NAME} Available=True again", lambda: available(namespace), AVAILABLE_TIMEOUT_S,
             lambda: diagnostics(namespace))
    assert served_token_ids(namespace) == oracle_token_ids(PROMPT, MAX_TOKENS)


def test_the_api_server_paused_for_30_s_leaves_the_world_serving_untouched(tiny_moe: str, namespace: str) -> None:
    control_plane = f"{CONTEXT.removeprefix('kind-')}-control-plane"
    before = {name: p["metadata"]["uid"] for name, p in worker_pods(namespace).items()}
    restarts = operator_restarts(namespace)
    subprocess.run(["docker", "pause", control_plane], check=True, capture_output=True, timeout=60)
    try:
        time.sleep(30)  # the outage itself: every API call (the operator's, the kubelets') hangs meanwhile
    finally:
        subprocess.run(["docker", "unpause", control_plane], check=False, capture_output=True, timeout=60)
    wait_for("the API server answering again", lambda: kubectl("get", "--raw", "/readyz", check=False).returncode
             == 0 or None, 120)
    wait_for(f"{NAME} Available=True", lambda: available(namespace), AVAILABLE_TIMEOUT_S,
             lambda: diagnostics(namespace))
    assert {name: p["metadata"]["uid"] for name, p in worker_pods(namespace).items()} == before  # none replaced
    assert operator_restarts(namespace) == restarts  # the operator waited it out
    assert served_token_ids(namespace) == oracle_token_ids(PROMPT, MAX_TOKENS)


# Run in a worker pod's container (`kubectl exec ... python -c`): SIGKILL one rank process of its node agent and
# print its PID. The ranks are the agent's multiprocessing children, started by spawn ("spawn_main" in their
# command line) or forked by the agent's forkserver (whose command line they share, with it as their parent);
# the forkserver itself and multiprocessing's resource tracker are left alone.
KILL_A_RANK = r"""
import os, signal
procs = {}
for d in os.listdir("/proc"):
    if d.isdigit():
        try:
            cmd = open(f"/proc/{d}/cmdline", "rb").read()
            ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        procs[int(d)] = (ppid, cmd)
def forkserver(pid):
    return b"forkserver" in procs.get(pid, (0, b""))[1]
ranks = sorted(p for p, (ppid, cmd) in procs.items() if b"resource_tracker" not in cmd
               and (b"spawn_main" in cmd or (forkserver(p) and forkserver(ppid))))
if not ranks:
    raise SystemExit(f"no rank process: {sorted((p, c[:100]) for p, (_, c) in procs.items())}")
os.kill(ranks[0], signal.SIGKILL)
print(ranks[0])
"""


def world_generation(namespace: str) -> int:
    shown = kubectl("-n", namespace, "get", "idep", NAME, "-o", "jsonpath={.status.worldGeneration}")
    return int(shown.stdout or 0)


def test_a_killed_rank_process_is_served_around_and_its_pod_rejoins(tiny_moe: str, namespace: str) -> None:
    """A rank process killed inside its pod (not the pod): the survivors' world serves, the agent restarts the rank
    in place, and the same pod rejoins in the scale-up that follows; no pod is replaced."""
    before = {name: p["metadata"]["uid"] for name, p in worker_pods(namespace).items()}
    world = world_generation(namespace)
    victim = sorted(before)[-1]
    killed = kubectl("-n", namespace, "exec", victim, "--", "python", "-c", KILL_A_RANK)
    assert killed.stdout.strip().isdigit(), killed.stdout
    survivors_answer(namespace, world)
    # a recovery (the survivors' world) and a scale-up (the pod back): two new worlds at least
    wait_for(f"{NAME} Available=True at full size after the crash", lambda: available(namespace)
             and world_generation(namespace) >= world + 2, AVAILABLE_TIMEOUT_S, lambda: diagnostics(namespace))
    assert {name: p["metadata"]["uid"] for name, p in worker_pods(namespace).items()} == before  # none replaced
    assert served_token_ids(namespace) == oracle_token_ids(PROMPT, MAX_TOKENS)


def elastic(namespace: str) -> dict[str, Any]:
    shown = kubectl("-n", namespace, "get", "idep", NAME, "-o", "jsonpath={.status.elastic}", check=False)
    return dict(json.loads(shown.stdout)) if shown.returncode == 0 and shown.stdout.strip() else {}


def test_the_operator_killed_during_a_scale_down_completes_it_after_its_restart(tiny_moe: str,
                                                                                 namespace: str) -> None:
    """The operator's pods deleted (grace 0) right after a scale-down 2 -> 1 is asked for, so the operation is
    cut wherever it is (here a drain with nothing in flight takes about a second, too short to aim at a phase from
    outside): the Deployment's new pod completes what it finds in status; then the scale back up to 2."""
    restarts = operator_restarts(namespace)
    kubectl("-n", namespace, "scale", "idep", NAME, "--replicas", "1")
    kubectl("-n", namespace, "delete", "pod", "-l", "app.kubernetes.io/name=shardwise,"
            "app.kubernetes.io/component=operator", "--grace-period=0", "--force", "--wait=false")

    def done(dpa: int) -> bool:
        e = elastic(namespace)
        return available(namespace) and e.get("phase") == "Done" and e.get("toDpa") == dpa and len(
            [p for p in worker_pods(namespace).values() if ready(p)]) == dpa

    wait_for("the scale-down completed by the new operator pod", lambda: done(1), AVAILABLE_TIMEOUT_S,
             lambda: diagnostics(namespace))
    assert set(operator_restarts(namespace)).isdisjoint(restarts)  # a new operator pod did it
    assert served_token_ids(namespace) == oracle_token_ids(PROMPT, MAX_TOKENS)
    kubectl("-n", namespace, "scale", "idep", NAME, "--replicas", "2")
    wait_for(f"{NAME} back at 2 groups", lambda: done(2), AVAILABLE_TIMEOUT_S, lambda: diagnostics(namespace))


def operator_restarts(namespace: str) -> dict[str, int]:
    """Each operator pod's container restarts."""
    shown = kubectl("-n", namespace, "get", "pods", "-l", "app.kubernetes.io/name=shardwise,"
                    "app.kubernetes.io/component=operator", "-o", "json")
    return {p["metadata"]["name"]: sum(c.get("restartCount", 0) for c in (p.get("status") or {}).get(
        "containerStatuses") or []) for p in json.loads(shown.stdout)["items"]}


def schedulable_workers() -> list[str]:
    nodes = json.loads(kubectl("get", "nodes", "-o", "json").stdout)["items"]
    return [n["metadata"]["name"] for n in nodes
            if "node-role.kubernetes.io/control-plane" not in n["metadata"].get("labels", {})]


def pod_alone_with_the_world(namespace: str) -> tuple[str, str]:
    """A Ready worker pod on a node that holds no router pod (losing the router's node would cut every request,
    which is the router's availability, not the world's), and its node; the test is skipped without one."""
    workers = schedulable_workers()
    if len(workers) < 3:
        pytest.skip(f"the kind cluster has {len(workers)} workers, the node-loss tests need 3 "
                    "(tests/e2e_kind/kind-cluster.yaml): make kind-down kind-up")
    before = {name: p for name, p in worker_pods(namespace).items() if ready(p)}
    shown = kubectl("-n", namespace, "get", "pods", "-l", f"app.kubernetes.io/component=router,"
                    f"shardwise.io/deployment={NAME}", "-o", "json")
    routers = {p["spec"].get("nodeName") for p in json.loads(shown.stdout)["items"]}
    victim = next((n for n, p in sorted(before.items()) if p["spec"]["nodeName"] not in routers), None)
    if victim is None:
        pytest.skip(f"every worker pod shares its node with a router pod ({sorted(routers)})")
    return victim, before[victim]["spec"]["nodeName"]


def survivors_answer(namespace: str, world: int) -> None:
    """Wait for a world after `world` (the survivors', formed without the lost group), then one completion through
    the Service equal to the oracle's: a request sent once the survivors serve is answered."""
    wait_for("the survivors' world", lambda: world_generation(namespace) > world, AVAILABLE_TIMEOUT_S,
             lambda: diagnostics(namespace))
    assert served_token_ids(namespace) == oracle_token_ids(PROMPT, MAX_TOKENS)


def replaced_elsewhere(namespace: str, victim: str, node: str) -> None:
    """Wait for the victim's group to be served by a Ready pod of another name on another node, Available at full
    size, answering like the oracle."""
    def replaced() -> bool:
        live = {n: p for n, p in worker_pods(namespace).items() if ready(p)}
        return len(live) == 2 and victim not in live and all(p["spec"]["nodeName"] != node for p in live.values())

    wait_for(f"{victim} replaced on a live node", replaced, AVAILABLE_TIMEOUT_S, lambda: diagnostics(namespace))
    wait_for(f"{NAME} Available=True at full size", lambda: available(namespace), AVAILABLE_TIMEOUT_S,
             lambda: diagnostics(namespace))
    assert served_token_ids(namespace) == oracle_token_ids(PROMPT, MAX_TOKENS)


def node_back(node: str) -> None:
    """Wait for `node` Ready again and advertise its GPUs again, as `make kind-up` does (a kubelet that
    re-registers zeroes the extended resource)."""
    def back() -> bool:
        shown = json.loads(kubectl("get", "node", node, "-o", "json").stdout)
        return any(c["type"] == "Ready" and c["status"] == "True" for c in shown["status"]["conditions"])

    wait_for(f"{node} Ready again", back, 300)
    gpus = {"capacity": {"nvidia.com/gpu": "2"}, "allocatable": {"nvidia.com/gpu": "2"}}
    kubectl("patch", "node", node, "--subresource=status", "--type=merge", "-p", json.dumps({"status": gpus}))


KIND_NETWORK = os.environ.get("KIND_EXPERIMENTAL_DOCKER_NETWORK", "kind")  # the Docker network kind puts nodes on


def test_a_partitioned_node_is_served_around_and_its_pod_replaced_on_another_node(tiny_moe: str,
                                                                                   namespace: str) -> None:
    """A node cut off the network (`docker network disconnect`) while its processes run on: its agent stops
    answering, its heartbeats stop, and its ranks' peers get no reset, only silence. The survivors serve, the pod is
    replaced on a live node; the node is connected again on its old address after."""
    victim, node = pod_alone_with_the_world(namespace)
    world = world_generation(namespace)
    shown = subprocess.run(["docker", "inspect", "-f", f'{{{{(index .NetworkSettings.Networks "{KIND_NETWORK}")'
                            '.IPAddress}}', node], check=True, capture_output=True, text=True, timeout=60)
    address = shown.stdout.strip()
    subprocess.run(["docker", "network", "disconnect", KIND_NETWORK, node], check=True, capture_output=True,
                   timeout=60)
    try:
        survivors_answer(namespace, world)
        replaced_elsewhere(namespace, victim, node)
    finally:
        subprocess.run(["docker", "network", "connect", "--ip", address, KIND_NETWORK, node], check=False,
                       capture_output=True, timeout=60)
        node_back(node)


def test_a_lost_node_is_served_around_and_its_pod_replaced_on_another_node(tiny_moe: str, namespace: str) -> None:
    victim, node = pod_alone_with_the_world(namespace)
    world = world_generation(namespace)
    subprocess.run(["docker", "stop", node], check=True, capture_output=True, timeout=120)  # the node is lost
    try:
        survivors_answer(namespace, world)  # (the lost pod stays Terminating until its node is back)
        replaced_elsewhere(namespace, victim, node)
    finally:
        subprocess.run(["docker", "start", node], check=False, capture_output=True, timeout=120)
        node_back(node)


def test_deleting_the_deployment_leaves_no_pod(tiny_moe: str, namespace: str) -> None:
    kubectl("-n", namespace, "delete", "idep", tiny_moe, "--timeout=120s", timeout=150)
    wait_for(f"every worker pod of {tiny_moe} gone", lambda: not worker_pods(namespace) or None, GONE_TIMEOUT_S,
             lambda: diagnostics(namespace))
    assert "NotFound" in kubectl("-n", namespace, "get", "idep", tiny_moe, check=False).stderr
