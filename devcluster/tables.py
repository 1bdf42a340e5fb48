"""Server-side printing: the `meta.k8s.io` Table that `kubectl get` asks for (`Accept: application/json;as=Table;
v=v1;g=meta.k8s.io`) and prints as it comes, so the columns are the server's.

- Custom resources: Name, then the served version's `additionalPrinterColumns` (a CRD that declares none gets Age).
  Their `jsonPath` is read in its simple forms (`.a.b.c`, `.a[0].b`, `.metadata.labels['x']`, a filter
  `.a[?(@.type=="X")].b` whose first match is shown); a missing value is
  an empty cell; `date` columns print as ages. Columns with `priority` > 0 show with `-o wide` only.
- Built-in kinds, as kubectl shows them from a real server: Pod (Name, Ready, Status, Restarts, Age; wide: IP,
  Node, Nominated Node, Readiness Gates), Node (Name, Status, Roles, Age, Version; wide: addresses and node info),
  Namespace (Status), ConfigMap (Data), Secret (Type, Data), ServiceAccount (Secrets), Deployment and StatefulSet
  (Ready), Event (Last Seen, Type, Reason, Object, Message), NetworkPolicy (Pod-Selector), PodDisruptionBudget
  (Min Available, Max Unavailable, Allowed Disruptions); every other kind Name and Age.
- Each row carries its object as the `includeObject` parameter asks: `Metadata` (the default, a
  PartialObjectMetadata), `Object` (the whole object) or `None`.
- Ages read as kubectl's: `119s`, then `2m30s` (under 10 minutes), `150m` (under 3 hours), `5h20m` (under 8
  hours), `30h` (under 2 days), `4d2h` (under 8 days), `30d` (under 2 years), `2y30d`.

On a watch, only the first event's Table carries the column definitions, as in Kubernetes.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

VERSIONS = ("v1", "v1beta1")
INCLUDE = ("Metadata", "Object", "None")
NONE = "<none>"

Cell = Callable[[Mapping[str, Any], datetime.datetime], Any]


@dataclasses.dataclass(frozen=True)
class Column:
    name: str
    cell: Cell
    type: str = "string"
    priority: int = 0
    format: str = ""
    description: str = ""

    def definition(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "format": self.format, "description": self.description,
                "priority": self.priority}


@dataclasses.dataclass(frozen=True)
class Printer:
    """How one request wants its Tables: the kind's columns, the Table's version, what each row carries."""

    columns: tuple[Column, ...]
    version: str
    include: str = "Metadata"

    def table(self, objects: Sequence[Mapping[str, Any]], *, now: datetime.datetime, headers: bool = True,
              metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return table(objects, self.columns, version=self.version, now=now, include=self.include, headers=headers,
                     metadata=metadata)


def wanted_version(accept: str | None) -> str | None:
    """The meta.k8s.io version of the Table the Accept header prefers, or None if it prefers plain JSON (an offer
    before any Table offer) or asks for no Table."""
    for offer in (accept or "").split(","):
        media, *options = (part.strip() for part in offer.split(";"))
        params = dict(option.partition("=")[::2] for option in options)
        if media not in ("application/json", "*/*"):
            continue
        if "as" not in params:
            return None
        if params["as"] == "Table" and params.get("g") == "meta.k8s.io" and params.get("v") in VERSIONS:
            return params["v"]
    return None


def table(objects: Sequence[Mapping[str, Any]], columns: Sequence[Column], *, version: str, now: datetime.datetime,
          include: str = "Metadata", headers: bool = True, metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The Table of these objects (one row each, in order)."""
    result: dict[str, Any] = {"kind": "Table", "apiVersion": f"meta.k8s.io/{version}",
                              "metadata": dict(metadata or {})}
    if headers:
        result["columnDefinitions"] = [column.definition() for column in columns]
    result["rows"] = [_row(obj, columns, version=version, now=now, include=include) for obj in objects]
    return result


def _row(obj: Mapping[str, Any], columns: Sequence[Column], *, version: str, now: datetime.datetime,
         include: str) -> dict[str, Any]:
    row: dict[str, Any] = {"cells": [column.cell(obj, now) for column in columns]}
    if include == "Object":
        row["object"] = obj
    elif include == "Metadata":
        row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": f"meta.k8s.io/{version}",
                         "metadata": obj.get("metadata") or {}}
    return row


def columns_for(kind: str, printer_columns: Sequence[Mapping[str, Any]] | None = None) -> tuple[Column, ...]:
    """The columns of a kind: a CRD version's printer columns when it declares them, else the built-in ones."""
    if printer_columns:
        return (NAME, *(_printer_column(spec) for spec in printer_columns))
    return BUILTIN_COLUMNS.get(kind, (NAME, AGE))


