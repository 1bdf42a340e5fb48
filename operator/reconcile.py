"""One reconcile step of an InferenceDeployment: read the object and what it owns, act, write the status.

Level-triggered: every step starts from the API (the deployment, its pods, its objects), so an operator restarted
at any point resumes from what exists, and deterministic names (NAME-I) make a repeated create a no-op.

A world generation is the set of pods formed into one torch.distributed world. Its lifecycle:

    no pods ──create all pods (gang)──> Provisioning ──all Running──> Configure every agent ──all Ready──> Running
       ^                                     │ not all Running before the gang deadline:                   │
       │                                     └── delete them, retry after 30 s doubling to 10 min          │
       └──── delete every pod <── Rolling (the pod template changed the world's shape: model, layout, ...) <─┤
       └──── delete every pod <── Recovering (a pod died or was deleted, a rank crashed) <──────────────────┘

A template change that leaves the ranks' shape alone (image, env, resources, pod shape) is no such roll: the elastic
state machine replaces the pods group by group (`Replace`) while the other groups serve.

The decisions of provisioning and serving are pure functions in `machine` (`provision`, `ready`, `not_ready`) with
table-driven unit tests; this module observes, asks the agents what those functions ask, and applies their
outcomes. The elastic operations still decide and act in `elastic`.

Each new set of pods is the next world generation (`status.worldGeneration`). An invalid spec never becomes
pods: it is reported as `InvalidSpec` with the planner's messages, and a running world is left serving.
"""

from __future__ import annotations

import base64
import copy
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError
from shardwise.controllers.health import HealthWatch
from shardwise.controllers.world import (
    AgentAuth,
    AgentTls,
    WorldError,
    WorldLayout,
    WorldPod,
    active_worlds,
    configure_world,
    configured_generations,
    engine_failure,
    rank_states,
    world_health,
)

from shardwise import vllm
from shardwise.api import Engine, InferenceDeploymentSpec
from shardwise.planner import Plan, plan

from . import builders as b
from . import certs, plans, routing
from . import machine as m
from .elastic import Elastic, group_size, in_place, is_standby, plan_at, pod_seen, role_of, unless_unavailable
from .kube import Kube, KubeError, Obj, path
from .status import (
    agent_address,
    eplb_busy,
    iso_at,
    layout_of,
    merge_diff,
    now_iso,
    parse_iso,
    pod_ready,
    set_condition,
)

log = logging.getLogger("shardwise.operator")

KIND = "InferenceDeployment"
ENSURE_S = 30.0  # a deployment's owned objects are re-read at most this often while its spec stays the same
UNWRITTEN_RETRY_S = 2.0  # the longest a step waits with a status the API server could not take
SWITCHED_ROUTED_S = 10.0  # the longest a pod switched into a world is routed to before its readiness says it serves
UNSENT_MAX = 200  # events held while the API server does not answer
DAEMON_KEYS = ("eplb", "autoscaling")  # status blocks the EPLB and autoscaling daemons write, not the step


# Objects a deployment runs without when the cluster does not serve their API: kind -> the API that serves it.
OPTIONAL_KINDS = {"NetworkPolicy": "networking.k8s.io/v1 NetworkPolicy"}


def want_name(wanted: list[Obj], kind: str) -> str:
    return next(str(w["metadata"]["name"]) for w in wanted if w["kind"] == kind)


@dataclass(frozen=True)
class ReconcileOptions:
    build: b.BuildOptions = field(default_factory=b.BuildOptions)
    gang_timeout_s: float = 300.0  # all pods of a world must run within this
    agent_port: int = b.GRPC_PORT
    prometheus_allow: tuple[str, ...] = ()  # the Prometheus URLs autoscaling may query (empty: any http(s))


