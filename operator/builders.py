"""The objects an InferenceDeployment owns, as pure functions of the deployment and its plan.

Every `build_*` returns a plain Kubernetes object (a dict) with owner reference and labels; nothing here talks to
the API, so each is tested on its own and the reconciler only compares and applies.

    Secret      NAME-agent-token   the token every agent call carries (generated once, never rewritten)
    ConfigMap   NAME-plan          the plan as JSON (rank table, ledger, estimates), `kubectl get cm` readable
    Service     NAME-workers       headless: stable DNS for the pods (pod 0 hosts the rendezvous store)
    Service     NAME               ClusterIP on port 8000 to the router (the deployment's OpenAI endpoint)
    Deployment  NAME-router        the router (`shardwise router`, spec.router.replicas pods)
    InferencePool NAME             Gateway API Inference Extension (when its CRD is installed): the DPA leaders
    NetworkPolicy NAME-workers     with --network-policy-namespace: who may reach the worker pods
    PDB         NAME               one worker pod at a time may be evicted voluntarily
    Pod         NAME-I             one per node slice: `shardwise agent` with the slice's ranks
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shardwise import vllm
from shardwise.api import (
    DEFAULT_IMAGE,
    DEFAULT_VLLM_IMAGE,
    GROUP,
    KIND,
    VERSION,
    Engine,
    InferenceDeploymentSpec,
    WorkerPodShape,
)
from shardwise.planner import Plan

from .certs import AGENT_FILES

Obj = dict[str, Any]

HTTP_PORT = 8000
GRPC_PORT = 50051
METRICS_PORT = 9090
STORE_PORT = 29500
IMAGE_UID = 10001  # the image's user (Dockerfile), so that runAsNonRoot needs no passwd lookup
WORKER_POD_SECURITY = {"runAsNonRoot": True, "runAsUser": IMAGE_UID, "runAsGroup": IMAGE_UID, "fsGroup": IMAGE_UID,
                       "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
MANAGER = "shardwise"
TOKEN_KEY = "token"
PLAN_KEY = "plan.json"

LABEL_DEPLOYMENT = "shardwise.io/deployment"
LABEL_POD_INDEX = "shardwise.io/pod-index"
LABEL_ROLE = "shardwise.io/role"
ANNOTATION_HASH = "shardwise.io/template-hash"
ANNOTATION_WORLD = "shardwise.io/world-generation"

GANG_ANNOTATIONS = {
    # Volcano reads the group from this annotation; scheduler-plugins' coscheduling from the label below.
    "volcano": "scheduling.k8s.io/group-name",
    "scheduler-plugins": "scheduling.x-k8s.io/pod-group",
}


@dataclass(frozen=True)
class BuildOptions:
    """Operator-wide choices that shape the pods (flags of `shardwise operator`)."""

    image: str = ""  # the worker image where spec.runtime.image is empty (the chart's agentImage), and the router's
    gang_scheduler: str = ""  # "", "volcano" or "scheduler-plugins"
    image_pull_policy: str = "IfNotPresent"
    store_port: int = STORE_PORT
    endpoint_picker: str = ""  # NAME:PORT of the Gateway API endpoint picker the InferencePools name (default EPP)
    network_policy_namespace: str = ""  # the operator's namespace: set, each deployment gets a NetworkPolicy


def names(name: str) -> dict[str, str]:
    return {"secret": f"{name}-agent-token", "configmap": f"{name}-plan", "headless": f"{name}-workers",
            "service": name, "pdb": name, "router": f"{name}-router", "network_policy": f"{name}-workers"}


def pod_name(name: str, index: int) -> str:
    return f"{name}-{index}"


def labels(name: str, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "shardwise", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component, "app.kubernetes.io/managed-by": MANAGER,
            LABEL_DEPLOYMENT: name}


def selector(name: str) -> dict[str, str]:
    """The labels every worker pod of the deployment carries (status.selector, the Services, the PDB)."""
    return {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": "worker", LABEL_DEPLOYMENT: name}


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector(name).items()))


def owner_reference(owner: Mapping[str, Any]) -> Obj:
    meta = owner["metadata"]
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _meta(owner: Mapping[str, Any], name: str, component: str, extra: Mapping[str, str] | None = None) -> Obj:
    return {"name": name, "namespace": owner["metadata"]["namespace"],
            "labels": {**labels(owner["metadata"]["name"], component), **(extra or {})},
            "ownerReferences": [owner_reference(owner)]}


#: the shape of the operator's worker pods, in the template hash: bumped when pods made by an older operator cannot
#: serve under a newer one (2: the agents' gRPC takes only mutual TLS), so the upgrade rolls them once
POD_FORMAT = 2


def made_from(obj: dict[str, Any]) -> str | None:
    """The template hash an object was built from (its annotation), None when it has none."""
    return (obj["metadata"].get("annotations") or {}).get(ANNOTATION_HASH)


def template_hash(spec: InferenceDeploymentSpec) -> str:
    """What the worker pods are made of: a change here rolls the deployment to a new world. Autoscaling and EPLB
    tuning are left out (they act on a running world), and so is dpa where elastic scaling changes it in place."""
    shaped = spec.model_dump(mode="json", by_alias=True, include={"model", "hardware", "parallelism", "serving",
                                                                    "runtime"})
    shaped["podFormat"] = POD_FORMAT
    shaped["redundantExperts"] = spec.eplb.redundant_experts if spec.eplb.enabled else 0
    if spec.parallelism.pp == 1 and spec.runtime.engine is Engine.REFERENCE:
        # dpa changes in place (elastic scaling); with pp > 1 it renumbers stages, and vLLM forms its world once
        # at start: a roll (vLLM's pods are drained as they stop)
        shaped["parallelism"].pop("dpa", None)
    return hashlib.sha256(json.dumps(shaped, sort_keys=True).encode()).hexdigest()[:16]


def world_hash(spec: InferenceDeploymentSpec) -> str:
    """What the ranks of a world are made of (the model, the layout but dpa, the serving limits, the engine, the
    GPUs): pods that agree on it can serve in one world, so a template change that leaves it alone (image, env,
    resources, pod shape, scheduling) replaces the pods group by group instead of all at once."""
    shaped = spec.model_dump(mode="json", by_alias=True, include={"model", "parallelism", "serving"})
    shaped["parallelism"].pop("dpa", None)
    shaped["hardware"] = {"gpu": spec.hardware.gpu, "gpusPerNode": spec.hardware.gpus_per_node}
    shaped["runtime"] = {"engine": spec.runtime.engine.value, "seed": spec.runtime.seed, "args": spec.runtime.args}
    shaped["podFormat"] = POD_FORMAT
    shaped["redundantExperts"] = spec.eplb.redundant_experts if spec.eplb.enabled else 0
    return hashlib.sha256(json.dumps(shaped, sort_keys=True).encode()).hexdigest()[:16]


def build_secret(owner: Mapping[str, Any], token: str, tls: Mapping[str, bytes]) -> Obj:
    """The agent token and the deployment's TLS files (certs.issue): the agents mount the token, the CA and
    their certificate and key; the operator alone reads the client certificate."""
    data = {TOKEN_KEY: base64.b64encode(token.encode()).decode(),
            **{k: base64.b64encode(v).decode() for k, v in tls.items()}}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(owner, names(owner["metadata"]["name"])["secret"], "agent-token"), "data": data}


def build_configmap(owner: Mapping[str, Any], plan: Plan) -> Obj:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(owner, names(owner["metadata"]["name"])["configmap"], "plan"),
            "data": {PLAN_KEY: plan_json(plan)}}


def plan_json(plan: Plan) -> str:
    """The plan as JSON: indented to read with kubectl while small, compact once that would pass 512 KiB (the
    ConfigMap must stay under the API server's 1 MiB object limit; the planner caps the world for that)."""
    data = plan.to_dict()
    readable = json.dumps(data, indent=1, sort_keys=True)
    return readable if len(readable) < 512 * 1024 else json.dumps(data, separators=(",", ":"), sort_keys=True)


def _ports(store_port: int) -> list[Obj]:
    return [{"name": "http", "port": HTTP_PORT, "targetPort": "http"},
            {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc"},
            {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics"},
            {"name": "rendezvous", "port": store_port, "targetPort": store_port}]


def build_headless_service(owner: Mapping[str, Any], options: BuildOptions = BuildOptions()) -> Obj:
    name = owner["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(owner, names(name)["headless"], "workers"),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": selector(name),
                     "ports": _ports(options.store_port)}}


def router_selector(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": "router", LABEL_DEPLOYMENT: name}


def build_service(owner: Mapping[str, Any]) -> Obj:
    """The deployment's stable address: port 8000 to its router pods."""
    name = owner["metadata"]["name"]
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(owner, names(name)["service"], "serving"),
            "spec": {"type": "ClusterIP", "selector": router_selector(name),
                     "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http"}]}}


