"""The resources the local API server serves: the built-in kinds the project and its tools use, and the custom
resources that applied CRDs declare.

Each served resource is a key `kmock.resource(group, version, plural)` and a `ServedResource`, kmock's discovery
record (`kmock.ResourceInfo`: kind, singular, short names, categories, verbs, subresources) extended with what the
emulator's semantics need: the list kind, where a scale subresource reads and writes its replicas, whether the
kind is built in (only built-in kinds take strategic-merge patches, as in Kubernetes), a CRD version's printer
columns (tables.py) and its CEL validation rules (validation.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import attrs
import kmock

from .validation import Rule, rules_of

VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True)
class ScalePaths:
    """Where the scale subresource maps `spec.replicas`, `status.replicas` and `status.selector` (dotted paths,
    as in a CRD's `subresources.scale`)."""

    spec_replicas: str
    status_replicas: str
    label_selector: str | None = None


@attrs.define(repr=False, kw_only=True)
class ServedResource(kmock.ResourceInfo):
    list_kind: str = ""
    scale: ScalePaths | None = None
    builtin: bool = False
    printer_columns: tuple[dict[str, Any], ...] = ()  # a CRD version's additionalPrinterColumns (tables.py)
    validations: tuple[Rule, ...] = ()  # a CRD version's x-kubernetes-validations (validation.py)

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources


def api_version(resource: kmock.resource) -> str:
    """`v1` for the core group, `group/version` otherwise."""
    return f"{resource.group}/{resource.version}" if resource.group else str(resource.version)


def _builtin(group_version: str, plural: str, kind: str, *, namespaced: bool = True, short: tuple[str, ...] = (),
             status: bool = False, scale: ScalePaths | None = None) -> tuple[kmock.resource, ServedResource]:
    group, _, version = group_version.rpartition("/")
    subresources = {"status"} if status else set()
    if scale is not None:
        subresources.add("scale")
    info = ServedResource(kind=kind, list_kind=f"{kind}List", singular=kind.lower(), namespaced=namespaced,
                          verbs=set(VERBS), shortnames=set(short), subresources=subresources, scale=scale,
                          builtin=True)
    return kmock.resource(group, version, plural), info


_REPLICAS = ScalePaths(".spec.replicas", ".status.replicas")

# The kinds the operator, its chart, kubectl and kopf touch. Storage only: no controller runs behind them.
BUILTINS: tuple[tuple[kmock.resource, ServedResource], ...] = (
    _builtin("v1", "namespaces", "Namespace", namespaced=False, short=("ns",), status=True),
    _builtin("v1", "nodes", "Node", namespaced=False, short=("no",), status=True),
    _builtin("v1", "pods", "Pod", short=("po",), status=True),
    _builtin("v1", "services", "Service", short=("svc",), status=True),
    _builtin("v1", "endpoints", "Endpoints", short=("ep",)),
    _builtin("v1", "configmaps", "ConfigMap", short=("cm",)),
    _builtin("v1", "secrets", "Secret"),
    _builtin("v1", "serviceaccounts", "ServiceAccount", short=("sa",)),
    _builtin("v1", "events", "Event", short=("ev",)),
    _builtin("apps/v1", "deployments", "Deployment", short=("deploy",), status=True, scale=_REPLICAS),
    _builtin("apps/v1", "statefulsets", "StatefulSet", short=("sts",), status=True, scale=_REPLICAS),
    _builtin("apps/v1", "replicasets", "ReplicaSet", short=("rs",), status=True, scale=_REPLICAS),
    _builtin("apps/v1", "daemonsets", "DaemonSet", short=("ds",), status=True),
    _builtin("coordination.k8s.io/v1", "leases", "Lease"),
    _builtin("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", short=("pdb",), status=True),
    _builtin("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy", short=("netpol",)),
    _builtin("apiextensions.k8s.io/v1", "customresourcedefinitions", "CustomResourceDefinition",
             namespaced=False, short=("crd", "crds"), status=True),
    _builtin("rbac.authorization.k8s.io/v1", "roles", "Role"),
    _builtin("rbac.authorization.k8s.io/v1", "rolebindings", "RoleBinding"),
    _builtin("rbac.authorization.k8s.io/v1", "clusterroles", "ClusterRole", namespaced=False),
    _builtin("rbac.authorization.k8s.io/v1", "clusterrolebindings", "ClusterRoleBinding", namespaced=False),
)

CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES = kmock.resource("", "v1", "namespaces")
PODS = kmock.resource("", "v1", "pods")
SECRETS = kmock.resource("", "v1", "secrets")
SERVICEACCOUNTS = kmock.resource("", "v1", "serviceaccounts")
RBAC_GROUP = "rbac.authorization.k8s.io"


def from_crd(crd: Mapping[str, Any]) -> dict[kmock.resource, ServedResource]:
    """The resources a CRD serves: one per served version, with the version's status and scale subresources."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    served: dict[kmock.resource, ServedResource] = {}
    for version in spec.get("versions") or []:
        if not version.get("served", True):
            continue
        subresources = version.get("subresources") or {}
        scale = subresources.get("scale")
        info = ServedResource(
            kind=names.get("kind"), list_kind=names.get("listKind") or f"{names.get('kind')}List",
            singular=names.get("singular") or str(names.get("kind", "")).lower(),
            namespaced=spec.get("scope", "Namespaced") == "Namespaced", verbs=set(VERBS),
            shortnames=set(names.get("shortNames") or ()), categories=set(names.get("categories") or ()),
            subresources={name for name in ("status", "scale") if name in subresources},
            scale=None if scale is None else ScalePaths(scale["specReplicasPath"], scale["statusReplicasPath"],
                                                        scale.get("labelSelectorPath")),
            printer_columns=tuple(column for column in version.get("additionalPrinterColumns") or ()
                                  if isinstance(column, dict)),
            validations=rules_of((version.get("schema") or {}).get("openAPIV3Schema") or {}),
        )
        served[kmock.resource(spec.get("group"), version.get("name"), names.get("plural"))] = info
    return served


def discovery_entries(resource: kmock.resource, info: ServedResource) -> list[dict[str, Any]]:
    """The APIResourceList entries of one resource: itself, then its subresources (scale is autoscaling/v1)."""
    entries: list[dict[str, Any]] = [{
        "name": resource.plural, "singularName": info.singular, "namespaced": bool(info.namespaced),
        "kind": info.kind, "verbs": sorted(info.verbs), "shortNames": sorted(info.shortnames),
        "categories": sorted(info.categories),
    }]
    for sub in sorted(info.subresources):
        entry: dict[str, Any] = {"name": f"{resource.plural}/{sub}", "singularName": "",
                                 "namespaced": bool(info.namespaced), "kind": info.kind,
                                 "verbs": ["get", "patch", "update"]}
        if sub == "scale":
            entry.update(group="autoscaling", version="v1", kind="Scale")
        entries.append(entry)
    if resource == SERVICEACCOUNTS:  # the TokenRequest API (POST only; apiserver.py serves it)
        entries.append({"name": "serviceaccounts/token", "singularName": "", "namespaced": True,
                        "group": "authentication.k8s.io", "version": "v1", "kind": "TokenRequest",
                        "verbs": ["create"]})
    return entries