# -- ages -------------------------------------------------------------------------------------------------------


def human_duration(seconds: float) -> str:
    """A duration as kubectl prints ages: exact while short, coarser as it grows."""
    whole = int(seconds)
    if whole < -1:
        return "<invalid>"
    if whole < 0:
        return "0s"
    if whole < 120:
        return f"{whole}s"
    minutes, hours, days = whole // 60, whole // 3600, whole // 86400
    if minutes < 10:
        return _two(minutes, "m", whole % 60, "s")
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return _two(hours, "h", minutes % 60, "m")
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return _two(days, "d", hours % 24, "h")
    if hours < 24 * 365 * 2:
        return f"{days}d"
    if hours < 24 * 365 * 8:
        return _two(days // 365, "y", days % 365, "d")
    return f"{days // 365}y"


def _two(major: int, major_unit: str, minor: int, minor_unit: str) -> str:
    return f"{major}{major_unit}" + (f"{minor}{minor_unit}" if minor else "")


def parse_time(value: Any) -> datetime.datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.UTC)


def age(value: Any, now: datetime.datetime) -> str:
    """The age of an RFC 3339 timestamp: `<unknown>` when there is none, `<invalid>` when it does not parse."""
    if value in (None, ""):
        return "<unknown>"
    when = parse_time(value)
    return "<invalid>" if when is None else human_duration((now - when).total_seconds())


# -- CRD printer columns ----------------------------------------------------------------------------------------

_STEP = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]|\['([^']*)'\]|\[\"([^\"]*)\"\]"
                   r"|\[\?\(@\.([A-Za-z0-9_]+)\s*==\s*[\"']([^\"']*)[\"']\)\]")


def json_path(obj: Any, path: str) -> Any:
    """The value at a simple JSONPath (`.a.b`, `.a[0].b`, `.a['b.c']`, a filter `.a[?(@.type=="X")].b`, braces
    allowed); None when absent. ValueError for a path outside these forms."""
    text = path.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1].strip()
    text = text.removeprefix("$")
    value, position = obj, 0
    while position < len(text):
        step = _STEP.match(text, position)
        if step is None:
            raise ValueError(f"unsupported JSONPath {path!r}")
        position = step.end()
        key, index, quoted, double, field, wanted = step.groups()
        if field is not None:  # a filter keeps the matching items; a column shows the first, as Kubernetes does
            value = next((x for x in value if isinstance(x, Mapping) and str(x.get(field)) == wanted), None) \
                if isinstance(value, list) else None
        elif index is not None:
            value = value[int(index)] if isinstance(value, list) and int(index) < len(value) else None
        else:
            name = next(part for part in (key, quoted, double) if part is not None)
            value = value.get(name) if isinstance(value, Mapping) else None
        if value is None:
            return None
    return value


def _printer_column(spec: Mapping[str, Any]) -> Column:
    path, kind = str(spec.get("jsonPath", "")), str(spec.get("type", "string"))

    def cell(obj: Mapping[str, Any], now: datetime.datetime) -> Any:
        try:
            value = json_path(obj, path)
        except ValueError:
            return None
        return _typed(kind, value, now)

    return Column(name=str(spec.get("name", "")), cell=cell, type=kind, priority=int(spec.get("priority", 0)),
                  format=str(spec.get("format", "")), description=str(spec.get("description", "")))


def _typed(kind: str, value: Any, now: datetime.datetime) -> Any:
    """A printer column's cell: the value as its declared type, None when it is not of that type."""
    if value is None:
        return None
    if kind == "string":
        return _text(value)
    if kind == "integer":
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        return int(value) if is_number else None
    if kind == "number":
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
    if kind == "boolean":
        return value if isinstance(value, bool) else None
    if kind == "date":
        return age(value, now) if isinstance(value, str) else None
    return None


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return json.dumps(value, separators=(",", ":"))


# -- built-in kinds ---------------------------------------------------------------------------------------------


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("spec") or {}