#: where the pods find their credentials: files of Secret volumes, never environment variables
SECRETS_DIR = "/var/run/secrets/shardwise"
TOKEN_FILE = f"{SECRETS_DIR}/agent/token"
API_KEY_FILE = f"{SECRETS_DIR}/api-key/key"


def credentials(name: str, spec: InferenceDeploymentSpec, *, api_key: bool = True,
                tls: bool = False) -> tuple[list[Obj], list[Obj], list[Obj]]:
    """(env, volumes, mounts) giving a container the agent token and, with `api_key` and a
    spec.runtime.apiKeySecret, the API key, as read-only files (`SHARDWISE_AGENT_TOKEN_FILE`,
    `SHARDWISE_API_KEY_FILE`): a file is not inherited by child processes nor shown where the environment is.
    With `tls` (an agent) also the deployment's CA and the agents' certificate and key beside the token
    (`SHARDWISE_AGENT_TLS_DIR`): its gRPC port then takes only mutual TLS."""
    env: list[Obj] = [{"name": "SHARDWISE_AGENT_TOKEN_FILE", "value": TOKEN_FILE}]
    items = [{"key": TOKEN_KEY, "path": "token"}]
    if tls:
        items += [{"key": k, "path": k} for k in AGENT_FILES]
        env.append({"name": "SHARDWISE_AGENT_TLS_DIR", "value": f"{SECRETS_DIR}/agent"})
    volumes: list[Obj] = [{"name": "agent-token", "secret": {
        "secretName": names(name)["secret"], "items": items, "defaultMode": 0o444}}]
    mounts: list[Obj] = [{"name": "agent-token", "mountPath": f"{SECRETS_DIR}/agent", "readOnly": True}]
    key = spec.runtime.api_key_secret
    if api_key and key is not None:
        env.append({"name": "SHARDWISE_API_KEY_FILE", "value": API_KEY_FILE})
        volumes.append({"name": "api-key", "secret": {
            "secretName": key.name, "items": [{"key": key.key, "path": "key"}], "defaultMode": 0o444}})
        mounts.append({"name": "api-key", "mountPath": f"{SECRETS_DIR}/api-key", "readOnly": True})
    return env, volumes, mounts


