"""The node lifecycle controller, as Kubernetes' controller manager runs it, for the local cluster's nodes.

A node whose kubelet stops renewing its Lease (in `kube-node-lease`) for `grace` seconds is lost to the cluster:

- its `Ready` condition becomes `Unknown` (reason `NodeStatusUnknown`) and it is tainted
  `node.kubernetes.io/unreachable` with effects NoSchedule (the scheduler places nothing new there) and NoExecute;
- its pods' `Ready` condition becomes False (Endpoints and controllers stop counting them), and every pod that
  does not tolerate the NoExecute taint is evicted: deleted gracefully. Nobody on the node confirms the deletion,
  so the pod stays Terminating in the API, as it does in Kubernetes until the node is back or someone deletes it
  with `--grace-period=0`.

The grace is counted on the controller's own clock from the moment it saw the Lease's `renewTime` change (or saw
the node first), so a controller that was cut off from the API (a pass failed) starts every grace anew rather
than finding every node lost at once; and when every node is lost together, nothing is evicted (Kubernetes'
full disruption: the fault is more likely the controller's view). A node that renews its Lease again loses the
taints (its kubelet reports `Ready` itself). This local cluster adds
no default tolerations (Kubernetes' DefaultTolerationSeconds admission plugin gives each pod 300 s), so a pod
without its own toleration is evicted as soon as its node is found lost. `Cluster.lose_node` is the fault that
leads here: a node powered off, its processes killed and its kubelet silent.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time

import aiohttp

from .aiokube import ApiError, KubeClient, Obj
from .nodes import LEASE_NAMESPACE, timestamp
from .scheduling import tolerates

log = logging.getLogger("devcluster.nodelifecycle")

UNREACHABLE = "node.kubernetes.io/unreachable"
_API_ERRORS = (ApiError, aiohttp.ClientError, TimeoutError, OSError)


def unreachable_taints(now: datetime.datetime) -> list[Obj]:
    return [{"key": UNREACHABLE, "effect": effect, "timeAdded": timestamp(now)}
            for effect in ("NoSchedule", "NoExecute")]


def lost_conditions(conditions: list[Obj], now: datetime.datetime) -> list[Obj]:
    """The node's conditions with `Ready` Unknown (the others as the kubelet last wrote them)."""
    out = [c for c in conditions if c.get("type") != "Ready"]
    ready = next((c for c in conditions if c.get("type") == "Ready"), {})
    since = ready.get("lastTransitionTime") if ready.get("status") == "Unknown" else timestamp(now)
    out.append({"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                "message": "Kubelet stopped posting node status.",
                "lastHeartbeatTime": ready.get("lastHeartbeatTime", timestamp(now)), "lastTransitionTime": since})
    return out


class NodeLifecycle:
    def __init__(self, client: KubeClient, *, grace: float = 40.0, period: float = 1.0) -> None:
        self.client, self.grace, self.period = client, grace, period
        self._seen: dict[str, tuple[str, float]] = {}  # node -> (its Lease's renewTime, when it was first seen)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            try:
                await self.check()
            except _API_ERRORS as e:
                log.warning("node lifecycle: a pass failed (every grace starts again): %s", e)
                self._seen.clear()

    async def check(self) -> None:
        """One pass over every node."""
        now, clock = datetime.datetime.now(datetime.UTC), time.monotonic()
        nodes = (await self.client.get("/api/v1/nodes")).get("items") or []
        leases = {lease["metadata"]["name"]: lease for lease in (await self.client.get(
            f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases")).get("items") or []}
        silent: dict[str, float] = {}
        for node in nodes:
            name = node["metadata"]["name"]
            renewed = str(((leases.get(name) or {}).get("spec") or {}).get("renewTime") or "")
            seen = self._seen.get(name)
            if seen is None or seen[0] != renewed:
                self._seen[name] = seen = (renewed, clock)
            silent[name] = clock - seen[1]
        lost_all = bool(nodes) and all(s > self.grace for s in silent.values())
        for node in nodes:
            name = node["metadata"]["name"]
            lost = silent[name] > self.grace
            taints = list((node.get("spec") or {}).get("taints") or [])
            marked = any(t.get("key") == UNREACHABLE for t in taints)
            if lost and not marked:
                log.warning("node %s: its Lease not renewed for %.0f s: unreachable", name, silent[name])
                # the taints first: the scheduler stops placing pods there before anything else changes
                await self.client.patch(f"/api/v1/nodes/{name}", {"spec": {"taints": [
                    *taints, *unreachable_taints(now)]}})
                await self.client.patch(f"/api/v1/nodes/{name}/status", {"status": {"conditions": lost_conditions(
                    list((node.get("status") or {}).get("conditions") or []), now)}})
            elif not lost and marked:
                await self.client.patch(f"/api/v1/nodes/{name}", {"spec": {"taints": [
                    t for t in taints if t.get("key") != UNREACHABLE]}})
            if lost and not lost_all:
                await self._evict(name, now)

    async def _evict(self, node: str, now: datetime.datetime) -> None:
        pods = (await self.client.get("/api/v1/pods", fieldSelector=f"spec.nodeName={node}")).get("items") or []
        execute = {"key": UNREACHABLE, "effect": "NoExecute"}
        for pod in pods:
            meta, status = pod["metadata"], pod.get("status") or {}
            path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
            conditions = list(status.get("conditions") or [])
            ready = next((c for c in conditions if c.get("type") == "Ready"), None)
            if status.get("phase") in ("Pending", "Running") and (ready is None or ready.get("status") != "False"):
                conditions = [c for c in conditions if c.get("type") != "Ready"]
                conditions.append({"type": "Ready", "status": "False", "reason": "NodeNotReady",
                                   "lastTransitionTime": timestamp(now)})
                try:
                    await self.client.patch(f"{path}/status", {"metadata": {"uid": meta["uid"]},
                                                                "status": {"conditions": conditions}})
                except ApiError as e:
                    if e.status != 404:
                        raise
            if not meta.get("deletionTimestamp") and not tolerates(
                    (pod.get("spec") or {}).get("tolerations") or [], execute):
                log.warning("node %s lost: evicting pod %s/%s", node, meta["namespace"], meta["name"])
                try:
                    await self.client.delete(path, {"apiVersion": "v1", "kind": "DeleteOptions",
                                                    "preconditions": {"uid": meta["uid"]}})
                except ApiError as e:
                    if e.status not in (404, 409):
                        raise
