"""The patch formats of the Kubernetes API, chosen by the request's Content-Type.

- `application/merge-patch+json` (RFC 7386): maps merge recursively, `null` deletes a key, lists are replaced.
- `application/json-patch+json` (RFC 6902): a list of operations; a failed `test` is HTTP 422.
- `application/strategic-merge-patch+json`: a merge patch in which some lists merge item by item, matched by a
  merge key (a Pod's containers by `name`, their ports by `containerPort`, env by `name`; a Service's ports by
  `port`; conditions by `type`; finalizers as a set), with the directives `$patch: delete|replace|merge`,
  `$deleteFromPrimitiveList/<field>` and `$setElementOrder/<field>` (accepted; the order is not applied).
  Kubernetes serves it for built-in kinds only; a custom resource answers 415.

The merge keys come from the Kubernetes API types (`patchMergeKey` tags) for the kinds this project uses; a list
not in the table is replaced, as a merge patch would. Server-side apply (`application/apply-patch+yaml`) merges
lists by the same keys; it is not a patch format here but a write of its own (fields.py).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import jsonpatch
import jsonpointer

MERGE = "application/merge-patch+json"
JSON = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"


class PatchError(ValueError):
    """A patch the API refuses, with the HTTP status it answers."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


def _pod_spec(prefix: str) -> dict[str, str | None]:
    keys: dict[str, str | None] = {"volumes": "name", "imagePullSecrets": "name", "hostAliases": "ip"}
    for containers in ("containers", "initContainers", "ephemeralContainers"):
        keys[containers] = "name"
        keys[f"{containers}.ports"] = "containerPort"
        keys[f"{containers}.env"] = "name"
        keys[f"{containers}.volumeMounts"] = "mountPath"
        keys[f"{containers}.volumeDevices"] = "devicePath"
    return {f"{prefix}.{path}": key for path, key in keys.items()}


_METADATA: dict[str, str | None] = {"metadata.ownerReferences": "uid", "metadata.finalizers": None}
_CONDITIONS: dict[str, str | None] = {"status.conditions": "type"}
_WORKLOAD = {**_METADATA, **_CONDITIONS, **_pod_spec("spec.template.spec")}

# Dotted field paths (list items add no segment) -> merge key; None merges a list of scalars as a set.
MERGE_KEYS: Mapping[str, Mapping[str, str | None]] = {
    "Pod": {**_METADATA, **_CONDITIONS, **_pod_spec("spec")},
    "Service": {**_METADATA, **_CONDITIONS, "spec.ports": "port"},
    "Node": {**_METADATA, **_CONDITIONS, "status.addresses": "type", "spec.taints": "key"},
    "Namespace": {**_METADATA, **_CONDITIONS},
    "PodDisruptionBudget": {**_METADATA, **_CONDITIONS},
    "Deployment": _WORKLOAD,
    "StatefulSet": _WORKLOAD,
    "ReplicaSet": _WORKLOAD,
    "DaemonSet": _WORKLOAD,
}


def merge_keys_of(kind: str, *, builtin: bool) -> Mapping[str, str | None]:
    """The merge keys of a kind; a custom resource merges only its metadata's lists by key (its schema declares no
    list types the emulator reads), as server-side apply does without `x-kubernetes-list-type`."""
    return MERGE_KEYS.get(kind, _METADATA) if builtin else _METADATA


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def apply_patch(target: Mapping[str, Any], patch: Any, content_type: str | None, *, kind: str,
                builtin: bool) -> dict[str, Any]:
    """The object after the patch; raises PatchError with the status Kubernetes would answer."""
    kind_of = media_type(content_type)
    if kind_of == MERGE:
        return _as_object(merge_patch(target, _mapping(patch)))
    if kind_of == JSON:
        return _as_object(json_patch(target, patch))
    if kind_of == STRATEGIC and builtin:
        return _as_object(strategic_merge_patch(target, _mapping(patch), merge_keys_of(kind, builtin=True)))
    raise PatchError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - accepted "
                     f"media types include: {JSON}, {MERGE}" + (f", {STRATEGIC}" if builtin else ""))


