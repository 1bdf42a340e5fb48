"""The OpenAPI v3 documents kubectl reads before it writes (`/openapi/v3` and `/openapi/v3/<group-version>`).

`kubectl apply` and `kubectl create` validate by default (`--validate=strict`): kubectl first asks the server's
OpenAPI v3 document of the object's group-version whether its PATCH operation takes the `fieldValidation` query
parameter. If it does, kubectl leaves validation to the server (`fieldValidation=Strict`, which apiserver.py honours
for custom resources and CRDs); if no document answers, it downloads the OpenAPI v2 schema to validate on its own
side, and with neither it fails: `error validating data: failed to download openapi`. A real API server always
publishes these documents, so the README's `kubectl apply -f examples/tiny-moe.yaml` has to work here as typed.

What is published: the index of group-versions, and for each one its paths (collection, object, and each
subresource) with their operations, each naming its `x-kubernetes-group-version-kind` and the query parameters the
server takes (`fieldValidation`, `fieldManager`, `dryRun`, `force`). The component schemas are open objects (no
field list): kubectl needs the operations to choose server-side validation, and the server does the validating.
A custom resource's group-version appears as soon as its CRD is served.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import kmock

from .resources import ServedResource

PREFIX = "/openapi/v3"
_WRITE_PARAMS = ("fieldValidation", "fieldManager", "dryRun")


def group_version_path(resource: kmock.resource) -> str:
    """`api/v1` or `apis/GROUP/VERSION`: the key of the group-version in the index."""
    return f"apis/{resource.group}/{resource.version}" if resource.group else f"api/{resource.version}"


def _param(name: str, where: str = "query") -> dict[str, Any]:
    return {"name": name, "in": where, "required": where == "path", "schema": {"type": "string", "uniqueItems": True}}


def _operation(verb: str, kind: dict[str, str], params: Iterable[str], action: str) -> dict[str, Any]:
    schema = {"type": "object"}
    op: dict[str, Any] = {
        "operationId": f"{action}{kind['kind']}", "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": kind, "parameters": [_param(p) for p in params],
        "responses": {"200": {"description": "OK", "content": {"application/json": {"schema": schema}}}},
    }
    if verb in ("post", "put", "patch"):
        types = ["application/json"] if verb != "patch" else [
            "application/json-patch+json", "application/merge-patch+json", "application/strategic-merge-patch+json",
            "application/apply-patch+yaml"]
        op["requestBody"] = {"content": {t: {"schema": schema} for t in types}}
    return op


def document(served: Iterable[tuple[kmock.resource, ServedResource]]) -> dict[str, Any]:
    """The OpenAPI v3 document of one group-version's resources."""
    paths: dict[str, Any] = {}
    for resource, info in served:
        gvk = {"group": str(resource.group or ""), "version": str(resource.version), "kind": str(info.kind)}
        root = f"/{group_version_path(resource)}"
        base = f"{root}/namespaces/{{namespace}}/{resource.plural}" if info.namespaced else f"{root}/{resource.plural}"
        scope = [_param("namespace", "path")] if info.namespaced else []
        write = [*_WRITE_PARAMS]
        paths[base] = {
            "parameters": scope,
            "get": _operation("get", gvk, ("labelSelector", "fieldSelector", "limit", "continue", "watch",
                                           "resourceVersion", "timeoutSeconds"), "list"),
            "post": _operation("post", gvk, write, "post"),
            "delete": _operation("delete", gvk, ("labelSelector", "fieldSelector", *write), "deletecollection"),
        }
        item = {"parameters": [*scope, _param("name", "path")],
                "get": _operation("get", gvk, (), "get"),
                "put": _operation("put", gvk, write, "put"),
                "patch": _operation("patch", gvk, (*write, "force"), "patch"),
                "delete": _operation("delete", gvk, ("dryRun", "gracePeriodSeconds", "propagationPolicy"), "delete")}
        paths[f"{base}/{{name}}"] = item
        for sub in sorted(info.subresources):
            sub_gvk = {"group": "autoscaling", "version": "v1", "kind": "Scale"} if sub == "scale" else gvk
            paths[f"{base}/{{name}}/{sub}"] = {
                "parameters": item["parameters"],
                "get": _operation("get", sub_gvk, (), "get"),
                "put": _operation("put", sub_gvk, write, "put"),
                "patch": _operation("patch", sub_gvk, (*write, "force"), "patch"),
            }
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.32.0"}, "paths": paths,
            "components": {"schemas": {}}}


def _hash(doc: dict[str, Any]) -> str:
    return hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32].upper()


def serve(path: str, served: list[tuple[kmock.resource, ServedResource]]) -> dict[str, Any] | None:
    """The answer to GET `path` (under PREFIX): the index, one group-version's document, or None (404)."""
    groups: dict[str, list[tuple[kmock.resource, ServedResource]]] = {}
    for resource, info in served:
        groups.setdefault(group_version_path(resource), []).append((resource, info))
    rest = path[len(PREFIX):].strip("/")
    if not rest:
        return {"paths": {gv: {"serverRelativeURL": f"{PREFIX}/{gv}?hash={_hash(document(items))}"}
                          for gv, items in sorted(groups.items())}}
    if rest not in groups:
        return None
    return document(sorted(groups[rest], key=lambda item: str(item[0].plural)))
