"""A container's environment and command line as a kubelet builds them, from the pod, its IP and the ConfigMaps
and Secrets it names (fetched by the caller). Pure functions.

- `envFrom` (ConfigMaps and Secrets, with a prefix) first, then `env` in order, later names winning.
- `env[].valueFrom`: `fieldRef` (the downward API: `metadata.name`, `metadata.namespace`, `metadata.uid`,
  `metadata.labels['KEY']`, `metadata.annotations['KEY']`, `spec.nodeName`, `spec.serviceAccountName`,
  `status.podIP`, `status.podIPs`, `status.hostIP`, `status.hostIPs`), `resourceFieldRef` (a container's
  requests or limits of cpu, memory or ephemeral-storage over a divisor, rounded up; an unset limit reads as the
  node's allocatable), `configMapKeyRef` and `secretKeyRef` (a missing one fails the container's start with
  `CreateContainerConfigError` unless `optional`).
- `$(NAME)` in a value, a command or an argument is replaced by an earlier variable (or a service link variable,
  which the caller passes); an unknown reference stays as written and `$$` is a literal `$`.
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Mapping
from typing import Any

from shardwise.api import parse_quantity

Obj = Mapping[str, Any]
Data = Mapping[str, str]

_SUBSCRIPT = re.compile(r"metadata\.(labels|annotations)\['([^']*)'\]")
_REFERENCE = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


class EnvError(Exception):
    """The container's environment cannot be built (the kubelet reports CreateContainerConfigError)."""


def sources(container: Obj) -> tuple[set[str], set[str]]:
    """The names of the ConfigMaps and Secrets the container's environment reads."""
    configmaps: set[str] = set()
    secrets: set[str] = set()
    for item in container.get("envFrom") or []:
        if item.get("configMapRef"):
            configmaps.add(item["configMapRef"]["name"])
        if item.get("secretRef"):
            secrets.add(item["secretRef"]["name"])
    for var in container.get("env") or []:
        source = var.get("valueFrom") or {}
        if source.get("configMapKeyRef"):
            configmaps.add(source["configMapKeyRef"]["name"])
        if source.get("secretKeyRef"):
            secrets.add(source["secretKeyRef"]["name"])
    return configmaps, secrets


def configmap_data(obj: Obj | None) -> dict[str, str] | None:
    if obj is None:
        return None
    binary = {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("binaryData") or {}).items()}
    return {**binary, **(obj.get("data") or {})}


def secret_data(obj: Obj | None) -> dict[str, str] | None:
    if obj is None:
        return None
    return {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()}


def expand(text: str, env: Mapping[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "$"
        return env.get(name, match.group(0))

    return _REFERENCE.sub(replace, text)


def field_value(pod: Obj, path: str, *, pod_ip: str, host_ip: str) -> str:
    metadata, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    subscript = _SUBSCRIPT.fullmatch(path)
    if subscript:
        return str((metadata.get(subscript.group(1)) or {}).get(subscript.group(2), ""))
    values = {
        "metadata.name": metadata.get("name"), "metadata.namespace": metadata.get("namespace"),
        "metadata.uid": metadata.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName") or "default",
        "status.podIP": pod_ip, "status.podIPs": pod_ip, "status.hostIP": host_ip, "status.hostIPs": host_ip,
    }
    if path not in values:
        raise EnvError(f"unsupported fieldRef fieldPath {path!r}")
    return str(values[path] or "")


def resource_value(pod: Obj, container: Obj, ref: Obj, node_allocatable: Mapping[str, str]) -> str:
    name = ref.get("containerName") or container.get("name")
    target = next((c for c in (pod.get("spec") or {}).get("containers") or [] if c.get("name") == name), None)
    if target is None:
        raise EnvError(f"resourceFieldRef: no container named {name!r}")
    kind, _, resource = str(ref.get("resource", "")).partition(".")
    if kind not in ("limits", "requests") or resource not in ("cpu", "memory", "ephemeral-storage"):
        raise EnvError(f"unsupported resourceFieldRef resource {ref.get('resource')!r}")
    table = (target.get("resources") or {}).get(kind) or {}
    value = table.get(resource) or node_allocatable.get(resource) or "0"
    divisor = parse_quantity(ref.get("divisor") or "1")
    return str(math.ceil(parse_quantity(value) / divisor))


def _lookup(source: Obj, tables: Mapping[str, Data | None], what: str) -> str | None:
    data = tables.get(source.get("name", ""))
    key = source.get("key", "")
    if data is not None and key in data:
        return data[key]
    if source.get("optional"):
        return None
    missing = f"{what} {source.get('name')!r} not found" if data is None else f"key {key!r} not found in {what} " \
        f"{source.get('name')!r}"
    raise EnvError(missing)


def container_env(pod: Obj, container: Obj, *, pod_ip: str, host_ip: str, configmaps: Mapping[str, Data | None],
                  secrets: Mapping[str, Data | None], node_allocatable: Mapping[str, str],
                  services: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables the pod's spec gives the container (the caller adds them to the process's base environment
    and its service link variables, `services`, which values may reference but which are not returned)."""
    env: dict[str, str] = {}
    for item in container.get("envFrom") or []:
        ref, tables, what = ((item["configMapRef"], configmaps, "configmap") if item.get("configMapRef")
                             else (item.get("secretRef") or {}, secrets, "secret"))
        data = tables.get(ref.get("name", ""))
        if data is None and not ref.get("optional"):
            raise EnvError(f"{what} {ref.get('name')!r} not found")
        env.update({f"{item.get('prefix') or ''}{key}": value for key, value in (data or {}).items()})
    for var in container.get("env") or []:
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = expand(str(var.get("value") or ""), {**(services or {}), **env})
            continue
        value: str | None
        if source.get("fieldRef"):
            value = field_value(pod, source["fieldRef"].get("fieldPath", ""), pod_ip=pod_ip, host_ip=host_ip)
        elif source.get("resourceFieldRef"):
            value = resource_value(pod, container, source["resourceFieldRef"], node_allocatable)
        elif source.get("configMapKeyRef"):
            value = _lookup(source["configMapKeyRef"], configmaps, "configmap")
        elif source.get("secretKeyRef"):
            value = _lookup(source["secretKeyRef"], secrets, "secret")
        else:
            raise EnvError(f"env {var.get('name')!r}: unsupported valueFrom {sorted(source)}")
        if value is not None:
            env[var["name"]] = value
    return env


def command_line(container: Obj, env: Mapping[str, str]) -> list[str]:
    """`command` then `args`, with `$(NAME)` references expanded. An image's entrypoint is unknown here: a
    container without `command` cannot start."""
    if not container.get("command"):
        raise EnvError("the container has no command (images are not run here, so their entrypoints are unknown)")
    return [expand(str(part), env) for part in [*container["command"], *(container.get("args") or [])]]
