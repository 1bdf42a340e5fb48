"""The local cluster's scheduler: binds pending pods to nodes through the public API (`pods/NAME/binding`), so it
also works against a real API server (where it should be given its own scheduler name).

It watches pods and nodes (two informers). Every change wakes one pass over the pending pods that ask for one of
its scheduler names (default: `default-scheduler` and `shardwise`), highest priority and oldest first; each pod is
placed by `scheduling.place` on what the nodes hold, counting the pods bound earlier in the pass before their
binding shows in the watch (Kubernetes' "assumed" pods), so no GPU is booked twice. A pod that fits nowhere stays
Pending with the condition `PodScheduled=False`, reason `Unschedulable` and Kubernetes' message, written only when
it changes; it is retried on the next change of a node or a pod, and at least every `resync` seconds.

Not emulated: preemption, pod (anti-)affinity, topology spread, node ports, volumes, scoring plugins beyond the
least-allocated one, and Events (`FailedScheduling`, `Scheduled`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from collections.abc import Iterable
from typing import Any

import aiohttp

from . import scheduling
from .aiokube import STRATEGIC, ApiError, Informer, KubeClient, Obj

log = logging.getLogger(__name__)

SCHEDULER_NAMES = ("default-scheduler", "shardwise")


class Scheduler:
    def __init__(self, client: KubeClient, *, scheduler_names: Iterable[str] = SCHEDULER_NAMES,
                 resync: float = 30.0) -> None:
        self.client = client
        self.scheduler_names = tuple(scheduler_names)
        self.resync = resync
        self.pods = Informer(client, "/api/v1/pods", self._changed)
        self.nodes = Informer(client, "/api/v1/nodes", self._changed)
        self._wake = asyncio.Event()
        self._assumed: dict[str, str] = {}  # pod uid -> node, bound but not yet seen bound

    async def wait_synced(self) -> None:
        await self.pods.synced.wait()
        await self.nodes.synced.wait()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.pods.run())
            tasks.create_task(self.nodes.run())
            await self.wait_synced()
            while True:
                await self._schedule_pending()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.resync):  # not wait_for: on 3.11 it can swallow a cancellation
                        await self._wake.wait()
                self._wake.clear()

    def _changed(self, kind: str, obj: Obj) -> None:
        self._wake.set()

    async def _schedule_pending(self) -> None:
        """One pass: observe, place each pending pod, apply (bind, or record why it stays Pending)."""
        pods = list(self.pods.objects.values())
        seen = {(p.get("metadata") or {}).get("uid"): p for p in pods}
        self._assumed = {uid: node for uid, node in self._assumed.items()
                         if uid in seen and not (seen[uid].get("spec") or {}).get("nodeName")}
        nodes = sorted(self.nodes.objects.values(), key=lambda n: str((n.get("metadata") or {}).get("name")))
        pending = sorted((p for p in pods if scheduling.schedulable(p, self.scheduler_names)
                          and p["metadata"].get("uid") not in self._assumed), key=scheduling.queue_order)
        for pod in pending:
            used = scheduling.usage(pods, self._assumed)
            placement = scheduling.place(pod, nodes, used)
            try:
                if placement.node is not None:
                    await self._bind(pod, placement.node)
                else:
                    await self._mark_unschedulable(pod, placement.message)
            except (ApiError, aiohttp.ClientError, TimeoutError) as e:
                log.warning("scheduling %s/%s: %s", pod["metadata"].get("namespace"), pod["metadata"]["name"], e)

    async def _bind(self, pod: Obj, node: str) -> None:
        metadata = pod["metadata"]
        binding = {"apiVersion": "v1", "kind": "Binding",
                   "metadata": {"name": metadata["name"], "namespace": metadata["namespace"], "uid": metadata["uid"]},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        try:
            await self.client.create(f"/api/v1/namespaces/{metadata['namespace']}/pods/{metadata['name']}/binding",
                                     binding)
        except ApiError as e:
            if e.status in (404, 409):  # gone, or bound meanwhile (by another scheduler)
                return
            raise
        self._assumed[metadata["uid"]] = node
        log.info("bound %s/%s to %s", metadata["namespace"], metadata["name"], node)

    async def _mark_unschedulable(self, pod: Obj, message: str) -> None:
        condition = scheduling.unschedulable_condition(pod, message, _now())
        if condition is None:
            return
        metadata = pod["metadata"]
        patch: dict[str, Any] = {"metadata": {"uid": metadata["uid"]}, "status": {"conditions": [condition]}}
        try:
            await self.client.patch(f"/api/v1/namespaces/{metadata['namespace']}/pods/{metadata['name']}/status",
                                    patch, STRATEGIC)
        except ApiError as e:
            if e.status not in (404, 409):
                raise


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