def router_hash(spec: InferenceDeploymentSpec, options: BuildOptions) -> str:
    shaped = {"router": spec.router.model_dump(mode="json", by_alias=True), "image": router_image(spec, options),
              "key": spec.runtime.api_key_secret.model_dump(mode="json") if spec.runtime.api_key_secret else None,
              "pullSecrets": spec.runtime.pod.image_pull_secrets}
    return hashlib.sha256(json.dumps(shaped, sort_keys=True).encode()).hexdigest()[:16]


def router_pod_spec(owner: Mapping[str, Any], spec: InferenceDeploymentSpec, options: BuildOptions) -> Obj:
    """The router's pod spec: `shardwise router` on port 8000 (metrics 9090), ready while a group admits."""
    name = owner["metadata"]["name"]
    r = spec.router
    env: list[Obj] = [
        {"name": "SHARDWISE_DEPLOYMENT", "value": name},
        {"name": "SHARDWISE_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "SHARDWISE_ROUTER_POLICY", "value": r.policy.value},
        {"name": "SHARDWISE_ROUTER_PREFIX_AFFINITY", "value": "true" if r.prefix_affinity else "false"},
        {"name": "SHARDWISE_ROUTER_RETRY_SECONDS", "value": f"{r.retry_seconds:g}"},
        {"name": "SHARDWISE_ROUTER_DRAIN_SECONDS", "value": "25"},
    ]
    secret_env, volumes, mounts = credentials(name, spec)
    pull = {"imagePullSecrets": pull_secrets(spec.runtime.pod)} if spec.runtime.pod.image_pull_secrets else {}
    return {
        "restartPolicy": "Always", "terminationGracePeriodSeconds": 30, **pull, "volumes": volumes,
        # Services' link variables (SHARDWISE_METRICS_PORT=tcp://...) must never reach the CLI's settings; the router
        # never calls the Kubernetes API, so it gets no ServiceAccount token either
        "enableServiceLinks": False, "automountServiceAccountToken": False,
        "containers": [{
            "name": "router", "image": router_image(spec, options),
            "imagePullPolicy": options.image_pull_policy, "command": ["shardwise", "router"],
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "env": env + secret_env, "volumeMounts": mounts,
            "ports": [{"name": "http", "containerPort": HTTP_PORT}, {"name": "metrics", "containerPort": METRICS_PORT}],
            "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
            "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1,
                               "timeoutSeconds": 2, "failureThreshold": 2},
            "securityContext": copy.deepcopy(CONTAINER_SECURITY),
        }],
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
    }


