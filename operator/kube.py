"""The operator's Kubernetes client: plain dicts over the official client's transport (kubeconfig or in-cluster
auth, TLS), with a count of the requests made (the benchmark reports requests per reconcile)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

Obj = dict[str, Any]
JSON = "application/json"
MERGE = "application/merge-patch+json"

# (group/version prefix, namespaced plural) of every kind the operator touches
PATHS = {
    "Pod": ("/api/v1", "pods"), "Service": ("/api/v1", "services"), "ConfigMap": ("/api/v1", "configmaps"),
    "Secret": ("/api/v1", "secrets"), "Event": ("/api/v1", "events"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "InferencePool": ("/apis/inference.networking.k8s.io/v1", "inferencepools"),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),
    "InferenceDeployment": ("/apis/shardwise.io/v1alpha1", "inferencedeployments"),
}


class KubeError(Exception):
    def __init__(self, status: int, reason: str, body: Any = None) -> None:
        super().__init__(f"{status} {reason}")
        self.status, self.reason, self.body = status, reason, body


def load_config(kubeconfig: str | None = None) -> client.Configuration:
    """The kubeconfig named (or $KUBECONFIG / ~/.kube/config), else the pod's service account."""
    conf = client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path or os.path.exists(os.path.expanduser("~/.kube/config")):
        config.load_kube_config(config_file=path, client_configuration=conf)
    else:
        config.load_incluster_config(client_configuration=conf)
    return conf


def path(kind: str, namespace: str, name: str = "", subresource: str = "") -> str:
    prefix, plural = PATHS[kind]
    out = f"{prefix}/namespaces/{quote(namespace)}/{plural}"
    if name:
        out += f"/{quote(name)}"
    if subresource:
        out += f"/{subresource}"
    return out


class Kube:
    def __init__(self, configuration: client.Configuration) -> None:
        self.api = client.ApiClient(configuration)
        self.requests = 0
        self._lock = threading.Lock()

    def request(self, method: str, url_path: str, body: Any = None, *, query: Mapping[str, str] | None = None,
                content_type: str = JSON, timeout: float = 30) -> Any:
        with self._lock:
            self.requests += 1
        full = url_path + ("?" + urlencode(dict(query)) if query else "")
        method_, url, headers, body_, _ = self.api.param_serialize(
            method, full, header_params={"Accept": JSON, "Content-Type": content_type}, body=body,
            auth_settings=["BearerToken"])
        try:
            response = self.api.call_api(method_, url, header_params=headers, body=body_, _request_timeout=timeout)
            response.read()
        except ApiException as e:
            raise KubeError(e.status or 0, e.reason or "", _json(e.body)) from e
        data = _json(response.data)
        if not 200 <= response.status < 300:
            message = data.get("message", "") if isinstance(data, dict) else ""
            raise KubeError(response.status, message or str(response.reason), data)
        return data

    # ------------------------------------------------------------------------------------ shorthands
    def get(self, kind: str, namespace: str, name: str, timeout: float = 30) -> Obj | None:
        try:
            return self.request("GET", path(kind, namespace, name), timeout=timeout)  # type: ignore[no-any-return]
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, selector: str = "") -> list[Obj]:
        out = self.request("GET", path(kind, namespace), query={"labelSelector": selector} if selector else None)
        return list(out.get("items") or [])

    def create(self, obj: Obj) -> Obj | None:
        """Create; None when it already exists (a restarted operator re-creates nothing)."""
        try:
            return self.request("POST", path(obj["kind"], obj["metadata"]["namespace"]), obj)  # type: ignore
        except KubeError as e:
            if e.status == 409:
                return None
            raise

    def patch(self, kind: str, namespace: str, name: str, body: Obj, subresource: str = "") -> Obj:
        return self.request("PATCH", path(kind, namespace, name, subresource), body,  # type: ignore[no-any-return]
                            content_type=MERGE)

    def delete(self, kind: str, namespace: str, name: str, *, grace: int | None = None,
               uid: str | None = None) -> bool:
        body: Obj = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self.request("DELETE", path(kind, namespace, name), body)
            return True
        except KubeError as e:
            if e.status in (404, 409):
                return False
            raise

    def close(self) -> None:
        self.api.close()


def _json(data: Any) -> Any:
    if not data:
        return {}
    try:
        return json.loads(data)
    except (TypeError, ValueError):
        return {"message": data.decode(errors="replace") if isinstance(data, bytes) else str(data)}
