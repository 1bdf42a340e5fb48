"""Kubernetes' protobuf request bodies (`application/vnd.kubernetes.protobuf`) read into the JSON objects the
emulator stores, for the kinds whose `kubectl create` generators send them and the project's users create so:
Secret, ConfigMap, Namespace and ServiceAccount; and the requests kubectl sends so that are not stored
(`REQUESTS`): TokenRequest (`kubectl create token`), SelfSubjectAccessReview (`kubectl auth can-i`) and
SelfSubjectReview (`kubectl auth whoami`). Any other kind is refused (415: send it as JSON).

The envelope: the 4 bytes `k8s\\x00`, then a `runtime.Unknown` message: typeMeta (field 1: apiVersion 1, kind 2),
raw (2: the object's own message), contentEncoding (3, which must be empty) and contentType (4).

The wire: a message is a sequence of fields, each a key, a varint `number << 3 | wire type`, then its value: a
varint (wire type 0: integers and bools; negative int64s take 10 bytes, two's complement), 8 or 4 little-endian
bytes (types 1 and 5, which these messages do not use, skipped), or a length-delimited byte string (type 2:
strings, bytes, nested messages, each item of a repeated field, each entry of a map). A map is a repeated entry
message of key (1) and value (2). A field that repeats in a message that is not repeated: the last one wins.

The tables below give each message's fields by number as k8s.io/api's and apimachinery's `generated.proto` number
them, every field of these messages: a number they lack is one Kubernetes does not know either, and is skipped as it
skips it. To JSON as the Go types write it: bytes as base64, a Time as RFC 3339 seconds (the zero Time absent),
FieldsV1 as its JSON; empty strings and zero integers are left out (their JSON fields are `omitempty`; Go writes
them on the wire all the same), bools are kept as sent (they are pointers there: sent means set).
"""

from __future__ import annotations

import base64
import datetime
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

MEDIA_TYPE = "application/vnd.kubernetes.protobuf"
MAGIC = b"k8s\x00"

Value = int | bytes  # a field's value on the wire: a varint (or fixed-width integer), or a byte string
Reader = Callable[[Value], Any]


class WireError(ValueError):
    """The body is not a protobuf object this reader can read."""


class UnsupportedKind(WireError):
    """The body is an object of a kind this reader has no table for."""


# -- the wire -------------------------------------------------------------------------------------------------------


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at `at` and where the next field starts."""
    value = shift = 0
    while at < len(data) and shift < 70:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7
    raise WireError("a varint is truncated or longer than 10 bytes")


def fields(data: bytes) -> Iterator[tuple[int, Value]]:
    """The fields of one message in wire order: (number, value)."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        value: Value
        if wire == 0:
            value, at = _varint(data, at)
        elif wire == 2:
            size, at = _varint(data, at)
            value, at = data[at:at + size], at + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, at = int.from_bytes(data[at:at + size], "little"), at + size
        else:
            raise WireError(f"field {number}: wire type {wire} (groups) is not used by Kubernetes")
        if at > len(data) or number == 0:
            raise WireError(f"field {number} is truncated" if number else "field number 0")
        yield number, value


# -- values ---------------------------------------------------------------------------------------------------------


def _raw(value: Value) -> bytes:
    if not isinstance(value, bytes):
        raise WireError("a varint where a length-delimited field was expected")
    return value


def _string(value: Value) -> str:
    try:
        return _raw(value).decode()
    except UnicodeDecodeError as e:
        raise WireError(f"a string is not UTF-8: {e}") from e


def _bytes(value: Value) -> str:
    return base64.b64encode(_raw(value)).decode()


def _int(value: Value) -> int:
    if not isinstance(value, int):
        raise WireError("a byte string where a varint was expected")
    return value - (1 << 64) if value >= 1 << 63 else value


def _bool(value: Value) -> bool:
    return _int(value) != 0


