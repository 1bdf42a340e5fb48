"""Generate the InferenceDeployment CRD from the pydantic models (`shardwise crd`, `make crds`).

Kubernetes wants a structural OpenAPI v3 schema: no `$ref`, every node typed, `nullable` instead of
`anyOf [X, null]`, boolean `exclusiveMinimum`. This module turns pydantic's JSON Schema into that and
wraps it in the CustomResourceDefinition with the status and scale subresources (scale on
`.spec.parallelism.dpa`) and the printer columns. A test regenerates it and compares it with
`crds/inferencedeployments.shardwise.io.yaml`.
"""

from __future__ import annotations

from typing import Any

import yaml
from pydantic import BaseModel

from shardwise import api
from shardwise.planner import MAX_WORLD_SIZE

# `propertyNames` (pydantic's bound on a dict's keys) is no field of apiextensions v1's JSONSchemaProps: a strict API
# server refuses the whole CRD for it. pydantic still checks the keys' length.
_DROP = {"title", "$defs", "propertyNames"}


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(x, defs) for x in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        return _structural({**target, **{k: v for k, v in node.items() if k != "$ref"}}, defs)
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        nullable = len(options) < len(node["anyOf"])
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if len(options) == 1:
            merged: dict[str, Any] = {**_structural(options[0], defs), **_structural(rest, defs)}
            if nullable:
                merged["nullable"] = True
            return merged
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP or (key == "additionalProperties" and value is False):
            continue  # structural schemas forbid `additionalProperties: false`; unknown fields are pruned
        if key == "additionalProperties" and value is True:  # a free-form object (a Kubernetes Volume, Affinity)
            out["x-kubernetes-preserve-unknown-fields"] = True
            continue
        if key == "exclusiveMinimum":
            out["minimum"] = value
            out["exclusiveMinimum"] = True
        elif key == "exclusiveMaximum":
            out["maximum"] = value
            out["exclusiveMaximum"] = True
        elif key == "properties":
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = _structural(value, defs)
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "default" in out and (out["default"] is None or out.pop(api.NO_CRD_DEFAULT, False)):
        del out["default"]
    return out


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="serialization")
    schema: dict[str, Any] = _structural(raw, raw.get("$defs", {}))
    return schema


def _read(section: type[BaseModel], name: str) -> str:
    """CEL reading a field of a spec section, with pydantic's default where it (or its section) is absent."""
    field = section.model_fields[name]
    key = field.alias or name
    parent = {api.ParallelismSpec: "parallelism", api.ElasticSpec: "elastic"}[section]
    return f"(has(self.{parent}) && has(self.{parent}.{key}) ? self.{parent}.{key} : {field.default})"


def validations() -> list[dict[str, str]]:
    """The planner's bounds that need no model, as CEL rules on `spec` (x-kubernetes-validations): the API server
    refuses a write breaking one, whether or not the admission webhook runs, `kubectl scale` included.

    The messages are static: a `messageExpression` building a string from integers (`string(self.x)`) is
    refused by a real API server as far over the CEL cost budget, whatever the rule. The admission webhook
    answers the same writes with the numbers."""
    tp, dpa, pp, cp = (_read(api.ParallelismSpec, n) for n in ("tp", "dpa", "pp", "cp"))
    low, high = _read(api.ElasticSpec, "min_dpa"), _read(api.ElasticSpec, "max_dpa")
    cap = MAX_WORLD_SIZE
    factors = " && ".join(f"{x} <= {cap}" for x in (tp, dpa, pp, cp))
    return [
        {"rule": f"{low} <= {high}", "fieldPath": ".elastic.minDpa",
         "message": "elastic.minDpa must not exceed elastic.maxDpa"},
        {"rule": f"{low} > {high} || ({low} <= {dpa} && {dpa} <= {high})", "fieldPath": ".parallelism.dpa",
         "message": "parallelism.dpa must lie within elastic.minDpa..maxDpa"},
        {"rule": f"{factors} && {pp} * {dpa} * {cp} * {tp} <= {cap}", "fieldPath": ".parallelism",
         "message": f"pp*dpa*cp*tp must be at most {cap} ranks"},
    ]


def _bounded(node: Any) -> Any:
    """Every string of a spec without a maxLength (or an enum) gets api.MAX_STRING, as pydantic checks it."""
    if isinstance(node, list):
        return [_bounded(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: (_bounded(v) if k in ("properties", "items", "additionalProperties", "anyOf") or isinstance(v, dict)
               else v) for k, v in node.items()}
    if out.get("type") == "string" and "maxLength" not in out and "enum" not in out:
        out["maxLength"] = api.MAX_STRING
    return out


def openapi_schema() -> dict[str, Any]:
    spec = _bounded(_schema(api.InferenceDeploymentSpec))
    spec["x-kubernetes-validations"] = validations()
    status = _schema(api.InferenceDeploymentStatus)
    status.pop("additionalProperties", None)
    status["x-kubernetes-preserve-unknown-fields"] = True
    return {
        "type": "object",
        "description": "An LLM inference deployment with a validated parallel layout.",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
        "required": ["spec"],
    }


_AVAILABLE = '.status.conditions[?(@.type=="Available")]'
PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Desired", "type": "integer", "jsonPath": ".spec.parallelism.dpa", "description": "Attention groups "
     "wanted (spec.parallelism.dpa, the scale subresource)"},
    {"name": "DPA", "type": "integer", "jsonPath": ".status.dpa", "description": "Attention groups serving"},
    {"name": "Ready", "type": "string", "jsonPath": ".status.ready", "description": "Ready pods / pods"},
    {"name": "Model", "type": "string", "jsonPath": ".status.model", "description": "The model name served"},
    {"name": "Reason", "type": "string", "jsonPath": f"{_AVAILABLE}.reason",
     "description": "Why the deployment is, or is not, Available"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "World", "type": "integer", "jsonPath": ".status.worldSize", "description": "Ranks", "priority": 1},
    {"name": "Engine", "type": "string", "jsonPath": ".status.engine.name", "description": "reference or vllm",
     "priority": 1},
    {"name": "URL", "type": "string", "jsonPath": ".status.url", "description": "OpenAI endpoint (the router)",
     "priority": 1},
]


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": ["all", "shardwise"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.parallelism.dpa",
                            "statusReplicasPath": ".status.dpa",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


HEADER = "# Generated by `make crds` from shardwise/api.py. Do not edit.\n"


def render() -> str:
    return HEADER + yaml.safe_dump(crd(), sort_keys=False, width=110)
