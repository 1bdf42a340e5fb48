"""A watch-fed cache of the objects the operator reads on every reconcile step, so that a step whose deployment
did not change costs no API request.

One informer per kind (InferenceDeployments, and the Pods, Services, ConfigMaps, PodDisruptionBudgets,
NetworkPolicies and router Deployments labelled `app.kubernetes.io/managed-by=shardwise`), per watched namespace
or cluster-wide: it lists once, then watches from the list's resourceVersion; a watch that ends is resumed from
the last resourceVersion it saw (bookmarks included), and one the server answers 410 Gone is listed again.

Reads (`Kube.get`, `Kube.list`) are answered from an informer once it has listed; before that, and for every other
kind, they go to the API. Writes go to the API, and the object the API answers (a create, a patch, a graceful
delete) is stored at once, so the next step reads its own writes even before their watch events arrive: the
operator's state machine never acts twice on a status it has already moved past. An object only ever moves forward:
an event or an answer older (by resourceVersion) than what is stored, or than the object's deletion, is dropped.

`on_change(kind, old, new)` is called after every change an informer applies (`new` None: deleted), from the
informer's thread; the operator uses it to wake the deployment's step.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from .kube import Kube, KubeError, Obj, Reader

log = logging.getLogger("shardwise.operator")

MANAGED = "app.kubernetes.io/managed-by=shardwise"
# the kinds a reconcile step reads, and the label selector each one's informer watches with
CACHED: dict[str, str] = {
    "InferenceDeployment": "", "Pod": MANAGED, "Service": MANAGED, "ConfigMap": MANAGED,
    "PodDisruptionBudget": MANAGED, "NetworkPolicy": MANAGED, "Deployment": MANAGED,
}
WATCH_TIMEOUT_S = 300  # the server ends a watch after this; it is resumed from the last resourceVersion
RETRY_S = 1.0  # after a failed list or watch (the API server down, say)
TOMBSTONES = 10_000  # deletions remembered (an answer older than its object's deletion is dropped)
ABSENT_RETRY_S = 30.0  # after a 404: the kind's API is not served (yet)

OnChange = Callable[[str, Obj | None, Obj | None], None]
Key = tuple[str, str]


def version(obj: Mapping[str, Any]) -> int:
    """An object's resourceVersion as a number (the API server's are etcd revisions); -1 when it has none."""
    raw = (obj.get("metadata") or {}).get("resourceVersion", "")
    try:
        return int(str(raw))
    except ValueError:
        return -1


def parse_selector(selector: str) -> dict[str, str]:
    """`k=v,k2=v2` (the only form the operator writes) as a dict."""
    out = {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        k, sep, v = term.partition("=")
        if not sep or k.endswith("!"):
            raise ValueError(f"the cache reads equality selectors only, got {term!r}")
        out[k.strip()] = v.lstrip("=").strip()
    return out


class Informer:
    """The objects of one kind in the given namespaces (every namespace when empty) that match `selector`."""

    def __init__(self, kube: Kube, kind: str, namespaces: Iterable[str] = (), selector: str = "",
                 on_change: OnChange | None = None) -> None:
        self.kube, self.kind, self.selector = kube, kind, selector
        self._labels = parse_selector(selector)
        self.scopes: tuple[str, ...] = tuple(namespaces) or ("",)  # "": cluster-wide
        self.on_change = on_change
        self._objects: dict[Key, Obj] = {}
        self._deleted: dict[Key, int] = {}  # the resourceVersion each key was deleted at: older answers are dropped
        self._listed: set[str] = set()
        self._synced = threading.Event()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._streams: set[Any] = set()  # the watch responses being read (shut by `stop`)
        self._failing: dict[str, float] = {}  # scope -> when its watch began failing (until it works again)
        self.relists = 0  # lists after the first one (410 Gone, or a failed watch without a resourceVersion)

    # ------------------------------------------------------------------------------------------ reads
    @property
    def synced(self) -> bool:
        return len(self._listed) == len(self.scopes)

    def covers(self, namespace: str) -> bool:
        return self.scopes == ("",) or namespace in self.scopes

    def get(self, namespace: str, name: str) -> Obj | None:
        with self._lock:
            obj = self._objects.get((namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, namespace: str, selector: str) -> list[Obj]:
        labels = parse_selector(selector)
        with self._lock:
            found = [obj for (ns, _), obj in self._objects.items()
                     if ns == namespace and _matches(obj, labels)]
            return copy.deepcopy(sorted(found, key=lambda o: o["metadata"]["name"]))

    # ----------------------------------------------------------------------------------------- writes
    def observe(self, obj: Obj) -> None:
        """An object the API answered with (created, patched, being deleted): stored if it is newer."""
        meta = obj.get("metadata") or {}
        if obj.get("kind") != self.kind or not meta.get("name") or version(obj) < 0:
            return
        if not _matches(obj, self._labels):
            return
        self._apply((str(meta.get("namespace") or ""), str(meta["name"])), obj)

    def _apply(self, key: Key, obj: Obj | None, at: int = -1) -> None:
        """Store `obj`, or with None delete the key at resourceVersion `at`; an answer or event no newer than what
        is stored (or than the key's deletion) changes nothing, and a deletion older than the stored object (a
        pod of the same name made again since) leaves it."""
        with self._lock:
            old = self._objects.get(key)
            if obj is not None:
                if version(obj) <= max(version(old) if old is not None else -1, self._deleted.get(key, -1)):
                    return
                self._objects[key] = obj
            else:
                self._deleted[key] = max(at, self._deleted.get(key, -1))
                while len(self._deleted) > TOMBSTONES:  # the oldest deletions: their late answers came long ago
                    del self._deleted[next(iter(self._deleted))]
                if old is None or at < version(old):
                    return
                del self._objects[key]
        if self.on_change is not None:
            try:
                self.on_change(self.kind, old, obj)
            except Exception:  # a wake-up that fails must not stop the informer
                log.exception("on_change of %s %s/%s failed", self.kind, *key)

    # -------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        for scope in self.scopes:
            t = threading.Thread(target=self._run, args=(scope,), name=f"informer-{self.kind}-{scope or 'all'}",
                                 daemon=True)
            t.start()
            self._threads.append(t)

    def wait_synced(self, timeout: float) -> bool:
        return self._synced.wait(timeout)

    def stop(self) -> None:
        """Stop watching: the streams in flight are shut, so the threads end at once (`join` waits for them)."""
        self._stop.set()
        for stream in list(self._streams):
            _shut(stream)

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)

    def _run(self, scope: str) -> None:
        resume: int | None = None
        while not self._stop.is_set():
            try:
                if resume is None:
                    resume = self._list(scope)
                resume = self._watch(scope, resume)
            except KubeError as e:
                if e.status == 410:
                    resume = None  # history compacted: list again
                    continue
                if e.status == 404:  # the kind's API is not served (or no longer): none exist; listed again later
                    self._forget(scope)
                    self._mark_listed(scope)
                    resume = None
                    self._stop.wait(ABSENT_RETRY_S)
                    continue
                self._failed(scope, e)
            except Exception as e:  # connection refused or cut: resume from the last resourceVersion
                self._failed(scope, e)

    def _failed(self, scope: str, e: Exception) -> None:
        """Said once per outage (the retries every RETRY_S are logged at debug level), then retried."""
        if scope not in self._failing:
            self._failing[scope] = time.monotonic()
            log.warning("watch of %s in %s failed: %r; retrying every %.0f s", self.kind, scope or "all namespaces",
                        e, RETRY_S)
        else:
            log.debug("watch of %s in %s failed again: %r", self.kind, scope or "all namespaces", e)
        self._stop.wait(RETRY_S)

    def _recovered(self, scope: str) -> None:
        since = self._failing.pop(scope, None)
        if since is not None:
            log.warning("watch of %s in %s back after %.1f s", self.kind, scope or "all namespaces",
                        time.monotonic() - since)

    def _list(self, scope: str) -> int:
        items, at = self.kube.list_all(self.kind, scope, self.selector)
        seen = set()
        for obj in items:
            obj.setdefault("kind", self.kind)
            key = (str(obj["metadata"].get("namespace") or ""), str(obj["metadata"]["name"]))
            seen.add(key)
            self._apply(key, obj)
        self._forget(scope, keep=seen, at=at)
        self._mark_listed(scope)
        self._recovered(scope)
        return at

    def _forget(self, scope: str, keep: Collection[Key] = (), at: int | None = None) -> None:
        """Delete what the scope holds beyond `keep`: gone by resourceVersion `at` (a list's; None: each object's own,
        when the kind's API is not served any more)."""
        with self._lock:
            gone = [(k, version(o)) for k, o in self._objects.items()
                    if k not in keep and (not scope or k[0] == scope) and (at is None or version(o) <= at)]
        for key, own in gone:
            self._apply(key, None, own if at is None else at)

    def _mark_listed(self, scope: str) -> None:
        if scope in self._listed:
            self.relists += 1
        self._listed.add(scope)
        if self.synced:
            self._synced.set()

    def _watch(self, scope: str, since: int) -> int:
        for event in self.kube.watch(self.kind, scope, self.selector, since, WATCH_TIMEOUT_S, self._streams,
                                     on_open=lambda: self._recovered(scope)):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                code = int(obj.get("code") or 0)
                raise KubeError(code, str(obj.get("message") or obj.get("reason") or "watch error"), obj)
            at = version(obj)
            if kind in ("ADDED", "MODIFIED"):
                obj.setdefault("kind", self.kind)
                self._apply((str(obj["metadata"].get("namespace") or ""), str(obj["metadata"]["name"])), obj)
            elif kind == "DELETED":
                self._apply((str(obj["metadata"].get("namespace") or ""), str(obj["metadata"]["name"])), None, at)
            since = max(since, at)
        return since


class Cache:
    """The informers of every cached kind, in the namespaces the operator watches."""

    def __init__(self, kube: Kube, namespaces: Iterable[str] = (), on_change: OnChange | None = None,
                 kinds: Mapping[str, str] = CACHED) -> None:
        self.informers = {kind: Informer(kube, kind, namespaces, selector, on_change)
                          for kind, selector in kinds.items()}

    def start(self) -> None:
        for informer in self.informers.values():
            informer.start()

    def stop(self, timeout: float = 2.0) -> None:
        for informer in self.informers.values():
            informer.stop()
        for informer in self.informers.values():
            informer.join(timeout)

    def wait_synced(self, timeout: float) -> bool:
        """Wait until every informer has listed (at most `timeout` seconds in all)."""
        deadline = time.monotonic() + timeout
        return all(i.wait_synced(max(0.0, deadline - time.monotonic())) for i in self.informers.values())

    def reader(self, kind: str, namespace: str) -> Reader | None:
        """The informer that answers reads of `kind` in `namespace`, once it has listed; else None (ask the API)."""
        informer = self.informers.get(kind)
        if informer is None or not informer.synced or not informer.covers(namespace):
            return None
        return informer

    def observe(self, obj: Obj | None) -> None:
        if isinstance(obj, dict) and obj.get("kind") in self.informers:
            self.informers[obj["kind"]].observe(obj)


def _matches(obj: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


def _shut(stream: Any) -> None:
    """End a watch response another thread is reading: shut its socket down (closing alone may not wake a read)."""
    for end in ("shutdown", "close"):
        try:
            getattr(stream, end)()
        except Exception:  # already closed, or no socket to shut down: the other way is tried
            continue