def _time(value: Value) -> str | None:
    """A meta/v1 Time (seconds 1, nanos 2) as RFC 3339 seconds; the zero Time as None."""
    seconds = next((_int(v) for n, v in fields(_raw(value)) if n == 1), 0)
    if seconds == 0:
        return None
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _fields_v1(value: Value) -> Any:
    """A FieldsV1 (raw 1: its JSON)."""
    raw = next((_raw(v) for n, v in fields(_raw(value)) if n == 1), b"{}")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise WireError(f"fieldsV1 is not JSON: {e}") from e


@dataclass(frozen=True)
class Field:
    name: str  # the JSON name
    read: Reader
    shape: str = "one"  # "one", "list" (a repeated field) or "map" (repeated entries: key 1, value 2)


Table = Mapping[int, Field]


def decode(data: bytes, table: Table) -> dict[str, Any]:
    """One message as a JSON object."""
    obj: dict[str, Any] = {}
    for number, value in fields(data):
        field = table.get(number)
        if field is None:
            continue  # a field Kubernetes does not know either (the tables hold every field of their message)
        if field.shape == "map":
            entry = dict(fields(_raw(value)))
            obj.setdefault(field.name, {})[_string(entry.get(1, b""))] = field.read(entry.get(2, b""))
        elif field.shape == "list":
            obj.setdefault(field.name, []).append(field.read(value))
        else:
            obj[field.name] = field.read(value)
    return {key: value for key, value in obj.items() if isinstance(value, bool) or value not in ("", 0, None)}


def message(table: Table) -> Reader:
    return lambda value: decode(_raw(value), table)


# -- the messages ---------------------------------------------------------------------------------------------------

OWNER_REFERENCE: Table = {
    1: Field("kind", _string), 3: Field("name", _string), 4: Field("uid", _string), 5: Field("apiVersion", _string),
    6: Field("controller", _bool), 7: Field("blockOwnerDeletion", _bool),
}
MANAGED_FIELDS_ENTRY: Table = {
    1: Field("manager", _string), 2: Field("operation", _string), 3: Field("apiVersion", _string),
    4: Field("time", _time), 6: Field("fieldsType", _string), 7: Field("fieldsV1", _fields_v1),
    8: Field("subresource", _string),
}
OBJECT_META: Table = {
    1: Field("name", _string), 2: Field("generateName", _string), 3: Field("namespace", _string),
    4: Field("selfLink", _string), 5: Field("uid", _string), 6: Field("resourceVersion", _string),
    7: Field("generation", _int), 8: Field("creationTimestamp", _time), 9: Field("deletionTimestamp", _time),
    10: Field("deletionGracePeriodSeconds", _int), 11: Field("labels", _string, "map"),
    12: Field("annotations", _string, "map"), 13: Field("ownerReferences", message(OWNER_REFERENCE), "list"),
    14: Field("finalizers", _string, "list"), 17: Field("managedFields", message(MANAGED_FIELDS_ENTRY), "list"),
}
OBJECT_REFERENCE: Table = {
    1: Field("kind", _string), 2: Field("namespace", _string), 3: Field("name", _string), 4: Field("uid", _string),
    5: Field("apiVersion", _string), 6: Field("resourceVersion", _string), 7: Field("fieldPath", _string),
}
NAMESPACE_CONDITION: Table = {
    1: Field("type", _string), 2: Field("status", _string), 4: Field("lastTransitionTime", _time),
    5: Field("reason", _string), 6: Field("message", _string),
}
_METADATA = Field("metadata", message(OBJECT_META))

