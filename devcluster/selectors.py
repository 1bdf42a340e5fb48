"""Label and field selectors, parsed and matched as the Kubernetes API does on list and watch.

Label selectors: comma-separated requirements, all of which must hold: `key=value` (or `==`), `key!=value`,
`key in (a,b)`, `key notin (a,b)`, `key` (exists) and `!key` (does not exist). `!=` and `notin` also match objects
without the label, as in Kubernetes.

Field selectors: `path=value` (or `==`) and `path!=value`, comma-separated. Only the paths Kubernetes supports for
the kind are accepted (`metadata.name` and `metadata.namespace` everywhere, more for some kinds, e.g. a Pod's
`spec.nodeName` and `status.phase`); others are refused, as the real server refuses them. A missing field reads as
the empty string, so `spec.nodeName=` selects unscheduled pods.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


class SelectorError(ValueError):
    """A selector the API refuses (HTTP 400)."""


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: frozenset[str] = frozenset()

    def holds(self, value: str | None) -> bool:
        """Whether the requirement holds for a label or field value (None: the label is absent)."""
        if self.op == "exists":
            return value is not None
        if self.op == "!exists":
            return value is None
        if self.op in ("=", "in"):
            return value in self.values
        return value not in self.values  # "!=", "notin"


_KEY = r"[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?)?"
_EQUALITY = re.compile(rf"\s*(?P<key>{_KEY})\s*(?P<op>==|=|!=)\s*(?P<value>{_VALUE})\s*")
_SET = re.compile(rf"\s*(?P<key>{_KEY})\s+(?P<op>in|notin)\s*\((?P<values>[^()]*)\)\s*")
_EXISTS = re.compile(rf"\s*(?P<bang>!?)\s*(?P<key>{_KEY})\s*")
_VALUE_ONLY = re.compile(rf"\s*{_VALUE}\s*")

# Field paths Kubernetes accepts in field selectors, by kind, besides metadata.name and metadata.namespace.
FIELDS: Mapping[str, frozenset[str]] = {
    "Pod": frozenset({"spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
                      "spec.hostNetwork", "status.phase", "status.podIP", "status.nominatedNodeName"}),
    "Event": frozenset({"involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                        "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
                        "involvedObject.fieldPath", "reason", "reportingComponent", "type"}),
    "Namespace": frozenset({"status.phase"}),
    "Node": frozenset({"spec.unschedulable"}),
    "Secret": frozenset({"type"}),
    "ReplicaSet": frozenset({"status.replicas"}),
}
ALWAYS = frozenset({"metadata.name", "metadata.namespace"})


def _split(text: str) -> list[str]:
    """Top-level comma-separated terms (commas inside `in (...)` stay with their term)."""
    terms, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            terms.append(text[start:i])
            start = i + 1
    terms.append(text[start:])
    return [term for term in terms if term.strip()]


def _label_requirement(term: str) -> Requirement:
    if match := _SET.fullmatch(term):
        values = [value.strip() for value in match["values"].split(",")]
        if not all(_VALUE_ONLY.fullmatch(value) for value in values):
            raise SelectorError(f"invalid label selector values in {term.strip()!r}")
        return Requirement(match["key"], match["op"], frozenset(values))
    if match := _EQUALITY.fullmatch(term):
        return Requirement(match["key"], "!=" if match["op"] == "!=" else "=", frozenset({match["value"]}))
    if match := _EXISTS.fullmatch(term):
        return Requirement(match["key"], "!exists" if match["bang"] else "exists")
    raise SelectorError(f"unable to parse requirement: {term.strip()!r}")


def parse_labels(text: str) -> tuple[Requirement, ...]:
    """Parse a `labelSelector` query parameter."""
    return tuple(_label_requirement(term) for term in _split(text))


def parse_fields(text: str, kind: str) -> tuple[Requirement, ...]:
    """Parse a `fieldSelector` query parameter for objects of `kind`."""
    supported = ALWAYS | FIELDS.get(kind, frozenset())
    requirements = []
    for term in _split(text):
        key, op, value = _field_term(term)
        if key not in supported:
            raise SelectorError(f'field label not supported: {key} (for {kind}: {", ".join(sorted(supported))})')
        requirements.append(Requirement(key, op, frozenset({value})))
    return tuple(requirements)


def _field_term(term: str) -> tuple[str, str, str]:
    for op in ("!=", "==", "="):
        key, found, value = term.partition(op)
        if found:
            return key.strip(), "!=" if op == "!=" else "=", value.strip()
    raise SelectorError(f"invalid field selector term: {term.strip()!r} (want path=value or path!=value)")


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """A field as a field selector reads it: a string, "" when missing, booleans as "true"/"false"."""
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def matches(obj: Mapping[str, Any], labels: Iterable[Requirement], fields: Iterable[Requirement]) -> bool:
    """Whether an object satisfies every label and field requirement."""
    present = (obj.get("metadata") or {}).get("labels") or {}
    return (all(req.holds(present.get(req.key)) for req in labels)
            and all(req.holds(field_value(obj, req.key)) for req in fields))


@dataclass(frozen=True)
class Selection:
    """Which objects a list, watch or collection delete is about: the URL's namespace and name, and selectors."""

    namespace: str | None = None
    name: str | None = None
    labels: tuple[Requirement, ...] = ()
    fields: tuple[Requirement, ...] = ()

    def selects(self, obj: Mapping[str, Any]) -> bool:
        metadata = obj.get("metadata") or {}
        return ((self.namespace is None or metadata.get("namespace") == self.namespace)
                and (self.name is None or metadata.get("name") == self.name)
                and matches(obj, self.labels, self.fields))
