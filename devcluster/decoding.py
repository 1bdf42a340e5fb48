"""Strict decoding, as the Kubernetes API server decodes a JSON body into its Go types: a field the type does not
declare is an unknown field, named by its path (`spec.versions[0].schema.openAPIV3Schema.properties.x.propertyNames`).
The emulator (apiserver.py) decodes CustomResourceDefinitions so, where a misspelt or unsupported schema keyword
makes a schema that does not say what its author meant; other kinds are stored as sent.

What happens to an unknown field is the write's `fieldValidation` directive, as in Kubernetes: `Strict` refuses the
write (400, `strict decoding error: unknown field "PATH"`, every unknown field named in the body's order); `Warn`
(the default) and `Ignore` drop the field (a Go type has no room for it), `Warn` saying so in a `Warning` header.
Server-side apply refuses an unknown field whatever the directive: its machinery types the configuration first
(`failed to create typed patch object (...): .PATH: field not declared in schema`, which Kubernetes answers as an
internal error, 500).

The types are the kubernetes client's models (`kubernetes.client.V1CustomResourceDefinition`, `V1JSONSchemaProps`,
`V1ValidationRule`...): their `attribute_map` holds the JSON name of every field and their `openapi_types` the type
of each, so no field is listed here. The JSONSchemaProps fields a model types as `object` because they take one of
two shapes are read by the shape they have: `items` (a schema or a list of schemas), `additionalProperties` and
`additionalItems` (a schema or a bool), `dependencies` (per key, a schema or a list of names). Values typed
`object` otherwise (`default`, `enum`, `example`) are free. The models come with the `kubernetes` package (the
operator's dependency, not the local cluster's), imported on first use: where it is not installed, nothing is
decoded strictly (a warning says so once).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

STRICT, WARN, IGNORE = "Strict", "Warn", "Ignore"
DIRECTIVES = ("", IGNORE, STRICT, WARN)  # "" is Warn
MODELS = {"CustomResourceDefinition": "V1CustomResourceDefinition"}  # the kinds decoded strictly, by their model
_SCHEMA = "V1JSONSchemaProps"
_CONTAINER = re.compile(r"(?:(List|list)\[|(Dict|dict)[\[(]str, )(.+)[\])]")  # List[T], Dict[str, T] (or old forms)


@dataclass(frozen=True)
class Decoded:
    obj: dict[str, Any]  # the object without its unknown fields
    unknown: list[str] = field(default_factory=list)  # their paths, in the body's order


@functools.cache
def _models() -> Any | None:
    try:
        return importlib.import_module("kubernetes.client")
    except ImportError:
        log.warning("the kubernetes package is not installed: CustomResourceDefinitions are not decoded strictly")
        return None


@functools.cache
def _fields(model: str) -> dict[str, str]:
    """A model's fields: JSON name -> type (`str`, `V1ObjectMeta`, `List[V1ValidationRule]`, `object`...)."""
    cls = getattr(_models(), model)
    return {name: cls.openapi_types[attribute] for attribute, name in cls.attribute_map.items()}


def _is_model(kind: str) -> bool:
    return hasattr(getattr(_models(), kind, None), "attribute_map")


def decode(kind: str, obj: dict[str, Any]) -> Decoded:
    """The object of this kind as the API server decodes it: without the fields its type lacks, and their paths.
    A kind not decoded strictly (or no models installed) comes back whole."""
    model = MODELS.get(kind)
    if model is None or _models() is None:
        return Decoded(obj)
    unknown: list[str] = []
    return Decoded(_typed(obj, model, "", unknown), unknown)


def _typed(value: Any, kind: str, path: str, unknown: list[str]) -> Any:
    """The value read as `kind` (a model, a list or map of them, or a scalar), without the fields its models lack,
    whose paths go to `unknown`."""
    container = _CONTAINER.fullmatch(kind)
    if container is not None:
        inner = container.group(3)
        if container.group(1) and isinstance(value, list):
            return [_typed(item, inner, f"{path}[{i}]", unknown) for i, item in enumerate(value)]
        if container.group(2) and isinstance(value, dict):
            return {key: _typed(item, inner, _join(path, key), unknown) for key, item in value.items()}
        return value
    if not isinstance(value, dict) or not _is_model(kind):
        return value
    fields = _fields(kind)
    kept: dict[str, Any] = {}
    for key, item in value.items():
        where = _join(path, key)
        if key in fields:
            kept[key] = _typed(item, _shaped(kind, key, item) or fields[key], where, unknown)
        else:
            unknown.append(where)
    return kept


def _shaped(model: str, key: str, value: Any) -> str | None:
    """The type of a JSONSchemaProps field that takes one of two shapes, by the shape of its value (None: the
    model's type)."""
    if model != _SCHEMA:
        return None
    if key == "dependencies":
        return f"Dict[str, {_SCHEMA}]"  # a list of names stays as it is
    if key in ("items", "additionalProperties", "additionalItems"):
        return f"List[{_SCHEMA}]" if isinstance(value, list) else _SCHEMA
    return None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def strict_error(kind: str, version: str, unknown: list[str]) -> str:
    """What a Strict write with unknown fields is told (400)."""
    fields = ", ".join(f"unknown field {json.dumps(path)}" for path in unknown)
    return f"{kind} in version {json.dumps(version)} cannot be handled as a {kind}: strict decoding error: {fields}"


def warning_header(unknown: list[str]) -> str:
    """The `Warning` header of a Warn write with unknown fields: one `299 - "text"` warning each."""
    return ", ".join("299 - " + json.dumps(f"unknown field {json.dumps(path)}") for path in unknown)


def apply_error(obj: dict[str, Any], api_version: str, kind: str, unknown: list[str]) -> str:
    """What a server-side apply with unknown fields is told: its typed-patch error."""
    metadata = obj.get("metadata") or {}
    errors = [f".{path}: field not declared in schema" for path in unknown]
    text = errors[0] if len(errors) == 1 else "\n".join(["errors:", *(f"  {e}" for e in errors)])
    return (f"failed to create typed patch object ({metadata.get('namespace') or ''}/{metadata.get('name') or ''}; "
            f"{api_version}, Kind={kind}): {text}")
