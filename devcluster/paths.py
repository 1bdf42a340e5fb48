"""Requests as the emulator reads them: an API path split into resource, namespace, name and subresource, and
the Kubernetes action (list, watch, fetch, create, update, delete) kmock's reactions match on.

kmock 0.8 parses paths too, but fails on `/api/v1/namespaces` and on a namespace's own paths; this parser also
reads the legacy `/watch/` prefix and any true `watch` parameter (`true` or `1`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import aiohttp.web
import kmock


@dataclass(frozen=True)
class ApiPath:
    resource: kmock.resource | None = None
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None
    watch: bool = False


def parse_path(path: str) -> ApiPath:
    """Split an API path: /api/v1[/watch][/namespaces/NS]/PLURAL[/NAME[/SUBRESOURCE]], and /apis/GROUP/VERSION/..."""
    parts = [part for part in path.split("/") if part]
    version: str | None
    if parts[:1] == ["api"] and len(parts) >= 2:
        group, version, rest = "", parts[1], parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 2:
        group, version, rest = parts[1], (parts[2] if len(parts) > 2 else None), parts[3:]
    else:
        return ApiPath()
    watch = rest[:1] == ["watch"]
    rest = rest[1:] if watch else rest
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces" and not (len(rest) == 3 and rest[2] in ("status", "finalize")):
        namespace, rest = rest[1], rest[2:]
    plural = rest[0] if rest else None
    return ApiPath(kmock.resource(group=group, version=version, plural=plural), namespace,
                   rest[1] if len(rest) > 1 else None, "/".join(rest[2:]) or None, watch)


def action_of(method: str, path: ApiPath, params: dict[str, str]) -> kmock.action | None:
    if path.resource is None or path.resource.plural is None:
        return None
    named = path.name is not None
    if method == "GET":
        watch = path.watch or params.get("watch", "").lower() in ("true", "1")
        return kmock.action.WATCH if watch else kmock.action.FETCH if named else kmock.action.LIST
    actions = {("POST", False): kmock.action.CREATE, ("PATCH", True): kmock.action.UPDATE,
               ("DELETE", True): kmock.action.DELETE}
    return actions.get((method, named))


async def parse_request(raw: aiohttp.web.BaseRequest, *, id: int) -> kmock.Request:
    body = await raw.read()
    path = parse_path(raw.path)
    params = dict(raw.query)
    try:
        data = json.loads(body) if body else None
    except ValueError:
        data = None  # the handlers that need a body answer 400
    return kmock.Request(id=id, raw_request=raw, url=raw.url, method=raw.method, params=params,
                         headers=raw.headers, cookies=dict(raw.cookies), body=body,
                         text=body.decode(errors="replace"), data=data,
                         action=action_of(raw.method.upper(), path, params), resource=path.resource,
                         namespace=path.namespace, name=path.name, subresource=path.subresource)
