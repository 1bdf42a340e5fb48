"""What the API server does to an object on create, update, delete and scale: pure functions from the stored
object and the request's body to the object to store. The emulator stamps `resourceVersion` when it stores one.

- Create: `uid`, `creationTimestamp`, `generation: 1`; the namespace is the URL's; for kinds with a status
  subresource the body's status is dropped (a Pod starts `Pending`, a Namespace `Active`); a Secret without a
  type is `Opaque` (Kubernetes' default).
- Update: server-owned metadata (uid, creationTimestamp, deletionTimestamp, generation, resourceVersion) cannot be
  written (nor, by server-side apply, apiVersion, kind, name and namespace: `applicable`). With a status
  subresource, a write to the object keeps the stored status and a write to `/status` changes nothing but status.
  `generation` moves when anything but metadata (and status, where it has its own subresource) changes.
- Delete: an object with finalizers, or a Pod bound to a node (graceful deletion, left to its node), only gets
  `deletionTimestamp`; it goes once no finalizer is left and no grace period is pending.
- Garbage collection: the finalizers a delete's propagation policy adds (`orphan`, `foregroundDeletion`) and the
  edits the collector makes to `metadata.ownerReferences`; the emulator (apiserver.py) decides when.
- Bind: a Pod's binding sets its node and its `PodScheduled` condition.
- Scale: a `Scale` (autoscaling/v1) read from and written to the paths a CRD's scale subresource declares.
"""

from __future__ import annotations

import copy
import datetime
import random
from collections.abc import Mapping
from typing import Any

from .resources import ScalePaths, ServedResource

SERVER_OWNED = ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation",
                "resourceVersion")
ORPHAN = "orphan"  # the finalizer of an Orphan delete: dependents lose their reference to the object first
FOREGROUND = "foregroundDeletion"  # the finalizer of a Foreground delete: blocking dependents go first
POLICIES = ("Background", "Foreground", "Orphan")  # DeleteOptions.propagationPolicy
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # the alphabet Kubernetes uses for generateName suffixes


def timestamp(when: datetime.datetime) -> str:
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def generated_name(prefix: str, rng: random.Random) -> str:
    return prefix + "".join(rng.choice(_NAME_CHARS) for _ in range(5))


def meta(obj: Mapping[str, Any]) -> dict[str, Any]:
    value = obj.get("metadata")
    return value if isinstance(value, dict) else {}


def created(body: Mapping[str, Any], *, api_version: str, info: ServedResource, namespace: str | None, name: str,
            uid: str, now: datetime.datetime) -> dict[str, Any]:
    """The object to store for a create request."""
    obj: dict[str, Any] = {"apiVersion": api_version, "kind": info.kind, "metadata": {}}
    obj.update(copy.deepcopy({key: value for key, value in body.items() if key not in ("apiVersion", "kind")}))
    metadata = obj["metadata"] = meta(obj)
    for field in SERVER_OWNED:
        metadata.pop(field, None)
    metadata.update(name=name, uid=uid, creationTimestamp=timestamp(now), generation=1)
    if namespace is None:
        metadata.pop("namespace", None)
    else:
        metadata["namespace"] = namespace
    if info.has_status:
        obj.pop("status", None)
    if obj["kind"] == "Secret" and not obj.get("type"):
        obj["type"] = "Opaque"
    return _with_initial_status(obj)


def _with_initial_status(obj: dict[str, Any]) -> dict[str, Any]:
    if obj["kind"] == "Pod":
        obj.setdefault("status", {"phase": "Pending"})
    elif obj["kind"] == "Namespace":
        obj.setdefault("status", {"phase": "Active"})
    elif obj["kind"] == "CustomResourceDefinition":
        obj["status"] = crd_status(obj)
    return obj


def crd_status(crd: Mapping[str, Any]) -> dict[str, Any]:
    """A CRD's status as the API server keeps it: names accepted and established at once."""
    spec = crd.get("spec") or {}
    conditions = [{"type": kind, "status": "True", "reason": reason, "message": message,
                   "lastTransitionTime": meta(crd).get("creationTimestamp")}
                  for kind, reason, message in (("NamesAccepted", "NoConflicts", "no conflicts found"),
                                                ("Established", "InitialNamesAccepted", "the initial names have "
                                                 "been accepted"))]
    stored = [version["name"] for version in spec.get("versions") or [] if version.get("storage")]
    return {"acceptedNames": copy.deepcopy(spec.get("names") or {}), "conditions": conditions,
            "storedVersions": stored}


