"""The local cluster's Deployment and ReplicaSet controllers, as kube-controller-manager runs them, through the public
API (so they also work against a real API server).

A Deployment owns one ReplicaSet per pod template, named `NAME-HASH` with the `pod-template-hash` label on it, its
selector and its pods; a ReplicaSet keeps `spec.replicas` active pods (not failed, not being deleted) that it owns
through a controller ownerReference, creating them from its template or deleting the surplus (not ready ones and
the newest first). A template change rolls: with `RollingUpdate` the new ReplicaSet grows while the total stays
within `replicas + maxSurge`, and the old ones shrink while at least `replicas - maxUnavailable` pods stay available
(both may be counts or percentages, the surge rounded up and the unavailable rounded down; with both 0,
maxUnavailable is 1, as the API's validation wants one of them positive); with `Recreate` the old pods are all
gone before the new ones start. Deleting a Deployment deletes its ReplicaSets and their pods by their
ownerReferences (the API server's garbage collector). `status` carries what `kubectl get deploy` and
`kubectl rollout status` read: replicas, updatedReplicas, readyReplicas, availableReplicas, unavailableReplicas,
observedGeneration and the Available and Progressing conditions; each ReplicaSet's status its replicas, ready and
available counts. The revision is the `deployment.kubernetes.io/revision` annotation; ReplicaSets beyond
`revisionHistoryLimit` (default 10) with no pods are deleted.

Not emulated: minReadySeconds (a ready pod is available at once), progressDeadlineSeconds, pausing, rollbacks
(`kubectl rollout undo`), adopting orphaned pods or ReplicaSets, and Events.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import hashlib
import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from .aiokube import ApiError, Informer, KubeClient, Obj

log = logging.getLogger(__name__)

HASH_LABEL = "pod-template-hash"
REVISION = "deployment.kubernetes.io/revision"
_API_ERRORS = (ApiError, aiohttp.ClientError, TimeoutError)


def template_hash(template: Mapping[str, Any]) -> str:
    """A short, stable name for a pod template (the same template, the same ReplicaSet)."""
    digest = hashlib.sha256(json.dumps(template, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    alphabet = "bcdfghjkmnpqrstvwxz2456789"  # as Kubernetes' safe encoding: no vowels, no look-alikes
    value = int(digest[:16], 16)
    return "".join(alphabet[(value >> (5 * i)) % len(alphabet)] for i in range(10))


def scaled(value: Any, total: int, *, round_up: bool) -> int:
    """An IntOrString of maxSurge or maxUnavailable against `total` replicas."""
    if isinstance(value, str) and value.endswith("%"):
        share = total * float(value[:-1]) / 100
        return math.ceil(share) if round_up else math.floor(share)
    return int(value)


def rolling_bounds(deployment: Obj) -> tuple[int, int]:
    """(maxSurge, maxUnavailable) of a RollingUpdate Deployment; defaults 25% and 25%."""
    spec = deployment.get("spec") or {}
    desired = int(spec.get("replicas", 1))
    rolling = ((spec.get("strategy") or {}).get("rollingUpdate") or {})
    surge = scaled(rolling.get("maxSurge", "25%"), desired, round_up=True)
    unavailable = scaled(rolling.get("maxUnavailable", "25%"), desired, round_up=False)
    if surge == 0 and unavailable == 0:
        unavailable = 1
    return surge, unavailable


@dataclass(frozen=True)
class SetSeen:
    """A ReplicaSet of a Deployment as the rollout sees it."""
    name: str
    replicas: int  # spec.replicas
    pods: int  # its active pods
    available: int  # of them ready
    new: bool  # of the Deployment's current template


def rollout(desired: int, strategy: str, surge: int, unavailable: int, sets: Iterable[SetSeen]) -> dict[str, int]:
    """The spec.replicas each ReplicaSet should have now (only those that change), one rollout step."""
    sets = list(sets)
    new = next((s for s in sets if s.new), None)
    old = [s for s in sets if not s.new]
    out: dict[str, int] = {}
    if strategy == "Recreate":
        for s in old:
            if s.replicas:
                out[s.name] = 0
        if new is not None and not any(s.pods for s in old) and new.replicas != desired:
            out[new.name] = desired
        return out
    if new is None:
        return out
    if not old or all(s.replicas == 0 and s.pods == 0 for s in old):
        if new.replicas != desired:
            out[new.name] = desired
        return out
    # grow the new set within the surge: every pod of every set counts
    total = sum(max(s.replicas, s.pods) for s in sets)
    grow = max(0, min(desired - new.replicas, desired + surge - total))
    if grow:
        out[new.name] = new.replicas + grow
    # shrink the old ones while enough stay available, counting replicas (pods beyond a set's replicas are going
    # already): first their pods that are not available anyway, within what the new set's unready pods leave
    minimum = desired - unavailable
    budget = max(0, sum(s.replicas for s in sets) - minimum - max(0, new.replicas - new.available))
    left = {s.name: s.replicas for s in old}
    for s in old:
        cut = min(max(0, s.replicas - s.available), budget)
        left[s.name] -= cut
        budget -= cut
    room = sum(min(s.available, left.get(s.name, s.replicas)) for s in sets) - minimum
    for s in sorted(old, key=lambda s: s.available):
        cut = max(0, min(left[s.name], room))
        left[s.name] -= cut
        room -= cut
    out.update({name: n for name, n in left.items() if n != next(s.replicas for s in old if s.name == name)})
    if new.replicas > desired:  # the Deployment was scaled down during the roll
        out[new.name] = desired
    return out


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _active(pod: Obj) -> bool:
    return not pod["metadata"].get("deletionTimestamp") and (pod.get("status") or {}).get("phase") not in (
        "Failed", "Succeeded")


def _controller_uid(obj: Obj) -> str | None:
    return next((str(r.get("uid")) for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")),
                None)


def _owner_reference(owner: Obj, kind: str) -> Obj:
    return {"apiVersion": "apps/v1", "kind": kind, "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}


def _matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e.get("key"), e.get("operator"), set(e.get("values") or [])
        present = key in labels
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and present and labels[key] in values) \
                or (op == "Exists" and not present) or (op == "DoesNotExist" and present):
            return False
    return True


class DeploymentController:
    """Runs the Deployment and ReplicaSet controllers: three informers, and a pass over the namespaces' objects a
    change concerns, at least every `resync` seconds."""

    def __init__(self, client: KubeClient, *, resync: float = 30.0) -> None:
        self.client, self.resync = client, resync
        self.deployments = Informer(client, "/apis/apps/v1/deployments", self._changed)
        self.sets = Informer(client, "/apis/apps/v1/replicasets", self._changed)
        self.pods = Informer(client, "/api/v1/pods", self._changed)
        self._wake = asyncio.Event()
        self._pending: set[str] = set()  # namespaces with a change not yet looked at

    def _changed(self, _: str, obj: Obj) -> None:
        self._pending.add(str(obj["metadata"].get("namespace") or ""))
        self._wake.set()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            for informer in (self.deployments, self.sets, self.pods):
                tasks.create_task(informer.run())
            for informer in (self.deployments, self.sets, self.pods):
                await informer.synced.wait()
            resync_at = 0.0
            loop = asyncio.get_running_loop()
            while True:
                everything = loop.time() >= resync_at
                if everything:
                    resync_at = loop.time() + self.resync
                namespaces = {k[0] for k in self.deployments.objects} | {k[0] for k in self.sets.objects} \
                    if everything else set(self._pending)
                self._pending.clear()
                for ns in sorted(namespaces):
                    try:
                        await self.sync_namespace(ns)
                    except _API_ERRORS as e:  # looked at again on the next change or resync
                        log.warning("deployment controller: namespace %s: %s", ns, e)
                        self._pending.add(ns)
                self._wake.clear()
                if self._pending:
                    await asyncio.sleep(0.2)  # a failing API is retried at a steady pace
                    continue
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.1, resync_at - loop.time())):
                        await self._wake.wait()

    async def sync_namespace(self, ns: str) -> None:
        deployments = [d for k, d in self.deployments.objects.items() if k[0] == ns]
        sets = [s for k, s in self.sets.objects.items() if k[0] == ns]
        pods = [p for k, p in self.pods.objects.items() if k[0] == ns]
        for d in deployments:
            if not d["metadata"].get("deletionTimestamp"):
                await self.sync_deployment(d, [s for s in sets if _controller_uid(s) == d["metadata"]["uid"]], pods)
        for s in sets:
            if not s["metadata"].get("deletionTimestamp"):
                await self.sync_replicaset(s, [p for p in pods if _controller_uid(p) == s["metadata"]["uid"]])

    # -- Deployments ---------------------------------------------------------------------------------------------

    async def sync_deployment(self, d: Obj, owned: list[Obj], pods: list[Obj]) -> None:
        meta, spec = d["metadata"], d.get("spec") or {}
        ns = meta["namespace"]
        desired = int(spec.get("replicas", 1))
        template = copy.deepcopy(spec.get("template") or {})
        digest = template_hash(template)
        new = next((s for s in owned if (s["metadata"].get("labels") or {}).get(HASH_LABEL) == digest), None)
        revision = 1 + max((int((s["metadata"].get("annotations") or {}).get(REVISION, "0")) for s in owned),
                           default=0)
        if new is None:
            new = await self._create_set(d, template, digest, revision)
            owned = [*owned, new]
        elif int((new["metadata"].get("annotations") or {}).get(REVISION, "0")) < revision - 1:
            # a template that comes back (a rollback by hand) takes the newest revision
            await self._patch(f"/apis/apps/v1/namespaces/{ns}/replicasets/{new['metadata']['name']}",
                              {"metadata": {"annotations": {REVISION: str(revision)}}})
        by_uid = {s["metadata"]["uid"]: s for s in owned}
        active = {uid: [p for p in pods if _controller_uid(p) == uid and _active(p)] for uid in by_uid}
        seen = [SetSeen(s["metadata"]["name"], int((s.get("spec") or {}).get("replicas", 0)), len(active[uid]),
                        sum(_ready(p) for p in active[uid]), s is new) for uid, s in by_uid.items()]
        strategy = (spec.get("strategy") or {}).get("type") or "RollingUpdate"
        surge, unavailable = rolling_bounds(d) if strategy == "RollingUpdate" else (0, desired)
        for set_name, replicas in rollout(desired, strategy, surge, unavailable, seen).items():
            log.debug("deployment %s/%s: ReplicaSet %s to %d replicas", ns, meta["name"], set_name, replicas)
            await self._patch(f"/apis/apps/v1/namespaces/{ns}/replicasets/{set_name}", {"spec": {"replicas": replicas}})
        await self._prune(d, [s for s in owned if s is not new], active)
        await self._deployment_status(d, new, seen, desired, unavailable)

    async def _create_set(self, d: Obj, template: Obj, digest: str, revision: int) -> Obj:
        meta, spec = d["metadata"], d.get("spec") or {}
        labels = {**((template.get("metadata") or {}).get("labels") or {}), HASH_LABEL: digest}
        template.setdefault("metadata", {})["labels"] = labels
        selector = copy.deepcopy(spec.get("selector") or {})
        selector.setdefault("matchLabels", {})[HASH_LABEL] = digest
        body: Obj = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
                "metadata": {"name": f"{meta['name']}-{digest}", "namespace": meta["namespace"], "labels": labels,
                             "annotations": {REVISION: str(revision)},
                             "ownerReferences": [_owner_reference(d, "Deployment")]},
                "spec": {"replicas": 0, "selector": selector, "template": template}}
        path = f"/apis/apps/v1/namespaces/{meta['namespace']}/replicasets"
        try:
            made: Obj = await self.client.create(path, body)
        except ApiError as e:
            if e.status != 409:
                raise
            made = await self.client.get(f"{path}/{body['metadata']['name']}")
        log.info("deployment %s/%s: ReplicaSet %s (revision %d)", meta["namespace"], meta["name"],
                 made["metadata"]["name"], revision)
        return made

    async def _prune(self, d: Obj, old: list[Obj], active: Mapping[str, list[Obj]]) -> None:
        """Old ReplicaSets beyond revisionHistoryLimit, with no replicas and no pods, go (oldest first)."""
        limit = int((d.get("spec") or {}).get("revisionHistoryLimit", 10))
        idle = [s for s in old if not (s.get("spec") or {}).get("replicas") and not active[s["metadata"]["uid"]]]
        idle.sort(key=lambda s: int((s["metadata"].get("annotations") or {}).get(REVISION, "0")))
        for s in idle[:max(0, len(idle) - limit)]:
            with contextlib.suppress(ApiError):
                await self.client.delete(f"/apis/apps/v1/namespaces/{s['metadata']['namespace']}/replicasets/"
                                         f"{s['metadata']['name']}")

    async def _deployment_status(self, d: Obj, new: Obj, seen: list[SetSeen], desired: int,
                                 unavailable: int) -> None:
        meta = d["metadata"]
        mine = next(s for s in seen if s.new)
        replicas, ready = sum(s.pods for s in seen), sum(s.available for s in seen)
        complete = mine.pods == desired == mine.available and replicas == desired
        old = d.get("status") or {}
        conditions = {c.get("type"): c for c in old.get("conditions") or []}

        def condition(type_: str, status: str, reason: str, message: str) -> Obj:
            before = conditions.get(type_) or {}
            since = before.get("lastTransitionTime") if before.get("status") == status else _now()
            return {"type": type_, "status": status, "reason": reason, "message": message,
                    "lastTransitionTime": since or _now(), "lastUpdateTime": _now()}

        enough = ready >= desired - unavailable
        set_name = new["metadata"]["name"]
        status = {
            "observedGeneration": meta.get("generation"), "replicas": replicas, "updatedReplicas": mine.pods,
            "readyReplicas": ready, "availableReplicas": ready, "unavailableReplicas": max(0, desired - ready),
            "conditions": [
                condition("Available", "True" if enough else "False",
                          "MinimumReplicasAvailable" if enough else "MinimumReplicasUnavailable",
                          "Deployment has minimum availability." if enough else
                          "Deployment does not have minimum availability."),
                condition("Progressing", "True", "NewReplicaSetAvailable" if complete else "ReplicaSetUpdated",
                          f'ReplicaSet "{set_name}" has successfully progressed.' if complete else
                          f'ReplicaSet "{set_name}" is progressing.'),
            ],
        }
        counts = ("replicas", "updatedReplicas", "readyReplicas", "availableReplicas", "unavailableReplicas")
        same = all(int(old.get(k) or 0) == int(status.get(k) or 0) for k in counts) \
            and old.get("observedGeneration") == status["observedGeneration"] \
            and all((conditions.get(c["type"]) or {}).get(k) == c[k] for c in status["conditions"]
                    for k in ("status", "reason", "message"))
        revision = (new["metadata"].get("annotations") or {}).get(REVISION, "1")
        path = f"/apis/apps/v1/namespaces/{meta['namespace']}/deployments/{meta['name']}"
        if (meta.get("annotations") or {}).get(REVISION) != revision:
            await self._patch(path, {"metadata": {"annotations": {REVISION: revision}}})
        if not same:  # zero counts are left out, as Kubernetes does (null removes them in a merge patch)
            await self._patch(f"{path}/status", {"status": {**status, **{k: None for k in counts
                                                                         if not status.get(k)}}})

    # -- ReplicaSets ---------------------------------------------------------------------------------------------

    async def sync_replicaset(self, s: Obj, owned: list[Obj]) -> None:
        meta, spec = s["metadata"], s.get("spec") or {}
        ns = meta["namespace"]
        want = int(spec.get("replicas", 1))
        selector = spec.get("selector") or {}
        mine = [p for p in owned if _matches(selector, p["metadata"].get("labels") or {})]
        for p in mine:  # a failed pod of a restartPolicy-Always template is not counted: it goes, replaced
            if not p["metadata"].get("deletionTimestamp") and (p.get("status") or {}).get("phase") in (
                    "Failed", "Succeeded"):
                await self._delete_pod(p)
        active = [p for p in mine if _active(p)]
        if len(active) < want:
            template = spec.get("template") or {}
            for _ in range(want - len(active)):
                pod_meta: Obj = {**copy.deepcopy(template.get("metadata") or {}), "generateName": f"{meta['name']}-",
                                 "namespace": ns, "ownerReferences": [_owner_reference(s, "ReplicaSet")]}
                pod_meta.pop("name", None)
                body: Obj = {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta,
                             "spec": copy.deepcopy(template.get("spec") or {})}
                await self.client.create(f"/api/v1/namespaces/{ns}/pods", body)
        elif len(active) > want:
            # not scheduled, then not ready, then the newest go first
            doomed = sorted(active, key=lambda p: str(p["metadata"].get("creationTimestamp") or ""), reverse=True)
            doomed.sort(key=lambda p: (bool((p.get("spec") or {}).get("nodeName")), _ready(p)))
            for p in doomed[:len(active) - want]:
                await self._delete_pod(p)
        ready = sum(_ready(p) for p in active)
        status = {"replicas": len(active), "fullyLabeledReplicas": len(active), "readyReplicas": ready,
                  "availableReplicas": ready, "observedGeneration": meta.get("generation")}
        old = s.get("status") or {}
        if any(old.get(k, 0 if k != "observedGeneration" else None) != v for k, v in status.items()):
            await self._patch(f"/apis/apps/v1/namespaces/{ns}/replicasets/{meta['name']}/status", {"status": status})

    async def _delete_pod(self, p: Obj) -> None:
        meta = p["metadata"]
        with contextlib.suppress(ApiError):
            await self.client.delete(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                                     {"apiVersion": "v1", "kind": "DeleteOptions",
                                      "preconditions": {"uid": meta["uid"]}})

    async def _patch(self, path: str, body: Obj) -> None:
        try:
            await self.client.patch(path, body)
        except ApiError as e:
            if e.status != 404:  # deleted meanwhile: nothing to do
                raise