def build_router(owner: Mapping[str, Any], spec: InferenceDeploymentSpec,
                 options: BuildOptions = BuildOptions()) -> Obj:
    """The router as a Deployment of spec.router.replicas pods, rolled one surge pod at a time."""
    name = owner["metadata"]["name"]
    annotations = {ANNOTATION_HASH: router_hash(spec, options)}
    pod_meta = {"labels": {**labels(name, "router"), **router_selector(name)}, "annotations": annotations}
    meta = _meta(owner, names(name)["router"], "router")
    meta["annotations"] = annotations
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": spec.router.replicas, "selector": {"matchLabels": router_selector(name)},
                     "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                     "template": {"metadata": pod_meta, "spec": router_pod_spec(owner, spec, options)}}}


def build_pdb(owner: Mapping[str, Any]) -> Obj:
    name = owner["metadata"]["name"]
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(owner, names(name)["pdb"], "disruption-budget"),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(name)}}}


def model_dir(spec: InferenceDeploymentSpec) -> str:
    """Where worker pods see the checkpoint of `spec.model.source` ("" for a preset: weights from the seed)."""
    return spec.model.source.mount_path if spec.model.source is not None else ""


def cp_fields(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The context-parallel settings a world is configured with. maxModelLen left to its default goes as 0: each
    agent then uses its own SHARDWISE_MAX_MODEL_LEN, which `build_pod` sets from the plan (the model's positions)."""
    par = spec.parallelism
    return {"cp": par.cp, "cp_mode": par.cp_mode.value, "cp_layout": par.cp_layout.value,
            "cp_comm": par.cp_comm.value, "max_model_len": spec.serving.max_model_len or 0}


def planned_architecture(plan: Plan) -> str:
    """The architecture a plan was made for, as JSON, for the pods to check a checkpoint against."""
    return plan.arch.model_dump_json(by_alias=True) if plan.arch is not None else ""


def served_name(owner: Mapping[str, Any], spec: InferenceDeploymentSpec) -> str:
    """The model name of the OpenAI API: `spec.model.servedName`, else the preset's, else the deployment's."""
    return spec.model.served_name or spec.model.preset or owner["metadata"]["name"]


def _model_volume(spec: InferenceDeploymentSpec) -> tuple[list[Obj], list[Obj]]:
    """(volumes, mounts) that put the checkpoint at `model_dir(spec)`, read-only: a host path at the same path
    (what the local cluster's process-backed pods see anyway), or the PVC's subPath."""
    source = spec.model.source
    if source is None:
        return [], []
    mount: Obj = {"name": "model", "mountPath": source.mount_path, "readOnly": True}
    if source.path is not None:
        volume: Obj = {"name": "model", "hostPath": {"path": source.path, "type": "Directory"}}
    else:
        assert source.pvc is not None
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": source.pvc.claim_name, "readOnly": True}}
        if source.pvc.sub_path:
            mount["subPath"] = source.pvc.sub_path
    return [volume], [mount]


GiB = 1 << 30
MiB = 1 << 20
#: host memory of one rank process beside the weights it stages: the Python interpreter, torch and its allocator
RANK_OVERHEAD_BYTES = 1 * GiB
#: host memory of vLLM's processes beside its rank workers: its API server and engine core
VLLM_OVERHEAD_BYTES = 1 * GiB
#: CPUs a rank process requests: the one that drives its GPU (launches kernels, runs the scheduler's Python)
CPU_PER_RANK = 1


def default_requests(spec: InferenceDeploymentSpec, plan: Plan, ranks: Sequence[int]) -> dict[str, str]:
    """The cpu and memory a worker pod requests where spec.runtime.resources.requests does not say:

        memory = sum over the pod's ranks of (weightsBytes + RANK_OVERHEAD_BYTES)
                 + VLLM_OVERHEAD_BYTES                          engine vllm
                 + VLLM_CPU_KVCACHE_SPACE GiB per rank          engine vllm on gpu "cpu": its KV cache is host memory
                 rounded up to a whole Mi
        cpu    = CPU_PER_RANK per rank

    weightsBytes is the plan's ledger row of the rank (what it stages from the checkpoint on its way to the GPU).
    The reference runtime's KV cache lives on the GPU (on gpu "cpu" it grows with the requests), so it is not
    counted. A pod without ranks yet (a standby pod) is sized for the plan's heaviest pod, whose ranks a scale-up
    may give it."""
    slices = [list(ranks)] if ranks else plan.pods()
    per_slice = [(len(r), sum(plan.ledger_for_rank(x).weights_bytes for x in r) if plan.stage_ledger else 0)
                 for r in slices] or [(plan.gpus_per_pod, 0)]
    count, weights = max(per_slice, key=lambda c: (c[1] + c[0] * RANK_OVERHEAD_BYTES, c[0]))
    memory = weights + count * RANK_OVERHEAD_BYTES
    if spec.runtime.engine is Engine.VLLM:
        memory += VLLM_OVERHEAD_BYTES
        if spec.hardware.gpu == "cpu":
            memory += count * vllm.cpu_kv_cache_gib(plan) * GiB
    return {"cpu": str(count * CPU_PER_RANK), "memory": f"{math.ceil(memory / MiB)}Mi"}


def worker_resources(spec: InferenceDeploymentSpec, plan: Plan, ranks: Sequence[int]) -> Obj:
    """A worker container's resources: `default_requests` under the user's requests (key by key), the user's
    limits alone, and the pod's GPUs in both. A key the user limits without requesting gets no default:
    Kubernetes makes its request the limit."""
    user = spec.runtime.resources
    gpus = {spec.hardware.resource_name: str(plan.gpus_per_pod)}
    defaults = {k: v for k, v in default_requests(spec, plan, ranks).items() if k not in user.limits}
    return {"requests": {**defaults, **user.requests, **gpus}, "limits": {**user.limits, **gpus}}


def leader_ranks(plan: Plan) -> set[int]:
    assert plan.grid is not None
    return {int(plan.grid.grid[0, g, 0, 0]) for g in range(plan.grid.dpa)}


def build_pod(owner: Mapping[str, Any], spec: InferenceDeploymentSpec, plan: Plan, index: int, world: int,
              options: BuildOptions = BuildOptions(), ranks: list[int] | None = None, standby: bool = False) -> Obj:
    """Worker pod `index` of world generation `world`: the node slice that runs `ranks` (by default
    `plan.pods()[index]`; a pod added by elastic scaling after a recovery may run other ranks). `standby`: a
    standby pod (`spec.elastic.standbyPods`), labelled role=standby, which waits without ranks until a scale-up
    configures it."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    ranks = list(plan.pods()[index]) if ranks is None else list(ranks)
    hw, par = spec.hardware, spec.parallelism
    role = "standby" if standby else "leader" if set(ranks) & leader_ranks(plan) else "worker"
    headless = names(name)["headless"]
    env: list[Obj] = [
        {"name": "SHARDWISE_DEPLOYMENT", "value": name},
        {"name": "SHARDWISE_GENERATION", "value": str(world)},
        {"name": "SHARDWISE_POD_INDEX", "value": str(index)},
        {"name": "SHARDWISE_RANKS", "value": ",".join(map(str, ranks))},
        {"name": "SHARDWISE_WORLD_SIZE", "value": str(plan.world_size)},
        {"name": "SHARDWISE_RENDEZVOUS",
         "value": f"{pod_name(name, 0)}.{headless}.{namespace}.svc:{options.store_port}"},
        {"name": "SHARDWISE_WAIT_FOR_CONFIGURE", "value": "true"},  # the operator configures each world
        {"name": "SHARDWISE_HOST_STORE", "value": "true"},  # any surviving pod may host the next world's meeting
        {"name": "SHARDWISE_STORE_PORT", "value": str(options.store_port)},
        {"name": "SHARDWISE_MODEL", "value": plan.model_name},
        {"name": "SHARDWISE_WEIGHTS", "value": model_dir(spec)},
        {"name": "SHARDWISE_SERVED_MODEL_NAME", "value": served_name(owner, spec)},
        {"name": "SHARDWISE_TP", "value": str(par.tp)},
        {"name": "SHARDWISE_MOE_TP", "value": str(par.moe_tp)},
        {"name": "SHARDWISE_CP", "value": str(par.cp)},
        {"name": "SHARDWISE_CP_MODE", "value": par.cp_mode.value},
        {"name": "SHARDWISE_CP_LAYOUT", "value": par.cp_layout.value},
        {"name": "SHARDWISE_CP_COMM", "value": par.cp_comm.value},
        {"name": "SHARDWISE_DPA", "value": str(plan.grid.dpa if plan.grid else par.dpa)},  # the plan's size
        {"name": "SHARDWISE_PP", "value": str(par.pp)},
        {"name": "SHARDWISE_SEED", "value": str(spec.runtime.seed)},
        {"name": "SHARDWISE_MAX_MODEL_LEN", "value": str(plan.max_model_len)},
        {"name": "SHARDWISE_MAX_RUNNING", "value": str(spec.serving.max_running or 64)},
        {"name": "SHARDWISE_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    # the vLLM engine takes its API key as VLLM_API_KEY (vllm_pod below): vLLM reads no file
    secret_env, secret_volumes, secret_mounts = credentials(name, spec, api_key=spec.runtime.engine != Engine.VLLM,
                                                            tls=True)
    env += secret_env
    ports = [{"name": "http", "containerPort": HTTP_PORT}, {"name": "grpc", "containerPort": GRPC_PORT},
             {"name": "metrics", "containerPort": METRICS_PORT}]
    ports.append({"name": "rendezvous", "containerPort": options.store_port})
    extra_labels = {LABEL_POD_INDEX: str(index), LABEL_ROLE: role, "app.kubernetes.io/component": "worker"}
    annotations = {ANNOTATION_HASH: template_hash(spec), ANNOTATION_WORLD: str(world)}
    meta = _meta(owner, pod_name(name, index), "worker", extra_labels)
    if options.gang_scheduler:
        group = f"{name}-w{world}"
        key = GANG_ANNOTATIONS[options.gang_scheduler]
        if options.gang_scheduler == "scheduler-plugins":
            meta["labels"][key] = group
        else:
            annotations[key] = group
    meta["annotations"] = annotations
    volumes, mounts = _model_volume(spec)
    volumes, mounts = volumes + secret_volumes, mounts + secret_mounts
    pod: Obj = {
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {
            "hostname": pod_name(name, index), "subdomain": headless, "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 30, "enableServiceLinks": False,
            "automountServiceAccountToken": False,  # the agent never calls the Kubernetes API
            "nodeSelector": dict(hw.node_selector),
            "tolerations": [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in hw.tolerations],
            "containers": [{
                "name": "agent", "image": worker_image(spec, options),
                "imagePullPolicy": options.image_pull_policy,
                "command": ["shardwise", "agent"], "env": env, "ports": ports,
                # the agent's fatal error is the end of its log: the pod's status (and the operator's condition and
                # event) says why it exited
                "terminationMessagePolicy": "FallbackToLogsOnError",
                "resources": worker_resources(spec, plan, ranks),
                # a crashed rank fails /healthz at once; a short period makes the pod event (and the
                # operator's recovery) follow within about two seconds
                "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1,
                                   "timeoutSeconds": 2, "failureThreshold": 1},
                # the agent process itself: a hung (stopped, deadlocked) agent is killed and its pod fails,
                # which the operator recovers like a lost pod; the startup probe covers a slow start
                "startupProbe": {"httpGet": {"path": "/livez", "port": "http"}, "periodSeconds": 1,
                                 "timeoutSeconds": 5, "failureThreshold": 300},
                "livenessProbe": {"httpGet": {"path": "/livez", "port": "http"}, "periodSeconds": 10,
                                  "timeoutSeconds": 10, "failureThreshold": 3,
                                  "terminationGracePeriodSeconds": 10},
                "securityContext": copy.deepcopy(CONTAINER_SECURITY),
            }],
            "securityContext": copy.deepcopy(WORKER_POD_SECURITY),
        },
    }
    if volumes:
        pod["spec"]["volumes"] = volumes
        pod["spec"]["containers"][0]["volumeMounts"] = mounts
    container = pod["spec"]["containers"][0]
    _shape(pod, spec.runtime.pod)
    if spec.runtime.engine is Engine.VLLM:
        _vllm_container(owner, spec, plan, index, container, options)
        pod["spec"]["terminationGracePeriodSeconds"] = spec.elastic.scale_down.drain_timeout_seconds + 30
        # vLLM's images run as root (their caches live under /root): no user is forced; the rest holds
        pod["spec"]["securityContext"] = {"seccompProfile": {"type": "RuntimeDefault"}}
    container["env"] += [{"name": e.name, "value": e.value} for e in spec.runtime.env]
    return pod


def worker_image(spec: InferenceDeploymentSpec, options: BuildOptions) -> str:
    """spec.runtime.image when given; else the operator's --agent-image for the reference engine, and the vLLM
    image (the operator's has no vLLM) for engine vllm."""
    if spec.runtime.image:
        return spec.runtime.image
    if spec.runtime.engine is Engine.VLLM:
        return DEFAULT_VLLM_IMAGE
    return options.image or DEFAULT_IMAGE


def router_image(spec: InferenceDeploymentSpec, options: BuildOptions) -> str:
    """The operator's own image runs the router; without one, the reference engine's worker image does."""
    return options.image or (spec.runtime.image if spec.runtime.engine is Engine.REFERENCE else "") or DEFAULT_IMAGE


def pull_secrets(shape: WorkerPodShape) -> list[Obj]:
    """The spec's imagePullSecrets as a pod spec lists them (worker and router pods pull from one registry)."""
    return [{"name": n} for n in shape.image_pull_secrets]


def _shape(pod: Obj, shape: WorkerPodShape) -> None:
    """Merge the spec's pod shape into a built worker pod; the operator's own keys win (admission refuses the
    reserved ones, so nothing is lost silently)."""
    meta, body, container = pod["metadata"], pod["spec"], pod["spec"]["containers"][0]
    meta["labels"] = {**shape.labels, **meta["labels"]}
    meta["annotations"] = {**shape.annotations, **meta.get("annotations", {})}
    volumes = [copy.deepcopy(v) for v in shape.volumes]
    mounts = [copy.deepcopy(m) for m in shape.volume_mounts]
    if shape.shm_size is not None:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shape.shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if volumes:
        body["volumes"] = body.get("volumes", []) + volumes
    if mounts:
        container["volumeMounts"] = container.get("volumeMounts", []) + mounts
    if shape.image_pull_secrets:
        body["imagePullSecrets"] = pull_secrets(shape)
    if shape.affinity:
        body["affinity"] = copy.deepcopy(shape.affinity)
    if shape.topology_spread_constraints:
        body["topologySpreadConstraints"] = copy.deepcopy(shape.topology_spread_constraints)
    if shape.priority_class_name:
        body["priorityClassName"] = shape.priority_class_name


def _vllm_container(owner: Mapping[str, Any], spec: InferenceDeploymentSpec, plan: Plan, index: int,
                    container: Obj, options: BuildOptions) -> None:
    """engine vllm: the agent supervises vLLM started with the plan's arguments (`shardwise.vllm`), from the
    spec's image (the operator's --agent-image has no vLLM)."""
    name, namespace = owner["metadata"]["name"], owner["metadata"]["namespace"]
    leader = f"{pod_name(name, 0)}.{names(name)['headless']}.{namespace}.svc"
    command = vllm.pod_command(spec, plan, index, served_name=served_name(owner, spec), leader=leader)
    container["command"] = ["shardwise", "agent", "--engine", "vllm", "--"]
    container["args"] = list(command.args)
    container["env"] += [{"name": k, "value": v} for k, v in sorted(command.env.items())]
    container["env"].append({"name": "SHARDWISE_ENGINE", "value": "vllm"})
    key = spec.runtime.api_key_secret
    if key is not None:
        container["env"].append({"name": "VLLM_API_KEY",
                                 "valueFrom": {"secretKeyRef": {"name": key.name, "key": key.key}}})
    # the agent answers /healthz from what it knows, but on a busy node a reply can miss one 2 s deadline
    container["readinessProbe"]["failureThreshold"] = 3
    container["ports"] += [{"name": "vllm-rpc", "containerPort": vllm.RPC_PORT},
                           {"name": "vllm-master", "containerPort": vllm.MASTER_PORT}]


INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
EPP_PORT = 9002  # the Gateway API Inference Extension's endpoint picker (ext-proc) port


def build_inference_pool(owner: Mapping[str, Any], options: BuildOptions = BuildOptions()) -> Obj:
    """An InferencePool of the pods that lead DPA groups (port 8000), for a gateway whose endpoint picker chooses
    among them; a pod that leaves in a scale-down is relabelled `leaving` first, so it drops out of the pool."""
    name = owner["metadata"]["name"]
    picker, _, port = (options.endpoint_picker or f"{name}-epp:{EPP_PORT}").partition(":")
    return {"apiVersion": INFERENCE_POOL_API, "kind": "InferencePool",
            "metadata": _meta(owner, name, "inference-pool"),
            "spec": {"selector": {"matchLabels": {**selector(name), LABEL_ROLE: "leader"}},
                     "targetPorts": [{"number": HTTP_PORT}],
                     "endpointPickerRef": {"name": picker, "port": {"number": int(port or EPP_PORT)},
                                           "failureMode": "FailOpen"}}}


GATEWAY_NAMESPACE_LABEL = "shardwise.io/gateway"  # namespaces (labelled by an admin) whose pods may call leaders


def build_network_policy(owner: Mapping[str, Any], options: BuildOptions) -> Obj:
    """Ingress to the worker pods: every port from the deployment's own workers (rendezvous, collectives), the
    OpenAI port from its router and from namespaces an admin labels `shardwise.io/gateway: "true"` (a Gateway
    API gateway's), the agents' gRPC and HTTP from the operator's pods in its namespace, and metrics from
    anywhere (Prometheus). Nothing else reaches them: another tenant's pod cannot abort requests, read
    statistics or join the rendezvous store."""
    name = owner["metadata"]["name"]
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": options.network_policy_namespace}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator",
                                                "app.kubernetes.io/part-of": "shardwise"}}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(owner, names(name)["network_policy"], "network-policy"),
            "spec": {"podSelector": {"matchLabels": selector(name)}, "policyTypes": ["Ingress"], "ingress": [
                {"from": [{"podSelector": {"matchLabels": selector(name)}}]},
                {"from": [{"podSelector": {"matchLabels": router_selector(name)}},
                          {"namespaceSelector": {"matchLabels": {GATEWAY_NAMESPACE_LABEL: "true"}}}],
                 "ports": [{"protocol": "TCP", "port": HTTP_PORT}]},
                {"from": [operator], "ports": [{"protocol": "TCP", "port": GRPC_PORT},
                                               {"protocol": "TCP", "port": HTTP_PORT}]},
                {"ports": [{"protocol": "TCP", "port": METRICS_PORT}]},
            ]}}