KINDS: Mapping[str, tuple[str, Table]] = {  # kind: (its plural, its message)
    "Secret": ("secrets", {
        1: _METADATA, 2: Field("data", _bytes, "map"), 3: Field("type", _string),
        4: Field("stringData", _string, "map"), 5: Field("immutable", _bool),
    }),
    "ConfigMap": ("configmaps", {
        1: _METADATA, 2: Field("data", _string, "map"), 3: Field("binaryData", _bytes, "map"),
        4: Field("immutable", _bool),
    }),
    "Namespace": ("namespaces", {
        1: _METADATA, 2: Field("spec", message({1: Field("finalizers", _string, "list")})),
        3: Field("status", message({1: Field("phase", _string),
                                    2: Field("conditions", message(NAMESPACE_CONDITION), "list")})),
    }),
    "ServiceAccount": ("serviceaccounts", {
        1: _METADATA, 2: Field("secrets", message(OBJECT_REFERENCE), "list"),
        3: Field("imagePullSecrets", message({1: Field("name", _string)}), "list"),
        4: Field("automountServiceAccountToken", _bool),
    }),
}
RESOURCE_ATTRIBUTES: Table = {
    1: Field("namespace", _string), 2: Field("verb", _string), 3: Field("group", _string),
    4: Field("version", _string), 5: Field("resource", _string), 6: Field("subresource", _string),
    7: Field("name", _string),
}  # (8 and 9, field and label selector attributes, are not read: the local authorizer does not judge them)
REQUESTS: Mapping[tuple[str, str], Table] = {  # (apiVersion, kind): its message
    ("authentication.k8s.io/v1", "TokenRequest"): {
        1: _METADATA, 2: Field("spec", message({
            1: Field("audiences", _string, "list"), 4: Field("expirationSeconds", _int),
            3: Field("boundObjectRef", message({1: Field("kind", _string), 2: Field("apiVersion", _string),
                                                3: Field("name", _string), 4: Field("uid", _string)})),
        })),
    },
    ("authorization.k8s.io/v1", "SelfSubjectAccessReview"): {
        1: _METADATA, 2: Field("spec", message({
            1: Field("resourceAttributes", message(RESOURCE_ATTRIBUTES)),
            2: Field("nonResourceAttributes", message({1: Field("path", _string), 2: Field("verb", _string)})),
        })),
    },
    ("authentication.k8s.io/v1", "SelfSubjectReview"): {1: _METADATA},
}
UNKNOWN: Table = {  # runtime.Unknown, the envelope
    1: Field("typeMeta", message({1: Field("apiVersion", _string), 2: Field("kind", _string)})),
    2: Field("raw", _raw), 3: Field("contentEncoding", _string), 4: Field("contentType", _string),
}


def _envelope(body: bytes) -> tuple[str, str, bytes]:
    """The apiVersion, kind and raw message of a protobuf body; WireError for one that is not a Kubernetes object."""
    if not body.startswith(MAGIC):
        raise WireError("the body does not start with the protobuf envelope's magic bytes k8s\\x00")
    envelope = decode(body[len(MAGIC):], UNKNOWN)
    if envelope.get("contentEncoding"):
        raise WireError(f"content encoding {envelope['contentEncoding']!r} is not read")
    type_meta = envelope.get("typeMeta") or {}
    return type_meta.get("apiVersion", ""), type_meta.get("kind", ""), envelope.get("raw", b"")


def read_object(body: bytes) -> tuple[str, dict[str, Any]]:
    """The object a protobuf body holds, as JSON, and the plural of its kind. UnsupportedKind for a kind without
    a table, WireError for a body that is not a Kubernetes protobuf object."""
    api_version, kind, raw = _envelope(body)
    if api_version != "v1" or kind not in KINDS:
        raise UnsupportedKind(f"{api_version or '?'}, Kind={kind or '?'}")
    plural, table = KINDS[kind]
    return plural, {"apiVersion": api_version, "kind": kind, **decode(raw, table)}


def read_request(body: bytes, api_version: str, kind: str) -> dict[str, Any]:
    """The request of `REQUESTS` a protobuf body holds, as JSON; UnsupportedKind when it holds another kind."""
    sent_version, sent_kind, raw = _envelope(body)
    if (sent_version, sent_kind) != (api_version, kind):
        raise UnsupportedKind(f"{sent_version or '?'}, Kind={sent_kind or '?'}")
    return {"apiVersion": api_version, "kind": kind, **decode(raw, REQUESTS[api_version, kind])}
