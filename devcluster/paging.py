"""Paged lists: `limit` and `continue`, as the Kubernetes API serves them (`kubectl get` asks for pages of 500,
`--chunk-size` for others; client-go's pager and informers follow `continue`).

A list with `limit=N` answers the first N objects (ordered by namespace and name, as etcd orders its keys) and, when
more remain, `metadata.continue`: an opaque token naming the list's resourceVersion and the last key served, and
`remainingItemCount` when no selector filters the list. Every page of a list shows the objects as they were at
the first page's resourceVersion (Kubernetes reads them from etcd at that revision); the emulator rewinds the
current objects through its change log (changelog.py). Once the log no longer holds the changes since that revision,
the token is too old: 410 Gone (reason Expired), as Kubernetes answers once etcd has compacted it. A token that
does not decode is a 400.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .changelog import Change

Key = tuple[str, str]  # (namespace or "", name): the order of a list
TOKEN_VERSION = "meta.k8s.io/v1"
EXPIRED = ("The provided continue parameter is too old to display a consistent list result. You can start a new "
           "list without the continue parameter.")


class InvalidPage(ValueError):
    """A `limit` or `continue` the API refuses with 400."""


@dataclasses.dataclass(frozen=True)
class Page:
    limit: int | None = None  # None: the whole list
    revision: int | None = None  # the resourceVersion a continued list reads at (None: now)
    after: Key | None = None  # the last key the previous page served


def key(obj: Mapping[str, Any]) -> Key:
    metadata = obj.get("metadata") or {}
    return (metadata.get("namespace") or "", metadata.get("name") or "")


def read_page(params: Mapping[str, str]) -> Page:
    """The page a list request asks for."""
    limit = None
    if params.get("limit"):
        try:
            limit = int(params["limit"])
        except ValueError as e:
            raise InvalidPage(f"limit: Invalid value: {params['limit']!r}: must be an integer") from e
        if limit < 0:
            raise InvalidPage(f"limit: Invalid value: {limit}: must be greater than or equal to 0")
    token = params.get("continue")
    if not token:
        return Page(limit=limit or None)
    if params.get("resourceVersion") or params.get("resourceVersionMatch"):
        raise InvalidPage("specifying resource version is not allowed when using continue")
    revision, after = decode_token(token)
    return Page(limit=limit or None, revision=revision, after=after)


def encode_token(revision: int, after: Key) -> str:
    text = json.dumps({"v": TOKEN_VERSION, "rv": revision, "start": list(after)}, separators=(",", ":"))
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def decode_token(token: str) -> tuple[int, Key]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = json.loads(raw)
        revision, start = data["rv"], data["start"]
        if data.get("v") != TOKEN_VERSION or not isinstance(revision, int) or revision < 1:
            raise ValueError("not a continue token of this server")
        namespace, name = (str(part) for part in start)
    except (binascii.Error, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise InvalidPage(f"continue key is not valid: {e}") from e
    return revision, (namespace, name)


def rewind(current: Iterable[dict[str, Any]], changes: Sequence[Change]) -> list[dict[str, Any]]:
    """The objects as they were before `changes` (the retained changes after some revision, oldest first, of the
    objects' resource), ordered by key."""
    state = {key(obj): obj for obj in current}
    for change in reversed(changes):
        if change.type == "ADDED":
            state.pop(key(change.object), None)
        else:
            before = change.previous if change.previous is not None else change.object
            state[key(before)] = before
    return [state[k] for k in sorted(state)]


def paginate(items: Sequence[dict[str, Any]], page: Page) -> tuple[list[dict[str, Any]], Key | None, int]:
    """The items of this page (of items ordered by key), the key to continue after (None on the last page) and the
    count of items after this page."""
    start = 0
    if page.after is not None:
        start = next((i for i, obj in enumerate(items) if key(obj) > page.after), len(items))
    if page.limit is None or start + page.limit >= len(items):
        return list(items[start:]), None, 0
    chunk = list(items[start:start + page.limit])
    return chunk, key(chunk[-1]), len(items) - start - page.limit
