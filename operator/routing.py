"""The deployment's router: its Deployment, its route table and `status.url`.

Every reconcile step of a deployment with `spec.router.enabled` keeps the router object current (replaced when
its template hash changes), pushes the route table to each router pod that runs (controllers/routes.py), and
sets `status.url`: the Service's DNS name where the cluster gives Services an address, else the router pod's IP
(the local cluster has no Service proxy).

A group takes new requests when its leader pod is ready and is not leaving in a scale-down; the elastic state
machine calls `sync()` with the leaving pods before it drains them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Protocol

from shardwise.controllers import routes as ctl

from shardwise.api import Engine, InferenceDeploymentSpec

from . import builders as b
from .elastic import plan_at
from .kube import Kube, KubeError, Obj
from .status import layout_of, pod_ready

log = logging.getLogger("shardwise.operator")


class Host(Protocol):
    """What routing needs of the operator around it (the reconciler): the API, the build options and its
    cached answer about the InferencePool API (served or not, and when that was looked up)."""

    kube: Kube
    pool_api: tuple[bool, float] | None

    @property
    def build(self) -> b.BuildOptions: ...


def ensure(r: Host, obj: Obj, spec: InferenceDeploymentSpec) -> None:
    """Create the router object, replace it when its template changed, delete it when the router is disabled."""
    ns = obj["metadata"]["namespace"]
    want = b.build_router(obj, spec, r.build)
    kind, rname = want["kind"], want["metadata"]["name"]
    live = r.kube.get(kind, ns, rname)
    if not spec.router.enabled:
        if live is not None and not live["metadata"].get("deletionTimestamp"):
            r.kube.delete(kind, ns, rname, uid=live["metadata"].get("uid"))
        return
    if live is None:
        r.kube.create(want)
        return
    if live["metadata"].get("deletionTimestamp"):
        return
    have = b.made_from(live)
    if have == want["metadata"]["annotations"][b.ANNOTATION_HASH]:
        return
    r.kube.patch(kind, ns, rname, {"metadata": {"annotations": want["metadata"]["annotations"]}, "spec": want["spec"]})


POOL_CHECK_S = 300.0  # how long an answer about the InferencePool API holds: present ...
POOL_ABSENT_CHECK_S = 15.0  # ... or absent (a CRD installed later is found within this)


def ensure_pool(r: Host, obj: Obj) -> None:
    """The deployment's InferencePool, where the Gateway API Inference Extension's CRD is installed (looked up
    by the operator every 15 s while absent, every 5 min once present): created when missing, its spec kept as
    built."""
    now = time.monotonic()
    known = r.pool_api
    if known is None or now - known[1] > (POOL_CHECK_S if known[0] else POOL_ABSENT_CHECK_S):
        try:
            r.kube.request("GET", "/apis/" + b.INFERENCE_POOL_API)
            present = True
        except KubeError as e:
            if e.status == 404 or e.status == 503:  # not served (503: an aggregated API that is down)
                present = False
            elif e.unavailable:  # no answer at all: the pool is an extra, the deployment's step goes on
                log.info("InferencePool API not looked up (asked again next step): %s", e)
                return
            else:
                raise
        known = (present, now)
        r.pool_api = known
    if not known[0]:
        return
    want = b.build_inference_pool(obj, r.build)
    ns, name = obj["metadata"]["namespace"], want["metadata"]["name"]
    try:
        live = r.kube.get("InferencePool", ns, name)
        if live is None:
            r.kube.create(want)
        elif live.get("spec") != want["spec"]:
            r.kube.patch("InferencePool", ns, name, {"spec": want["spec"]})
    except KubeError as e:  # the pool is an extra: it never holds up the deployment's own reconcile
        if e.status == 404:  # the CRD went away since it was looked up
            r.pool_api = (False, now)
        log.warning("InferencePool %s/%s not kept: %s %s", ns, name, e.status, e)


def leaders(spec: InferenceDeploymentSpec, st: Obj, live: Iterable[Obj],
            leaving: Iterable[int] = (), serving: Iterable[int] = ()) -> list[ctl.Leader]:
    """The pods that lead DPA groups in the configured world, with their groups and whether they admit: a Ready
    pod, or one in `serving` (just switched into this world by the operator, before its readiness probe, up to
    a second later, says so)."""
    layout = layout_of(st)
    world_dpa = int(st.get("worldDpa") or 0)
    if not layout or not world_dpa or int(st.get("configuredWorld") or 0) != int(st.get("worldGeneration") or 0):
        return []
    members = {int(q["metadata"]["labels"][b.LABEL_POD_INDEX]): q for q in live
               if not q["metadata"].get("deletionTimestamp") and (q.get("status") or {}).get("podIP")}
    gone, known = set(leaving), set(serving)
    groups: dict[int, list[int]] = {}
    if spec.runtime.engine is Engine.VLLM:  # each API-serving pod balances its own data-parallel ranks
        for i in layout:
            q = members.get(i)
            if q is not None and q["metadata"]["labels"].get(b.LABEL_ROLE) == "leader":
                groups.setdefault(i, []).append(i)
    else:
        grid = plan_at(spec, world_dpa).grid
        assert grid is not None
        owner = {rank: i for i, ranks in layout.items() for rank in ranks}
        for g in range(world_dpa):
            at = owner.get(int(grid.grid[0, g, 0, 0]))
            if at is not None and at in members:
                groups.setdefault(at, []).append(g)
    out = []
    for i, gs in sorted(groups.items()):
        q = members[i]
        out.append(ctl.Leader(url=f"http://{q['status']['podIP']}:{b.HTTP_PORT}", groups=tuple(gs),
                              admitting=(pod_ready(q) or i in known) and i not in gone))
    return out


def sync(r: Host, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, live: Iterable[Obj],
         token: str, leaving: Iterable[int] = (), serving: Iterable[int] = ()) -> dict[str, str]:
    """Push the route table to every running router pod; set status.url. Returns the pods that missed it."""
    if not spec.router.enabled:
        st.pop("url", None)
        return {}
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    routers = {q["metadata"]["name"]: f"http://{q['status']['podIP']}:{b.HTTP_PORT}"
               for q in r.kube.list("Pod", ns, _selector(name))
               if (q.get("status") or {}).get("phase") == "Running" and q["status"].get("podIP")
               and not q["metadata"].get("deletionTimestamp")}
    routes = ctl.table(b.served_name(obj, spec), int(st.get("worldGeneration") or 0),
                       leaders(spec, st, live, leaving, serving))
    errors = ctl.push(routers, token, routes) if routers else {}
    for pod, why in errors.items():
        log.info("router %s of %s/%s did not take routes %s: %s", pod, ns, name, routes["version"], why)
    service = r.kube.get("Service", ns, b.names(name)["service"]) or {}
    cluster_ip = (service.get("spec") or {}).get("clusterIP")
    if cluster_ip and cluster_ip != "None":
        st["url"] = f"http://{name}.{ns}.svc:{b.HTTP_PORT}"
    elif routers:
        st["url"] = sorted(routers.values())[0]
    else:
        st.pop("url", None)
    return errors


def not_serving(r: Host, obj: Obj, spec: InferenceDeploymentSpec) -> str:
    """Why the router does not answer at status.url ("" when a router pod is Ready, or the router is disabled).
    A router pod is ready while it has routes to a group that admits."""
    if not spec.router.enabled:
        return ""
    ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
    pods = [q for q in r.kube.list("Pod", ns, _selector(name)) if not q["metadata"].get("deletionTimestamp")]
    if any(pod_ready(q) for q in pods):
        return ""
    if not pods:
        return f"the router is not serving: no router pod ({b.names(name)['router']}) runs yet"
    return f"the router is not serving: 0 of {len(pods)} router pods ready"


def _selector(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(b.router_selector(name).items()))