def _mapping(patch: Any) -> Mapping[str, Any]:
    if not isinstance(patch, Mapping):
        raise PatchError(400, "BadRequest", "the patch must be a JSON object")
    return patch


def _as_object(result: Any) -> dict[str, Any]:
    if not isinstance(result, dict):
        raise PatchError(422, "Invalid", "the patched document is not an object")
    return result


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: maps merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: Mapping[str, Any], operations: Any) -> Any:
    """RFC 6902; a failed `test` or an operation on a missing path is 422, a malformed patch 400."""
    if not isinstance(operations, list):
        raise PatchError(400, "BadRequest", "a JSON patch must be a list of operations")
    try:
        return jsonpatch.apply_patch(copy.deepcopy(dict(target)), operations)
    except jsonpatch.JsonPatchTestFailed as e:
        raise PatchError(422, "Invalid", f"the server rejected our request due to an error in our request: {e}") from e
    except (jsonpatch.JsonPatchConflict, jsonpointer.JsonPointerException) as e:
        raise PatchError(422, "Invalid", f"the patch could not be applied: {e}") from e
    except (jsonpatch.InvalidJsonPatch, TypeError, KeyError) as e:
        raise PatchError(400, "BadRequest", f"invalid JSON patch: {e}") from e


def strategic_merge_patch(target: Mapping[str, Any], patch: Mapping[str, Any],
                          merge_keys: Mapping[str, str | None], path: str = "") -> Any:
    """A strategic merge patch of a map at `path` (dotted, list items add no segment)."""
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return _strip(patch)
    result = dict(target)
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.partition("/")[2]
            result[field] = [item for item in result.get(field) or [] if item not in value]
        elif key.startswith("$"):
            continue  # $patch, $setElementOrder/..., $retainKeys: nothing more to do here
        else:
            _merge_field(result, key, value, merge_keys, f"{path}.{key}" if path else key)
    return result


def _merge_field(result: dict[str, Any], key: str, value: Any, merge_keys: Mapping[str, str | None],
                 path: str) -> None:
    old = result.get(key)
    if value is None:
        result.pop(key, None)
    elif isinstance(value, Mapping) and isinstance(old, Mapping):
        merged = strategic_merge_patch(old, value, merge_keys, path)
        if merged is None:
            result.pop(key, None)
        else:
            result[key] = merged
    elif isinstance(value, list) and path in merge_keys:
        result[key] = _merge_list(old if isinstance(old, list) else [], value, merge_keys, path)
    else:
        result[key] = _strip(value)


def _merge_list(old: list[Any], patch: list[Any], merge_keys: Mapping[str, str | None], path: str) -> list[Any]:
    merge_key = merge_keys[path]
    if any(isinstance(item, Mapping) and item.get("$patch") == "replace" for item in patch):
        return [_strip(item) for item in patch if not (isinstance(item, Mapping) and "$patch" in item)]
    if merge_key is None:  # a set of scalars
        return old + [item for item in patch if item not in old]
    result = [copy.deepcopy(item) for item in old]
    for item in patch:
        if not isinstance(item, Mapping) or merge_key not in item:
            raise PatchError(422, "Invalid", f"{path}: every item of a strategic merge needs its key {merge_key!r}")
        index = next((i for i, mine in enumerate(result) if mine.get(merge_key) == item[merge_key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del result[index]
        elif index is None:
            result.append(_strip(item))
        else:
            result[index] = strategic_merge_patch(result[index], item, merge_keys, path)
    return result


def _strip(value: Any) -> Any:
    """A patch value without its directives, for use as plain data."""
    if isinstance(value, Mapping):
        return {key: _strip(item) for key, item in value.items() if not key.startswith("$")}
    if isinstance(value, list):
        return [_strip(item) for item in value]
    return value
