"""A small asynchronous client of the public Kubernetes API over aiohttp, and an informer: all that the scheduler
and the nodes of the local cluster need, so that they work against the local API server and a real one alike.

- `Endpoint`: where the API is and how to authenticate, from a URL or a kubeconfig (`load_kubeconfig`): a bearer
  token (`token`, `tokenFile`), client certificates and a CA (files or `-data`; the CA's PEM is kept too, for the
  pods' `ca.crt`), `insecure-skip-tls-verify`.
  Exec and auth-provider plugins (cloud logins) are not supported.
- `KubeClient`: JSON requests (`get`, `create`, `patch`, `delete`, `request`) that raise `ApiError` with the
  API's status code and reason, and `watch`, which yields a watch stream's events.
- `Informer`: lists a collection, then watches it from the list's resourceVersion, keeping a cache of the objects
  and calling back on every change; a watch that ends resumes from the last resourceVersion seen (bookmarks
  included), and a `410 Gone` relists, reporting the differences as events.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import aiohttp
import yaml

log = logging.getLogger(__name__)

JSON = "application/json"
MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace or "", name)


class ApiError(Exception):
    """An error answer of the API: its HTTP status and, when the body is a Status, its reason and message."""

    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = body if isinstance(body, dict) else {}
        self.reason = str(self.body.get("reason", ""))
        super().__init__(f"{status} {self.reason}: {self.body.get('message', body)}")


@dataclass(frozen=True)
class Endpoint:
    server: str
    token: str | None = field(default=None, repr=False)
    ssl_context: ssl.SSLContext | None = field(default=None, compare=False)
    ca_pem: bytes | None = field(default=None, compare=False, repr=False)  # the CA the server is trusted by, if named


def load_kubeconfig(path: str | Path, context: str | None = None) -> Endpoint:
    """The endpoint of a kubeconfig's context (its current context by default)."""
    config = yaml.safe_load(Path(path).read_text()) or {}
    name = context or config.get("current-context")
    ctx = _named(config.get("contexts"), name, "context")
    cluster = _named(config.get("clusters"), ctx.get("cluster"), "cluster")
    user = _named(config.get("users"), ctx.get("user"), "user") if ctx.get("user") else {}
    server = str(cluster["server"]).rstrip("/")
    token = user.get("token")
    if not token and user.get("tokenFile"):
        token = Path(user["tokenFile"]).read_text().strip()
    if user.get("exec") or user.get("auth-provider"):
        raise ValueError(f"{path}: exec and auth-provider credentials are not supported")
    context_ssl = _ssl_context(cluster, user) if server.startswith("https:") else None
    return Endpoint(server=server, token=token, ssl_context=context_ssl, ca_pem=_ca_pem(cluster))


def _ca_pem(cluster: Mapping[str, Any]) -> bytes | None:
    """The CA a kubeconfig's cluster names (what a kubelet gives its pods as ca.crt), None when it names none."""
    if cluster.get("certificate-authority-data"):
        return base64.b64decode(cluster["certificate-authority-data"])
    if cluster.get("certificate-authority"):
        return Path(cluster["certificate-authority"]).read_bytes()
    return None


def _named(entries: Any, name: Any, what: str) -> dict[str, Any]:
    for entry in entries or []:
        if entry.get("name") == name:
            return cast(dict[str, Any], entry.get(what) or {})
    raise ValueError(f"the kubeconfig has no {what} named {name!r}")