def spec_errors(raw: Any) -> tuple[InferenceDeploymentSpec | None, Plan | None, list[str]]:
    """The parsed spec and its plan, or the messages that reject it (what the admission webhook answers)."""
    try:
        spec = InferenceDeploymentSpec.model_validate(raw or {})
    except ValidationError as e:
        return None, None, [f"spec.{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
    p = plan(spec)
    if p.errors:
        return spec, p, [str(v) for v in p.errors]
    par = spec.parallelism
    standby = spec.elastic.standby_pods
    if standby and (spec.runtime.engine is Engine.VLLM or par.pp > 1):
        return spec, p, [f"spec.elastic.standbyPods: {standby} standby pods need a world that changes in place "
                         f"(the reference engine with pp=1), got engine {spec.runtime.engine.value}, pp={par.pp}"]
    if spec.runtime.engine is Engine.VLLM:
        return spec, p, vllm.refusals(spec, p)
    if par.moe_tp > 1 and (par.ep_size * par.moe_tp != par.stage_size or par.pp > 1):
        return spec, p, [f"spec.parallelism.moeTp: the reference runtime runs moeTp={par.moe_tp} with one copy of "
                         f"the experts per stage (ep * moeTp = dpa * tp) and pp=1, got ep={par.ep_size}, "
                         f"pp={par.pp}"]
    return spec, p, []


class Reconciler:
    """Steps of one operator process; `step()` is called by the per-deployment daemon until it returns None."""

    def __init__(self, kube: Kube, options: ReconcileOptions = ReconcileOptions(),
                 clock: Callable[[], float] = time.time) -> None:
        self.kube, self.options, self.clock = kube, options, clock
        self.elastic = Elastic(self)
        self.operations: dict[str, list[float]] = {}  # operation -> [count, seconds total, last pause]
        self.pool_api: tuple[bool, float] | None = None  # (is the InferencePool API served, when looked up)
        self._tokens: dict[tuple[str, str, str], AgentAuth] = {}  # (namespace, name, uid) -> token and TLS
        # (namespace, name) -> (uid, generation, when) its ConfigMap, Services, PDB and NetworkPolicy were checked
        self._ensured: dict[tuple[str, str], tuple[str, Any, float]] = {}
        # (namespace, name) -> {kind: why}: optional objects (a NetworkPolicy) the cluster would not take
        self._unserved: dict[tuple[str, str], dict[str, str]] = {}
        # pushed health of each serving world's agents: a crashed rank wakes the deployment's step at once
        self.on_change: Callable[[str, str], None] | None = None  # wakes (namespace, name)'s step; None: no watch
        self._watches: dict[tuple[str, str], HealthWatch] = {}
        # while the API server does not answer: (namespace, name) -> (the status the API holds, the one the
        # steps went on from), so that a recovery proceeds in memory and is recorded once the API is back
        self._unwritten: dict[tuple[str, str], tuple[Obj, Obj]] = {}
        self._unsent: list[Obj] = []  # events the API server could not take yet, oldest first
        # (namespace, name) -> (world, pods, until): pods a recovery switched into that world and saw serving, routed
        # to before their readiness probes catch up (a second or two); each leaves once it is seen Ready
        self._switched: dict[tuple[str, str], tuple[int, set[int], float]] = {}

    def token(self, obj: Obj) -> AgentAuth | None:
        """How to reach the deployment's agents: the agent token and the operator's TLS client files, read from
        the deployment's Secret once (they never change), then remembered. A Secret an older operator made
        without TLS files gets them now (its pods, plaintext, carry an older builders.POD_FORMAT and are rolled)."""
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"], str(meta.get("uid") or ""))
        if key not in self._tokens:
            name = b.names(key[1])["secret"]
            secret = self.kube.get("Secret", key[0], name)
            if secret is None:
                return None
            if certs.CLIENT_CERT not in (secret.get("data") or {}):
                tls = b.build_secret(obj, "", certs.issue(key[1]))["data"]
                tls.pop(b.TOKEN_KEY)
                secret = self.kube.patch("Secret", key[0], name, {"data": tls})
            self._tokens[key] = AgentAuth(_secret_value(secret, b.TOKEN_KEY), AgentTls(
                _secret_value(secret, "ca.crt").encode(), _secret_value(secret, certs.CLIENT_CERT).encode(),
                _secret_value(secret, certs.CLIENT_KEY).encode()))
        return self._tokens[key]

    @property
    def agent_port(self) -> int:
        return self.options.agent_port

    @property
    def build(self) -> b.BuildOptions:
        return self.options.build

    def metrics_op(self, operation: str, seconds: float, pause: float) -> None:
        m = self.operations.setdefault(operation, [0.0, 0.0, 0.0])
        m[0] += 1
        m[1] += seconds
        m[2] = pause

    # ------------------------------------------------------------------------------------------ step
    def step(self, namespace: str, name: str) -> float | None:
        """One reconcile; the seconds until the next one is due (None: the deployment is gone or going)."""
        obj = self.kube.get(KIND, namespace, name) or self.kube.get(KIND, namespace, name, cached=False)
        if obj is None or obj["metadata"].get("deletionTimestamp"):  # (not yet in the cache: asked of the API)
            self.unwatch(namespace, name)
            return None
        held = obj.setdefault("status", {})  # what the API holds (the cache sees the operator's own writes)
        key = (namespace, name)
        unwritten = self._unwritten.get(key)  # (kept until a status is written: a step that fails keeps it)
        # the status the last step decided but could not write, unless the API has since changed it (the EPLB
        # and autoscaling daemons' own blocks aside: theirs are taken as the API holds them)
        old = held
        if unwritten is not None and _apart_from_daemons(unwritten[0]) == _apart_from_daemons(held):
            old = {**_apart_from_daemons(copy.deepcopy(unwritten[1])),
                   **{k: v for k, v in held.items() if k in DAEMON_KEYS}}
        elif unwritten is not None:
            changed = sorted(k for k in {*unwritten[0], *held} - set(DAEMON_KEYS) if unwritten[0].get(k) != held.get(k))
            log.warning("status of %s/%s changed in the API (%s) since a step kept one it could not write: the kept "
                        "one is dropped", namespace, name, changed)
            self._unwritten.pop(key, None)
        st = copy.deepcopy(old)
        self._send_unsent()
        generation = obj["metadata"].get("generation")
        spec, p, errors = spec_errors(obj.get("spec"))
        pods = self.kube.list("Pod", namespace, b.selector_string(name))
        delay = UNWRITTEN_RETRY_S
        try:
            if errors or spec is None or p is None:
                delay = self._invalid(obj, st, errors, pods)
            else:
                delay = self._valid(obj, st, spec, p, pods)
                self.sync_router(obj, st, spec, pods)
            st["observedGeneration"] = generation
            self._write_status(obj, old, st)
        except KubeError as e:
            if not e.unavailable:
                raise
            # the step's decisions stand, those it made before a call the API server did not answer too (a
            # recovery's survivors may serve already): the next steps go on from them and write them once the API
            # answers
            self._unwritten[key] = (copy.deepcopy(obj["status"]), st)
            log.warning("status of %s/%s not written (%s): kept, written once the API server answers",
                        namespace, name, e)
            return min(delay, UNWRITTEN_RETRY_S)
        self._unwritten.pop(key, None)
        self._send_unsent()  # the API has just taken a write: what it missed goes out now, not at the next step
        return min(delay, UNWRITTEN_RETRY_S) if self._unsent else delay

    def sync_router(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, pods: list[Obj],
                    serving: Iterable[int] = ()) -> dict[str, str]:
        """Push the route table (groups leaving in a scale-down admit nothing; `serving`: pods a recovery just
        switched into this world, known to serve before their readiness says so: remembered, so that the later
        steps of this world route to them too, each until it is seen Ready, at most SWITCHED_ROUTED_S) and set
        status.url."""
        op = st.get("elastic") or {}
        leaving = op.get("leaving") or [] if op.get("operation") in ("ScaleDown", "Replace") and op.get(
            "phase") in ("Draining", "Switching") else []
        token = self.token(obj)
        if token is None:
            return {}
        key, now = (obj["metadata"]["namespace"], obj["metadata"]["name"]), self.clock()
        world = int(st.get("worldGeneration") or 0)
        if serving:
            self._switched[key] = (world, set(serving), now + SWITCHED_ROUTED_S)
        seen_at, switched, until = self._switched.get(key, (0, set(), 0.0))
        if seen_at < world or now > until:  # (a cached status a write behind reads the world before: kept)
            self._switched.pop(key, None)
            switched = set()
        switched -= {int(q["metadata"]["labels"][b.LABEL_POD_INDEX]) for q in pods if pod_ready(q)}
        return routing.sync(self, obj, st, spec, pods, token.token, leaving, switched)

    def _invalid(self, obj: Obj, st: Obj, errors: list[str], pods: list[Obj]) -> float:
        gen = obj["metadata"].get("generation")
        message = "; ".join(errors)
        conds = st.get("conditions") or []
        if not pods:
            conds = set_condition(conds, "Available", "False", "InvalidSpec", message, gen)
            st["phase"] = "Failed"
        conds = set_condition(conds, "Progressing", "False", "InvalidSpec", message, gen)
        st["conditions"] = conds
        return 60.0

    def _refused_checkpoint(self, obj: Obj, st: Obj, live: list[Obj], message: str) -> float:
        """The pods found that the checkpoint is not the planned model (or is broken): InvalidSpec with their
        numbers, the pods deleted, and nothing retried until the spec changes (no crash loop)."""
        gen = obj["metadata"].get("generation")
        for q in live:
            self.kube.delete("Pod", obj["metadata"]["namespace"], q["metadata"]["name"], uid=q["metadata"].get("uid"))
        why = f"checkpoint refused by the pods: {message}"
        conds = set_condition(st.get("conditions") or [], "Available", "False", "InvalidSpec", why, gen)
        st["conditions"] = set_condition(conds, "Progressing", "False", "InvalidSpec", why, gen)
        st["phase"], st["pods"], st["endpoints"] = "Failed", [], []
        st.pop("configuredWorld", None)
        return 60.0

    def restart_world(self, obj: Obj, st: Obj, live: list[Obj], reason: str, message: str) -> float:
        """Delete every pod: the next world is formed from scratch (a roll, or a recovery that kept nothing)."""
        ns, gen = obj["metadata"]["namespace"], obj["metadata"].get("generation")
        for q in live:
            if not q["metadata"].get("deletionTimestamp"):
                self.kube.delete("Pod", ns, q["metadata"]["name"], uid=q["metadata"].get("uid"))
        st["phase"] = "Recovering" if reason == "Recovering" else "Provisioning"
        st["conditions"] = set_condition(st.get("conditions") or [], "Progressing", "True", reason, message, gen)
        if reason == "Recovering":
            st["conditions"] = set_condition(st["conditions"], "Available", "False", reason, message, gen)
        st["pendingReason"] = reason
        st.pop("configuredWorld", None)  # the next world is formed from scratch
        st.pop("worldHash", None)
        return 1.0

    def _valid(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, p: Plan, pods: list[Obj]) -> float:
        name = obj["metadata"]["name"]
        token = self._ensure_objects(obj, p)
        self.unserved_condition(obj, st)
        routing.ensure(self, obj, spec)
        routing.ensure_pool(self, obj)
        st["selector"] = b.selector_string(name)
        st["engine"] = vllm.capabilities(spec.runtime.engine)
        st["model"] = b.served_name(obj, spec)
        live = [q for q in pods if not q["metadata"].get("deletionTimestamp")]
        want_hash = b.template_hash(spec)
        stale = [q for q in live if b.made_from(q) != want_hash]
        op = st.get("elastic") or {}
        if stale and not self._rolls_in_place(st, spec):
            if op.get("phase") not in (None, "Done"):
                st["elastic"] = {**op, "phase": "Done", "lastResult": "abandoned: the pod template changed"}
            message = f"the pod template changed: replacing {len(live)} pods of world {st.get('worldGeneration')}"
            return self.restart_world(obj, st, live, "Rolling", message)
        refused = st.get("checkpointRefused") or {}
        if refused.get("generation") == obj["metadata"].get("generation"):
            return self._refused_checkpoint(obj, st, live, str(refused.get("message", "")))
        st.pop("checkpointRefused", None)
        world = int(st.get("worldGeneration") or 0)
        if world and int(st.get("configuredWorld") or 0) == world and st.get("worldDpa"):
            if op.get("phase") not in (None, "Done"):
                self._watch_operation(obj, st, op, live, token)
                held = {int(q["metadata"]["labels"][b.LABEL_POD_INDEX]) for q in pods}
                return self.elastic.advance(obj, st, spec, live, token, held)
            return self._serve(obj, st, spec, live, pods, token)
        self.unwatch(obj["metadata"]["namespace"], name)
        return self._provision(obj, st, spec, p, live, len(pods) - len(live), token)

    def _rolls_in_place(self, st: Obj, spec: InferenceDeploymentSpec) -> bool:
        """A template change the serving world takes group by group (elastic `Replace`): the ranks' shape is the
        world's (`world_hash`), and the engine changes its world in place (the reference engine, one stage)."""
        world = int(st.get("worldGeneration") or 0)
        return (spec.runtime.engine is Engine.REFERENCE and spec.parallelism.pp == 1 and world > 0
                and int(st.get("configuredWorld") or 0) == world and bool(st.get("worldDpa"))
                and st.get("worldHash") == b.world_hash(spec))

    # ------------------------------------------------------------------------------------ health watch
    def watch(self, namespace: str, name: str, addresses: dict[int, str], token: AgentAuth) -> HealthWatch | None:
        """The health watch of a serving world's agents (a new one when its pods changed); None without
        `on_change` (nothing to wake)."""
        on_change = self.on_change
        if on_change is None:
            return None
        key = (namespace, name)
        current = self._watches.get(key)
        if current is not None and current.addresses == addresses:
            return current
        self.unwatch(namespace, name)
        self._watches[key] = HealthWatch(addresses, token, lambda: on_change(namespace, name))
        return self._watches[key]

    def _watch_operation(self, obj: Obj, st: Obj, op: Obj, live: list[Obj], token: AgentAuth) -> None:
        """While a recovery waits for its survivors to stand by, follow their agents' health: each rank that
        leaves the broken world wakes the step (instead of the next poll). Other operations follow nothing."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        if op.get("operation") != "Recover" or op.get("phase") != "Standby":
            self.unwatch(ns, name)
            return
        old = layout_of(st)
        survivors = {int(q["metadata"]["labels"][b.LABEL_POD_INDEX]): q for q in live}
        self.watch(ns, name, {i: agent_address(q, self.options.agent_port) for i, q in sorted(survivors.items())
                              if i in old and not q["metadata"].get("deletionTimestamp")}, token)

    def unwatch(self, namespace: str, name: str) -> None:
        watch = self._watches.pop((namespace, name), None)
        if watch is not None:
            watch.close()

    def close(self) -> None:
        for namespace, name in list(self._watches):
            self.unwatch(namespace, name)

    def _provision(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, p: Plan, live: list[Obj],
                   terminating: int, token: AgentAuth) -> float:
        """A world formed from scratch at the spec's size: `machine.provision` decides, this applies. Its questions
        (which world the agents run, Configure) are asked here and answered in the next call."""
        st["worldSize"] = p.world_size
        gang = st.get("gang") or {}
        seen = m.ProvisionSeen(
            world=int(st.get("worldGeneration") or 0), pod_count=p.pod_count, world_size=p.world_size,
            now=self.clock(), gang_timeout_s=self.options.gang_timeout_s,
            gang=m.Gang(parse_iso(gang.get("since")), int(gang.get("attempts") or 0), parse_iso(gang.get("retryAt"))),
            phase=st.get("phase"), pending_reason=st.get("pendingReason"),
            pods=tuple(pod_seen(q) for q in live), terminating=terminating,
            crash_loop=m.CrashLoop(int((st.get("crashLoop") or {}).get("crashes") or 0),
                                   parse_iso((st.get("crashLoop") or {}).get("lastAt"))))
        out = m.provision(seen)
        slices = p.pods()
        running = [WorldPod(q.index, f"{q.ip}:{self.options.agent_port}", tuple(slices[q.index]))
                   for q in seen.pods if q.running]
        while out.asks:
            ask = out.actions[0]
            if isinstance(ask, m.AskAgents):
                seen = replace(seen, agents=configured_generations(running, token))
            elif isinstance(ask, m.Configure):
                seen = replace(seen, configured=self._configure(spec, p, running, token, ask.world))
            out = m.provision(seen)
        return self._apply(obj, st, spec, p, live, out)

    def _configure(self, spec: InferenceDeploymentSpec, p: Plan, pods: list[WorldPod], token: AgentAuth,
                   world: int) -> m.Configured:
        layout = WorldLayout(generation=world, model=p.model_name, tp=spec.parallelism.tp, dpa=spec.parallelism.dpa,
                             pp=spec.parallelism.pp, seed=spec.runtime.seed,
                             redundant_experts=spec.eplb.redundant_experts if spec.eplb.enabled else 0,
                             weights_dir=b.model_dir(spec), planned_architecture=b.planned_architecture(p),
                             dtype=spec.model.dtype.value, moe_tp=spec.parallelism.moe_tp, **b.cp_fields(spec))
        try:
            configure_world(pods, token, layout)
        except WorldError as e:
            return m.Configured(str(e))
        return m.Configured()

    def _apply(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, p: Plan, live: list[Obj],
               out: m.Outcome) -> float:
        """Carry out a machine's outcome: its status fields, then its actions in order."""
        ns, name, gen = obj["metadata"]["namespace"], obj["metadata"]["name"], obj["metadata"].get("generation")
        made: list[Obj] = []
        for action in out.actions:
            if isinstance(action, m.RecordWorld):
                st["worldGeneration"] = action.world
                self.kube.patch(KIND, ns, name, {"status": {"worldGeneration": action.world,
                                                            "gang": _gang_status(action.gang)}},
                                subresource="status")
            elif isinstance(action, m.CreatePods):
                made += [q for q in (self.kube.create(b.build_pod(obj, spec, p, i, action.world, self.options.build))
                                     for i in action.indices) if q]
            elif isinstance(action, m.DeletePods):
                for q in action.pods:
                    self.kube.delete("Pod", ns, q.name, uid=q.uid or None)
            elif isinstance(action, m.Emit):
                self._event(obj, action.reason, action.message, warning=action.warning)
            elif isinstance(action, m.RestartWorld):
                self._record(st, out, live, p, gen)
                return self.restart_world(obj, st, live, action.reason, action.message)
            elif isinstance(action, m.RefuseCheckpoint):
                st["checkpointRefused"] = {"generation": gen, "message": action.message}
                return self._refused_checkpoint(obj, st, live, action.message)
        self._record(st, out, [*live, *made], p, gen)
        if out.configured:
            st["configuredWorld"] = st["worldGeneration"]
            st["worldHash"] = b.world_hash(spec)
            st["worldDpa"] = spec.parallelism.dpa
        return out.delay

    def _record(self, st: Obj, out: m.Outcome, pods: list[Obj], p: Plan, gen: Any) -> None:
        """An outcome's status fields."""
        if out.take_pending_reason:
            st.pop("pendingReason", None)
        if out.phase is not None:
            st["phase"] = out.phase
        for c in out.conditions:
            st["conditions"] = set_condition(st.get("conditions") or [], c.type, c.status, c.reason, c.message, gen)
        if out.gang is not None:
            st["gang"] = _gang_status(out.gang)
        if out.crash_loop is not None and out.crash_loop.last_at is not None:
            st["crashLoop"] = {"crashes": out.crash_loop.crashes, "lastAt": iso_at(out.crash_loop.last_at)}
        if out.report_pods:
            st["pods"] = self._pod_status(pods, dict(enumerate(p.pods())))

    def _serve(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, live: list[Obj], everyone: list[Obj],
               token: AgentAuth) -> float:
        """A configured world: readiness, status, losses (recovery) and dpa changes (elastic scaling)."""
        ns, gen = obj["metadata"]["namespace"], obj["metadata"].get("generation")
        world, world_dpa = int(st["worldGeneration"]), int(st["worldDpa"])
        layout = layout_of(st)
        members = {int(q["metadata"]["labels"][b.LABEL_POD_INDEX]): q for q in live}
        # pods a recovery kept out of the world (a crashed rank restarting in place) wait for the scale-up that
        # takes them back; when none follows (the spec asks for no more groups) they go
        spares = [i for i in st.get("spares") or [] if i in members and i not in layout]
        if spares and spec.parallelism.dpa <= world_dpa:
            spares = []
        if spares:
            st["spares"] = spares
        else:
            st.pop("spares", None)
        # standby pods (spec.elastic.standbyPods) wait beside the world for a scale-up to take them
        standby = {i: q for i, q in members.items() if i not in layout and i not in spares and is_standby(q)}
        with unless_unavailable(f"the pods of {ns}/{obj['metadata']['name']}"):  # (the next steps try again)
            for i, q in members.items():
                if i not in layout and i not in spares and i not in standby:  # left by an operation not completed
                    self.kube.delete("Pod", ns, q["metadata"]["name"], uid=q["metadata"].get("uid"))
                role = q["metadata"]["labels"].get(b.LABEL_ROLE)
                # a recovery or scale-up whose labels the API server did not take (it was down) is put right
                want = "spare" if i in spares else role_of(layout[i], group_size(spec)) if role in (
                    "spare", "standby") and i in layout else role
                if i in [*layout, *spares] and want != role:
                    self.kube.patch("Pod", ns, q["metadata"]["name"],
                                    {"metadata": {"labels": {b.LABEL_ROLE: want}}})
        lost = sorted(i for i in layout if i not in members
                      or (members[i].get("status") or {}).get("phase") in ("Failed", "Succeeded"))
        vllm_engine = spec.runtime.engine is Engine.VLLM
        if lost:
            why = f"pod(s) {lost} of world {world} lost"
            if not vllm_engine and self.elastic.start_recover(obj, st, spec, lost, why):
                return 0.0  # the survivors may stand by already: look at once
            return self.restart_world(obj, st, live, "Recovering", why + ": re-forming the world")
        pods = [members[i] for i in sorted(layout)]
        p_world = plan_at(spec, world_dpa)
        st["worldSize"] = p_world.world_size
        st["pods"] = self._pod_status(pods, layout)
        ready = [q for q in pods if pod_ready(q)]
        st["ready"] = f"{len(ready)}/{len(layout)}"
        addresses = {i: agent_address(members[i], self.options.agent_port)
                     for i in sorted(layout)}
        watch = self.watch(ns, obj["metadata"]["name"], addresses, token)
        if watch is not None and any(gen > world for gen in watch.generations().values()):
            adopted = self._adopt(obj, st, spec, members, token)
            if adopted is not None:
                return adopted
        g = spec.parallelism.tp * spec.parallelism.cp
        st["endpoints"] = sorted(f"http://{q['status']['podIP']}:{b.HTTP_PORT}" for q in ready
                                 if any(r % g == 0 for r in layout[int(q["metadata"]["labels"][b.LABEL_POD_INDEX])]))
        conds = st.get("conditions") or []
        want = spec.parallelism.dpa
        # every pod ready and no agent has pushed a crash (readiness would show it a probe or two later)
        if len(ready) == len(layout) and not (watch is not None and watch.degraded()):
            op = st.get("elastic") or {}
            want_hash = b.template_hash(spec)
            busy = eplb_busy(st, self.clock())
            seen = m.ReadySeen(
                world=world, world_dpa=world_dpa, want_dpa=want, world_size=p_world.world_size, pods=len(layout),
                generation=gen, eplb_busy=busy, operation=op.get("operation"),
                stale=tuple(sorted(i for i, q in members.items() if i not in standby and b.made_from(q) != want_hash)),
                cancelled_generation=op.get("cancelledGeneration"), last_result=str(op.get("lastResult", "")),
                refusal=in_place(spec, world_dpa, want) if want != world_dpa else None,
                router=routing.not_serving(self, obj, spec), now=self.clock(),
                grow_at=parse_iso((st.get("crashLoop") or {}).get("retryAt")))
            return self._apply_ready(obj, st, spec, live, everyone, spares, standby, m.ready(seen))
        op = st.get("elastic") or {}
        seen_nr = m.NotReadySeen(
            world=world, pods=len(layout), ready=len(ready), now=self.clock(), vllm=vllm_engine,
            names={i: q["metadata"]["name"] for i, q in members.items()},
            silent={i: t for i, t in (watch.silent() if watch is not None else {}).items()
                    if not pod_ready(members[i])},
            available=any(c.get("type") == "Available" and c.get("status") == "True" for c in conds)
            or st.get("servedWorld") == world,  # (it served, even if its router did not yet)
            served_world=st.get("servedWorld"), pending_reason=st.get("pendingReason"),
            operation=op.get("operation"), finished_at=parse_iso(op.get("finishedAt")),
            engine_crashes=int(st.get("engineCrashes") or 0), last_engine_failure=str(st.get("engineFailure") or ""))
        agents = [WorldPod(i, addresses[i], tuple(layout[i])) for i in sorted(layout)]
        out = m.not_ready(seen_nr)
        while out.asks:
            ask = out.actions[0]
            if isinstance(ask, m.AskHealth):
                seen_nr = replace(seen_nr, health=world_health(agents, token))
            elif isinstance(ask, m.AskEngineFailure):
                seen_nr = replace(seen_nr, engine_failure=engine_failure(addresses[ask.index], token))
            out = m.not_ready(seen_nr)
        return self._apply_not_ready(obj, st, spec, live, members, seen_nr, agents, token, out)

    def _apply_not_ready(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, live: list[Obj],
                         members: dict[int, Obj], seen: m.NotReadySeen, agents: list[WorldPod], token: AgentAuth,
                         out: m.Outcome) -> float:
        """Carry out `machine.not_ready`'s outcome."""
        ns, gen = obj["metadata"]["namespace"], obj["metadata"].get("generation")
        if out.phase is not None:
            st["phase"] = out.phase
        for c in out.conditions:
            st["conditions"] = set_condition(st.get("conditions") or [], c.type, c.status, c.reason, c.message, gen)
        if out.engine_failure is not None:
            st["engineFailure"] = out.engine_failure
        if out.engine_crashes is not None:
            st["engineCrashes"] = out.engine_crashes
        if out.retry_at is not None:
            st["gang"] = {**(st.get("gang") or {}), "retryAt": iso_at(out.retry_at)}
        for action in out.actions:
            if isinstance(action, m.DeletePods):
                for q in action.pods:
                    pod = members[q.index]
                    self.kube.delete("Pod", ns, pod["metadata"]["name"], grace=action.grace,
                                     uid=pod["metadata"].get("uid"))
            elif isinstance(action, m.Emit):
                self._event(obj, action.reason, action.message, warning=action.warning)
            elif isinstance(action, m.RestartWorld):
                return self.restart_world(obj, st, live, action.reason, action.message)
            elif isinstance(action, m.RecoverCrashed):
                return self._recover_crashed(obj, st, spec, live, members, seen, agents, token, action.crashed)
        return out.delay

    def _recover_crashed(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, live: list[Obj],
                         members: dict[int, Obj], seen: m.NotReadySeen, agents: list[WorldPod], token: AgentAuth,
                         crashed: tuple[int, ...]) -> float:
        """A rank of the reference engine's world crashed: adopt a later world the agents formed, else recover
        (survivors first) or re-form the world."""
        # a world the status does not record may be what broke this one (asked of the agents here too: a
        # restarted operator's watch has not heard from them yet)
        adopted = self._adopt(obj, st, spec, members, token)
        if adopted is not None:
            return adopted
        states = rank_states([a for a in agents if a.index in crashed], token)
        plan = m.crash_recovery(seen.world, crashed, {i: tuple(s) for i, s in states.items()}, seen.health or {})
        # survivors first: the groups without those pods serve at once and the desired size comes back by a
        # scale-up onto new pods; when every group has one (or the crashed ranks already stand by again), the
        # world re-forms in its pods with the restarted ranks
        if plan.left_out and self.elastic.start_recover(obj, st, spec, list(plan.left_out), plan.why, crashed=True,
                                                        spare=plan.spare):
            return 0.0
        if self.elastic.start_recover(obj, st, spec, [], plan.why):
            return 0.0
        return self.restart_world(obj, st, live, "Recovering", plan.why + ": re-forming the world")

    def _apply_ready(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, live: list[Obj], everyone: list[Obj],
                     spares: list[int], standby: dict[int, Obj], out: m.Outcome) -> float:
        """Carry out `machine.ready`'s outcome for a world whose pods are all ready; standby pods are kept at the
        spec's count while no operation starts."""
        gen = obj["metadata"].get("generation")
        if out.serves:
            st["dpa"] = int(st["worldDpa"])
            st["servedWorld"] = int(st["worldGeneration"])
            for key in ("gang", "pendingReason", "engineFailure", "engineCrashes"):
                st.pop(key, None)
        conds = st.get("conditions") or []
        for c in out.conditions:
            conds = set_condition(conds, c.type, c.status, c.reason, c.message, gen)
        taken = {int(q["metadata"]["labels"][b.LABEL_POD_INDEX]) for q in everyone}
        for action in out.actions:
            if isinstance(action, m.StartReplace):
                message = self.elastic.start_replace(obj, st, spec, list(action.pods), taken)
                conds = set_condition(conds, "Progressing", "True", "Rolling", message, gen)
            elif isinstance(action, m.StartScale):
                grows = action.dpa > int(st["worldDpa"])
                running = [i for i, q in standby.items() if pod_seen(q).running] if grows else []
                self.elastic.start_scale(obj, st, spec, action.dpa, taken, spares if grows else (), running)
                st.pop("spares", None)
            elif isinstance(action, m.RestartWorld):
                return self.restart_world(obj, st, live, action.reason, action.message)
        if out.phase is not None:
            st["phase"] = out.phase
        st["conditions"] = conds
        if not out.actions:
            self._keep_standby(obj, st, spec, standby, taken)
        return out.delay

    def _keep_standby(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, standby: dict[int, Obj],
                      taken: set[int]) -> None:
        """Standby pods at `spec.elastic.standbyPods`: one that exited or has an older pod template goes, the
        missing ones are created (at the lowest free indices), the extra ones go (the highest first);
        `status.standby` lists those running."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        want_hash = b.template_hash(spec)
        stale = [i for i, q in standby.items() if b.made_from(q) != want_hash]
        kept = m.standby_pods(spec.elastic.standby_pods, {i: pod_seen(q) for i, q in standby.items()}, stale)
        with unless_unavailable(f"the standby pods of {ns}/{name}"):
            for i in kept.delete:
                q = standby[i]
                self.kube.delete("Pod", ns, q["metadata"]["name"], uid=q["metadata"].get("uid"))
            if kept.create > 0:
                p = plan_at(spec, int(st["worldDpa"]))
                world = int(st["worldGeneration"])
                for i in itertools.islice(plans.free_indices(layout_of(st), taken), kept.create):
                    self.kube.create(b.build_pod(obj, spec, p, i, world, self.options.build, ranks=[], standby=True))
        if kept.running:
            st["standby"] = list(kept.running)
        else:
            st.pop("standby", None)

    def _adopt(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, members: dict[int, Obj],
               token: AgentAuth) -> float | None:
        """A later world that the agents serve and the status does not record (a recovery switched while the API
        server was down, and the operator restarted before it could write it): taken as the current world when
        its pods hold every rank of it, the pods out of it kept as spares for the scale-up that restores the
        size. None: no such world."""
        world = int(st["worldGeneration"])
        if spec.parallelism.pp != 1 or spec.runtime.engine is Engine.VLLM:
            return None
        port = self.options.agent_port
        worlds = active_worlds([WorldPod(i, agent_address(q, port), ()) for i, q in members.items()], token)
        found = m.adoption(world, worlds, group_size(spec), list(members),
                           [i for i, q in members.items() if is_standby(q)])
        if found is None:
            return None
        name = obj["metadata"]["name"]
        st["worldGeneration"] = st["configuredWorld"] = found.world
        st["worldDpa"] = st["dpa"] = found.dpa
        st["pods"] = [{"name": b.pod_name(name, i), "index": i, "ranks": list(r), "ready": True}
                      for i, r in found.layout.items()]
        if found.spares:
            st["spares"] = list(found.spares)
        kept = (f"; pod(s) {list(found.spares)} kept for the scale-up that restores dpa {spec.parallelism.dpa}"
                if found.spares else "")
        self._event(obj, "WorldAdopted", f"the agents serve world {found.world} (dpa {found.dpa} on pods "
                                         f"{sorted(found.layout)}), which the status did not record (world "
                                         f"{world}): taken as the current world{kept}", warning=True)
        return 0.2

    def serving_world(self, namespace: str, name: str) -> tuple[Obj, InferenceDeploymentSpec, Plan,
                                                                 list[WorldPod], AgentAuth] | None:
        """The deployment, its spec and plan, its agents and token while its world serves; None otherwise."""
        obj = self.kube.get(KIND, namespace, name)
        if obj is None or obj["metadata"].get("deletionTimestamp"):
            return None
        st = obj.get("status") or {}
        if st.get("phase") not in ("Running", "Rebalancing") or not st.get("configuredWorld"):
            return None
        spec, p, errors = spec_errors(obj.get("spec"))
        if errors or spec is None or p is None:
            return None
        layout = layout_of(st)
        pods = {int(q["metadata"]["labels"][b.LABEL_POD_INDEX]): q
                for q in self.kube.list("Pod", namespace, b.selector_string(name))
                if (q.get("status") or {}).get("podIP") and pod_ready(q)}
        if not layout or set(layout) - set(pods) or (st.get("elastic") or {}).get("phase") not in (None, "Done"):
            return None
        world = [WorldPod(i, agent_address(pods[i], self.options.agent_port), tuple(ranks))
                 for i, ranks in sorted(layout.items())]
        token = self.token(obj)
        if token is None:
            return None
        return obj, spec, p, world, token

    # ------------------------------------------------------------------------------------- objects
    def forget_ensured(self, namespace: str, name: str) -> None:
        """An object the deployment owns went: its next step checks them all again (and makes it anew)."""
        self._ensured.pop((namespace, name), None)

    def _ensure_objects(self, obj: Obj, p: Plan) -> AgentAuth:
        """The Secret, ConfigMap, Services and PDB (created when missing, the plan kept current); the token. For a
        spec already looked at they are checked again after ENSURE_S, so one deleted by hand comes back then."""
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        n = b.names(name)
        token = self.token(obj)
        if token is None:
            fresh, issued = secrets.token_hex(24), certs.issue(name)
            self.kube.create(b.build_secret(obj, fresh, issued))
            # what was stored: an earlier create (a restarted step) may have won
            token = self.token(obj) or AgentAuth(fresh, AgentTls(issued["ca.crt"], issued[certs.CLIENT_CERT],
                                                                 issued[certs.CLIENT_KEY]))
        seen = (str(obj["metadata"].get("uid") or ""), obj["metadata"].get("generation"))
        checked = self._ensured.get((ns, name))
        if checked is not None and checked[:2] == seen and self.clock() - checked[2] < ENSURE_S:
            return token  # the same spec, looked at moments ago: the steps between cost no requests for them
        cm = b.build_configmap(obj, p)
        live = self.kube.get("ConfigMap", ns, n["configmap"])
        if live is None:
            self.kube.create(cm)
        elif (live.get("data") or {}) != cm["data"]:
            self.kube.patch("ConfigMap", ns, n["configmap"], {"data": cm["data"]})
        wanted = [b.build_headless_service(obj, self.options.build), b.build_service(obj), b.build_pdb(obj)]
        if self.options.build.network_policy_namespace:
            wanted.append(b.build_network_policy(obj, self.options.build))
        unserved: dict[str, str] = {}
        for want in wanted:
            try:
                have = self.kube.get(want["kind"], ns, want["metadata"]["name"])
                if have is None:
                    self.kube.create(want)
                elif want["kind"] == "NetworkPolicy" and have.get("spec") != want["spec"]:
                    self.kube.patch("NetworkPolicy", ns, want["metadata"]["name"], {"spec": want["spec"]})
                elif want["kind"] == "Service" and (have.get("spec") or {}).get("selector") != \
                        want["spec"]["selector"]:
                    # the Service NAME led to the DPA leaders before the router: it leads to the router now
                    self.kube.patch("Service", ns, want["metadata"]["name"],
                                    {"spec": {"selector": want["spec"]["selector"]}})
            except KubeError as e:
                if want["kind"] not in OPTIONAL_KINDS or e.status not in (403, 404):
                    raise
                # an API the cluster does not serve (404), or one the operator may not write (403): reported by
                # a condition and an event; the deployment goes on without it
                unserved[want["kind"]] = (f"{OPTIONAL_KINDS[want['kind']]} not served by this cluster"
                                          if e.status == 404 else f"{want['kind']} not permitted: {e}")
        before = self._unserved.get((ns, name), {})
        for kind, why in unserved.items():
            if kind not in before:
                self.event(obj, "APINotServed", f"{kind} {want_name(wanted, kind)} not made: {why}; the "
                           "deployment runs without it", warning=True)
        self._unserved[(ns, name)] = unserved
        self._ensured[(ns, name)] = (*seen, self.clock())
        return token

    def unserved_condition(self, obj: Obj, st: Obj) -> None:
        """Condition APIsServed: False, with what is missing, while an optional object could not be made."""
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        gen = obj["metadata"].get("generation")
        unserved = self._unserved.get(key, {})
        conds = st.get("conditions") or []
        if unserved:
            st["conditions"] = set_condition(conds, "APIsServed", "False", "APINotServed",
                                             "; ".join(f"{k}: {v}" for k, v in sorted(unserved.items())), gen)
        elif any(c.get("type") == "APIsServed" for c in conds):
            st["conditions"] = set_condition(conds, "APIsServed", "True", "Served", "", gen)

    def _pod_status(self, pods: list[Obj], ranks: dict[int, list[int]]) -> list[Obj]:
        """status.pods: each pod with the ranks it runs (in the configured world, else in the plan)."""
        out = []
        for q in sorted(pods, key=lambda q: int(q["metadata"]["labels"].get(b.LABEL_POD_INDEX, 0))):
            i = int(q["metadata"]["labels"].get(b.LABEL_POD_INDEX, 0))
            out.append({"name": q["metadata"]["name"], "index": i, "ranks": list(ranks.get(i, [])),
                        "ready": pod_ready(q)})
        return out

    # --------------------------------------------------------------------------------------- status
    def _write_status(self, obj: Obj, old: Obj, new: Obj) -> None:
        """Write `new` over what the API holds (`obj["status"]`); an event when the phase changed from `old`
        (the status the step started from)."""
        held = obj["status"]
        if new == held and new == old:
            return
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        patch = merge_diff(held, new)
        try:
            if patch:
                self.kube.patch(KIND, ns, name, {"status": patch}, subresource="status")
        except KubeError as e:
            if e.status != 404:
                raise
            return
        obj["status"] = copy.deepcopy(new)
        if new.get("phase") != old.get("phase"):
            if {old.get("phase"), new.get("phase")} == {"Running", "Rebalancing"}:
                return  # the EPLB controller records its own events
            reason = {"Running": "Available", "Failed": "InvalidSpec"}.get(new.get("phase") or "", new.get("phase"))
            conds = {c["type"]: c for c in new.get("conditions") or []}
            message = (conds.get("Progressing") or conds.get("Available") or {}).get("message", "")
            self._event(obj, str(reason), f"{old.get('phase') or 'None'} -> {new.get('phase')}: {message}",
                        warning=new.get("phase") in ("Failed", "Degraded", "Recovering"))

    def event(self, obj: Obj, reason: str, message: str, *, warning: bool = False) -> None:
        self._event(obj, reason, message, warning=warning)

    def _event(self, obj: Obj, reason: str, message: str, *, warning: bool = False) -> None:
        meta = obj["metadata"]
        stamp = now_iso()
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": obj["apiVersion"], "kind": KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta["uid"]},
            "reason": reason, "message": message[:1024], "type": "Warning" if warning else "Normal",
            "source": {"component": "shardwise-operator"}, "firstTimestamp": stamp, "lastTimestamp": stamp,
            "count": 1, "reportingComponent": "shardwise-operator",
        }
        if self._unsent:  # after those the API has not taken yet, in order
            self._keep_unsent(event)
            return
        try:
            self.kube.request("POST", path("Event", meta["namespace"]), event)
        except KubeError as e:  # events are best effort: never fail a reconcile on one
            if e.unavailable:
                self._keep_unsent(event)
                return
            log.warning("event %s on %s/%s not recorded: %s", reason, meta["namespace"], meta["name"], e)

    def _keep_unsent(self, event: Obj) -> None:
        """Hold an event for the API server's return (its timestamps are when it happened); the oldest go first
        past UNSENT_MAX."""
        self._unsent.append(event)
        if len(self._unsent) > UNSENT_MAX:
            dropped = self._unsent.pop(0)
            log.warning("event %s dropped: the API server has not answered for %d events", dropped["reason"],
                        UNSENT_MAX)

    def _send_unsent(self) -> None:
        """Send the events held while the API server was down, oldest first; stop at the first it refuses."""
        while self._unsent:
            event = self._unsent[0]
            try:
                self.kube.request("POST", path("Event", event["metadata"]["namespace"]), event)
            except KubeError as e:
                if e.unavailable:
                    return
                log.warning("event %s not recorded: %s", event["reason"], e)
            self._unsent.pop(0)


def _gang_status(gang: m.Gang) -> Obj:
    """status.gang of a machine's Gang (timestamps to the second)."""
    out: Obj = {}
    if gang.since is not None:
        out["since"] = iso_at(gang.since)
    if gang.attempts:
        out["attempts"] = gang.attempts
    if gang.retry_at is not None:
        out["retryAt"] = iso_at(gang.retry_at)
    return out


def _apart_from_daemons(status: Obj) -> Obj:
    """A status without the blocks the EPLB and autoscaling daemons write."""
    return {k: v for k, v in status.items() if k not in DAEMON_KEYS}


def _secret_value(secret: Obj, key: str) -> str:
    if key in (secret.get("stringData") or {}):
        return str(secret["stringData"][key])
    return base64.b64decode((secret.get("data") or {}).get(key, "")).decode()
