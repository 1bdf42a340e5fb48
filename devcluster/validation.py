"""The CEL validation rules of a custom resource (`x-kubernetes-validations` in its CRD's schema), checked on every
write that changes the object outside its status, as the Kubernetes API server checks them. CEL is evaluated by
cel-python, an implementation nobody here wrote.

What is kept of Kubernetes' semantics: a rule sits on an object node of the schema, reached through `properties`
only, and is evaluated with `self` bound to that node's value when the node is present (an absent node is not
checked); `message` or `messageExpression` (a CEL string; if it fails, `message`, then the rule itself) is what
the client reads, under the node's path or the rule's `fieldPath`, as
`spec.parallelism.dpa: Invalid value: "object": <message>`; a rule that does not compile or fails to evaluate is
reported on its node too. Not kept: rules under `items` or `additionalProperties`, `oldSelf` (transition rules),
`reason`, the cost budget, and Kubernetes' CEL library extensions (only standard CEL).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import celpy
from celpy.adapter import json_to_cel


@dataclass(frozen=True)
class Rule:
    path: tuple[str, ...]  # the node the rule sits on, from the object's root: ("spec",), ("spec", "elastic")
    rule: str
    message: str = ""
    message_expression: str = ""
    field_path: str = ""  # relative to the node, as `.parallelism.dpa`


def rules_of(schema: Mapping[str, Any], path: tuple[str, ...] = ()) -> tuple[Rule, ...]:
    """Every rule of an OpenAPI v3 schema reached through `properties`, outermost first."""
    found = [Rule(path, str(r.get("rule", "")), str(r.get("message", "")), str(r.get("messageExpression", "")),
                  str(r.get("fieldPath", "")))
             for r in schema.get("x-kubernetes-validations") or [] if isinstance(r, Mapping)]
    for name, child in (schema.get("properties") or {}).items():
        if isinstance(child, Mapping):
            found.extend(rules_of(child, (*path, name)))
    return tuple(found)


@functools.cache
def _program(text: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(text))


def _evaluate(text: str, value: Any) -> Any:
    return _program(text).evaluate({"self": json_to_cel(value)})


def _node(obj: Any, path: tuple[str, ...]) -> tuple[bool, Any]:
    for name in path:
        if not isinstance(obj, Mapping) or name not in obj:
            return False, None
        obj = obj[name]
    return True, obj


def violations(rules: tuple[Rule, ...], obj: Mapping[str, Any]) -> list[str]:
    """What the API server says of each rule `obj` breaks (empty: none)."""
    out: list[str] = []
    for r in rules:
        present, value = _node(obj, r.path)
        if not present:
            continue
        where = ".".join(r.path) + r.field_path
        try:
            ok = _evaluate(r.rule, value)
        except Exception as e:  # celpy's parse and evaluation errors have no common base
            ok = e
        if isinstance(ok, Exception):  # (celpy returns some evaluation errors instead of raising them)
            out.append(f'{where}: Invalid value: "object": rule {r.rule!r} could not be evaluated: {ok}')
        elif not isinstance(ok, celpy.celtypes.BoolType):
            out.append(f'{where}: Invalid value: "object": rule {r.rule!r} gave {ok!r}, not a bool')
        elif not bool(ok):
            out.append(f'{where}: Invalid value: "object": {_message(r, value)}')
    return out


def _message(r: Rule, value: Any) -> str:
    if r.message_expression:
        try:
            text = _evaluate(r.message_expression, value)
            if isinstance(text, str) and text:
                return str(text)
        except Exception:  # a failing messageExpression falls back to message, as in Kubernetes
            pass
    return r.message or f"failed rule: {r.rule}"