def _status(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("status") or {}


def _or_none(value: Any) -> Any:
    return NONE if value in (None, "") else value


NAME = Column("Name", lambda obj, now: _meta(obj).get("name", ""), format="name",
              description="Name must be unique within a namespace.")
AGE = Column("Age", lambda obj, now: age(_meta(obj).get("creationTimestamp"), now),
             description="CreationTimestamp is a timestamp representing the server time when this object was "
                         "created.")


def pod_ready(pod: Mapping[str, Any]) -> str:
    statuses = _status(pod).get("containerStatuses") or []
    ready = sum(1 for s in statuses if s.get("ready") and "running" in (s.get("state") or {}))
    return f"{ready}/{len(_spec(pod).get('containers') or [])}"


def pod_restarts(pod: Mapping[str, Any], now: datetime.datetime) -> str:
    """Restarts of the pod's containers, with the age of the last one: `3 (42s ago)`."""
    statuses = _status(pod).get("containerStatuses") or []
    count = sum(int(s.get("restartCount") or 0) for s in statuses)
    finished = [parse_time(((s.get("lastState") or {}).get("terminated") or {}).get("finishedAt")) for s in statuses]
    last = max((when for when in finished if when is not None), default=None)
    if count and last is not None:
        return f"{count} ({human_duration((now - last).total_seconds())} ago)"
    return str(count)


def pod_status(pod: Mapping[str, Any]) -> str:
    """The STATUS kubectl shows: the phase, or what holds the pod (an init container, a waiting or terminated
    container's reason), or Terminating."""
    status = _status(pod)
    reason = status.get("reason") or status.get("phase") or "Unknown"
    initializing = _init_reason(pod)
    if initializing is not None:
        reason = initializing
    else:
        running = False
        for container in reversed(status.get("containerStatuses") or []):
            state = container.get("state") or {}
            waiting, terminated = state.get("waiting"), state.get("terminated")
            if waiting and waiting.get("reason"):
                reason = waiting["reason"]
            elif terminated is not None:
                reason = terminated.get("reason") or _exit(terminated)
            elif container.get("ready") and "running" in state:
                running = True
        if reason == "Completed" and running:
            reason = "Running"
    if _meta(pod).get("deletionTimestamp"):
        return "Unknown" if status.get("reason") == "NodeLost" else "Terminating"
    return str(reason)


def _init_reason(pod: Mapping[str, Any]) -> str | None:
    total = len(_spec(pod).get("initContainers") or [])
    for index, container in enumerate(_status(pod).get("initContainerStatuses") or []):
        state = container.get("state") or {}
        terminated, waiting = state.get("terminated"), state.get("waiting")
        if terminated is not None and terminated.get("exitCode") == 0:
            continue
        if terminated is not None:
            return "Init:" + (terminated.get("reason") or _exit(terminated))
        if waiting and waiting.get("reason") not in (None, "", "PodInitializing"):
            return f"Init:{waiting['reason']}"
        return f"Init:{index}/{total}"
    return None


def _exit(terminated: Mapping[str, Any]) -> str:
    signal = terminated.get("signal")
    return f"Signal:{signal}" if signal else f"ExitCode:{terminated.get('exitCode', 0)}"


def _readiness_gates(pod: Mapping[str, Any]) -> str:
    gates = [gate.get("conditionType") for gate in _spec(pod).get("readinessGates") or []]
    if not gates:
        return NONE
    true = {c.get("type") for c in _status(pod).get("conditions") or [] if c.get("status") == "True"}
    return f"{sum(1 for gate in gates if gate in true)}/{len(gates)}"


def node_status(node: Mapping[str, Any]) -> str:
    ready = next((c for c in _status(node).get("conditions") or [] if c.get("type") == "Ready"), None)
    state = "Unknown" if ready is None else "Ready" if ready.get("status") == "True" else "NotReady"
    return state + (",SchedulingDisabled" if _spec(node).get("unschedulable") else "")


def node_roles(node: Mapping[str, Any]) -> str:
    labels = _meta(node).get("labels") or {}
    roles = {key.removeprefix("node-role.kubernetes.io/") for key in labels
             if key.startswith("node-role.kubernetes.io/") and key != "node-role.kubernetes.io/"}
    if labels.get("kubernetes.io/role"):
        roles.add(labels["kubernetes.io/role"])
    return ",".join(sorted(roles)) or NONE


def _address(kind: str) -> Cell:
    def cell(node: Mapping[str, Any], now: datetime.datetime) -> str:
        found = [a.get("address") for a in _status(node).get("addresses") or [] if a.get("type") == kind]
        return str(found[0]) if found else NONE
    return cell


def _node_info(field: str) -> Cell:
    return lambda node, now: _or_none((_status(node).get("nodeInfo") or {}).get(field))


def _replicas_ready(obj: Mapping[str, Any], now: datetime.datetime) -> str:
    return f"{_status(obj).get('readyReplicas') or 0}/{_spec(obj).get('replicas', 1)}"


def label_selector(selector: Any) -> str:
    """A LabelSelector as kubectl prints it: requirements sorted by key (`app=web,!legacy,tier in (a,b)`), `<none>`
    when it selects everything."""
    selector = selector if isinstance(selector, Mapping) else {}
    requirements = [(str(key), f"{key}={value}") for key, value in (selector.get("matchLabels") or {}).items()]
    for expression in selector.get("matchExpressions") or []:
        key, operator = str(expression.get("key", "")), expression.get("operator")
        values = ",".join(sorted(str(v) for v in expression.get("values") or []))
        text = {"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})", "Exists": key,
                "DoesNotExist": f"!{key}"}.get(str(operator), f"{key} {operator} ({values})")
        requirements.append((key, text))
    return ",".join(text for _, text in sorted(requirements, key=lambda r: r[0])) or NONE


def _disruption_bound(name: str) -> Cell:
    """A PodDisruptionBudget's minAvailable or maxUnavailable (a number or a percentage), `N/A` when unset."""
    def cell(pdb: Mapping[str, Any], now: datetime.datetime) -> str:
        value = _spec(pdb).get(name)
        return "N/A" if value is None else _text(value)

    return cell


def _event_object(event: Mapping[str, Any], now: datetime.datetime) -> str:
    involved = event.get("involvedObject") or event.get("regarding") or {}
    return f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}"