def updated(current: Mapping[str, Any], body: Mapping[str, Any], *, info: ServedResource,
            subresource: str | None) -> dict[str, Any]:
    """The object to store for an update (PUT, or the result of a PATCH) of the object or its `/status`."""
    if subresource == "status":
        obj = copy.deepcopy(dict(current))
        _replace_key(obj, "status", body)
        return obj
    obj = copy.deepcopy(dict(body))
    obj["apiVersion"], obj["kind"] = current["apiVersion"], current["kind"]
    metadata = obj["metadata"] = meta(obj)
    for field in (*SERVER_OWNED, "name", "namespace"):
        _replace_key(metadata, field, meta(current))
    if info.has_status:
        _replace_key(obj, "status", current)
    if obj["kind"] == "CustomResourceDefinition":
        obj["status"] = crd_status(obj)
    metadata["generation"] = meta(current).get("generation", 1) + (1 if _spec_changed(current, obj, info) else 0)
    return obj


def applicable(config: Mapping[str, Any], *, info: ServedResource, subresource: str | None) -> dict[str, Any]:
    """The part of a server-side apply configuration that a write to the object (or its `/status`) sets: a write to
    `/status` sets status only; a write to the object sets no status where status has its own subresource, and never
    apiVersion, kind, the name, the namespace or server-owned metadata."""
    if subresource == "status":
        return {"status": copy.deepcopy(config["status"])} if "status" in config else {}
    result = {key: copy.deepcopy(value) for key, value in config.items()
              if key not in ("apiVersion", "kind", "metadata") and not (key == "status" and info.has_status)}
    metadata = {key: copy.deepcopy(value) for key, value in meta(config).items()
                if key not in (*SERVER_OWNED, "name", "namespace", "managedFields")}
    if metadata:
        result["metadata"] = metadata
    return result


def _replace_key(target: dict[str, Any], key: str, source: Mapping[str, Any]) -> None:
    if key in source:
        target[key] = copy.deepcopy(source[key])
    else:
        target.pop(key, None)


def _spec_changed(old: Mapping[str, Any], new: Mapping[str, Any], info: ServedResource) -> bool:
    ignored = {"metadata", "status"} if info.has_status else {"metadata"}
    return {k: v for k, v in old.items() if k not in ignored} != {k: v for k, v in new.items() if k not in ignored}


