"""Field ownership (`metadata.managedFields`) and server-side apply, as the Kubernetes API server keeps and does
them (its structured-merge-diff library), for the emulator's schemaless objects. Pure functions of the live object,
the request and the managers; the emulator (apiserver.py) stores what they return.

Glossary:
- path: a tuple of path elements spelt as in `managedFields[].fieldsV1`: `f:NAME` (a map key), `k:{"name":"main"}`
  (the item of a keyed list whose merge key has that value), `v:"x"` (a value of a list kept as a set). A path
  names a leaf (a scalar, an empty map, a list merged whole) or a list item.
- field set: the paths an object sets. apiVersion, kind and the server-owned metadata (name, namespace, uid,
  resourceVersion, generation, creationTimestamp, deletion marks, managedFields) are in no set.
- manager: an entry of managedFields, who wrote (`fieldManager`) how (`Apply` or `Update`) on which subresource,
  with the set it owns. Appliers are told apart by name and subresource; updaters by their apiVersion too.

Lists merge as in Kubernetes: the keyed lists and the sets of patches.MERGE_KEYS (a Pod's containers, env and volumes
by name, finalizers as a set...) item by item; any other list (tolerations, args, every list of a custom resource)
whole. A keyed list whose items lack their key, or repeat it, is taken whole.

Apply (PATCH `application/apply-patch+yaml`), given the applier's configuration:
1. the configuration merges into the live object (maps key by key, keyed lists item by item, sets as sets);
2. the paths the applier applied last time and leaves out now are removed, unless another manager owns them
   (or a path below them); a map or list left empty by a removal goes too;
3. a path whose value this changes (or adds) and that another manager owns is a conflict: 409 unless forced, and
   forcing takes the path away from that manager;
4. the applier now owns exactly the configuration's set; a manager left owning nothing is dropped.
Update (every other write): the paths a write changes or adds go to the writer and leave every other manager; the
paths it removes leave everyone. Both record the time of the change and the apiVersion written.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterable, Mapping
from typing import Any

Path = tuple[str, ...]

APPLY = "Apply"
UPDATE = "Update"
STRIPPED_METADATA = frozenset({"name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
                               "deletionTimestamp", "deletionGracePeriodSeconds", "selfLink", "managedFields"})
_ITEM = object()  # what a list item's own path maps to in a leaf view: items never "change", they come and go


@dataclasses.dataclass(frozen=True)
class Manager:
    """One managedFields entry."""

    manager: str
    operation: str  # APPLY or UPDATE
    api_version: str
    fields: frozenset[Path] = frozenset()
    time: str | None = None
    subresource: str | None = None

    @property
    def identity(self) -> tuple[str, str, str, str]:
        """What tells managers apart (Kubernetes leaves an applier's apiVersion out: it may apply any version)."""
        return (self.manager, self.operation, self.subresource or "",
                self.api_version if self.operation == UPDATE else "")

    def describe(self) -> str:
        """The manager as a conflict message names it: `"a"`, `"kubectl-edit" using v1`."""
        text = json.dumps(self.manager)
        if self.subresource:
            text += f" with subresource {json.dumps(self.subresource)}"
        return text + (f" using {self.api_version}" if self.operation == UPDATE else "")


class ManagedFieldsError(ValueError):
    """managedFields that cannot be read (a write that sends them answers 400)."""


class Conflicts(Exception):
    """Paths an apply would change that other managers own: Kubernetes answers 409 with one cause per path."""

    def __init__(self, conflicts: list[tuple[Manager, Path]]) -> None:
        self.conflicts = conflicts
        super().__init__(self.message)

    @property
    def message(self) -> str:
        count = len(self.conflicts)
        if count == 1:
            manager, path = self.conflicts[0]
            return f"Apply failed with 1 conflict: conflict with {manager.describe()}: {path_string(path)}"
        lines = []
        for who in sorted({manager.describe() for manager, _ in self.conflicts}):
            lines.append(f"conflicts with {who}:")
            lines += [f"- {path_string(path)}" for manager, path in self.conflicts if manager.describe() == who]
        return f"Apply failed with {count} conflicts: " + "\n".join(lines)

    def causes(self) -> list[dict[str, str]]:
        return [{"type": "FieldManagerConflict", "message": f"conflict with {manager.describe()}",
                 "field": path_string(path)} for manager, path in self.conflicts]


# -- field sets -------------------------------------------------------------------------------------------------


def leaves(obj: Mapping[str, Any], merge_keys: Mapping[str, str | None]) -> dict[Path, Any]:
    """Every path the object sets, with its value (list items map to a marker)."""
    found: dict[Path, Any] = {}
    for key, value in obj.items():
        if key in ("apiVersion", "kind"):
            continue
        if key == "metadata" and isinstance(value, Mapping):
            value = {k: v for k, v in value.items() if k not in STRIPPED_METADATA}
            if not value:
                continue
        _walk(found, (f"f:{key}",), key, value, merge_keys)
    return found


def field_set(obj: Mapping[str, Any], merge_keys: Mapping[str, str | None]) -> frozenset[Path]:
    return frozenset(leaves(obj, merge_keys))


def _walk(found: dict[Path, Any], path: Path, dotted: str, value: Any, merge_keys: Mapping[str, str | None]) -> None:
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            _walk(found, (*path, f"f:{key}"), f"{dotted}.{key}", item, merge_keys)
        return
    how = _list_type(value, dotted, merge_keys)
    if how == "set":
        found.update({(*path, _value_element(item)): True for item in value})
    elif how is not None:
        for item in value:
            item_path = (*path, _key_element(item, how))
            found[item_path] = _ITEM
            for key, field in item.items():
                _walk(found, (*item_path, f"f:{key}"), f"{dotted}.{key}", field, merge_keys)
    else:
        found[path] = value


def _list_type(value: Any, dotted: str, merge_keys: Mapping[str, str | None]) -> str | None:
    """How a list merges: "set", by its merge key (the key's name), or whole (None; also for anything else)."""
    if not isinstance(value, list) or not value or dotted not in merge_keys:
        return None
    key = merge_keys[dotted]
    if key is None:
        scalar = all(isinstance(item, str | int | float | bool) for item in value)
        return "set" if scalar and _distinct(value) else None
    if not all(isinstance(item, Mapping) and key in item for item in value):
        return None
    return key if _distinct([item[key] for item in value]) else None


def _distinct(values: list[Any]) -> bool:
    if all(isinstance(value, str | int | float | bool) for value in values):
        return len({(type(value), value) for value in values}) == len(values)
    return len({json.dumps(value, sort_keys=True) for value in values}) == len(values)


def _key_element(item: Mapping[str, Any], key: str) -> str:
    return "k:" + json.dumps({key: item[key]}, separators=(",", ":"))


def _value_element(value: Any) -> str:
    return "v:" + json.dumps(value, separators=(",", ":"))


def path_string(path: Path) -> str:
    """A path as Kubernetes prints it: `.spec.containers[name="main"].image`, `.metadata.finalizers[="x"]`."""
    text = ""
    for element in path:
        kind, _, rest = element.partition(":")
        if kind == "f":
            text += f".{rest}"
        elif kind == "k":
            text += "[" + ",".join(f"{key}={json.dumps(value)}" for key, value in json.loads(rest).items()) + "]"
        elif kind == "v":
            text += f"[={rest}]"
        else:
            text += f"[{rest}]"
    return text


def compare(old: Mapping[str, Any], new: Mapping[str, Any],
            merge_keys: Mapping[str, str | None]) -> tuple[frozenset[Path], frozenset[Path], frozenset[Path]]:
    """(added, modified, removed) paths from `old` to `new`."""
    before, after = leaves(old, merge_keys), leaves(new, merge_keys)
    added = after.keys() - before.keys()
    removed = before.keys() - after.keys()
    modified = {path for path in after.keys() & before.keys()
                if after[path] is not _ITEM and not _same(after[path], before[path])}
    return frozenset(added), frozenset(modified), frozenset(removed)


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values (1 is not 1.0 nor true)."""
    if isinstance(a, Mapping | list) or isinstance(b, Mapping | list):
        return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    return type(a) is type(b) and a == b


# -- managedFields ----------------------------------------------------------------------------------------------


def to_fields_v1(paths: Iterable[Path]) -> dict[str, Any]:
    """A field set in the FieldsV1 form: a tree of path elements, `"."` marking a member that has children."""
    tree: dict[str, Any] = {}
    members = sorted(set(paths))
    for path in members:
        node = tree
        for element in path:
            node = node.setdefault(element, {})
    for path in members:
        node = tree
        for element in path:
            node = node[element]
        if node:
            node["."] = {}
    return _sorted_tree(tree)


def _sorted_tree(tree: dict[str, Any]) -> dict[str, Any]:
    return {key: _sorted_tree(tree[key]) for key in sorted(tree, key=lambda key: (key != ".", key))}


def from_fields_v1(tree: Any, prefix: Path = ()) -> frozenset[Path]:
    if not isinstance(tree, Mapping):
        raise ManagedFieldsError(f"fieldsV1 must be a map at {path_string(prefix) or 'its root'}")
    found: set[Path] = set()
    for element, child in tree.items():
        if element == ".":
            continue
        if not isinstance(element, str) or element[:2] not in ("f:", "k:", "v:", "i:"):
            raise ManagedFieldsError(f"fieldsV1: unknown path element {element!r}")
        path = (*prefix, element)
        if not isinstance(child, Mapping):
            raise ManagedFieldsError(f"fieldsV1 must be a map at {path_string(path)}")
        if not child or "." in child:
            found.add(path)
        found |= from_fields_v1(child, path)
    return frozenset(found)


def decode(entries: Any) -> list[Manager]:
    """The managers of a `metadata.managedFields` value; ManagedFieldsError when it is malformed."""
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise ManagedFieldsError("metadata.managedFields must be a list")
    managers = []
    for entry in entries:
        if not isinstance(entry, Mapping) or entry.get("operation") not in (APPLY, UPDATE):
            raise ManagedFieldsError("metadata.managedFields: every entry needs an operation, Apply or Update")
        if entry.get("fieldsType", "FieldsV1") != "FieldsV1":
            raise ManagedFieldsError(f"metadata.managedFields: fieldsType {entry.get('fieldsType')!r} is not "
                                     "FieldsV1")
        managers.append(Manager(manager=str(entry.get("manager", "")), operation=entry["operation"],
                                api_version=str(entry.get("apiVersion", "")), time=entry.get("time"),
                                subresource=entry.get("subresource") or None,
                                fields=from_fields_v1(entry.get("fieldsV1") or {})))
    return managers


def encode(managers: Iterable[Manager]) -> list[dict[str, Any]]:
    """managedFields entries, in Kubernetes' order: appliers first, then by time and name."""
    ordered = sorted(managers, key=lambda m: (m.operation, m.time or "", m.manager, m.api_version,
                                              m.subresource or ""))
    entries = []
    for m in ordered:
        entry: dict[str, Any] = {"manager": m.manager, "operation": m.operation, "apiVersion": m.api_version,
                                 "time": m.time, "fieldsType": "FieldsV1", "fieldsV1": to_fields_v1(m.fields)}
        if m.subresource:
            entry["subresource"] = m.subresource
        entries.append(entry)
    return entries


# -- apply and update -------------------------------------------------------------------------------------------


def apply(live: Mapping[str, Any], config: Mapping[str, Any], managers: list[Manager], applier: Manager,
          merge_keys: Mapping[str, str | None], *, force: bool) -> tuple[dict[str, Any], list[Manager]]:
    """The object after applying `config` over `live` and the managers after it (`applier` names who applies, when
    and in which apiVersion; its fields are ignored). Raises Conflicts unless `force`."""
    config = _without_nulls(config)
    applied = field_set(config, merge_keys)
    merged = copy.deepcopy(dict(live))
    _merge_into(merged, config, merge_keys, "")
    previous = next((m for m in managers if m.identity == applier.identity), None)
    others = [m for m in managers if m.identity != applier.identity]
    kept = applied.union(*(m.fields for m in others))
    if previous is not None:
        _prune(merged, previous.fields - kept, kept)
    added, modified, removed = compare(live, merged, merge_keys)
    changed = added | modified
    conflicts = [(m, path) for m in others for path in sorted(m.fields & changed)]
    if conflicts and not force:
        raise Conflicts(conflicts)
    if previous is not None and previous.fields == applied and not changed and not removed:
        applier = dataclasses.replace(applier, time=previous.time)  # a no-op apply writes nothing
    after = [dataclasses.replace(m, fields=m.fields - changed - removed) for m in others]
    after.append(dataclasses.replace(applier, fields=applied))
    return merged, [m for m in after if m.fields]


def update(live: Mapping[str, Any], new: Mapping[str, Any], managers: list[Manager], writer: Manager,
           merge_keys: Mapping[str, str | None]) -> list[Manager]:
    """The managers after a write (not an apply) from `live` to `new` by `writer` (its fields are ignored)."""
    added, modified, removed = compare(live, new, merge_keys)
    changed = added | modified
    if not changed and not removed:
        return managers
    after = []
    owned: frozenset[Path] = frozenset()
    for m in managers:
        if m.identity == writer.identity:
            owned = m.fields
        else:
            after.append(dataclasses.replace(m, fields=m.fields - changed - removed))
    after.append(dataclasses.replace(writer, fields=(owned | changed) - removed))
    return [m for m in after if m.fields]


def _without_nulls(value: Any) -> Any:
    """An applied configuration without its null values: a null sets nothing (and so owns nothing)."""
    if isinstance(value, Mapping):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _merge_into(target: dict[str, Any], config: Mapping[str, Any], merge_keys: Mapping[str, str | None],
                dotted: str) -> None:
    for key, value in config.items():
        path = f"{dotted}.{key}" if dotted else key
        target[key] = _merged(target.get(key), value, merge_keys, path)


def _merged(old: Any, new: Any, merge_keys: Mapping[str, str | None], dotted: str) -> Any:
    if isinstance(new, Mapping) and isinstance(old, dict):
        _merge_into(old, new, merge_keys, dotted)
        return old
    how, was = _list_type(new, dotted, merge_keys), _list_type(old, dotted, merge_keys)
    if how == "set" and was == "set":
        return old + [copy.deepcopy(item) for item in new if item not in old]
    if how is not None and how == was:
        for item in new:
            index = next((i for i, mine in enumerate(old) if mine[how] == item[how]), None)
            if index is None:
                old.append(copy.deepcopy(item))
            else:
                _merge_into(old[index], item, merge_keys, dotted)
        return old
    return copy.deepcopy(new)


def _prune(obj: dict[str, Any], candidates: frozenset[Path], owned: frozenset[Path]) -> None:
    """Remove the paths no one keeps (nor a path below them); then the maps and lists that leaves empty."""
    for path in sorted(candidates, key=len):  # an item before its fields: its key locates it
        if any(other[:len(path)] == path for other in owned):
            continue
        found = _locate(obj, path)
        if found is None:
            continue
        container, at = found
        del container[at]
        for end in range(len(path) - 1, 0, -1):
            parent = _locate(obj, path[:end])
            if parent is None or not path[end - 1].startswith("f:") or path[:end] in owned:
                break
            holder, key = parent
            if holder[key] not in ({}, []):
                break
            del holder[key]


def _locate(obj: Any, path: Path) -> tuple[Any, Any] | None:
    """The container holding the value at `path` and its key or index there, or None if there is none."""
    node: Any = obj
    holder: Any = None
    at: Any = None
    for element in path:
        kind, _, rest = element.partition(":")
        holder = node
        if kind == "f" and isinstance(node, dict) and rest in node:
            at = rest
        elif kind == "k" and isinstance(node, list):
            wanted = json.loads(rest)
            at = next((i for i, item in enumerate(node) if isinstance(item, Mapping)
                       and all(item.get(key) == value for key, value in wanted.items())), None)
        elif kind == "v" and isinstance(node, list) and json.loads(rest) in node:
            at = node.index(json.loads(rest))
        else:
            at = None
        if at is None:
            return None
        node = holder[at]
    return None if holder is None else (holder, at)


# -- managedFields on objects -----------------------------------------------------------------------------------


def managers_of(obj: Mapping[str, Any] | None) -> list[Manager]:
    """The managers a stored object records (none if they do not decode: they are rebuilt by the next write)."""
    try:
        return decode(((obj or {}).get("metadata") or {}).get("managedFields"))
    except ManagedFieldsError:
        return []


def with_managers(obj: dict[str, Any], managers: list[Manager]) -> dict[str, Any]:
    """The object (changed in place) with these managers as its managedFields (none: no managedFields)."""
    metadata = obj.setdefault("metadata", {})
    if managers:
        metadata["managedFields"] = encode(managers)
    else:
        metadata.pop("managedFields", None)
    return obj


def tracked(current: Mapping[str, Any] | None, new: dict[str, Any], writer: Manager,
            merge_keys: Mapping[str, str | None]) -> dict[str, Any]:
    """The object a write (not an apply) stores, `new`, with its managedFields after the write: the write's own
    managedFields when it changes them (`[{}]` clears them, an empty list changes nothing, as in Kubernetes), else
    the stored ones; then, if the write changes the object, the writer's ownership of what it changed.
    ManagedFieldsError when the write sends managedFields that do not decode."""
    stored = ((current or {}).get("metadata") or {}).get("managedFields")
    sent = (new.get("metadata") or {}).get("managedFields")
    if sent == [{}]:
        return with_managers(new, [])
    base = decode(sent) if sent and sent != stored else managers_of(current)
    before = _content(current or {})
    if before == _content(new):
        return with_managers(new, base)
    return with_managers(new, update(before, new, base, writer, merge_keys))


def _content(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The object without its managedFields (a shallow copy)."""
    result = dict(obj)
    if isinstance(result.get("metadata"), Mapping):
        result["metadata"] = {key: value for key, value in result["metadata"].items() if key != "managedFields"}
    return result
