"""The operator's Kubernetes client: plain dicts over the official client's transport (kubeconfig or in-cluster
auth, TLS), with a count of the requests made (the benchmark reports requests per reconcile)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping, MutableSet
from typing import Any, Protocol
from urllib.parse import quote, urlencode

import urllib3
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


class Reader(Protocol):
    """The objects of one kind that a cache holds (operator/cache.py's Informer)."""

    def get(self, namespace: str, name: str) -> Obj | None: ...

    def list(self, namespace: str, selector: str) -> list[Obj]: ...


class ReadCache(Protocol):
    """Where `Kube` reads from before asking the API (operator/cache.py's Cache)."""

    def reader(self, kind: str, namespace: str) -> Reader | None: ...

    def observe(self, obj: Obj | None) -> None: ...


class KubeError(Exception):
    """An API request that failed: its HTTP status (0: no answer, the API server unreachable) and reason."""

    def __init__(self, status: int, reason: str, body: Any = None) -> None:
        super().__init__(f"{status} {reason}" if status else reason)
        self.status, self.reason, self.body = status, reason, body

    @property
    def unavailable(self) -> bool:
        """The API server did not answer, or answered that it cannot now (429, 5xx): worth a later try."""
        return self.status == 0 or self.status == 429 or self.status >= 500


def load_config(kubeconfig: str | None = None) -> client.Configuration:
    """The kubeconfig named (or $KUBECONFIG / ~/.kube/config), else the pod's service account."""
    conf = client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path or os.path.exists(os.path.expanduser("~/.kube/config")):
        config.load_kube_config(config_file=path, client_configuration=conf)
    else:
        config.load_incluster_config(client_configuration=conf)
    return conf


def bearer_token(conf: client.Configuration) -> str | None:
    """The bearer token a configuration sends, without its scheme, read afresh.

    The client keeps it as `api_key["authorization"]`: `Bearer <token>` from a kubeconfig, `bearer <token>` (lower
    case) from the in-cluster loader, or the bare token with the scheme in `api_key_prefix`. The in-cluster loader's
    refresh hook reads the ServiceAccount's token file again once its copy is older than a minute, so a bound token
    that the kubelet rotated is picked up."""
    if conf.refresh_api_key_hook is not None:
        conf.refresh_api_key_hook(conf)
    keys = conf.api_key or {}
    raw = str(keys.get("authorization") or keys.get("BearerToken") or "").strip()
    scheme, _, rest = raw.partition(" ")
    if rest and scheme.lower() == "bearer":
        return rest.strip() or None
    return raw or None


def path(kind: str, namespace: str, name: str = "", subresource: str = "") -> str:
    """The URL path of a namespaced kind's objects in `namespace` (every namespace when it is empty), of one
    object, or of its subresource."""
    prefix, plural = PATHS[kind]
    out = f"{prefix}/namespaces/{quote(namespace)}/{plural}" if namespace else f"{prefix}/{plural}"
    if name:
        out += f"/{quote(name)}"
    if subresource:
        out += f"/{subresource}"
    return out


class Kube:
    """The API, with reads of the kinds a `Cache` holds answered from it once it has listed (see operator/cache.py);
    `requests` counts what reached the API server, `discovery` the part that only asked which APIs it serves."""

    def __init__(self, configuration: client.Configuration) -> None:
        self.api = client.ApiClient(configuration)
        self.requests = 0
        self.discovery = 0  # of those, what asked whether an API is served (no object read or written)
        self.cache: ReadCache | None = None
        self._lock = threading.Lock()

    def _call(self, method: str, url_path: str, body: Any = None, *, query: Mapping[str, str] | None = None,
              content_type: str = JSON, timeout: float | tuple[float, float] = 30) -> Any:
        """Send one request; the response's body is not read yet."""
        with self._lock:
            self.requests += 1
            self.discovery += _is_discovery(url_path)
        full = url_path + ("?" + urlencode(dict(query)) if query else "")
        method_, url, headers, body_, _ = self.api.param_serialize(
            method, full, header_params={"Accept": JSON, "Content-Type": content_type}, body=body,
            auth_settings=["BearerToken"])
        try:
            return self.api.call_api(method_, url, header_params=headers, body=body_, _request_timeout=timeout)
        except ApiException as e:
            raise KubeError(e.status or 0, e.reason or "", _json(e.body)) from e
        except urllib3.exceptions.HTTPError as e:  # refused, reset, timed out: no answer at all
            raise KubeError(0, f"the API server did not answer {method} {url_path}: {_cause(e)}") from e

    def request(self, method: str, url_path: str, body: Any = None, *, query: Mapping[str, str] | None = None,
                content_type: str = JSON, timeout: float = 30) -> Any:
        response = self._call(method, url_path, body, query=query, content_type=content_type, timeout=timeout)
        try:
            response.read()
        except ApiException as e:
            raise KubeError(e.status or 0, e.reason or "", _json(e.body)) from e
        data = _json(response.data)
        if not 200 <= response.status < 300:
            message = data.get("message", "") if isinstance(data, dict) else ""
            raise KubeError(response.status, message or str(response.reason), data)
        return data

    def list_all(self, kind: str, namespace: str, selector: str = "") -> tuple[list[Obj], int]:
        """Every object of `kind` in `namespace` (every namespace when empty) matching `selector`, from the API,
        with the list's resourceVersion (where a watch of what follows starts)."""
        out = self.request("GET", path(kind, namespace), query={"labelSelector": selector} if selector else None)
        return list(out.get("items") or []), int((out.get("metadata") or {}).get("resourceVersion") or 0)

    def watch(self, kind: str, namespace: str, selector: str, since: int, timeout_s: int,
              streams: MutableSet[Any] | None = None, on_open: Callable[[], None] | None = None) -> Iterator[Obj]:
        """The watch events of `kind` after resourceVersion `since` (bookmarks included) until the server ends the
        stream (after `timeout_s`); `streams` holds the response while it is read, for another thread to shut;
        `on_open` is called once the server has accepted the watch."""
        query = {"watch": "true", "resourceVersion": str(since), "allowWatchBookmarks": "true",
                 "timeoutSeconds": str(timeout_s)}
        if selector:
            query["labelSelector"] = selector
        response = self._call("GET", path(kind, namespace), query=query, timeout=(10.0, timeout_s + 30.0))
        raw = response.response
        if not 200 <= response.status < 300:
            data = _json(raw.data)
            raise KubeError(response.status, (data.get("message") if isinstance(data, dict) else "") or "", data)
        if streams is not None:
            streams.add(raw)
        if on_open is not None:
            on_open()
        try:
            for line in raw:
                if line.strip():
                    yield json.loads(line)
        finally:
            if streams is not None:
                streams.discard(raw)
            raw.release_conn()

    # ------------------------------------------------------------------------------------ shorthands
    def get(self, kind: str, namespace: str, name: str, timeout: float = 30, *, cached: bool = True) -> Obj | None:
        """The object, from the cache where it holds the kind (unless `cached` is False), else from the API."""
        reader = self.cache.reader(kind, namespace) if self.cache is not None and cached else None
        if reader is not None:
            return reader.get(namespace, name)
        try:
            return self.request("GET", path(kind, namespace, name), timeout=timeout)  # type: ignore[no-any-return]
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, selector: str = "") -> list[Obj]:
        reader = self.cache.reader(kind, namespace) if self.cache is not None else None
        if reader is not None:
            return reader.list(namespace, selector)
        return self.list_all(kind, namespace, selector)[0]

    def create(self, obj: Obj) -> Obj | None:
        """Create; None when it already exists (a restarted operator re-creates nothing)."""
        try:
            created: Obj = self.request("POST", path(obj["kind"], obj["metadata"]["namespace"]), obj)
        except KubeError as e:
            if e.status == 409:
                return None
            raise
        self._observe(created, obj["kind"])
        return created

    def patch(self, kind: str, namespace: str, name: str, body: Obj, subresource: str = "") -> Obj:
        patched: Obj = self.request("PATCH", path(kind, namespace, name, subresource), body, content_type=MERGE)
        self._observe(patched, kind)
        return patched

    def _observe(self, answer: Any, kind: str) -> None:
        """What the API answered a write with goes into the cache at once (a step reads its own writes)."""
        if self.cache is not None and isinstance(answer, dict) and answer.get("metadata"):
            answer.setdefault("kind", kind)
            self.cache.observe(answer)

    def delete(self, kind: str, namespace: str, name: str, *, grace: int | None = None,
               uid: str | None = None) -> bool:
        body: Obj = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            answer = self.request("DELETE", path(kind, namespace, name), body)
            if isinstance(answer, dict) and answer.get("kind") == kind:  # graceful: the object, now deleting
                self._observe(answer, kind)
            return True
        except KubeError as e:
            if e.status in (404, 409):
                return False
            raise

    def close(self) -> None:
        self.api.close()


def _cause(e: BaseException) -> str:
    """The innermost reason of a urllib3 error, in a few words (`Connection refused`, `timed out`)."""
    inner: BaseException = e
    while getattr(inner, "reason", None) is not None and isinstance(inner.reason, BaseException):  # type: ignore[attr-defined]
        inner = inner.reason  # type: ignore[attr-defined]
    text = str(inner)
    return text.rsplit(": ", 1)[-1] if ": " in text else text or type(inner).__name__


def _is_discovery(url_path: str) -> bool:
    """`/api`, `/apis`, `/api/v1`, `/apis/GROUP` or `/apis/GROUP/VERSION`: which APIs are served, no object."""
    parts = url_path.strip("/").split("/")
    return parts[0] in ("api", "apis") and len(parts) <= (2 if parts[0] == "api" else 3)


def _json(data: Any) -> Any:
    if not data:
        return {}
    try:
        return json.loads(data)
    except (TypeError, ValueError):
        return {"message": data.decode(errors="replace") if isinstance(data, bytes) else str(data)}