def same_content(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether a write changes nothing (Kubernetes then neither stores it nor moves the resourceVersion)."""
    return dict(old) == dict(new)


def added_finalizers(current: Mapping[str, Any], new: Mapping[str, Any]) -> set[str]:
    return set(meta(new).get("finalizers") or ()) - set(meta(current).get("finalizers") or ())


def grace_period(obj: Mapping[str, Any], options: Mapping[str, Any]) -> int:
    """Seconds a delete leaves the object to its owner: a Pod bound to a node gets its grace period; others 0."""
    spec = obj.get("spec") or {}
    if obj.get("kind") != "Pod" or not spec.get("nodeName"):
        return 0
    asked = options.get("gracePeriodSeconds")
    return int(asked if asked is not None else spec.get("terminationGracePeriodSeconds", 30))


def marked_for_deletion(current: Mapping[str, Any], *, grace: int, now: datetime.datetime) -> dict[str, Any]:
    obj = copy.deepcopy(dict(current))
    obj["metadata"]["deletionTimestamp"] = timestamp(now + datetime.timedelta(seconds=grace))
    obj["metadata"]["deletionGracePeriodSeconds"] = grace
    return obj


def bound(pod: Mapping[str, Any], node: str, *, now: datetime.datetime) -> dict[str, Any]:
    """A Pod after its binding to a node: `spec.nodeName` and the condition `PodScheduled=True`."""
    obj = copy.deepcopy(dict(pod))
    obj.setdefault("spec", {})["nodeName"] = node
    status = obj.setdefault("status", {})
    others = [c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"]
    scheduled = {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": timestamp(now)}
    status["conditions"] = [scheduled, *others]
    return obj


def removable(obj: Mapping[str, Any]) -> bool:
    """Whether an object marked for deletion can go: no finalizers left and no grace period pending."""
    metadata = meta(obj)
    return (bool(metadata.get("deletionTimestamp")) and not metadata.get("finalizers")
            and not metadata.get("deletionGracePeriodSeconds"))


def get_path(obj: Mapping[str, Any], path: str) -> Any:
    value: Any = obj
    for part in path.strip(".").split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.strip(".").split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    obj[last] = value


def scale_of(obj: Mapping[str, Any], paths: ScalePaths) -> dict[str, Any]:
    """The Scale view of an object."""
    metadata = meta(obj)
    status: dict[str, Any] = {"replicas": get_path(obj, paths.status_replicas) or 0}
    if paths.label_selector and get_path(obj, paths.label_selector):
        status["selector"] = get_path(obj, paths.label_selector)
    return {
        "apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": {key: metadata[key] for key in ("name", "namespace", "uid", "resourceVersion",
                                                    "creationTimestamp") if key in metadata},
        "spec": {"replicas": get_path(obj, paths.spec_replicas) or 0},
        "status": status,
    }


def scaled(obj: Mapping[str, Any], paths: ScalePaths, replicas: int) -> dict[str, Any]:
    """The object with its replicas set where the scale subresource writes them."""
    result = copy.deepcopy(dict(obj))
    set_path(result, paths.spec_replicas, replicas)
    return result


def deletion_finalizers(current: Mapping[str, Any], policy: str | None) -> list[str]:
    """The finalizers a delete leaves: the object's own, plus `orphan` or `foregroundDeletion` as the propagation
    policy asks; without a policy, a collector finalizer the object already carries decides (as in Kubernetes)."""
    present = [f for f in meta(current).get("finalizers") or () if isinstance(f, str)]
    if policy is None:
        policy = next(({ORPHAN: "Orphan", FOREGROUND: "Foreground"}[f] for f in present if f in (ORPHAN, FOREGROUND)),
                      "Background")
    wanted = [f for f in present if f not in (ORPHAN, FOREGROUND)]
    wanted += {"Orphan": [ORPHAN], "Foreground": [FOREGROUND]}.get(policy, [])
    return present if set(wanted) == set(present) else wanted


def with_finalizers(obj: Mapping[str, Any], finalizers: list[str]) -> dict[str, Any]:
    new = copy.deepcopy(dict(obj))
    if finalizers == list(meta(obj).get("finalizers") or ()):
        return new
    if finalizers:
        new["metadata"]["finalizers"] = finalizers
    else:
        new["metadata"].pop("finalizers", None)
    return new


def deleting_with(obj: Mapping[str, Any], finalizer: str) -> bool:
    """Whether the object is being deleted and holds this collector finalizer."""
    metadata = meta(obj)
    return bool(metadata.get("deletionTimestamp")) and finalizer in (metadata.get("finalizers") or ())


def owner_references(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    refs = meta(obj).get("ownerReferences")
    return [ref for ref in refs if isinstance(ref, dict)] if isinstance(refs, list) else []


def owner_uids(obj: Mapping[str, Any] | None, *, blocking: bool = False) -> set[str]:
    """The uids the object's ownerReferences name (only those with `blockOwnerDeletion: true` if `blocking`)."""
    if obj is None:
        return set()
    return {str(ref.get("uid")) for ref in owner_references(obj)
            if ref.get("uid") and (not blocking or ref.get("blockOwnerDeletion") is True)}


def without_owners(obj: Mapping[str, Any], uids: set[str]) -> dict[str, Any]:
    """The object without its ownerReferences to these uids."""
    new = copy.deepcopy(dict(obj))
    kept = [ref for ref in owner_references(new) if ref.get("uid") not in uids]
    if kept:
        new["metadata"]["ownerReferences"] = kept
    else:
        new["metadata"].pop("ownerReferences", None)
    return new


def unblocked(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The object with none of its ownerReferences blocking its owners' deletion (the collector's way out of a
    foreground deletion cycle)."""
    new = copy.deepcopy(dict(obj))
    for ref in owner_references(new):
        if ref.get("blockOwnerDeletion") is True:
            ref["blockOwnerDeletion"] = False
    return new