def _event_last_seen(event: Mapping[str, Any], now: datetime.datetime) -> str:
    series = event.get("series") or {}
    stamp = (series.get("lastObservedTime") or event.get("lastTimestamp") or event.get("eventTime")
             or event.get("firstTimestamp") or _meta(event).get("creationTimestamp"))
    return age(stamp, now)


BUILTIN_COLUMNS: Mapping[str, tuple[Column, ...]] = {
    "Pod": (
        NAME,
        Column("Ready", lambda pod, now: pod_ready(pod), description="The number of ready containers."),
        Column("Status", lambda pod, now: pod_status(pod), description="The aggregate pod status."),
        Column("Restarts", pod_restarts, description="The number of container restarts."),
        AGE,
        Column("IP", lambda pod, now: _or_none(_status(pod).get("podIP")), priority=1),
        Column("Node", lambda pod, now: _or_none(_spec(pod).get("nodeName")), priority=1),
        Column("Nominated Node", lambda pod, now: _or_none(_status(pod).get("nominatedNodeName")), priority=1),
        Column("Readiness Gates", lambda pod, now: _readiness_gates(pod), priority=1),
    ),
    "Node": (
        NAME,
        Column("Status", lambda node, now: node_status(node)),
        Column("Roles", lambda node, now: node_roles(node)),
        AGE,
        Column("Version", _node_info("kubeletVersion")),
        Column("Internal-IP", _address("InternalIP"), priority=1),
        Column("External-IP", _address("ExternalIP"), priority=1),
        Column("OS-Image", _node_info("osImage"), priority=1),
        Column("Kernel-Version", _node_info("kernelVersion"), priority=1),
        Column("Container-Runtime", _node_info("containerRuntimeVersion"), priority=1),
    ),
    "Namespace": (NAME, Column("Status", lambda ns, now: _status(ns).get("phase", "")), AGE),
    "ConfigMap": (NAME, Column("Data", lambda cm, now: len(cm.get("data") or {}) + len(cm.get("binaryData") or {}),
                               type="integer"), AGE),
    "Secret": (NAME, Column("Type", lambda secret, now: secret.get("type") or ""),
               Column("Data", lambda secret, now: len(secret.get("data") or {}), type="integer"), AGE),
    "ServiceAccount": (NAME, Column("Secrets", lambda sa, now: len(sa.get("secrets") or []), type="integer"), AGE),
    "Deployment": (
        NAME, Column("Ready", _replicas_ready),
        Column("Up-to-date", lambda d, now: _status(d).get("updatedReplicas") or 0, type="integer"),
        Column("Available", lambda d, now: _status(d).get("availableReplicas") or 0, type="integer"), AGE,
    ),
    "StatefulSet": (NAME, Column("Ready", _replicas_ready), AGE),
    "NetworkPolicy": (NAME, Column("Pod-Selector", lambda np, now: label_selector(_spec(np).get("podSelector"))),
                      AGE),
    "PodDisruptionBudget": (
        NAME, Column("Min Available", _disruption_bound("minAvailable")),
        Column("Max Unavailable", _disruption_bound("maxUnavailable")),
        Column("Allowed Disruptions", lambda pdb, now: _status(pdb).get("disruptionsAllowed") or 0, type="integer"),
        AGE,
    ),
    "Event": (
        Column("Last Seen", _event_last_seen),
        Column("Type", lambda e, now: e.get("type", "")),
        Column("Reason", lambda e, now: e.get("reason", "")),
        Column("Object", _event_object),
        Column("Message", lambda e, now: str(e.get("message") or e.get("note") or "").strip()),
        Column("First Seen", lambda e, now: age(e.get("firstTimestamp") or e.get("eventTime"), now), priority=1),
        Column("Count", lambda e, now: e.get("count") or 1, type="integer", priority=1),
        dataclasses.replace(NAME, priority=1),
    ),
}
