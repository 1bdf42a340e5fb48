"""The objects the operator builds, as pure functions: names, labels, owner references, pods, and the decisions
the reconciler takes from status alone (backoff, conditions, spec errors)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from shardwise.operator import builders as b
from shardwise.operator.machine import backoff
from shardwise.operator.reconcile import spec_errors
from shardwise.operator.status import eplb_busy, iso_at, seconds_at, set_condition

from shardwise.api import EnvVar, InferenceDeploymentSpec
from shardwise.planner import plan

OWNER: dict[str, Any] = {"apiVersion": "shardwise.io/v1alpha1", "kind": "InferenceDeployment",
                         "metadata": {"name": "web", "namespace": "ml", "uid": "u-1"}}


def spec(**par: Any) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({
        "model": {"preset": "tiny-moe"}, "hardware": {"gpu": "cpu", "gpusPerNode": 2,
                                                      "nodeSelector": {"pool": "gpu"},
                                                      "tolerations": [{"key": "gpu", "operator": "Exists",
                                                                       "effect": "NoSchedule"}]},
        "parallelism": {"tp": 2, "dpa": 2, **par}, "serving": {"maxModelLen": 256},
        "eplb": {"enabled": True, "redundantExperts": 4}, "elastic": {"maxDpa": 8}})


def _tiny_pod_memory() -> str:
    """What a pod of spec() asks: 2 ranks x (the weights the ledger gives a rank + 1 GiB), rounded up to Mi."""
    (weights,) = {row["weightsBytes"] for row in plan(spec()).to_dict()["ledger"]}
    assert 0 < weights < 2**30 // 16  # tiny-moe's: the per-process overhead dominates
    return f"{-(-2 * (weights + 2**30) // 2**20)}Mi"


TINY_POD_MEMORY = _tiny_pod_memory()


def env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]}


def assert_owned(obj: dict[str, Any], component: str) -> None:
    meta = obj["metadata"]
    assert meta["namespace"] == "ml"
    assert meta["ownerReferences"] == [{"apiVersion": "shardwise.io/v1alpha1", "kind": "InferenceDeployment",
                                        "name": "web", "uid": "u-1", "controller": True,
                                        "blockOwnerDeletion": True}]
    assert meta["labels"]["app.kubernetes.io/name"] == "shardwise"
    assert meta["labels"]["app.kubernetes.io/instance"] == "web"
    assert meta["labels"]["app.kubernetes.io/managed-by"] == "shardwise"
    assert meta["labels"]["app.kubernetes.io/component"] == component
    assert meta["labels"]["shardwise.io/deployment"] == "web"


def env_of(pod: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(e["name"], e.get("value", e.get("valueFrom"))) for e in pod["spec"]["containers"][0]["env"]]


def assert_credentials_are_files(pod_spec: dict[str, Any], env: dict[str, Any], token_secret: str,
                                 key: tuple[str, str] | None) -> None:
    """The agent token (and the API key) reach the container as files of Secret volumes, never as variables."""
    assert "SHARDWISE_AGENT_TOKEN" not in env and "SHARDWISE_API_KEY" not in env
    assert not any(isinstance(v, dict) and "secretKeyRef" in v for v in env.values()), env
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in pod_spec["containers"][0]["volumeMounts"]}
    assert volumes["agent-token"]["secret"]["secretName"] == token_secret
    assert env["SHARDWISE_AGENT_TOKEN_FILE"] == mounts["agent-token"] + "/token"
    # an agent also gets the deployment's CA and its certificate (mutual TLS on gRPC); a router does not
    paths = [i["path"] for i in volumes["agent-token"]["secret"]["items"]]
    if "SHARDWISE_AGENT_TLS_DIR" in env:
        assert env["SHARDWISE_AGENT_TLS_DIR"] == mounts["agent-token"]
        assert paths == ["token", "ca.crt", "tls.crt", "tls.key"]  # never the operator's client key
    else:
        assert paths == ["token"]
    if key is None:
        assert "api-key" not in volumes and "SHARDWISE_API_KEY_FILE" not in env
    else:
        assert volumes["api-key"]["secret"]["secretName"] == key[0]
        assert volumes["api-key"]["secret"]["items"] == [{"key": key[1], "path": "key"}]
        assert env["SHARDWISE_API_KEY_FILE"] == mounts["api-key"] + "/key"


def test_every_pod_runs_its_node_slice_with_the_contract_env() -> None:
    s = spec()
    p = plan(s)
    pods = [b.build_pod(OWNER, s, p, i, world=3) for i in range(p.pod_count)]
    assert [q["metadata"]["name"] for q in pods] == ["web-0", "web-1"]
    for i, q in enumerate(pods):
        assert_owned(q, "worker")
        e = env(q)
        assert e["SHARDWISE_DEPLOYMENT"] == "web" and e["SHARDWISE_GENERATION"] == "3"
        assert e["SHARDWISE_POD_INDEX"] == str(i) and e["SHARDWISE_WORLD_SIZE"] == "4"
        assert e["SHARDWISE_RANKS"] == ["0,1", "2,3"][i]
        assert e["SHARDWISE_RENDEZVOUS"] == "web-0.web-workers.ml.svc:29500"
        assert e["SHARDWISE_HOST_STORE"] == "true"  # every pod can host a world's rendezvous
        assert_credentials_are_files(q["spec"], e, "web-agent-token", None)
        assert "SHARDWISE_AGENT_TLS_DIR" in e
        assert e["SHARDWISE_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        c = q["spec"]["containers"][0]
        assert c["command"] == ["shardwise", "agent"]
        assert c["resources"] == {"requests": {"cpu": "2", "memory": TINY_POD_MEMORY, "nvidia.com/gpu": "2"},
                                  "limits": {"nvidia.com/gpu": "2"}}  # a CPU and weights + 1 GiB a rank
        ports = {port["name"]: port["containerPort"] for port in c["ports"]}
        assert ports["http"] == 8000 and ports["grpc"] == 50051 and ports["metrics"] == 9090
        assert ports["rendezvous"] == 29500
        assert c["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
        assert q["spec"]["nodeSelector"] == {"pool": "gpu"}
        assert q["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
        assert q["spec"]["subdomain"] == "web-workers" and q["spec"]["hostname"] == f"web-{i}"
        assert q["metadata"]["labels"]["shardwise.io/pod-index"] == str(i)
        assert q["metadata"]["labels"]["shardwise.io/role"] == "leader"  # each pod leads its own DPA group
        assert q["metadata"]["annotations"][b.ANNOTATION_WORLD] == "3"


def test_worker_pods_run_unprivileged_and_a_hung_agent_is_killed_within_a_minute() -> None:
    s = spec()
    q = b.build_pod(OWNER, s, plan(s), 0, world=1)
    sec = q["spec"]["securityContext"]
    assert sec["runAsNonRoot"] is True and sec["runAsUser"] == sec["runAsGroup"] == 10001  # the image's user
    assert sec["seccompProfile"] == {"type": "RuntimeDefault"}
    c = q["spec"]["containers"][0]
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    live, start = c["livenessProbe"], c["startupProbe"]
    assert live["httpGet"] == start["httpGet"] == {"path": "/livez", "port": "http"}
    # an agent that stops answering: failed probes, then SIGTERM and SIGKILL after the probe's grace
    killed_after = (live["periodSeconds"] * live["failureThreshold"] + live["timeoutSeconds"]
                    + live["terminationGracePeriodSeconds"])
    assert killed_after <= 60, killed_after
    assert start["periodSeconds"] * start["failureThreshold"] >= 300  # a slow start (torch import) is no hang
    router = b.build_router(OWNER, s)
    rc = (router["spec"].get("template", router)["spec"])["containers"][0]
    assert rc["securityContext"]["capabilities"] == {"drop": ["ALL"]}


GPUS = {"nvidia.com/gpu": "2"}

RESOURCE_CASES: list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]] = [
    ("defaults from the plan: Burstable, never BestEffort", {},
     {"cpu": "2", "memory": TINY_POD_MEMORY}, {}),
    ("a request the user gives replaces that default only", {"requests": {"cpu": "500m"}},
     {"cpu": "500m", "memory": TINY_POD_MEMORY}, {}),
    ("the user's requests and limits as given", {"requests": {"cpu": "4", "memory": "16Gi"},
                                                 "limits": {"memory": "24Gi"}},
     {"cpu": "4", "memory": "16Gi"}, {"memory": "24Gi"}),
    ("limits equal to requests make the pod Guaranteed", {"requests": {"cpu": "2", "memory": "8Gi"},
                                                          "limits": {"cpu": "2", "memory": "8Gi"}},
     {"cpu": "2", "memory": "8Gi"}, {"cpu": "2", "memory": "8Gi"}),
    # Kubernetes makes a limited key's request its limit: a default above the limit would be refused
    ("a key limited without a request gets no default", {"limits": {"memory": "1Gi"}},
     {"cpu": "2"}, {"memory": "1Gi"}),
    ("ephemeral storage only as the user sets it", {"requests": {"ephemeral-storage": "10Gi"}},
     {"cpu": "2", "memory": TINY_POD_MEMORY, "ephemeral-storage": "10Gi"}, {}),
]


@pytest.mark.parametrize("case,resources,requests,limits", RESOURCE_CASES, ids=[c[0] for c in RESOURCE_CASES])
def test_worker_pods_request_cpu_and_memory_from_the_plan_unless_the_spec_names_them(
        case: str, resources: dict[str, Any], requests: dict[str, str], limits: dict[str, str]) -> None:
    s = InferenceDeploymentSpec.model_validate({**spec().model_dump(mode="json", by_alias=True),
                                                "runtime": {"resources": resources}})
    p = plan(s)
    for index in range(p.pod_count):
        got = b.build_pod(OWNER, s, p, index, world=1)["spec"]["containers"][0]["resources"]
        assert got == {"requests": {**requests, **GPUS}, "limits": {**limits, **GPUS}}


def test_worker_memory_counts_the_weights_each_rank_stages_and_vllms_own_processes() -> None:
    # Qwen3-235B-A22B at tp=4 on 8 H200s a pod: each rank stages 32,460,742,656 bytes of weights
    big = InferenceDeploymentSpec.model_validate({
        "model": {"preset": "Qwen3-235B-A22B"}, "hardware": {"gpu": "H200", "gpusPerNode": 8},
        "parallelism": {"tp": 4, "dpa": 4}, "serving": {"maxModelLen": 32768}, "elastic": {"maxDpa": 8}})
    p = plan(big)
    assert p.valid and {row["weightsBytes"] for row in p.to_dict()["ledger"]} == {32_460_742_656}
    requests = b.build_pod(OWNER, big, p, 1, world=1)["spec"]["containers"][0]["resources"]["requests"]
    assert requests == {"cpu": "8", "memory": f"{-(-8 * (32_460_742_656 + 2**30) // 2**20)}Mi",
                        "nvidia.com/gpu": "8"}
    # vLLM on the cpu device: 1 GiB more for its API server and engine core, and the KV cache its CPU build
    # allocates in host memory (VLLM_CPU_KVCACHE_SPACE GiB a rank)
    arch = plan(spec()).arch
    assert arch is not None
    on_vllm = InferenceDeploymentSpec.model_validate({
        **spec(dpa=1).model_dump(mode="json", by_alias=True, exclude={"eplb"}), "runtime": {"engine": "vllm"},
        "model": {"source": {"path": "/models/m"}, "architecture": arch.model_dump(by_alias=True)}})
    p = plan(on_vllm)
    pod = b.build_pod(OWNER, on_vllm, p, 0, world=1)
    container = pod["spec"]["containers"][0]
    kv_gib = int({e["name"]: e.get("value") for e in container["env"]}["VLLM_CPU_KVCACHE_SPACE"])
    weights = sum(row["weightsBytes"] for row in p.to_dict()["ledger"])
    assert kv_gib >= 1 and container["resources"]["requests"] == {
        "cpu": "2", "memory": f"{-(-(weights + 2 * 2**30 + 2**30 + 2 * kv_gib * 2**30) // 2**20)}Mi",
        "nvidia.com/gpu": "2"}


def test_only_pods_leading_a_dpa_group_serve() -> None:
    # two pipeline stages on two pods: the one DPA group is led from the first stage's pod
    s = spec(tp=2, dpa=1, pp=2)
    p = plan(s)
    assert p.pod_count == 2 and b.leader_ranks(p) == {0}
    roles = [b.build_pod(OWNER, s, p, i, 1)["metadata"]["labels"]["shardwise.io/role"] for i in range(2)]
    assert roles == ["leader", "worker"]
    svc = b.build_service(OWNER)  # the Service leads to the router, which knows the groups
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}]


def test_the_router_is_a_deployment_or_a_pod_the_service_selects() -> None:
    s = spec()
    dep = b.build_router(OWNER, s)
    assert dep["kind"] == "Deployment" and dep["spec"]["replicas"] == 1
    template = dep["spec"]["template"]
    assert b.build_service(OWNER)["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    container = template["spec"]["containers"][0]
    assert container["command"] == ["shardwise", "router"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["SHARDWISE_ROUTER_POLICY"] == "load"
    assert_credentials_are_files(template["spec"], env, "web-agent-token", None)
    raw = s.model_dump(by_alias=True)
    keyed = type(s).model_validate({**raw, "runtime": {**raw["runtime"], "apiKeySecret": {"name": "keys", "key": "k"}}})
    keyed_pod = b.build_router(OWNER, keyed)["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in keyed_pod["containers"][0]["env"]}
    assert_credentials_are_files(keyed_pod, env, "web-agent-token", ("keys", "k"))
    worker = b.build_pod(OWNER, keyed, plan(keyed), 0, world=1)
    assert_credentials_are_files(worker["spec"], dict(env_of(worker)), "web-agent-token", ("keys", "k"))
    # a router setting changes the router's hash, never the workers' (no roll of the world)
    rr = type(s).model_validate({**s.model_dump(by_alias=True), "router": {"policy": "round-robin"}})
    assert b.router_hash(rr, b.BuildOptions()) != b.router_hash(s, b.BuildOptions())
    assert b.template_hash(rr) == b.template_hash(s)


def test_services_pdb_configmap_and_secret() -> None:
    s = spec()
    p = plan(s)
    headless = b.build_headless_service(OWNER)
    assert_owned(headless, "workers")
    assert headless["metadata"]["name"] == "web-workers" and headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"] == b.selector("web")
    pdb = b.build_pdb(OWNER)
    assert_owned(pdb, "disruption-budget")
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": b.selector("web")}}
    cm = b.build_configmap(OWNER, p)
    assert_owned(cm, "plan")
    assert json.loads(cm["data"]["plan.json"])["worldSize"] == 4
    secret = b.build_secret(OWNER, "s3cret", {"ca.crt": b"CA", "tls.crt": b"CERT"})
    assert_owned(secret, "agent-token")
    assert base64.b64decode(secret["data"]["token"]).decode() == "s3cret"
    assert base64.b64decode(secret["data"]["ca.crt"]) == b"CA" and "ca.key" not in secret["data"]
    assert b.selector_string("web") == ("app.kubernetes.io/component=worker,app.kubernetes.io/instance=web,"
                                        "shardwise.io/deployment=web")


@pytest.mark.parametrize(("scheduler", "where", "key"), [
    ("volcano", "annotations", "scheduling.k8s.io/group-name"),
    ("scheduler-plugins", "labels", "scheduling.x-k8s.io/pod-group"),
])
def test_gang_scheduling_option_names_the_world_group(scheduler: str, where: str, key: str) -> None:
    s = spec()
    p = plan(s)
    pod = b.build_pod(OWNER, s, p, 1, 7, b.BuildOptions(gang_scheduler=scheduler))
    assert pod["metadata"][where][key] == "web-w7"
    plain = b.build_pod(OWNER, s, p, 1, 7)
    assert key not in plain["metadata"]["annotations"] and key not in plain["metadata"]["labels"]


def test_the_template_hash_changes_with_what_shapes_pods_only() -> None:
    base = b.template_hash(spec())
    assert b.template_hash(spec()) == base
    assert b.template_hash(spec(dpa=1)) == base  # dpa changes in place (elastic scaling)
    assert b.template_hash(spec(pp=2, dpa=1)) != b.template_hash(spec(pp=2, dpa=2))  # with stages, it rolls
    assert b.template_hash(spec(tp=1)) != base
    tuned = spec().model_copy(update={"autoscaling": spec().autoscaling.model_copy(update={"enabled": True})})
    assert b.template_hash(tuned) == base


def test_a_template_change_that_leaves_the_ranks_alone_keeps_the_world_hash_so_it_rolls_group_by_group() -> None:
    base = spec()
    world = b.world_hash(base)
    pod_level = base.model_copy(update={"runtime": base.runtime.model_copy(update={
        "image": "corp/agent:3", "env": [EnvVar(name="LOG_LEVEL", value="debug")]})})
    assert b.template_hash(pod_level) != b.template_hash(base)  # the pods are replaced ...
    assert b.world_hash(pod_level) == world  # ... and the new ones can join the serving world
    assert b.world_hash(spec(dpa=1)) == world
    for reshaped in (spec(tp=1), base.model_copy(update={"serving": base.serving.model_copy(
            update={"max_model_len": 1024})}), base.model_copy(update={"runtime": base.runtime.model_copy(
            update={"seed": 7})})):
        assert b.world_hash(reshaped) != world  # other weights, layout or limits: every pod at once


def test_pods_an_older_operator_made_are_stale_after_an_upgrade_that_changed_their_format(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = b.template_hash(spec())
    monkeypatch.setattr(b, "POD_FORMAT", b.POD_FORMAT - 1)  # the operator before mutual TLS
    assert b.template_hash(spec()) != now


def image(s: InferenceDeploymentSpec, options: b.BuildOptions | None = None) -> str:
    return str(b.build_pod(OWNER, s, plan(s), 0, 1, options or b.BuildOptions())["spec"]["containers"][0]["image"])


def test_the_spec_image_wins_and_the_operator_image_is_only_the_default() -> None:
    chart = b.BuildOptions(image="registry/shardwise:9")
    assert image(spec()) == "shardwise:0.1.0" and image(spec(), chart) == "registry/shardwise:9"
    own = spec().model_copy(update={"runtime": spec().runtime.model_copy(update={"image": "corp/agent:2"})})
    assert image(own, chart) == "corp/agent:2"  # the chart always passes --agent-image: it must not hide this
    router = b.build_router(OWNER, own, chart)
    assert router["spec"]["template"]["spec"]["containers"][0]["image"] == "registry/shardwise:9"


def shaped(**pod: Any) -> InferenceDeploymentSpec:
    return spec().model_copy(update={"runtime": spec().runtime.model_copy(update={
        "pod": b.WorkerPodShape.model_validate(pod)})})


def test_the_pod_shape_of_the_spec_is_merged_into_every_worker_pod() -> None:
    s = shaped(labels={"team": "search"}, annotations={"sidecar.istio.io/inject": "false"}, shmSize="16Gi",
               volumes=[{"name": "cache", "emptyDir": {}}], volumeMounts=[{"name": "cache", "mountPath": "/cache"}],
               imagePullSecrets=["regcred"], priorityClassName="inference-high",
               affinity={"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
               topologySpreadConstraints=[{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                           "whenUnsatisfiable": "ScheduleAnyway"}])
    pod = b.build_pod(OWNER, s, plan(s), 1, 3)
    meta, body, container = pod["metadata"], pod["spec"], pod["spec"]["containers"][0]
    assert meta["labels"]["team"] == "search" and meta["labels"]["shardwise.io/deployment"] == "web"
    assert meta["annotations"]["sidecar.istio.io/inject"] == "false" and b.ANNOTATION_HASH in meta["annotations"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in body["volumes"]
    assert {"name": "cache", "emptyDir": {}} in body["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "cache", "mountPath": "/cache"} in container["volumeMounts"]
    assert body["imagePullSecrets"] == [{"name": "regcred"}] and body["priorityClassName"] == "inference-high"
    assert body["affinity"] == s.runtime.pod.affinity and body["topologySpreadConstraints"][0]["maxSkew"] == 1
    assert body["nodeSelector"] == {"pool": "gpu"}  # the hardware block still applies
    router = b.build_router(OWNER, s)["spec"]["template"]["spec"]
    assert router["imagePullSecrets"] == [{"name": "regcred"}]  # the router's image comes from the same registry
    assert b.template_hash(s) != b.template_hash(spec())  # a new shape rolls the pods


@pytest.mark.parametrize("pod,fragment", [
    ({"labels": {"shardwise.io/role": "x"}}, "keys under shardwise.io/ and app.kubernetes.io/ are the operator's"),
    ({"labels": {"team": "a b"}}, "'a b' is not a label value"),
    ({"annotations": {"bad key!": "x"}}, "the name part must be"),
    ({"shmSize": "lots"}, "shmSize: invalid quantity 'lots'"),
    ({"shmSize": "0"}, "shmSize=0 must be positive"),
    ({"volumes": [{"name": "model", "emptyDir": {}}]}, "'model' is the operator's"),
    ({"volumes": [{"name": "a", "emptyDir": {}, "hostPath": {"path": "/x"}}]}, "exactly one source"),
    ({"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "b", "mountPath": "/b"}]},
     "'b' names no volume of this spec"),
    ({"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": "/dev/shm"}]},
     "/dev/shm is set by shmSize"),
    ({"imagePullSecrets": ["Reg_Cred"]}, "'Reg_Cred' is not a Secret name"),
    ({"volumes": [{"name": "agent-token", "emptyDir": {}}]}, "'agent-token' is the operator's"),
    ({"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": "/var/run/secrets"}]},
     "would cover /var/run/secrets/shardwise, where the operator mounts the agent token and the API key"),
    ({"volumes": [{"name": "a", "emptyDir": {}}],
      "volumeMounts": [{"name": "a", "mountPath": "/var/run/secrets/shardwise/agent"}]}, "would cover"),
])
def test_a_pod_shape_the_operator_could_not_honour_is_refused_with_its_field(pod: dict[str, Any],
                                                                             fragment: str) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:
        shaped(**pod)
    assert fragment in str(e.value), str(e.value)


def test_gang_backoff_doubles_from_30_s_to_10_min() -> None:
    assert [backoff(n) for n in range(1, 8)] == [30, 60, 120, 240, 480, 600, 600]


def test_a_condition_keeps_its_transition_time_while_its_status_holds() -> None:
    first = set_condition([], "Available", "False", "Provisioning", "creating", 1)
    first[0]["lastTransitionTime"] = "2020-01-01T00:00:00Z"
    same = set_condition(first, "Available", "False", "Provisioning", "still creating", 2)
    assert same[0]["lastTransitionTime"] == "2020-01-01T00:00:00Z" and same[0]["message"] == "still creating"
    flipped = set_condition(same, "Available", "True", "Serving", "ok", 2)
    assert flipped[0]["lastTransitionTime"] != "2020-01-01T00:00:00Z"
    both = set_condition(flipped, "Degraded", "False", "AsExpected", "", 2)
    both = set_condition(both, "Progressing", "False", "Complete", "", 2)
    assert [c["type"] for c in both] == ["Available", "Progressing", "Degraded"]


@pytest.mark.parametrize("eplb,busy", [
    ({"inProgress": True, "inProgressDeadline": "2026-12-01T12:10:00Z"}, True),  # experts moving: scaling waits
    ({"inProgress": True, "inProgressDeadline": "2026-12-01T11:50:00Z"}, False),  # left by a dead operator
    ({"inProgress": True}, False),  # a mark without a deadline (an older operator's) holds nothing back
    ({"inProgressDeadline": "2026-12-01T12:10:00Z"}, False),
    ({}, False),
])
def test_a_rebalance_holds_scaling_back_only_until_its_deadline(eplb: dict[str, Any], busy: bool) -> None:
    noon = 1_796_126_400.0  # 2026-12-01T12:00:00Z
    assert eplb_busy({"eplb": eplb}, noon) is busy


def test_a_standby_pod_holds_a_pods_gpus_waits_for_configure_and_no_service_or_group_takes_it() -> None:
    s = spec(tp=2, dpa=2)
    p = plan(s)
    pod = b.build_pod(OWNER, s, p, 5, 3, ranks=[], standby=True)
    assert pod["metadata"]["labels"]["shardwise.io/role"] == "standby"
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SHARDWISE_RANKS"] == "" and env["SHARDWISE_WAIT_FOR_CONFIGURE"] == "true"
    assert container["resources"] == b.build_pod(OWNER, s, p, 0, 3)["spec"]["containers"][0]["resources"]


def test_standby_pods_are_refused_where_the_world_does_not_change_in_place() -> None:
    base = spec().model_dump(mode="json", by_alias=True)
    assert spec_errors({**base, "elastic": {**base["elastic"], "standbyPods": 1}})[2] == []
    piped = {**base, "parallelism": {**base["parallelism"], "tp": 1, "pp": 2},
             "elastic": {**base["elastic"], "standbyPods": 2}}
    errors = spec_errors(piped)[2]
    assert errors and errors[0].startswith("spec.elastic.standbyPods: 2 standby pods") and "pp=2" in errors[0]


def test_spec_errors_are_the_planners_messages_with_numbers() -> None:
    good = spec().model_dump(mode="json", by_alias=True)
    assert spec_errors(good)[2] == []
    bad = {**good, "parallelism": {**good["parallelism"], "tp": 3}}
    errors = spec_errors(bad)[2]
    assert errors and any("3" in e for e in errors), errors
    assert spec_errors({"model": {"preset": "tiny-moe"}, "parallelism": {"tp": 0}})[2][0].startswith(
        "spec.parallelism.tp")
    cp = {"model": {"preset": "tiny-moe"}, "hardware": {"gpu": "cpu", "gpusPerNode": 2},
          "parallelism": {"tp": 2, "dpa": 2, "cp": 2}, "elastic": {"maxDpa": 8}}
    assert spec_errors(cp)[2] == []  # context parallelism runs on the reference engine
    moe_tp = {**cp, "parallelism": {"tp": 2, "dpa": 2, "moeTp": 2}}
    assert spec_errors(moe_tp)[2] == []  # MoE-TP runs
    replicated = {**cp, "parallelism": {"tp": 2, "dpa": 2, "moeTp": 2, "ep": 1}}
    assert spec_errors(replicated)[2] == [
        "spec.parallelism.moeTp: the reference runtime runs moeTp=2 with one copy of the experts per stage "
        "(ep * moeTp = dpa * tp) and pp=1, got ep=1, pp=1"]


def test_status_patches_drop_the_keys_that_went_away() -> None:
    from shardwise.operator.status import merge_diff

    old = {"phase": "Scaling", "elastic": {"operation": "ScaleUp", "target": {"0": [0], "1": [1], "2": [2]}},
           "gang": {"since": "t"}}
    new = {"phase": "Running", "elastic": {"operation": "ScaleDown", "target": {"0": [0]}}}
    assert merge_diff(old, new) == {"phase": "Running", "gang": None,
                                    "elastic": {"operation": "ScaleDown", "target": {"1": None, "2": None}}}
    assert merge_diff(new, new) == {}


def test_a_pod_added_by_scaling_runs_the_ranks_it_is_given() -> None:
    s = spec()
    p = plan(s)
    pod = b.build_pod(OWNER, s, p, 5, 4, ranks=[2, 3])
    assert env(pod)["SHARDWISE_RANKS"] == "2,3" and pod["metadata"]["name"] == "web-5"
    assert pod["metadata"]["labels"]["shardwise.io/role"] == "leader"  # rank 2 leads group 1
    assert b.build_pod(OWNER, s, p, 5, 4, ranks=[3])["metadata"]["labels"]["shardwise.io/role"] == "worker"


def test_an_operations_timestamps_keep_milliseconds_and_an_older_operators_seconds_still_read() -> None:
    t = 1_796_000_000.4567
    assert iso_at(t) == "2026-11-30T00:53:20.456Z"
    assert abs(seconds_at(iso_at(t)) - t) < 0.001  # a phase's elapsed time is not off by up to a second
    assert seconds_at("2026-11-30T00:53:20Z") == 1_796_000_000.0


def test_worker_and_router_pods_get_no_service_links_and_no_api_token() -> None:
    """Service-link variables (SHARDWISE_METRICS_PORT=tcp://...) would reach the CLI's settings, and neither the
    agent nor the router calls the Kubernetes API: their pods take neither."""
    s = spec()
    worker = b.build_pod(OWNER, s, plan(s), 0, world=1)["spec"]
    router = b.build_router(OWNER, s)["spec"]["template"]["spec"]
    for pod in (worker, router):
        assert pod["enableServiceLinks"] is False and pod["automountServiceAccountToken"] is False