def _ssl_context(cluster: Mapping[str, Any], user: Mapping[str, Any]) -> ssl.SSLContext:
    context = ssl.create_default_context()
    if cluster.get("insecure-skip-tls-verify"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    elif cluster.get("certificate-authority-data"):
        context.load_verify_locations(cadata=base64.b64decode(cluster["certificate-authority-data"]).decode())
    elif cluster.get("certificate-authority"):
        context.load_verify_locations(cafile=cluster["certificate-authority"])
    cert, key = _pem(user, "client-certificate"), _pem(user, "client-key")
    if cert is not None:
        with tempfile.TemporaryDirectory() as scratch:  # ssl loads certificate chains from files only
            cert_file, key_file = Path(scratch, "cert.pem"), Path(scratch, "key.pem")
            cert_file.write_bytes(cert)
            key_file.write_bytes(key or b"")
            os.chmod(key_file, 0o600)
            context.load_cert_chain(cert_file, key_file if key else None)
    return context


def _pem(user: Mapping[str, Any], name: str) -> bytes | None:
    if user.get(f"{name}-data"):
        return base64.b64decode(user[f"{name}-data"])
    if user.get(name):
        return Path(user[name]).read_bytes()
    return None


class KubeClient:
    """JSON over HTTP to one API server. Open it (`async with`) inside the event loop that uses it."""

    def __init__(self, endpoint: Endpoint | str, *, timeout: float = 10.0) -> None:
        self.endpoint = endpoint if isinstance(endpoint, Endpoint) else Endpoint(server=endpoint.rstrip("/"))
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> KubeClient:
        headers = {"Accept": JSON, "User-Agent": "shardwise-devcluster"}
        if self.endpoint.token:
            headers["Authorization"] = f"Bearer {self.endpoint.token}"
        self._session = aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the client is not open: use `async with KubeClient(...)`")
        return self._session

    async def request(self, method: str, path: str, *, body: Any = None, content_type: str = JSON,
                      params: Mapping[str, str] | None = None, timeout: float | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": content_type} if data is not None else {}
        async with self.session.request(method, self.endpoint.server + path, data=data, headers=headers,
                                        params=dict(params or {}), ssl=self._ssl(),
                                        timeout=aiohttp.ClientTimeout(total=timeout or self.timeout)) as response:
            raw = await response.read()
            try:
                answer = json.loads(raw) if raw else None
            except ValueError:
                answer = {"message": raw.decode(errors="replace")}
            if response.status >= 400:
                raise ApiError(response.status, answer)
            return answer

    async def get(self, path: str, **params: str) -> Any:
        return await self.request("GET", path, params=params)

    async def create(self, path: str, body: Obj) -> Any:
        return await self.request("POST", path, body=body)

    async def patch(self, path: str, body: Any, content_type: str = MERGE) -> Any:
        return await self.request("PATCH", path, body=body, content_type=content_type)

    async def delete(self, path: str, body: Obj | None = None) -> Any:
        return await self.request("DELETE", path, body=body)

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncIterator[Obj]:
        """The events of one watch request, until the server ends it."""
        query = {**params, "watch": "true"}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout)
        async with self.session.get(self.endpoint.server + path, params=query, ssl=self._ssl(),
                                    timeout=timeout) as response:
            if response.status >= 400:
                raise ApiError(response.status, await _json_or_none(response))
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)

    def _ssl(self) -> ssl.SSLContext | bool:
        return self.endpoint.ssl_context if self.endpoint.ssl_context is not None else True


async def _json_or_none(response: aiohttp.ClientResponse) -> Any:
    with contextlib.suppress(ValueError, aiohttp.ContentTypeError):
        return await response.json(content_type=None)
    return None


def key_of(obj: Mapping[str, Any]) -> Key:
    metadata = obj.get("metadata") or {}
    return (metadata.get("namespace") or "", metadata.get("name") or "")


class Informer:
    """The objects of one collection (`path`, e.g. `/api/v1/pods`, with optional selectors), kept current.

    `on_change(type, obj)` is called for every change (ADDED, MODIFIED, DELETED) after the cache holds it, from
    the informer's task; it must not block. `synced` is set once the first list is in the cache.
    """

    def __init__(self, client: KubeClient, path: str, on_change: Callable[[str, Obj], None], *,
                 field_selector: str = "", label_selector: str = "", watch_timeout: int = 300,
                 retry_delay: float = 1.0) -> None:
        self.client, self.path, self.on_change = client, path, on_change
        self.params = {name: value for name, value in (("fieldSelector", field_selector),
                                                      ("labelSelector", label_selector)) if value}
        self.watch_timeout, self.retry_delay = watch_timeout, retry_delay
        self.objects: dict[Key, Obj] = {}
        self.synced = asyncio.Event()

    async def run(self) -> None:
        while True:
            try:
                version: str | None = await self._relist()
                while version is not None:
                    version = await self._watch(version)
            except (TimeoutError, ApiError, aiohttp.ClientError, ValueError) as e:
                log.warning("informer %s: %s; retrying in %.1f s", self.path, e, self.retry_delay)
                await asyncio.sleep(self.retry_delay)  # a failing API is retried at a steady pace

    async def _relist(self) -> str:
        listing = await self.client.get(self.path, **self.params)
        fresh = {key_of(obj): obj for obj in listing.get("items") or []}
        gone = [obj for key, obj in self.objects.items() if key not in fresh]
        changed = [(("MODIFIED" if key in self.objects else "ADDED"), obj) for key, obj in fresh.items()
                   if self.objects.get(key) != obj]
        self.objects = fresh
        self.synced.set()
        for obj in gone:
            self.on_change("DELETED", obj)
        for kind, obj in changed:
            self.on_change(kind, obj)
        return str(listing["metadata"]["resourceVersion"])

    async def _watch(self, version: str) -> str | None:
        """Follow one watch request; the resourceVersion to resume from, or None to relist (410 Gone)."""
        params = {**self.params, "resourceVersion": version, "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(self.watch_timeout)}
        async for event in self.client.watch(self.path, params):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    return None
                raise ApiError(int(obj.get("code") or 500), obj)
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if kind == "BOOKMARK":
                continue
            if kind == "DELETED":
                self.objects.pop(key_of(obj), None)
            else:
                self.objects[key_of(obj)] = obj
            self.on_change(str(kind), obj)
        return version
