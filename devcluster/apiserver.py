"""A Kubernetes API server for the local cluster: kmock's `KubernetesEmulator` extended with the semantics that
kubectl, the kubernetes client and kopf rely on, served over HTTPS and HTTP on 127.0.0.1 from a background thread.

    server = APIServer()
    url = server.start()                      # http://127.0.0.1:<ephemeral port>; server.secure_url: https://...
    server.write_kubeconfig(".shardwise/dev/kubeconfig")   # the admin's token and the CA, over HTTPS
    ...                                       # kubectl --kubeconfig .shardwise/dev/kubeconfig get pods
    server.stop()                             # ends open watches, frees the ports

Identity, as strict as a real API server's, with one documented leniency:

- Authentication (auth.py): an `Authorization` header must be `Bearer <token>` (the scheme in any case, as
  Kubernetes reads it) with a token the server knows: the admin's (random per server, in the kubeconfig it writes;
  the user `kubernetes-admin` in `system:masters`) or a ServiceAccount token it issued that has not expired and
  whose ServiceAccount (and the Pod or Secret it is bound to) still exist with the uids it names. Anything else (a
  wrong or expired token, `Bearer bearer <token>`, `Basic ...`) is 401 `{"kind": "Status", "status": "Failure",
  "message": "Unauthorized", "reason": "Unauthorized", "code": 401}`. A request without credentials is anonymous
  (`system:anonymous`) on the HTTPS port, as there. THE ONE LENIENCY: on the plain-HTTP port a request with no
  `Authorization` header at all is served as the admin, as the API server's old localhost insecure port served
  every request, so that the many test clients that speak plain HTTP without credentials keep working. A header,
  when sent, is checked there too.
- Authorization (rbac.py): the admin may do anything; every other user is judged by RBAC over the stored Roles,
  ClusterRoles, RoleBindings and ClusterRoleBindings (and the bootstrap policy: discovery and the health paths for
  every authenticated user), from the request's verb, API group, resource/subresource, namespace and name; a
  refusal is 403 with Kubernetes' message (`pods is forbidden: User "system:serviceaccount:ns:sa" cannot list
  resource "pods" in API group "" in the namespace "ns"`).
- ServiceAccounts: the TokenRequest subresource (`POST .../serviceaccounts/NAME/token`, what a kubelet and `kubectl
  create token` send) issues tokens, bound to a Pod or a Secret if asked; every namespace has a ServiceAccount
  `default`, made with it (and again when deleted), as Kubernetes' ServiceAccount controller makes it.
  SelfSubjectAccessReview (`kubectl auth can-i`) and SelfSubjectReview (`kubectl auth whoami`) answer.
- TLS: the HTTPS port serves a certificate for 127.0.0.1 and the `kubernetes.default.svc` names, signed by a CA
  made per server (`credentials`, which a restarted server is given again); a kubeconfig and a pod's `ca.crt`
  trust that CA, so that an in-cluster client connects as on a real cluster.

What kmock provides and is kept: the request model, the reaction DSL (`emulator['get /x'] << b'...'`, which
runs before the Kubernetes fallbacks), the object store with its history (`emulator.objects`), the resource
registry (`emulator.resources`), the group discovery (`/apis`, `/apis/GROUP`) and the rendering of errors and
streams. What this module adds (docs/domain.md section 6 lists what kmock 0.8 lacks), besides its own path parsing
(paths.py) and bounded request and object histories (kmock keeps everything, and its matching slows with it):

- Resources: the built-in kinds of `resources.BUILTINS` (core, apps, coordination.k8s.io, policy,
  networking.k8s.io, apiextensions.k8s.io, rbac: RBAC is enforced (above); a NetworkPolicy is stored, never
  enforced: it filters no traffic) and,
  for every applied CRD, its served versions with their status and scale subresources, in discovery at once.
  `/api/v1` reports `v1`; `/version` reports v1.32.
- Metadata: uid, creationTimestamp, generation (moved by spec changes only), `generateName`, the namespace from
  the URL (which must exist), and a numeric resourceVersion from one global counter, taken by every write that
  changes something (a write that changes nothing is not stored and keeps its resourceVersion, as in Kubernetes).
- Writes: POST, PUT, PATCH (merge, JSON and strategic merge: see patches.py), DELETE of one object or of a
  selection; 409 on a duplicate name or a stale resourceVersion, 422 on a failed JSON-patch `test`.
- Server-side apply (`PATCH` as `application/apply-patch+yaml`, `fieldManager`, `force`; `kubectl apply
  --server-side`, also on `/status`): creates the object when absent, else merges the configuration into it, and
  keeps `metadata.managedFields` for every write (an apply as `Apply`, any other write as `Update` by its
  `fieldManager` or User-Agent): 409 with a FieldManagerConflict cause per field another manager set to another
  value unless forced, removal of what an applier stops applying. See fields.py.
- Status and scale subresources: a write to the object keeps its status, a write to `/status` keeps the rest;
  `/scale` maps to the paths the CRD declares (`kubectl scale`). See objects.py.
- Finalizers: a delete only sets `deletionTimestamp` while finalizers remain, and removing the last one deletes.
  A Pod bound to a node is deleted gracefully (its node finishes the deletion with a zero grace period).
- Garbage collection of `metadata.ownerReferences`, done at once inside the delete (and written, with its
  MODIFIED and DELETED events, after the owner's change), with the `propagationPolicy` (or `orphanDependents`) of
  the DeleteOptions body or query: Background (the default) deletes the dependents once the owner is gone,
  recursively; Foreground gives the owner `deletionTimestamp` and the `foregroundDeletion` finalizer, deletes its
  dependents and deletes the owner once none with `blockOwnerDeletion: true` is left; Orphan (the `orphan`
  finalizer) removes the dependents' references to the owner and keeps them. A dependent with another live owner
  is kept and loses only its references to owners gone or going; a dependent's own finalizers hold it as usual.
  Dependents of a namespaced owner are looked for in its namespace only; the references are matched by uid. An
  object created when all of its owners were deleted before (a controller's write that raced its owner's
  deletion) is deleted at once, as Kubernetes' collector deletes a dependent whose owners are gone; a reference
  to an owner this server never held is left alone.
- Binding: `POST pods/NAME/binding` (a Binding naming a Node) sets `spec.nodeName` and the `PodScheduled=True`
  condition once; a pod already bound or being deleted answers 409, as in Kubernetes (`spec.nodeName` itself
  stays writable here, unlike there).
- Lists and watches: label and field selectors (selectors.py), `kind`/`apiVersion` and the list's
  resourceVersion; pages (`limit`, `continue`) that show the list as it was at its first page, 410 once the
  history behind a token is gone (paging.py); a watch from a resourceVersion replays only the later changes it
  retains (changelog.py) and answers an ERROR event with 410 (Expired) when they are gone; objects entering or
  leaving a selection arrive as ADDED or DELETED; `timeoutSeconds`; BOOKMARK events with
  `allowWatchBookmarks=true` (every `bookmark_interval` seconds and when the watch times out); streams are
  `application/json` lines.
- Snapshots (`shardwise dev up --persist`): `snapshot()` returns every live object at its latest version, metadata
  intact, and the revision counter; `Emulator(restore=snapshot)` (or `APIServer(restore=...)`) starts from one
  before the server answers: CRDs first (so their resources are served), no object's metadata rewritten, the
  counter continuing after the highest stored resourceVersion (a client's resourceVersion never goes backwards)
  and no history before it (a watch or a page from an older resourceVersion is 410 Gone, as after a compaction).
- Tables: reads and watches that ask for them (`Accept: application/json;as=Table;v=v1;g=meta.k8s.io`, as
  `kubectl get` does) get `meta.k8s.io` Tables with a CRD's printer columns or kubectl's columns of the built-in
  kinds (tables.py).

- CEL validation: a custom resource's `x-kubernetes-validations` rules are checked on every write that changes it
  outside its status (create, update, patch, apply, `/scale`), with cel-python; 422 with each broken rule's
  message, as the API server answers (validation.py says what of it is kept). A CRD whose rules or
  messageExpressions take a form whose CEL cost is not known to be bounded is refused as over the cost budget (422
  `...x-kubernetes-validations[0].messageExpression: Forbidden: estimated messageExpression cost exceeds budget by
  factor of more than 100x ...`): a conservative guard, not Kubernetes' estimator (celcost.py).
- Strict decoding of CRDs: a field a CustomResourceDefinition's type lacks (anywhere: a JSONSchemaProps keyword
  such as `propertyNames`, a rule's misspelt key) is an unknown field, handled as the write's `fieldValidation`
  says: `Strict` (kubectl's default) refuses it (400 `strict decoding error: unknown field "spec.versions[0]
  .schema.openAPIV3Schema.properties.x.propertyNames"`), `Warn` (the default) and `Ignore` drop it, `Warn` with a
  `Warning` header; server-side apply refuses it whatever the directive (decoding.py).
- Protobuf bodies (`application/vnd.kubernetes.protobuf`, what `kubectl create secret|configmap|namespace|
  serviceaccount|token` and `kubectl auth` send) of Secrets, ConfigMaps, Namespaces, ServiceAccounts,
  TokenRequests and the two reviews are read (protowire.py); other kinds' protobuf bodies are refused (415).

Not emulated (yet): namespace deletion of contents, OpenAPI schemas (openapi.py publishes the operations kubectl's
default validation asks about, not the field schemas), schema
validation other than CEL rules, defaulting and pruning of custom resources (so server-side apply takes every
list of a custom resource whole: no `x-kubernetes-list-type` is read), conversion between CRD versions (each
version is stored apart), apply to `/scale`, `dryRun`, protobuf request bodies of other kinds (415: e.g.
`kubectl create deployment`), strict decoding of kinds other than CRDs, POST subresources other than `pods/binding`
and `serviceaccounts/token` (`pods/eviction`), client certificates, impersonation, TokenReview,
SelfSubjectRulesReview, admission webhooks (and admission plugins: a pod's ServiceAccount is not checked when it is
created), and every controller but the ServiceAccount one: the scheduler and the nodes are clients of this server
(scheduler.py, kubelet.py).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import dataclasses
import datetime
import json
import logging
import os
import random
import re
import secrets
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal.rendering import Response, StreamingError  # not in kmock's __all__

from . import auth, celcost, decoding, errors, fields, objects, openapi, paging, protowire, rbac, tables, validation
from .background import BackgroundLoop
from .changelog import Change, ChangeLog, Expired
from .objects import meta
from .patches import APPLY, PatchError, apply_patch, media_type, merge_keys_of
from .paths import parse_request
from .resources import (
    BUILTINS,
    CRDS,
    NAMESPACES,
    PODS,
    RBAC_GROUP,
    SECRETS,
    SERVICEACCOUNTS,
    ScalePaths,
    ServedResource,
    api_version,
    discovery_entries,
    from_crd,
)
from .selectors import Selection, SelectorError, parse_fields, parse_labels

log = logging.getLogger(__name__)

DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
DEFAULT_ACCOUNT = "default"  # the ServiceAccount every namespace has, and pods run as unless they name another
_REVIEWS = ("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            "/apis/authentication.k8s.io/v1/selfsubjectreviews")
SNAPSHOT_FORMAT = 1  # the layout of Emulator.snapshot(); restore refuses others
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_WATCH_HEADERS = {"Content-Type": "application/json"}  # client-go decodes watch streams by this type


@dataclasses.dataclass(frozen=True)
class _Watch:
    start: int  # the revision after which changes are sent
    bookmarks: bool
    timeout: int | None
    initial_events_end: bool  # bookmark the end of the initial events (sendInitialEvents=true)
    initial: list[dict[str, Any]] = dataclasses.field(default_factory=list)


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator with Kubernetes write, watch and discovery semantics (see the module docstring).

    Every write is one synchronous step on the server's event loop (no await between reading the stored object
    and storing the next one), so requests never interleave inside a write and no lock is needed.
    """

    history_limit: int = 10_000  # changes a watch can resume from; older resourceVersions are 410 Gone
    bookmark_interval: float = 60.0  # seconds between BOOKMARK events on watches that ask for them
    object_history: int = 4  # versions kept per object in `objects` (kmock keeps all of them)
    request_history: int = 1  # requests kept for kmock's request views (kmock keeps all of them)
    requests_served: int = attrs.field(default=0, init=False)
    clock: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC)
    rng: random.Random = attrs.field(factory=random.Random)
    restore: dict[str, Any] | None = None  # a snapshot() to start from
    credentials: auth.Credentials = attrs.field(factory=auth.Credentials.generate)  # the admin's and SA tokens
    min_token_seconds: int = 600  # the shortest expirationSeconds a TokenRequest may ask for (Kubernetes: 10 min)
    _changes: ChangeLog = attrs.field(init=False)
    _policy: rbac.Policy | None = attrs.field(default=None, init=False)  # the stored RBAC, built when asked

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._changes = ChangeLog(self.history_limit)
        for resource, info in BUILTINS:
            self.resources[resource] = copy.deepcopy(info)
        if self.restore is not None:
            self._restore(self.restore)
        self.fallback[kmock.method.PUT] << self._serve_replace
        self.fallback[kmock.method.DELETE] << self._serve_delete_collection
        self.fallback[kmock.method.POST] << self._serve_post_subresource
        for probe in ("healthz", "livez", "readyz"):
            self.fallback[f"get /{probe}"] << b"ok"
        for name in DEFAULT_NAMESPACES:
            if self._stored(NAMESPACES, None, name) is None:
                self._create(NAMESPACES, None, name, {"metadata": {"name": name}})
        for namespace in self._list(NAMESPACES, None):  # restored ones too: the controller makes what is missing
            self._ensure_default_account(namespace)

    @property
    def revision(self) -> int:
        """The resourceVersion of the latest write."""
        return self._changes.revision

    def close_watches(self) -> None:
        self._changes.close()

    # -- snapshots ----------------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Every live object at its latest version (copies, metadata intact) and the revision counter, as
        `{"format": 1, "revision": N, "objects": [{"resource": [GROUP, VERSION, PLURAL], "object": {...}}]}`,
        CRDs and namespaces first. Synchronous: on the server's loop it sees no write half-done."""
        entries = [{"resource": [resource.group or "", resource.version, resource.plural],
                    "object": copy.deepcopy(obj)} for resource, obj in self._live()]
        entries.sort(key=_snapshot_order)
        return {"format": SNAPSHOT_FORMAT, "revision": self.revision, "objects": entries}

    def _restore(self, snapshot: dict[str, Any]) -> None:
        """Store a snapshot's objects as they are (no revision taken, no change recorded) and move the counter
        to its highest revision. ValueError when it is malformed (see `restorable`)."""
        highest, entries = restorable(snapshot)
        for resource, obj in entries:
            if resource not in self.resources:  # a custom resource whose CRD is not in the snapshot
                log.warning("not restoring %s %s: no CRD serves it", resource.plural, meta(obj)["name"])
                continue
            self._objects[resource, meta(obj).get("namespace"), meta(obj)["name"]] = obj
            if resource == CRDS:
                self._sync_crd("ADDED", obj, None)
        self._changes.revision = highest
        self._changes._compacted = highest  # no history before the snapshot: older resourceVersions are 410 Gone

    # -- HTTP entry point -------------------------------------------------------------------------------------

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # kmock's own entry point parses paths that fail on `/api/v1/namespaces`; this one parses them itself.
        request = await parse_request(raw_request, id=self.requests_served)
        self._remember(request)
        user = self._authenticate(request.headers.get("Authorization", ""), secure=raw_request.secure)
        if user is None:
            log.info("401 Unauthorized: %s %s", request.method, request.url.path)
            return aiohttp.web.json_response(auth.UNAUTHORIZED, status=401)
        attributes = None if rbac.MASTERS in user.groups else \
            rbac.attributes(user, request.method, request.url.path, request.params)  # the admin needs no look
        if attributes is not None and not self._rbac().allows(attributes):
            message = rbac.forbidden_message(attributes)
            log.info("403 Forbidden: %s", message)  # what a missing grant looks like, in the server's log
            return aiohttp.web.json_response({**errors.status(403, "Forbidden", message),
                                              "details": rbac.forbidden_details(attributes)}, status=403)
        try:
            if request.method.upper() == "POST" and request.url.path in _REVIEWS:
                return await self._serve_review(request, user)
            if request.method.upper() == "GET" and (request.url.path + "/").startswith(openapi.PREFIX + "/"):
                document = openapi.serve(request.url.path, [(r, self._info(r)) for r in self.resources])
                if document is None:
                    raise errors.unknown_resource(request.url.path)
                return aiohttp.web.json_response(document)
            return await self._handle(request)
        except StreamingError as e:  # the stream had started: end it with an ERROR event
            log.error("watch stream failed: %s", request.url, exc_info=e.__cause__)
            raw_response: aiohttp.web.StreamResponse = e.args[0]
            with contextlib.suppress(ConnectionError):
                await self._stream_error(cast(Exception, e.__cause__), raw_response)
                await raw_response.write_eof()
            return raw_response
        except Exception as e:
            if not isinstance(e, kmock.KubernetesError):
                log.exception("request failed: %s %s", request.method, request.url)
            return await self._render_error(e)

    def _remember(self, request: kmock.Request) -> None:
        """Keep only the latest requests: kmock keeps them all, and matches each request to its reaction by
        scanning them (32 kept requests cost 5 ms a request)."""
        self.requests_served += 1
        _keep_last(self._requests, self.request_history - 1)
        self._requests.append(request)
        for reaction in self._payloads:
            _keep_last(reaction._requests, self.request_history)

    # -- authentication and authorization --------------------------------------------------------------------

    def _authenticate(self, header: str, *, secure: bool) -> auth.User | None:
        """Who sends the request (auth.py): the admin, a ServiceAccount, or, without credentials, the admin on the
        plain-HTTP port (the old insecure port) and anonymous on the TLS port; None when its credentials are
        refused (401)."""
        if not header.strip():
            return auth.ANONYMOUS if secure else auth.ADMIN
        token = auth.bearer_token(header)
        if token is None:
            return None
        if secrets.compare_digest(token.encode(), self.credentials.admin_token.encode()):
            return auth.ADMIN
        claims = self.credentials.verify(token, self.clock())
        if claims is None:
            return None
        private = claims["kubernetes.io"]
        namespace, account = str(private.get("namespace") or ""), private.get("serviceaccount") or {}
        stored = self._stored(SERVICEACCOUNTS, namespace, str(account.get("name") or ""))
        if stored is None or meta(stored).get("uid") != account.get("uid"):
            return None  # its ServiceAccount was deleted (or deleted and made again)
        for kind, resource in (("pod", PODS), ("secret", SECRETS)):
            bound = private.get(kind)
            if bound is not None:
                held = self._stored(resource, namespace, str(bound.get("name") or ""))
                if held is None or meta(held).get("uid") != bound.get("uid"):
                    return None  # the object it was bound to is gone
        return auth.service_account_user(namespace, str(account["name"]), str(account.get("uid") or ""))

    def _rbac(self) -> rbac.Policy:
        """The stored RBAC objects as a policy, built again after any of them changed (`_store` forgets it)."""
        if self._policy is None:
            def stored(plural: str) -> list[dict[str, Any]]:
                return self._list(kmock.resource(RBAC_GROUP, "v1", plural), None)

            self._policy = rbac.Policy.of(roles=stored("roles"), cluster_roles=stored("clusterroles"),
                                          role_bindings=stored("rolebindings"),
                                          cluster_bindings=stored("clusterrolebindings"))
        return self._policy

    async def _serve_review(self, request: kmock.Request, user: auth.User) -> aiohttp.web.StreamResponse:
        """A SelfSubjectAccessReview (`kubectl auth can-i`): may the requester do what its spec says? Or a
        SelfSubjectReview (`kubectl auth whoami`): who is it?"""
        subject_review = request.url.path == _REVIEWS[1]
        body = _request_body(request, *(("authentication.k8s.io/v1", "SelfSubjectReview") if subject_review
                                        else ("authorization.k8s.io/v1", "SelfSubjectAccessReview")))
        spec = body.get("spec") or {}
        if subject_review:
            info = {"username": user.name, "groups": list(user.groups), **({"uid": user.uid} if user.uid else {})}
            return aiohttp.web.json_response({"kind": "SelfSubjectReview", "apiVersion": "authentication.k8s.io/v1",
                                              "metadata": {"creationTimestamp": None},
                                              "status": {"userInfo": info}}, status=201)
        resource, other = spec.get("resourceAttributes"), spec.get("nonResourceAttributes")
        if (resource is None) == (other is None):
            raise errors.invalid(kmock.resource("authorization.k8s.io", "v1", "selfsubjectaccessreviews"), "",
                                 "spec: Invalid value: exactly one of nonResourceAttributes or resourceAttributes "
                                 "must be specified")
        if resource is not None:
            asked = rbac.Attributes(user, str(resource.get("verb") or ""), "", resource_request=True,
                                    group=str(resource.get("group") or ""),
                                    resource=str(resource.get("resource") or ""),
                                    subresource=str(resource.get("subresource") or ""),
                                    namespace=str(resource.get("namespace") or ""),
                                    name=str(resource.get("name") or ""))
        else:
            paths: dict[str, Any] = other or {}
            asked = rbac.Attributes(user, str(paths.get("verb") or ""), str(paths.get("path") or ""),
                                    resource_request=False)
        return aiohttp.web.json_response({"kind": "SelfSubjectAccessReview", "apiVersion": "authorization.k8s.io/v1",
                                          "metadata": {"creationTimestamp": None}, "spec": spec,
                                          "status": {"allowed": self._rbac().allows(asked)}}, status=201)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # kmock's emulator stores writes here, before the reactions run; this one stores them in its reactions.
        return await kmock.RawHandler._handle(self, request)

    # -- discovery ----------------------------------------------------------------------------------------------

    def _get_resources(self) -> list[kmock.resource]:
        return list(iter(self.resources))

    async def _serve_version(self, request: kmock.Request) -> dict[str, Any]:
        wanted = cast(kmock.resource, request.resource)
        served = sorted(((resource, self._info(resource)) for resource in self.resources
                         if (resource.group, resource.version) == (wanted.group, wanted.version)),
                        key=lambda item: str(item[0].plural))
        if not served:
            raise errors.unknown_resource(request.url.path)
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": api_version(wanted),
                "resources": [entry for resource, info in served for entry in discovery_entries(resource, info)]}

    async def _serve_server_version(self, request: kmock.Request) -> dict[str, Any]:
        return {"major": "1", "minor": "32", "gitVersion": "v1.32.0", "gitTreeState": "clean",
                "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.23", "compiler": "gc",
                "platform": "linux/amd64"}

    # -- reads --------------------------------------------------------------------------------------------------

    async def _serve_list(self, request: kmock.Request) -> Response:
        resource, info = self._served(request)
        selection = self._selection(request, info)
        printer = self._printer(request, info)
        page = _page(request)
        revision = self._changes.revision if page.revision is None else page.revision
        selected = [obj for obj in self._snapshot(resource, request.namespace, revision) if selection.selects(obj)]
        items, after, remaining = paging.paginate(selected, page)
        metadata: dict[str, Any] = {"resourceVersion": str(revision)}
        if after is not None:
            metadata["continue"] = paging.encode_token(revision, after)
            if not (selection.labels or selection.fields):
                metadata["remainingItemCount"] = remaining
        if printer is not None:
            return _reply(printer.table(items, now=self.clock(), metadata=metadata))
        return _reply(self._list_of(resource, info, items, metadata))

    async def _serve_fetch(self, request: kmock.Request) -> Response:
        _, info = self._served(request)
        current = self._require(request, info)
        if request.subresource == "scale":
            return _reply(objects.scale_of(current, self._scale_paths(info)))
        printer = self._printer(request, info)
        if printer is not None:
            return _reply(printer.table([current], now=self.clock(),
                                        metadata={"resourceVersion": meta(current)["resourceVersion"]}))
        return _reply(current)

    # -- writes -------------------------------------------------------------------------------------------------

    async def _serve_create(self, request: kmock.Request) -> Response:
        resource, info = self._served(request)
        if request.subresource:
            raise errors.method_not_allowed(f"POST is not supported on {resource.plural}/{request.subresource}")
        body, warning = _decoded(request, resource, info, _body(request))
        namespace = self._create_namespace(request, info, body)
        name = self._create_name(resource, namespace, body)
        return _reply(self._create(resource, namespace, name, body, writer=self._writer(request, resource)),
                      status=201, warning=warning)

    async def _serve_post_subresource(self, request: kmock.Request) -> Response:
        """POST to a named object: `pods/NAME/binding` (what a scheduler sends) and `serviceaccounts/NAME/token`
        (a TokenRequest: what a kubelet sends for a pod, or `kubectl create token`)."""
        if request.resource == SERVICEACCOUNTS and request.subresource == "token" and request.namespace is not None:
            return self._serve_token(request)
        if request.resource != PODS or request.subresource != "binding" or request.namespace is None:
            raise errors.method_not_allowed(f"POST is not supported on {request.url.path}")
        current = self._require(request, self._info(PODS))
        target = _body(request).get("target") or {}
        name = str(request.name)
        if target.get("kind", "Node") != "Node" or not target.get("name"):
            raise errors.invalid(PODS, name, "target: Invalid value: a Binding names a Node (target.kind, "
                                 "target.name)")
        if (current.get("spec") or {}).get("nodeName"):
            raise errors.conflict(PODS, name, f"pod {name} is already assigned to node "
                                  f"\"{current['spec']['nodeName']}\"")
        if meta(current).get("deletionTimestamp"):
            raise errors.conflict(PODS, name, f"pod {name} is being deleted, cannot be assigned to a host")
        self._write(PODS, current, objects.bound(current, str(target["name"]), now=self.clock()))
        return _reply({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201},
                      status=201)

    def _serve_token(self, request: kmock.Request) -> Response:
        """A ServiceAccount token (auth.py) for `spec.expirationSeconds` (default 3600, at least
        `min_token_seconds`), for `spec.audiences` (default the API's), bound to `spec.boundObjectRef` (a Pod,
        which must run as this ServiceAccount, or a Secret) if given."""
        account = self._require(request, self._info(SERVICEACCOUNTS))
        name, namespace = str(request.name), str(request.namespace)
        body = _request_body(request, "authentication.k8s.io/v1", "TokenRequest")
        if body.get("kind", "TokenRequest") != "TokenRequest":
            raise errors.bad_request(f"the body is a {body.get('kind')}, not a TokenRequest")
        spec = dict(body.get("spec") or {})
        seconds = spec.get("expirationSeconds", 3600)
        if not isinstance(seconds, int) or isinstance(seconds, bool) or seconds < self.min_token_seconds:
            minimum = f"{self.min_token_seconds // 60} minutes" if self.min_token_seconds % 60 == 0 \
                else f"{self.min_token_seconds} seconds"
            raise _invalid_token_request(name, f"spec.expirationSeconds: Invalid value: {json.dumps(seconds)}: may "
                                         f"not specify a duration less than {minimum}")
        if seconds > 2**32:
            raise _invalid_token_request(name, f"spec.expirationSeconds: Invalid value: {seconds}: may not specify "
                                         "a duration larger than 2^32 seconds")
        spec["expirationSeconds"] = seconds
        spec["audiences"] = list(spec.get("audiences") or auth.API_AUDIENCES)
        bound = self._bound_object(name, namespace, spec.get("boundObjectRef"))
        now = self.clock()
        claims = auth.token_claims(namespace=namespace, name=name, uid=meta(account)["uid"],
                                   audiences=spec["audiences"], issued=now, seconds=seconds, bound=bound)
        expires = now + datetime.timedelta(seconds=seconds)
        return _reply({"kind": "TokenRequest", "apiVersion": "authentication.k8s.io/v1",
                       "metadata": {"name": name, "namespace": namespace, "creationTimestamp": None}, "spec": spec,
                       "status": {"token": self.credentials.issue(claims),
                                  "expirationTimestamp": objects.timestamp(expires)}}, status=201)

    def _bound_object(self, account: str, namespace: str, ref: Any) -> dict[str, str] | None:
        """The Pod or Secret a token is bound to ({"kind", "name", "uid"}), checked as Kubernetes checks it."""
        if not ref:
            return None
        kind, name = str(ref.get("kind") or ""), str(ref.get("name") or "")
        if kind not in ("Pod", "Secret") or ref.get("apiVersion", "v1") != "v1":
            raise errors.bad_request(f"cannot bind token to object of type {ref.get('apiVersion', 'v1')}, "
                                     f"Kind={kind}")
        resource = PODS if kind == "Pod" else SECRETS
        held = self._stored(resource, namespace, name)
        if held is None:
            raise errors.not_found(resource, name)
        if kind == "Pod" and ((held.get("spec") or {}).get("serviceAccountName") or "default") != account:
            raise errors.bad_request(f'cannot bind token for serviceaccount "{account}" to pod running with '
                                     "different serviceaccount name.")
        if ref.get("uid") and ref["uid"] != meta(held)["uid"]:
            raise errors.conflict(resource, name, f"the UID in the bound object reference ({ref['uid']}) does not "
                                  "match the UID in record. The object might have been deleted and then recreated")
        return {"kind": kind, "name": name, "uid": meta(held)["uid"]}

    async def _serve_update(self, request: kmock.Request) -> Response:
        resource, info = self._served(request)
        content_type = request.headers.get("Content-Type")
        if media_type(content_type) == APPLY:
            return self._serve_apply(request, resource, info)
        if "force" in request.params:
            raise _invalid_options("force: Forbidden: may not be specified for non-apply patch", "PatchOptions")
        current = self._require(request, info)
        if request.subresource == "scale":
            paths = self._scale_paths(info)
            scale = _patched(objects.scale_of(current, paths), request, content_type, kind="Scale", builtin=True)
            return _reply(objects.scale_of(self._scale(request, info, current, scale), paths))
        body = _patched(current, request, content_type, kind=str(info.kind), builtin=info.builtin)
        body, warning = _decoded(request, resource, info, body)
        return _reply(self._update(request, info, current, body), warning=warning)

    def _serve_apply(self, request: kmock.Request, resource: kmock.resource, info: ServedResource) -> Response:
        """Server-side apply (fields.py): create the object from the configuration when it is absent, else merge
        the configuration into it, with field ownership and its conflicts."""
        if request.subresource not in (None, "status"):
            raise errors.method_not_allowed(f"server-side apply is not supported on {resource.plural}/"
                                            f"{request.subresource}")
        applier, force = _applier(request, resource, now=self.clock())
        config = _apply_config(request, resource, info)
        _check_applied_fields(request, resource, info, config)
        body = objects.applicable(config, info=info, subresource=request.subresource)
        keys = merge_keys_of(str(info.kind), builtin=info.builtin)
        current = self._stored(resource, request.namespace if info.namespaced else None, str(request.name))
        try:
            if current is None:
                if request.subresource is not None:
                    raise errors.not_found(resource, str(request.name))
                namespace = self._create_namespace(request, info, config)
                name = self._create_name(resource, namespace, {"metadata": {"name": request.name}})
                if meta(config).get("resourceVersion"):
                    raise errors.not_found(resource, name)  # a precondition on an object that is not there
                obj, managers = fields.apply({}, body, [], applier, keys, force=force)
                return _reply(self._create(resource, namespace, name, obj, managers=managers), status=201)
            _check_fresh(resource, current, config)
            merged, managers = fields.apply(current, body, fields.managers_of(current), applier, keys, force=force)
        except fields.Conflicts as e:
            raise kmock.KubernetesError(status=409, reason="Conflict", message=e.message,
                                        details={"causes": e.causes()}) from e
        new = fields.with_managers(objects.updated(current, merged, info=info, subresource=request.subresource),
                                   managers)
        return _reply(self._store_update(resource, current, new))

    async def _serve_replace(self, request: kmock.Request) -> Response:
        resource, info = self._served(request)
        if request.name is None:
            raise errors.method_not_allowed(f"PUT is not supported on the collection {resource.plural}")
        current = self._require(request, info)
        body = _body(request)
        if request.subresource == "scale":
            return _reply(objects.scale_of(self._scale(request, info, current, body), self._scale_paths(info)))
        body, warning = _decoded(request, resource, info, body)
        return _reply(self._update(request, info, current, body), warning=warning)

    async def _serve_delete(self, request: kmock.Request) -> Response:
        resource, info = self._served(request)
        if request.subresource:
            raise errors.method_not_allowed(f"DELETE is not supported on {resource.plural}/{request.subresource}")
        current = self._require(request, info)
        obj, gone = self._delete(resource, current, _delete_options(request))
        return _reply(obj, status=200 if gone else 202)

    async def _serve_delete_collection(self, request: kmock.Request) -> Response:
        if request.name is not None:
            return await self._serve_delete(request)
        resource, info = self._served(request)
        selection = self._selection(request, info)
        options = {key: value for key, value in _delete_options(request).items() if key != "preconditions"}
        chosen = [obj for obj in self._list(resource, request.namespace) if selection.selects(obj)]
        deleted = [self._delete(resource, obj, options)[0] for obj in chosen]
        return _reply(self._list_of(resource, info, deleted))

    # -- watch --------------------------------------------------------------------------------------------------

    async def _serve_watch(self, request: kmock.Request) -> Response:  # type: ignore[override]
        # kmock's watch is the stream itself; this one wraps it in a Response to set its content type.
        resource, info = self._served(request)
        selection = self._selection(request, info)
        watch = self._watch_options(request, resource, selection)
        printer = self._printer(request, info)
        render = _identity if printer is None else self._table_events(printer)
        return Response(status=200, headers=_WATCH_HEADERS,
                        payload=self._watch_stream(resource, info, selection, watch, render))

    def _watch_options(self, request: kmock.Request, resource: kmock.resource, selection: Selection) -> _Watch:
        """Where a watch starts (with the current objects as ADDED events when no resourceVersion is given or
        `sendInitialEvents=true`), when it ends, and whether it gets bookmarks."""
        params = request.params
        version = params.get("resourceVersion", "")
        send_initial = params.get("sendInitialEvents") == "true"
        timeout = params.get("timeoutSeconds")
        watch = _Watch(start=self._changes.revision, bookmarks=params.get("allowWatchBookmarks") == "true",
                       timeout=None if timeout is None else _integer(timeout, "timeoutSeconds"),
                       initial_events_end=send_initial)
        if version in ("", "0") or send_initial:
            current = [obj for obj in self._list(resource, request.namespace) if selection.selects(obj)]
            return dataclasses.replace(watch, initial=[{"type": "ADDED", "object": obj} for obj in current])
        return dataclasses.replace(watch, start=_integer(version, "resourceVersion"))

    async def _watch_stream(self, resource: kmock.resource, info: ServedResource, selection: Selection,
                            watch: _Watch, render: Callable[[dict[str, Any]], dict[str, Any]],
                            ) -> AsyncIterator[bytes | dict[str, Any]]:
        yield b""  # send the headers now: clients wait for them before they read events
        for event in watch.initial:
            yield render(event)
        if watch.bookmarks and watch.initial_events_end:
            yield _bookmark(resource, info, watch.start, initial_events_end=True)
        loop = asyncio.get_running_loop()
        deadline = None if watch.timeout is None else loop.time() + watch.timeout
        next_bookmark = loop.time() + self.bookmark_interval if watch.bookmarks else None
        cursor = watch.start
        while not self._changes.closed:
            try:
                changes = self._changes.since(cursor)
            except Expired as e:
                yield {"type": "ERROR", "object": errors.status(410, "Expired", str(e))}
                return
            for change in changes:
                cursor = change.revision
                seen = _event_for(resource, selection, change)
                if seen is not None:
                    yield render(seen)
            now = loop.time()
            if deadline is not None and now >= deadline:
                break
            if next_bookmark is not None and now >= next_bookmark:
                yield _bookmark(resource, info, cursor)
                next_bookmark = now + self.bookmark_interval
            wake = min((t for t in (deadline, next_bookmark) if t is not None), default=None)
            await self._changes.wait(cursor, None if wake is None else max(0.0, wake - now))
        if watch.bookmarks and not self._changes.closed:
            yield _bookmark(resource, info, cursor)  # Kubernetes bookmarks a watch that times out

    def _table_events(self, printer: tables.Printer) -> Callable[[dict[str, Any]], dict[str, Any]]:
        """Watch events whose objects are Tables of one row; only the first carries the column definitions."""
        first = True

        def render(event: dict[str, Any]) -> dict[str, Any]:
            nonlocal first
            obj = event["object"]
            metadata = {"resourceVersion": meta(obj).get("resourceVersion", "")}
            rendered = {"type": event["type"], "object": printer.table([obj], now=self.clock(), headers=first,
                                                                        metadata=metadata)}
            first = False
            return rendered

        return render

    # -- steps shared by the handlers -----------------------------------------------------------------------------

    def _info(self, resource: kmock.resource) -> ServedResource:
        return cast(ServedResource, self.resources[resource])

    def _served(self, request: kmock.Request) -> tuple[kmock.resource, ServedResource]:
        resource = request.resource
        if resource is None or resource.plural is None or resource not in self.resources:
            raise errors.unknown_resource(request.url.path)
        info = self._info(resource)
        if request.namespace is not None and not info.namespaced:
            raise errors.unknown_resource(request.url.path)
        if request.subresource is not None and request.subresource not in info.subresources:
            raise errors.unknown_resource(request.url.path)
        return resource, info

    def _selection(self, request: kmock.Request, info: ServedResource) -> Selection:
        try:
            return Selection(namespace=request.namespace, name=request.name,
                             labels=parse_labels(request.params.get("labelSelector", "")),
                             fields=parse_fields(request.params.get("fieldSelector", ""), str(info.kind)))
        except SelectorError as e:
            raise errors.bad_request(str(e)) from e

    def _printer(self, request: kmock.Request, info: ServedResource) -> tables.Printer | None:
        """How to print Tables, when the request asks for them (Accept: ...;as=Table;g=meta.k8s.io) about objects
        (not about a subresource)."""
        version = tables.wanted_version(request.headers.get("Accept"))
        if version is None or request.subresource is not None:
            return None
        include = request.params.get("includeObject") or "Metadata"
        if include not in tables.INCLUDE:
            raise errors.bad_request(f"includeObject: Unsupported value: {include!r}: supported values: "
                                     + ", ".join(f'"{value}"' for value in tables.INCLUDE))
        return tables.Printer(tables.columns_for(str(info.kind), info.printer_columns), version, include)

    def _snapshot(self, resource: kmock.resource, namespace: str | None, revision: int) -> list[dict[str, Any]]:
        """The objects of a resource (in a namespace, or all) as they were at a revision, ordered as lists are."""
        current = self._list(resource, namespace)
        if revision >= self._changes.revision:
            return current
        try:
            changes = self._changes.since(revision)
        except Expired as e:
            raise kmock.KubernetesError(status=410, reason="Expired", message=paging.EXPIRED,
                                        details={"causes": []}) from e
        mine = [change for change in changes if change.resource == resource
                and (namespace is None or meta(change.object).get("namespace") == namespace)]
        return paging.rewind(current, mine)

    def _writer(self, request: kmock.Request, resource: kmock.resource) -> fields.Manager:
        """Who a write (not an apply) records in managedFields: its `fieldManager`, else its User-Agent's product."""
        name = request.params.get("fieldManager") or request.headers.get("User-Agent", "").split("/")[0][:128]
        _check_manager(name, request)
        return fields.Manager(name, fields.UPDATE, api_version(resource), time=objects.timestamp(self.clock()),
                              subresource=request.subresource)

    def _stored(self, resource: kmock.resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (resource, namespace, name)
        if key not in self._objects or self._objects[key].deleted:
            return None
        return self._objects[key].raw

    def _require(self, request: kmock.Request, info: ServedResource) -> dict[str, Any]:
        resource, name = cast(kmock.resource, request.resource), str(request.name)
        obj = self._stored(resource, request.namespace if info.namespaced else None, name)
        if obj is None:
            raise errors.not_found(resource, name)
        return obj

    def _list(self, resource: kmock.resource, namespace: str | None) -> list[dict[str, Any]]:
        found = [obj.raw for (kind, ns, _), obj in self._objects.items()
                 if kind == resource and (namespace is None or ns == namespace) and not obj.deleted]
        return sorted(found, key=lambda obj: (meta(obj).get("namespace") or "", meta(obj)["name"]))

    def _list_of(self, resource: kmock.resource, info: ServedResource, items: list[dict[str, Any]],
                 metadata: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"apiVersion": api_version(resource), "kind": info.list_kind,
                "metadata": metadata or {"resourceVersion": str(self._changes.revision)}, "items": items}

    def _scale_paths(self, info: ServedResource) -> ScalePaths:
        assert info.scale is not None  # _served() let the scale subresource through
        return info.scale

    def _create_namespace(self, request: kmock.Request, info: ServedResource, body: dict[str, Any]) -> str | None:
        if not info.namespaced:
            return None
        if request.namespace is None:
            raise errors.method_not_allowed("a namespaced object is created under /namespaces/NAMESPACE/")
        if meta(body).get("namespace") not in (None, "", request.namespace):
            raise errors.bad_request("the namespace of the provided object does not match the namespace sent "
                                     "on the request")
        if self._stored(NAMESPACES, None, request.namespace) is None:
            raise errors.not_found(NAMESPACES, request.namespace)
        return request.namespace

    def _create_name(self, resource: kmock.resource, namespace: str | None, body: dict[str, Any]) -> str:
        name, prefix = meta(body).get("name"), meta(body).get("generateName")
        if not name and prefix:
            name = objects.generated_name(prefix, self.rng)
        if not name:
            raise errors.invalid(resource, "", "metadata.name: Required value: name or generateName is required")
        if len(name) > 253 or not _NAME.fullmatch(name):
            raise errors.invalid(resource, name, "metadata.name: Invalid value: a lowercase RFC 1123 subdomain "
                                 "must consist of lower case alphanumeric characters, '-' or '.'")
        if self._stored(resource, namespace, name) is not None:
            raise errors.already_exists(resource, name)
        return str(name)

    def _create(self, resource: kmock.resource, namespace: str | None, name: str, body: dict[str, Any], *,
                writer: fields.Manager | None = None, managers: list[fields.Manager] | None = None) -> dict[str, Any]:
        """Store a new object; its managedFields are those of an apply (`managers`), or record the `writer` of a
        create as the owner of every field it sets."""
        if meta(body).get("resourceVersion"):
            raise errors.bad_request("resourceVersion should not be set on objects to be created")
        info = self._info(resource)
        obj = objects.created(body, api_version=api_version(resource), info=info,
                              namespace=namespace, name=name, uid=str(uuid.uuid4()), now=self.clock())
        if managers is not None:
            fields.with_managers(obj, managers)
        elif writer is not None:
            obj = self._tracked(info, None, obj, writer)
        return self._store(resource, "ADDED", obj, previous=None)

    def _tracked(self, info: ServedResource, current: dict[str, Any] | None, new: dict[str, Any],
                 writer: fields.Manager) -> dict[str, Any]:
        try:
            return fields.tracked(current, new, writer, merge_keys_of(str(info.kind), builtin=info.builtin))
        except fields.ManagedFieldsError as e:
            raise errors.bad_request(str(e)) from e

    def _update(self, request: kmock.Request, info: ServedResource, current: dict[str, Any],
                body: dict[str, Any]) -> dict[str, Any]:
        resource = cast(kmock.resource, request.resource)
        _check_identity(request, body)
        _check_fresh(resource, current, body)
        new = objects.updated(current, body, info=info, subresource=request.subresource)
        return self._store_update(resource, current, self._tracked(info, current, new,
                                                                   self._writer(request, resource)))

    def _store_update(self, resource: kmock.resource, current: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        if meta(current).get("deletionTimestamp") and objects.added_finalizers(current, new):
            raise errors.invalid(resource, meta(current)["name"], "metadata.finalizers: Forbidden: no new "
                                 "finalizers can be added if the object is being deleted")
        return self._write(resource, current, new)

    def _scale(self, request: kmock.Request, info: ServedResource, current: dict[str, Any],
               scale: dict[str, Any]) -> dict[str, Any]:
        resource = cast(kmock.resource, request.resource)
        _check_identity(request, scale)
        _check_fresh(resource, current, scale)
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise errors.invalid(resource, meta(current)["name"], f"spec.replicas: Invalid value: {replicas!r}: "
                                 "must be a non-negative integer")
        scaled = objects.scaled(current, self._scale_paths(info), replicas)
        return self._write(resource, current, objects.updated(current, scaled, info=info, subresource=None))

    def _delete(self, resource: kmock.resource, current: dict[str, Any],
                options: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """Delete now, or mark for deletion; returns the object and whether it is gone (once the garbage collector
        has done what the delete let it do at once)."""
        if resource == NAMESPACES and meta(current)["name"] in DEFAULT_NAMESPACES:
            raise errors.forbidden(resource, meta(current)["name"], "this namespace may not be deleted")
        _check_preconditions(resource, current, options.get("preconditions") or {})
        grace = objects.grace_period(current, options)
        metadata = meta(current)
        finalizers = objects.deletion_finalizers(current, _propagation(options))
        if not finalizers and grace == 0:
            return self._store(resource, "DELETED", copy.deepcopy(current), previous=current), True
        pending = metadata.get("deletionGracePeriodSeconds")
        new = current
        if not metadata.get("deletionTimestamp") or (pending is not None and pending > grace):
            new = objects.marked_for_deletion(current, grace=grace, now=self.clock())
        stored = self._write(resource, current, objects.with_finalizers(new, finalizers))
        return stored, self._fresh(resource, stored) is None

    def _write(self, resource: kmock.resource, current: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        """Store an update: a deletion once nothing holds the object, nothing at all if nothing changed."""
        if objects.removable(new):
            return self._store(resource, "DELETED", new, previous=current)
        if objects.same_content(current, new):
            return current
        return self._store(resource, "MODIFIED", new, previous=current)

    def _store(self, resource: kmock.resource, kind: str, obj: dict[str, Any],
               previous: dict[str, Any] | None) -> dict[str, Any]:
        """Take the next revision, store (or soft-delete) the object, record the change for watches. A custom
        resource whose CRD has CEL rules is checked first when its content outside status changes (422), and so is a
        CRD's new CEL against the cost guard (422)."""
        if kind != "DELETED":
            self._validate(resource, obj, previous)
            if resource == CRDS:
                _check_cel_costs(obj, previous)
        if kind != "DELETED" and obj.get("kind") == "Secret" and obj.get("stringData"):
            # write-only: a Secret's stringData is merged into data (base64), as the real server does
            encoded = {k: base64.b64encode(str(v).encode()).decode() for k, v in obj.pop("stringData").items()}
            obj["data"] = {**(obj.get("data") or {}), **encoded}
        revision = self._changes.next_revision()
        obj["metadata"]["resourceVersion"] = str(revision)
        key = (resource, meta(obj).get("namespace"), meta(obj)["name"])
        if key not in self._objects:
            self._objects[key] = obj
        elif kind == "DELETED":
            self._objects[key].delete()
        else:
            self._objects[key].history.append(obj)
        history = self._objects[key].history
        del history[:-self.object_history]
        self._changes.append(Change(revision, resource, kind, obj, previous))
        if resource == CRDS:
            self._sync_crd(kind, obj, previous)
        if resource.group == RBAC_GROUP:
            self._policy = None
        self._collect_garbage(resource, kind, obj, previous)
        if resource == NAMESPACES and kind == "ADDED":
            self._ensure_default_account(obj)
        elif resource == SERVICEACCOUNTS and kind == "DELETED" and meta(obj)["name"] == DEFAULT_ACCOUNT:
            namespace = self._stored(NAMESPACES, None, str(meta(obj).get("namespace")))
            if namespace is not None:
                self._ensure_default_account(namespace)
        return obj

    def _ensure_default_account(self, namespace: dict[str, Any]) -> None:
        """What Kubernetes' ServiceAccount controller does, here at once: every namespace that is not being deleted
        has a ServiceAccount `default` (made with it, made again when deleted)."""
        name = meta(namespace)["name"]
        if not meta(namespace).get("deletionTimestamp") and self._stored(SERVICEACCOUNTS, name,
                                                                        DEFAULT_ACCOUNT) is None:
            self._create(SERVICEACCOUNTS, name, DEFAULT_ACCOUNT, {"metadata": {"name": DEFAULT_ACCOUNT}})

    def _validate(self, resource: kmock.resource, obj: dict[str, Any], previous: dict[str, Any] | None) -> None:
        rules = self._info(resource).validations
        if not rules or (previous is not None and _content(previous) == _content(obj)):
            return
        broken = validation.violations(rules, obj)
        if broken:
            raise errors.invalid(resource, meta(obj)["name"], broken[0] if len(broken) == 1
                                 else "[" + ", ".join(broken) + "]")

    # -- garbage collection (ownerReferences) ---------------------------------------------------------------------
    # Kubernetes' collector is a controller that follows changes; this one reacts to each stored change at once,
    # inside the write that made it, so its own writes (and their watch events) follow that change in order.

    def _collect_garbage(self, resource: kmock.resource, kind: str, obj: dict[str, Any],
                         previous: dict[str, Any] | None) -> None:
        if kind == "DELETED":
            for dependent_resource, dependent in self._dependents(obj):
                self._attempt_to_delete(dependent_resource, dependent)
        elif kind == "ADDED" and objects.owner_uids(obj) and all(
                self._owner(uid, obj) is None and self._was_deleted(uid, obj) for uid in objects.owner_uids(obj)):
            # created for owners that are all gone (a controller's write that raced its owner's deletion): the
            # collector deletes a dependent whose owners do not exist, as Kubernetes' does
            self._attempt_to_delete(resource, obj)
        elif objects.deleting_with(obj, objects.ORPHAN):
            self._orphan_dependents(resource, obj)
        elif objects.deleting_with(obj, objects.FOREGROUND):
            for dependent_resource, dependent in self._dependents(obj):
                self._attempt_to_delete(dependent_resource, dependent)
            self._finish_foreground(resource, obj)
        # owners deleted in the foreground that this object no longer blocks may go now
        released = objects.owner_uids(previous, blocking=True)
        if kind == "DELETED":
            released |= objects.owner_uids(obj, blocking=True)
        else:
            released -= objects.owner_uids(obj, blocking=True)
        for uid in released:
            owner = self._owner(uid, obj)
            if owner is not None:
                self._finish_foreground(*owner)

    def _live(self) -> list[tuple[kmock.resource, dict[str, Any]]]:
        return [(resource, stored.raw) for (resource, _, _), stored in list(self._objects.items())
                if not stored.deleted]

    def _fresh(self, resource: kmock.resource, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The stored version of this object, if it is still there (and not a new object of the same name)."""
        stored = self._stored(resource, meta(obj).get("namespace"), meta(obj)["name"])
        return stored if stored is not None and meta(stored).get("uid") == meta(obj).get("uid") else None

    def _owner(self, uid: str, dependent: dict[str, Any]) -> tuple[kmock.resource, dict[str, Any]] | None:
        """The live owner with this uid that the dependent can have: cluster-scoped or in its namespace."""
        namespace = meta(dependent).get("namespace")
        for resource, obj in self._live():
            if meta(obj).get("uid") == uid:
                return (resource, obj) if meta(obj).get("namespace") in (None, namespace) else None
        return None

    def _was_deleted(self, uid: str, dependent: dict[str, Any]) -> bool:
        """An owner with this uid that the dependent could have had (cluster-scoped or in its namespace) existed
        here and was deleted."""
        namespace = meta(dependent).get("namespace")
        for stored in list(self._objects.values()):
            if not stored.deleted or not any(v is not None for v in stored.history):
                continue
            last = stored.last.raw  # its last state before the deletion
            if meta(last).get("uid") == uid and meta(last).get("namespace") in (None, namespace):
                return True
        return False

    def _dependents(self, owner: dict[str, Any]) -> list[tuple[kmock.resource, dict[str, Any]]]:
        """The live objects whose ownerReferences name the owner: in its namespace if it has one."""
        uid, namespace = meta(owner).get("uid"), meta(owner).get("namespace")
        return [(resource, obj) for resource, obj in self._live()
                if uid in objects.owner_uids(obj) and namespace in (None, meta(obj).get("namespace"))]

    def _attempt_to_delete(self, resource: kmock.resource, dependent: dict[str, Any]) -> None:
        """What the collector does to a dependent of a deleted (or foreground-deleting) owner: with another live
        owner it keeps the object and drops the references to owners gone or going; otherwise it deletes it (in
        the foreground when an owner waits for it and it has dependents of its own)."""
        current = self._fresh(resource, dependent)
        if current is None or meta(current).get("deletionTimestamp") or not objects.owner_uids(current):
            return
        gone: set[str] = set()
        waiting: set[str] = set()
        solid = False
        for uid in objects.owner_uids(current):
            owner = self._owner(uid, current)
            if owner is None:
                gone.add(uid)
            elif objects.deleting_with(owner[1], objects.FOREGROUND):
                waiting.add(uid)
            else:
                solid = True
        if solid:
            if gone or waiting:
                self._write(resource, current, objects.without_owners(current, gone | waiting))
            return
        policy = None
        if waiting:
            own = self._dependents(current)
            if any(objects.deleting_with(obj, objects.FOREGROUND) for _, obj in own):
                self._write(resource, current, objects.unblocked(current))  # a cycle: stop blocking the owners
                current = self._fresh(resource, current)
            if own:
                policy = "Foreground"
        if current is not None:
            self._gc_delete(resource, current, {} if policy is None else {"propagationPolicy": policy})

    def _orphan_dependents(self, resource: kmock.resource, owner: dict[str, Any]) -> None:
        uid = meta(owner)["uid"]
        for dependent_resource, dependent in self._dependents(owner):
            current = self._fresh(dependent_resource, dependent)
            if current is not None:
                self._write(dependent_resource, current, objects.without_owners(current, {uid}))
        current = self._fresh(resource, owner)
        if current is not None and objects.deleting_with(current, objects.ORPHAN):
            kept = [f for f in meta(current)["finalizers"] if f != objects.ORPHAN]
            self._write(resource, current, objects.with_finalizers(current, kept))

    def _finish_foreground(self, resource: kmock.resource, owner: dict[str, Any]) -> None:
        """Drop the `foregroundDeletion` finalizer of an owner that no dependent blocks any more."""
        current = self._fresh(resource, owner)
        if current is None or not objects.deleting_with(current, objects.FOREGROUND):
            return
        uid = meta(current)["uid"]
        if any(uid in objects.owner_uids(obj, blocking=True) for _, obj in self._dependents(current)):
            return
        kept = [f for f in meta(current)["finalizers"] if f != objects.FOREGROUND]
        self._write(resource, current, objects.with_finalizers(current, kept))

    def _gc_delete(self, resource: kmock.resource, obj: dict[str, Any], options: dict[str, Any]) -> None:
        try:
            self._delete(resource, obj, options)
        except kmock.KubernetesError as e:  # e.g. a default namespace: the collector leaves it, as it must
            log.warning("garbage collector could not delete %s %s: %s", resource.plural, meta(obj)["name"], e)

    def _sync_crd(self, kind: str, crd: dict[str, Any], previous: dict[str, Any] | None) -> None:
        """Serve what a CRD declares; when it goes (or drops a version), its objects go with it."""
        before = from_crd(previous) if previous is not None else {}
        after = from_crd(crd) if kind != "DELETED" else {}
        for resource in before.keys() - after.keys():
            for obj in self._list(resource, None):
                self._store(resource, "DELETED", copy.deepcopy(obj), previous=obj)
            del self.resources[resource]
        for resource, info in after.items():
            self.resources[resource] = info


# -- request parsing and small pure helpers -------------------------------------------------------------------


def _content(obj: dict[str, Any]) -> dict[str, Any]:
    """What CEL rules judge: the object without its status and metadata (a status or label write is not checked)."""
    return {k: v for k, v in obj.items() if k not in ("status", "metadata")}


def _snapshot_order(entry: dict[str, Any]) -> tuple[bool, bool, str, str, str, str]:
    group, version, plural = entry["resource"]
    resource = kmock.resource(group, version, plural)
    return (resource != CRDS, resource != NAMESPACES, group, plural, meta(entry["object"]).get("namespace") or "",
            meta(entry["object"])["name"])


def restorable(snapshot: Any) -> tuple[int, list[tuple[kmock.resource, dict[str, Any]]]]:
    """A snapshot's highest revision (its counter, or an object's higher resourceVersion) and its objects (copies),
    CRDs first, then namespaces; ValueError saying what is malformed."""
    if not isinstance(snapshot, dict) or snapshot.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"not a snapshot of format {SNAPSHOT_FORMAT}")
    entries = [_snapshot_entry(i, entry) for i, entry in enumerate(snapshot.get("objects") or [])]
    keys = {(resource, meta(obj).get("namespace"), meta(obj)["name"]) for resource, obj in entries}
    if len(keys) < len(entries):
        raise ValueError("an object is in the snapshot twice")
    highest = max([_revision_of(snapshot.get("revision", 0), "the snapshot's revision")]
                  + [_revision_of(meta(obj)["resourceVersion"], f"{meta(obj)['name']}'s resourceVersion")
                     for _, obj in entries])
    return highest, sorted(entries, key=lambda entry: (entry[0] != CRDS, entry[0] != NAMESPACES))


def _snapshot_entry(index: int, entry: Any) -> tuple[kmock.resource, dict[str, Any]]:
    """A snapshot entry's resource and a copy of its object; ValueError naming the entry when it is malformed."""
    resource = entry.get("resource") if isinstance(entry, dict) else None
    obj = entry.get("object") if isinstance(entry, dict) else None
    if not (isinstance(resource, list) and len(resource) == 3 and all(isinstance(part, str) for part in resource)):
        raise ValueError(f"object {index}: resource must be [GROUP, VERSION, PLURAL]")
    metadata = meta(obj) if isinstance(obj, dict) else {}
    missing = [field for field in ("name", "uid", "resourceVersion") if not metadata.get(field)]
    if missing:
        raise ValueError(f"object {index}: metadata lacks {', '.join(missing)}")
    return kmock.resource(*resource), copy.deepcopy(cast(dict[str, Any], obj))


def _revision_of(value: Any, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not a number: {value!r}") from e


def _keep_last(items: list[Any], count: int) -> None:
    del items[:max(0, len(items) - max(0, count))]


def _reply(obj: dict[str, Any], status: int = 200, *, warning: str | None = None) -> Response:
    """A JSON answer; `warning`, a `Warning` header's value (kubectl prints each warning as `Warning: ...`)."""
    return Response(status=status, payload=obj, headers={"Warning": warning} if warning else None)


def _body(request: kmock.Request) -> dict[str, Any]:
    content_type = media_type(request.headers.get("Content-Type"))
    if content_type == protowire.MEDIA_TYPE:
        return _protobuf_body(request)
    if content_type not in ("", "application/json", "*/*"):
        raise errors.unsupported_media_type(content_type)
    if not isinstance(request.data, dict):
        raise errors.bad_request("the request body must be a JSON object")
    return request.data


def _request_body(request: kmock.Request, api_version: str, kind: str) -> dict[str, Any]:
    """The body of a request that is not stored (a TokenRequest, a review): JSON, or protobuf as kubectl sends it."""
    if media_type(request.headers.get("Content-Type")) != protowire.MEDIA_TYPE:
        return _body(request)
    try:
        return protowire.read_request(request.body, api_version, kind)
    except protowire.UnsupportedKind as e:
        raise errors.bad_request(f"the body is a {e}, which {request.url.path} does not serve; send a {api_version}, "
                                 f"Kind={kind}") from e
    except protowire.WireError as e:
        raise errors.bad_request(f"the protobuf body could not be decoded: {e}") from e


def _protobuf_body(request: kmock.Request) -> dict[str, Any]:
    """A protobuf body (protowire.py) as JSON: of a kind protowire reads, sent to that kind's URL."""
    try:
        plural, obj = protowire.read_object(request.body)
    except protowire.UnsupportedKind as e:
        raise kmock.KubernetesError(
            status=415, reason="UnsupportedMediaType", details={"causes": []},
            message=f"the body of the request was in {protowire.MEDIA_TYPE}, which the local API server reads for "
                    f"{', '.join(protowire.KINDS)} only, not for {e}: send JSON (kubectl apply does)") from e
    except protowire.WireError as e:
        raise errors.bad_request(f"the protobuf body could not be decoded: {e}") from e
    resource = request.resource
    if resource is None or (resource.group or "", resource.version, resource.plural) != ("", "v1", plural):
        raise errors.bad_request(f"the body is a {obj['kind']}, which {request.url.path} does not serve")
    return obj


def _field_validation(request: kmock.Request) -> str:
    """The write's `fieldValidation` directive: Strict, Warn (the default) or Ignore."""
    value = request.params.get("fieldValidation", "")
    if value not in decoding.DIRECTIVES:
        options = {"POST": "CreateOptions", "PUT": "UpdateOptions"}.get(request.method.upper(), "PatchOptions")
        raise _invalid_options(f"fieldValidation: Unsupported value: {json.dumps(value)}: supported values: "
                               + ", ".join(json.dumps(d) for d in decoding.DIRECTIVES), options)
    return value or decoding.WARN


def _decoded(request: kmock.Request, resource: kmock.resource, info: ServedResource,
             body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The body of a create, update or patch as the API server decodes it (decoding.py), and the `Warning` header
    it answers with: unknown fields refuse a Strict write (400); Warn and Ignore drop them, Warn saying so."""
    directive = _field_validation(request)
    decoded = decoding.decode(str(info.kind), body) if info.builtin else decoding.Decoded(body)
    if not decoded.unknown:
        return body, None
    if directive == decoding.STRICT:
        raise errors.bad_request(decoding.strict_error(str(info.kind), str(resource.version), decoded.unknown))
    return decoded.obj, decoding.warning_header(decoded.unknown) if directive == decoding.WARN else None


def _check_applied_fields(request: kmock.Request, resource: kmock.resource, info: ServedResource,
                          config: dict[str, Any]) -> None:
    """A server-side apply configuration with unknown fields is refused whatever the directive, as Kubernetes' apply
    machinery refuses it: with an internal error (500)."""
    _field_validation(request)
    unknown = decoding.decode(str(info.kind), config).unknown if info.builtin else []
    if unknown:
        raise kmock.KubernetesError(status=500, reason="InternalError", details={"causes": []},
                                    message=decoding.apply_error(config, api_version(resource), str(info.kind),
                                                                 unknown))


def _check_cel_costs(crd: dict[str, Any], previous: dict[str, Any] | None) -> None:
    """A CRD's rules and messageExpressions pass the CEL cost guard (celcost.py), or it is invalid (422)."""
    refused = celcost.refusals(crd, previous)
    for refusal in refused:
        log.info("CRD %s: %s refused: %s", meta(crd).get("name"), refusal.path, refusal.reason)
    if refused:
        messages = [refusal.message for refusal in refused]
        raise errors.invalid(CRDS, meta(crd)["name"], messages[0] if len(messages) == 1
                             else "[" + ", ".join(messages) + "]")


def _identity(event: dict[str, Any]) -> dict[str, Any]:
    return event


def _page(request: kmock.Request) -> paging.Page:
    try:
        return paging.read_page(request.params)
    except paging.InvalidPage as e:
        raise errors.bad_request(str(e)) from e


class _JSONLikeLoader(yaml.SafeLoader):
    """YAML as JSON reads it: timestamps stay strings."""


_JSONLikeLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _apply_config(request: kmock.Request, resource: kmock.resource, info: ServedResource) -> dict[str, Any]:
    """The applied configuration: a YAML (or JSON) object of the URL's kind and apiVersion, naming the URL's
    object, without managedFields."""
    config = request.data
    if config is None and request.body:
        try:
            config = yaml.load(request.body, Loader=_JSONLikeLoader)  # a SafeLoader without timestamps
        except yaml.YAMLError as e:
            raise errors.bad_request(f"error decoding YAML: {e}") from e
    if not isinstance(config, dict):
        raise errors.bad_request("the apply configuration must be an object")
    if not config.get("apiVersion") or not config.get("kind"):
        raise errors.bad_request("the apply configuration must set apiVersion and kind")
    if (config["apiVersion"], config["kind"]) != (api_version(resource), info.kind):
        raise errors.bad_request(f"the apply configuration is a {config['apiVersion']}, Kind={config['kind']}; "
                                 f"this URL serves {api_version(resource)}, Kind={info.kind}")
    if meta(config).get("managedFields") is not None:
        raise errors.bad_request("metadata.managedFields must be nil")
    _check_identity(request, config)
    return config


def _applier(request: kmock.Request, resource: kmock.resource, *,
             now: datetime.datetime) -> tuple[fields.Manager, bool]:
    """Who applies (the required `fieldManager`), and whether it forces conflicts (`force=true`)."""
    name = request.params.get("fieldManager", "")
    if not name:
        raise _invalid_options("fieldManager: Required value: is required for apply patch", "PatchOptions")
    _check_manager(name, request)
    force = request.params.get("force", "false").lower()
    if force not in ("true", "false", "1", "0"):
        raise errors.bad_request(f"force: invalid value {force!r}: must be true or false")
    applier = fields.Manager(name, fields.APPLY, api_version(resource), subresource=request.subresource,
                             time=objects.timestamp(now))
    return applier, force in ("true", "1")


def _check_manager(name: str, request: kmock.Request) -> None:
    if len(name.encode()) > 128:
        options = {"POST": "CreateOptions", "PUT": "UpdateOptions"}.get(request.method.upper(), "PatchOptions")
        raise _invalid_options("fieldManager: Too long: may not be more than 128 bytes", options)


def _patched(target: dict[str, Any], request: kmock.Request, content_type: str | None, *, kind: str,
             builtin: bool) -> dict[str, Any]:
    try:
        return apply_patch(target, request.data, content_type, kind=kind, builtin=builtin)
    except PatchError as e:
        raise kmock.KubernetesError(status=e.status, reason=e.reason, message=str(e), details={"causes": []}) from e


def _integer(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError as e:
        raise errors.bad_request(f"{name}: invalid value {value!r}: must be an integer") from e


def _delete_options(request: kmock.Request) -> dict[str, Any]:
    options = dict(request.data) if isinstance(request.data, dict) else {}
    params = request.params
    if "gracePeriodSeconds" in params:
        options["gracePeriodSeconds"] = _integer(params["gracePeriodSeconds"], "gracePeriodSeconds")
    if "propagationPolicy" in params:
        options["propagationPolicy"] = params["propagationPolicy"]
    if "orphanDependents" in params:
        options["orphanDependents"] = params["orphanDependents"] == "true"
    return options


def _propagation(options: dict[str, Any]) -> str | None:
    """The delete's propagation policy (`orphanDependents` is its deprecated spelling), None if not given."""
    policy, orphan = options.get("propagationPolicy"), options.get("orphanDependents")
    if policy is not None and orphan is not None:
        raise _invalid_options("orphanDependents: Invalid value: both orphanDependents and propagationPolicy "
                               "are set; set at most one")
    if orphan is not None:
        return "Orphan" if orphan else "Background"
    if policy is not None and policy not in objects.POLICIES:
        raise _invalid_options(f"propagationPolicy: Unsupported value: {policy!r}: supported values: "
                               + ", ".join(f'"{p}"' for p in objects.POLICIES))
    return policy


def _invalid_options(message: str, kind: str = "DeleteOptions") -> kmock.KubernetesError:
    return kmock.KubernetesError(status=422, reason="Invalid", message=f'{kind}.meta.k8s.io "" is invalid: '
                                 f"{message}", details={"causes": []})


def _invalid_token_request(name: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=422, reason="Invalid", details={"causes": []},
                                 message=f'TokenRequest.authentication.k8s.io "{name}" is invalid: {message}')


def _check_identity(request: kmock.Request, body: dict[str, Any]) -> None:
    name, namespace = meta(body).get("name"), meta(body).get("namespace")
    if name and name != request.name:
        raise errors.bad_request(f"the name of the object ({name}) does not match the name on the URL "
                                 f"({request.name})")
    if namespace and request.namespace and namespace != request.namespace:
        raise errors.bad_request("the namespace of the provided object does not match the namespace sent on the "
                                 "request")


def _check_fresh(resource: kmock.resource, current: dict[str, Any], body: dict[str, Any]) -> None:
    """A write that names a resourceVersion applies only to that version (optimistic concurrency)."""
    wanted = meta(body).get("resourceVersion")
    if wanted and wanted != meta(current)["resourceVersion"]:
        raise errors.conflict(resource, meta(current)["name"], errors.STALE)


def _check_preconditions(resource: kmock.resource, current: dict[str, Any], preconditions: dict[str, Any]) -> None:
    for field in ("uid", "resourceVersion"):
        wanted, actual = preconditions.get(field), meta(current).get(field)
        if wanted and wanted != actual:
            raise errors.conflict(resource, meta(current)["name"], f"Precondition failed: {field} in precondition: "
                                  f"{wanted}, {field} in object meta: {actual}")


def _event_for(resource: kmock.resource, selection: Selection, change: Change) -> dict[str, Any] | None:
    """The event a watch sees: objects entering or leaving its selection arrive as ADDED or DELETED."""
    if change.resource != resource:
        return None
    now_in = selection.selects(change.object)
    if change.type != "MODIFIED":
        return {"type": change.type, "object": change.object} if now_in else None
    was_in = change.previous is not None and selection.selects(change.previous)
    if now_in:
        return {"type": "MODIFIED" if was_in else "ADDED", "object": change.object}
    return {"type": "DELETED", "object": change.object} if was_in else None


def _bookmark(resource: kmock.resource, info: ServedResource, revision: int, *,
              initial_events_end: bool = False) -> dict[str, Any]:
    metadata: dict[str, Any] = {"resourceVersion": str(revision)}
    if initial_events_end:
        metadata["annotations"] = {"k8s.io/initial-events-end": "true"}
    return {"type": "BOOKMARK", "object": {"kind": info.kind, "apiVersion": api_version(resource),
                                           "metadata": metadata}}


# -- the server -----------------------------------------------------------------------------------------------


class APIServer(BackgroundLoop):
    """The emulator served from a background thread that runs its own asyncio loop, on two ports of `host`: HTTPS
    on `secure_port` (`secure_url`), with the certificate of its `credentials` (auth.py), where every request is
    authenticated (a bearer token, else anonymous) and authorized by RBAC; and plain HTTP on `port` (`url`),
    where a request without an `Authorization` header is the admin's (see the module docstring).

    `start()` returns the HTTP URL once both ports are bound; `stop()` ends open watches and frees the ports, and
    keeps `final_snapshot`, every object as the last request left it (what `APIServer(restore=...)` starts from: a
    restart that keeps the objects, as etcd does, and no watch history; give it the same ports and `credentials`
    and every client, kubeconfig and pod token carries on). Keyword options go to the `Emulator` (e.g.
    `history_limit`, `bookmark_interval`, `restore`, `min_token_seconds`). The emulator belongs to the server's
    loop: touch it from other threads only through HTTP or `snapshot()`.
    """

    label = "the API server"

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, secure_port: int = 0,
                 credentials: auth.Credentials | None = None, **options: Any) -> None:
        super().__init__()
        if options.get("restore") is not None:
            restorable(options["restore"])  # a malformed snapshot fails here, in the caller's thread
        self.host, self.port, self.secure_port = host, port, secure_port
        self.credentials = credentials or auth.Credentials.generate([host])
        self._options = options
        self.emulator: Emulator | None = None
        self.final_snapshot: dict[str, Any] | None = None  # after `stop()`: what it held once it served no more

    @property
    def url(self) -> str:
        """The plain-HTTP address (the insecure port: no credentials is the admin)."""
        return f"http://{_host_in_url(self.host)}:{self.port}"

    @property
    def secure_url(self) -> str:
        """The HTTPS address, where every request is authenticated and authorized."""
        return f"https://{_host_in_url(self.host)}:{self.secure_port}"

    def start(self, timeout: float = 10.0) -> str:
        self._start_thread(timeout, "devcluster-apiserver")
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)

    def write_kubeconfig(self, path: str | Path, *, namespace: str = "default") -> Path:
        """Write a kubeconfig whose current context is the admin at the HTTPS address, trusting the server's CA."""
        return write_kubeconfig(path, self.secure_url, namespace=namespace, token=self.credentials.admin_token,
                                ca_pem=self.credentials.ca_pem)

    def snapshot(self, timeout: float = 10.0) -> dict[str, Any]:
        """The emulator's `snapshot()`, taken on the server's loop between two requests (JSON-serialisable; what
        `APIServer(restore=...)` starts from)."""
        if self._thread is None or self._loop is None or self.emulator is None:
            raise RuntimeError(f"{self.label} is not running")
        emulator = self.emulator

        async def take() -> dict[str, Any]:
            return emulator.snapshot()

        return asyncio.run_coroutine_threadsafe(take(), self._loop).result(timeout)

    def __enter__(self) -> APIServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _main(self) -> None:
        self.emulator = Emulator(credentials=self.credentials, **self._options)
        plain, secure = _listening(self.host, self.port), _listening(self.host, self.secure_port)
        self.port, self.secure_port = plain.getsockname()[1], secure.getsockname()[1]
        async with self.emulator:
            runner = aiohttp.web.ServerRunner(aiohttp.web.Server(self.emulator, handler_cancellation=True),
                                              shutdown_timeout=2.0)
            await runner.setup()
            try:
                await aiohttp.web.SockSite(runner, plain).start()
                await aiohttp.web.SockSite(runner, secure, ssl_context=self.credentials.server_ssl_context()).start()
                self._mark_ready()
                await self._stopped()
                self.emulator.close_watches()
            finally:
                await runner.cleanup()
                plain.close()
                secure.close()
                self.final_snapshot = self.emulator.snapshot()  # no request is served any more: nothing lost


def _listening(host: str, port: int) -> socket.socket:
    """A bound, listening socket (port 0: any free one), made reusable at once as aiohttp's own sites make theirs."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=128)


def _host_in_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def kubeconfig(url: str, *, name: str = "shardwise-dev", namespace: str = "default", token: str | None = None,
               ca_pem: bytes | None = None) -> dict[str, Any]:
    """A kubeconfig with one cluster, user and context: a bearer `token` (none: a request without credentials,
    which the plain-HTTP port serves as the admin's), and the CA an HTTPS server is trusted by."""
    cluster: dict[str, Any] = {"server": url}
    if ca_pem is not None:
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
    return {
        "apiVersion": "v1", "kind": "Config", "preferences": {}, "current-context": name,
        "clusters": [{"name": name, "cluster": cluster}],
        "users": [{"name": name, "user": {"token": token} if token else {}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name, "namespace": namespace}}],
    }


def write_kubeconfig(path: str | Path, url: str, *, namespace: str = "default", token: str | None = None,
                     ca_pem: bytes | None = None) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(kubeconfig(url, namespace=namespace, token=token, ca_pem=ca_pem),
                                     sort_keys=False))
    if token:
        os.chmod(target, 0o600)  # it holds the admin's credentials
    return target
