"""`shardwise dev install-chart`: the Helm chart's operator installed on the local cluster as `helm install` would
install it, so that it runs in-cluster: as the chart's Deployment (the local Deployment controller makes its pod),
with its ServiceAccount's token mounted by the kubelet and only the RBAC the chart grants (the local API server
authorizes a ServiceAccount by RBAC: a missing grant fails as on a real cluster).

The chart is rendered by Helm's own engine (helm-python-sdk, offline: `lookup` finds nothing) with values suited
to the local cluster (`local_values`), under the user's `--set` expressions (Helm's syntax); then, with kubectl and
the cluster's kubeconfig (the admin), in Helm's order: the release namespace (`--create-namespace`), the CRDs of
the chart's crds/ when absent (Helm never upgrades them), then every rendered object (kubectl apply: running it
again upgrades), ordered by kind as Helm installs them and annotated with the release as Helm annotates them. No
release Secret is written: `helm` itself does not know of this install.

The local values: the admission webhook off (the local API server calls no admission webhooks, and serves no
ValidatingWebhookConfiguration), NetworkPolicies on (they are stored and owned, not enforced), and the operator's
health, metrics and webhook ports drawn free on this machine (a process-backed pod listens on the machine's
addresses, where the chart's fixed 8080 and 9090 may be taken). The image is not pulled: the container's command,
`shardwise operator ...`, runs from this installation.
"""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "charts" / "shardwise"
RELEASE = "shardwise"
NAMESPACE = "shardwise-system"
#: the order Helm installs kinds in (releaseutil.InstallOrder); others come after, in the order rendered
INSTALL_ORDER = (
    "PriorityClass", "Namespace", "NetworkPolicy", "ResourceQuota", "LimitRange", "PodSecurityPolicy",
    "PodDisruptionBudget", "ServiceAccount", "Secret", "SecretList", "ConfigMap", "StorageClass", "PersistentVolume",
    "PersistentVolumeClaim", "CustomResourceDefinition", "ClusterRole", "ClusterRoleList", "ClusterRoleBinding",
    "ClusterRoleBindingList", "Role", "RoleList", "RoleBinding", "RoleBindingList", "Service", "DaemonSet", "Pod",
    "ReplicationController", "ReplicaSet", "Deployment", "HorizontalPodAutoscaler", "StatefulSet", "Job", "CronJob",
    "IngressClass", "Ingress", "APIService", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
)

Obj = dict[str, Any]
Kubectl = Callable[..., str]


class ChartError(Exception):
    """The chart cannot be rendered or installed (the message says why)."""


@dataclass(frozen=True)
class Installed:
    crds: list[str]  # the CRDs created (empty: they were there)
    objects: list[str]  # KIND/NAME of every object applied, in order
    deployment: str  # the operator's Deployment
    namespace: str


def free_ports(count: int) -> list[int]:
    """`count` distinct ports free on every address of this machine now (held together while drawn)."""
    with contextlib.ExitStack() as held:
        probes = [held.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("0.0.0.0", 0))
        return [int(probe.getsockname()[1]) for probe in probes]


def local_values() -> Obj:
    """The values that suit the local cluster (see the module docstring); the user's --set win over them."""
    health, metrics, webhook = free_ports(3)
    return {"webhook": {"enabled": False}, "networkPolicy": {"enabled": True},
            "ports": {"health": health, "metrics": metrics, "webhook": webhook}}


def merged(base: Mapping[str, Any], override: Mapping[str, Any]) -> Obj:
    """`override` deep-merged over `base` (maps merged key by key, anything else replaced), as Helm merges values."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def values(sets: Sequence[str]) -> Obj:
    """The local values under the user's `--set` expressions (Helm's own parser: `a.b=c`, `list={x,y}`, ...)."""
    helm = _helm()
    out = local_values()
    for expression in sets:
        try:
            out = merged(out, helm.parse_set_string(expression))
        except helm.HelmError as e:
            raise ChartError(f"--set {expression}: {e}") from e
    return out


def render(chart: Path, chart_values: Mapping[str, Any], *, release: str,
           namespace: str) -> tuple[list[Obj], list[Obj]]:
    """The chart's CRDs (crds/) and its rendered objects (in Helm's install order, annotated with the release)."""
    helm = _helm()
    if not (chart / "Chart.yaml").is_file():
        raise ChartError(f"no chart at {chart} (its Chart.yaml is missing)")
    try:
        with helm.Chart.load(chart) as loaded:
            loaded.validate_schema(dict(chart_values))
            crds = [doc for crd in loaded.crds for doc in yaml.safe_load_all(crd["data"]) if doc]
            files = loaded.render(dict(chart_values), name=release, namespace=namespace, is_install=True)
    except helm.HelmError as e:
        raise ChartError(str(e)) from e
    rendered = [doc for path, text in sorted(files.items()) if not path.endswith("NOTES.txt")
                for doc in yaml.safe_load_all(text) if doc]
    rank = {kind: i for i, kind in enumerate(INSTALL_ORDER)}
    rendered.sort(key=lambda obj: rank.get(obj.get("kind", ""), len(rank)))  # stable: template order within a kind
    for obj in rendered:
        annotations = obj.setdefault("metadata", {}).setdefault("annotations", None) or {}
        obj["metadata"]["annotations"] = {**annotations, "meta.helm.sh/release-name": release,
                                          "meta.helm.sh/release-namespace": namespace}
    return crds, rendered


def install(kubectl: Kubectl, *, chart: Path = CHART, release: str = RELEASE, namespace: str = NAMESPACE,
            sets: Sequence[str] = ()) -> Installed:
    """Render and apply the chart (see the module docstring). `kubectl(*args, input=...)` runs kubectl against the
    cluster and returns its stdout, raising ChartError when it fails."""
    crds, rendered = render(chart, values(sets), release=release, namespace=namespace)
    created = []
    for crd in crds:
        name = crd["metadata"]["name"]
        if not kubectl("get", "customresourcedefinition", name, "--ignore-not-found", "-o", "name").strip():
            kubectl("create", "-f", "-", input=json.dumps(crd))
            created.append(name)
    if crds:
        kubectl("wait", "--for=condition=Established", "--timeout=60s",
                *[f"customresourcedefinition/{crd['metadata']['name']}" for crd in crds])
    namespace_doc = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    if not kubectl("get", "namespace", namespace, "--ignore-not-found", "-o", "name").strip():
        kubectl("create", "-f", "-", input=json.dumps(namespace_doc))
    kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump_all(rendered))
    deployments = [obj["metadata"]["name"] for obj in rendered if obj.get("kind") == "Deployment"]
    if len(deployments) != 1:
        raise ChartError(f"the chart rendered {len(deployments)} Deployments, not the operator's one")
    return Installed(crds=created, objects=[f"{obj['kind']}/{obj['metadata']['name']}" for obj in rendered],
                     deployment=deployments[0], namespace=namespace)


def kubectl_runner(kubeconfig: Path, *, timeout: float = 120) -> Kubectl:
    """kubectl against the cluster of a kubeconfig; ChartError with its message when it fails."""

    def run(*args: str, input: str | None = None) -> str:
        done = subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig), *args], capture_output=True, text=True,
                              input=input, timeout=timeout, check=False)
        if done.returncode:
            raise ChartError(f"kubectl {' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    return run


def _helm() -> Any:
    try:
        import helm_python
    except ImportError as e:
        raise ChartError("rendering the chart needs helm-python-sdk (in the dev extra: pip install -e '.[dev]')") \
            from e
    return helm_python
