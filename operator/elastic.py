"""Elastic EP in place: a state machine in `status.elastic` that changes the number of DPA groups of a serving
world without restarting the ranks that stay, and re-forms a world that lost ranks from its survivors.

    ScaleUp    Provisioning (new pods run, their ranks load while the old world serves)
               -> Preparing (Configure the next generation everywhere, Prepare on the old pods)
               -> Switching (Pause the old world at a step boundary, Switch, Resume everywhere) -> Done
    ScaleDown  Draining (drain: stop admitting on the leaving groups and wait for their requests, cancel the
               scale-down on timeout; abort: end their requests with finish_reason aborted)
               -> Switching (Configure without ranks on the leaving pods, Pause, Switch, Resume) -> delete the
               leaving pods -> Done
    Replace    Provisioning (new pods of the current template take the ranks of the groups being replaced, at
               most `spec.elastic.maxUnavailableGroups` at a time; they load while the old world serves)
               -> Preparing (Configure the next generation, the replaced pods without ranks)
               -> Draining (the replaced groups stop admitting and finish their requests; on the drain's timeout
               the rest are aborted) -> Switching -> delete the replaced pods -> Done; the next step replaces the
               next groups until no pod has the old template (a rolling update group by group)
    Recover    Standby (the survivors' ranks, whose world broke, stand by in their processes)
               -> Switching (Configure the complete surviving groups, renumbered, Switch with recover) -> Done;
               the pods left out are deleted (lost, or their agent silent) or kept as spares (a crashed rank
               that their agent restarts in place), and the next step restores the desired size through a
               ScaleUp that takes the spares back (they switch in with recover, at the same time as the paused
               world) and creates new pods only for the rest; a spare not standing by again within `REJOIN_S`
               rolls that ScaleUp back and the next one creates new pods. Only when every group has a crashed
               rank does the world wait in its pods for the crashed ranks to restart as standbys (the same
               phases, all pods kept).

Every phase is idempotent (the agents' calls are, per generation) and the whole operation has a deadline
(`spec.elastic.operationTimeoutSeconds`): before the switch a failure rolls back (the old world resumes, new
pods go); at or after it, a world that cannot be completed is re-formed from scratch. An operator restarted in
any phase continues from `status.elastic`. One operation at a time: a change made meanwhile waits for it.

Pods keep their names; `status.pods` records which ranks each one runs in the current world, which is what
every phase reads (after a recovery a pod may lead a renumbered group).

What to do is decided by pure functions: around a phase by `machine.operation` (a size asked for meanwhile, the
deadline, an agent's error retried or failing the operation), inside it by `phases.step`. This module plans the
operations (`start_*`), observes, asks the agents what those functions ask, and carries out their actions
through the API server and the agents.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import grpc
from kubernetes.client.exceptions import ApiException
from shardwise.controllers.eplb import carried_map, maps_by_pod
from shardwise.controllers.world import (
    AgentAuth,
    WorldError,
    WorldLayout,
    WorldPod,
    call_each,
    configure_world,
    configured_generations,
    rank_states,
)

from shardwise.api import InferenceDeploymentSpec
from shardwise.planner import Plan, plan

from . import builders as b
from . import machine as m
from . import phases as ph
from . import plans
from .kube import Kube, KubeError, Obj
from .status import agent_address, decode_layout, encode_layout, iso_at, layout_of, merge_diff, parse_iso, seconds_at

log = logging.getLogger("shardwise.operator")


class Host(Protocol):
    """What the elastic state machine needs of the operator around it (the reconciler)."""

    kube: Kube
    clock: Callable[[], float]

    @property
    def agent_port(self) -> int: ...

    @property
    def build(self) -> b.BuildOptions: ...

    def event(self, obj: Obj, reason: str, message: str, *, warning: bool = False) -> None: ...

    def sync_router(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, pods: list[Obj],
                    serving: Iterable[int] = ()) -> dict[str, str]: ...

    def metrics_op(self, operation: str, seconds: float, pause: float) -> None: ...

    def restart_world(self, obj: Obj, st: Obj, live: list[Obj], reason: str, message: str) -> float: ...


CALL_S = 120.0


def next_world(st: Obj) -> int:
    """The generation of the next world an operation forms: above the serving one and above every generation an
    earlier operation chose, including one rolled back, failed or cut short by another (`status.lastWorld`, and
    the operation in `status.elastic`). Such a generation stays configured in the agents that took it (a Configure
    of it again keeps the first spec), and its ranks' addresses stay under its keys in the rendezvous store, which
    lives as long as pod 0: a second world under the same number would read addresses no listener has any more."""
    op = st.get("elastic") or {}
    return max(int(st["worldGeneration"]), int(st.get("lastWorld") or 0), int(op.get("targetWorld") or 0)) + 1


def plan_at(spec: InferenceDeploymentSpec, dpa: int) -> Plan:
    par = spec.parallelism.model_copy(update={"dpa": dpa})
    return plan(spec.model_copy(update={"parallelism": par}))


def group_size(spec: InferenceDeploymentSpec) -> int:
    return spec.parallelism.tp * spec.parallelism.cp


def in_place(spec: InferenceDeploymentSpec, from_dpa: int, to_dpa: int) -> str | None:
    """Why a dpa change cannot be made in place (None: it can)."""
    par = spec.parallelism
    if par.pp != 1:
        return f"pp={par.pp}: a dpa change renumbers every later stage's ranks"
    a, z = plan_at(spec, from_dpa), plan_at(spec, to_dpa)
    if a.errors or z.errors:
        return "; ".join(str(v) for v in (*a.errors, *z.errors))
    if a.gpus_per_pod != z.gpus_per_pod or group_size(spec) % a.gpus_per_pod:
        return (f"pods of {a.gpus_per_pod} GPUs must hold whole parts of attention groups of {group_size(spec)} "
                f"ranks at both sizes (got {a.gpus_per_pod} and {z.gpus_per_pod} GPUs per pod)")
    return None


def world_layout(spec: InferenceDeploymentSpec, p: Plan, generation: int, dpa: int) -> WorldLayout:
    """The layout of a world an operation forms: the running world switches into it, and a new pod's ranks wait
    at its rendezvous until that switch comes."""
    return WorldLayout(generation=generation, model=p.model_name, tp=spec.parallelism.tp, dpa=dpa,
                       pp=spec.parallelism.pp, seed=spec.runtime.seed, joins_running_world=True,
                       redundant_experts=spec.eplb.redundant_experts if spec.eplb.enabled else 0,
                       weights_dir=b.model_dir(spec), planned_architecture=b.planned_architecture(p),
                       dtype=spec.model.dtype.value, moe_tp=spec.parallelism.moe_tp,
                       **b.cp_fields(spec))


class Elastic:
    def __init__(self, r: Host) -> None:
        self.r = r
        self._waiting: dict[tuple[str, str], str] = {}  # what each deployment's awaited ranks last showed (logged)

    # ------------------------------------------------------------------------------------------ start
    def start_scale(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, to_dpa: int,
                    taken: Collection[int] = (), spares: Collection[int] = (), standby: Collection[int] = ()) -> None:
        """`taken`: indices of every pod that exists, terminating ones too (a pod of a lost node stays
        Terminating until its node is back: its name is not free). `spares`: pods a recovery left out of the
        world but kept (their crashed rank restarts in place): a scale-up takes them before creating pods, and
        then the running standby pods (`standby`)."""
        from_dpa = int(st["worldDpa"])
        world = int(st["worldGeneration"])
        layout = layout_of(st)
        g = group_size(spec)
        per_pod = plan_at(spec, to_dpa).gpus_per_pod
        now = self.r.clock()
        deadline = now + spec.elastic.operation_timeout_seconds
        op: Obj = {"operation": "ScaleUp" if to_dpa > from_dpa else "ScaleDown", "fromDpa": from_dpa,
                   "toDpa": to_dpa, "startedAt": iso_at(now), "deadline": iso_at(deadline),
                   "targetWorld": next_world(st), "generation": obj["metadata"].get("generation")}
        if to_dpa > from_dpa:
            grown = plans.scale_up(layout, from_dpa, to_dpa, g, per_pod, taken, spares, standby)
            op.update(phase="Provisioning", target=encode_layout(grown.target), leaving=[], groupSize=g)
            if grown.rejoin:
                op["rejoin"] = grown.rejoin
            took = sorted(i for i in standby if i in grown.target)
            if took:
                op["standby"] = took
        else:
            keep, leaving = plans.scale_down(layout, to_dpa, g)
            op.update(phase="Draining", target=encode_layout(keep), leaving=leaving, groupSize=g)
        self._set(st, op)
        rejoining = f"; pod(s) {op['rejoin']} rejoin" if op.get("rejoin") else ""
        if op.get("standby"):
            rejoining += f"; standby pod(s) {op['standby']} join"
        self.r.event(obj, "ScalingStarted", f"{op['operation']} dpa {from_dpa} -> {to_dpa} (world {world} -> "
                                            f"{op['targetWorld']}{rejoining})")

    def start_replace(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, stale: list[int],
                      taken: set[int]) -> str:
        """Replace the first groups holding a pod of an old template (`stale`) with new pods; `taken`: indices
        of every pod that exists (terminating ones too: a new pod must not wait for a name). The message."""
        layout = layout_of(st)
        dpa = int(st["worldDpa"])
        g = group_size(spec)
        rolled = plans.replace(layout, dpa, g, stale, spec.elastic.max_unavailable_groups, taken)
        chosen, leaving = rolled.groups, rolled.leaving
        now = self.r.clock()
        op: Obj = {"operation": "Replace", "phase": "Provisioning", "fromDpa": dpa, "toDpa": dpa,
                   "startedAt": iso_at(now), "deadline": iso_at(now + spec.elastic.operation_timeout_seconds),
                   "targetWorld": next_world(st), "generation": obj["metadata"].get("generation"),
                   "target": encode_layout(rolled.target), "leaving": leaving, "groups": chosen, "groupSize": g}
        self._set(st, op)
        message = (f"the pod template changed: replacing DPA group(s) {chosen} of {dpa} (pods {leaving} by "
                   f"{[rolled.by[i] for i in leaving]}; {rolled.later} more group(s) after these)")
        self.r.event(obj, "RollingGroups", message)
        return message

    def start_recover(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, lost: list[int], why: str,
                      crashed: bool = False, spare: Collection[int] = ()) -> bool:
        """Plan a recovery from the surviving pods; False when nothing can be kept (then: re-form from scratch).
        `lost`: the pods left out of the new world (gone, or with `crashed`, running a crashed rank: they are
        deleted once the survivors serve, and the scale-up that follows replaces them), except those in `spare`
        (a crashed rank whose agent answers and restarts it in place): they are kept, and the scale-up that
        follows takes them back once their ranks stand by again, instead of starting new pods cold."""
        kept = plans.recover(layout_of(st), group_size(spec), lost)
        if kept is None or spec.parallelism.pp != 1:
            return False
        now = self.r.clock()
        op: Obj = {"operation": "Recover", "phase": "Standby", "fromDpa": int(st["worldDpa"]),
                   "toDpa": kept.groups, "startedAt": iso_at(now),
                   "deadline": iso_at(now + min(300, spec.elastic.operation_timeout_seconds)),
                   "targetWorld": next_world(st), "target": encode_layout(kept.target), "leaving": kept.leaving,
                   "lost": sorted(lost), "generation": obj["metadata"].get("generation")}
        if crashed:
            op["crashed"] = True
        restarting = sorted(i for i in spare if i in lost)
        if restarting:
            op["spare"] = restarting
        self._set(st, op)
        self.r.event(obj, "RecoveryStarted", f"{why}: re-forming world {op['targetWorld']} from "
                                             f"{kept.groups} complete groups", warning=True)
        return True

    # ---------------------------------------------------------------------------------------- advance
    def advance(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, live: list[Obj], token: AgentAuth,
                held: Collection[int] = ()) -> float:
        """One step of the operation in progress. `held`: indices of every pod that exists, terminating ones
        too (a new pod deleted before it joined, evicted from a lost node say, is given another index)."""
        op = dict(st["elastic"])
        now = self.r.clock()
        st["phase"] = {"Recover": "Recovering", "Replace": "Rolling"}.get(op["operation"], "Scaling")
        pods = {int(q["metadata"]["labels"][b.LABEL_POD_INDEX]): q for q in live}
        target = decode_layout(op["target"])
        world = int(st["worldGeneration"])
        seen = m.OperationSeen(op["operation"], op["phase"], int(op["fromDpa"]), int(op["toDpa"]),
                               spec.parallelism.dpa, now, seconds_at(op["deadline"]), op.get("waiting"))
        out = m.operation(seen)
        if any(isinstance(a, m.QueueDpa) for a in out.actions):
            seen = dataclasses.replace(seen, waiting=spec.parallelism.dpa)  # (announced once)
        delay = self._control(obj, st, op, pods, token, out)
        if delay is not None:
            return delay
        try:
            return self._run_phase(obj, st, spec, op, pods, target, world, token, held)
        except WorldError as e:
            # (the phase may have moved on within the run: the phase that failed is decided on)
            out = m.operation(dataclasses.replace(seen, phase=op["phase"], error=str(e)))
        delay = self._control(obj, st, op, pods, token, out)
        return out.delay if delay is None else delay

    def _control(self, obj: Obj, st: Obj, op: Obj, pods: dict[int, Obj], token: AgentAuth,
                 out: m.Outcome) -> float | None:
        """Carry out `machine.operation`'s outcome; None when the phase is to run (RunPhase)."""
        for action in out.actions:
            if isinstance(action, m.QueueDpa):  # one operation at a time: the new size is taken up after this one
                op["waiting"] = action.dpa
                self._set(st, op)
            elif isinstance(action, m.Emit):
                self.r.event(obj, action.reason, action.message, warning=action.warning)
            elif isinstance(action, m.FailOperation):
                return self._fail(obj, st, op, pods, token, action.why, action.rollback)
            elif isinstance(action, m.RunPhase):
                return None
        return out.delay

    def _run_phase(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, op: Obj, pods: dict[int, Obj],
                   target: dict[int, list[int]], world: int, token: AgentAuth, held: Collection[int]) -> float:
        """Run the operation's phase: `phases.step` decides, this carries out its actions, asks the agents what
        it asks and decides again, until a step ends (its delay, or the delay of the action that ended the
        operation)."""
        provisioning = op["operation"] in ("ScaleUp", "Replace") and op["phase"] == "Provisioning"
        if provisioning and self._reindex(obj, st, op, pods, target, held):
            return 0.2
        run = _Run(obj, st, spec, op, pods, target, world, token)
        seen = ph.PhaseSeen(
            operation=op["operation"], phase=op["phase"], world=world, target_world=int(op["targetWorld"]),
            from_dpa=int(op["fromDpa"]), now=self.r.clock(), started=seconds_at(op["startedAt"]),
            old={i: tuple(r) for i, r in layout_of(st).items()}, target={i: tuple(r) for i, r in target.items()},
            pods={i: pod_seen(q) for i, q in pods.items()}, leaving=tuple(op.get("leaving") or ()),
            rejoin=tuple(op.get("rejoin") or ()), prepared=bool(op.get("prepared")),
            abort=spec.elastic.scale_down.mode.value == "abort",
            drain_timeout_s=spec.elastic.scale_down.drain_timeout_seconds)
        while True:
            out = ph.step(seen)
            for action in out.actions:
                ended, seen = self._carry_out(run, seen, action)
                if ended is not None:
                    return ended
            if not ph.decides_again(out):
                return out.delay

    def _carry_out(self, run: _Run, seen: ph.PhaseSeen, action: ph.PhaseAction) -> tuple[float | None, ph.PhaseSeen]:
        """One action of a phase's step: the observation with its answer, and the delay when it ends the step."""
        obj, st, spec, op, pods, token = run.obj, run.st, run.spec, run.op, run.pods, run.token
        gen, old = int(op["targetWorld"]), layout_of(st)
        if isinstance(action, ph.CreateNew):
            p_to = plan_at(spec, op["toDpa"])
            for i in action.indices:
                self.r.kube.create(b.build_pod(obj, spec, p_to, i, gen, self.r.build, ranks=run.target[i]))
        elif isinstance(action, ph.SetPhase):
            op["phase"] = action.phase
            self._set(st, op)
            if action.record:  # before the world pauses or switches: a restarted operator completes it
                self._write(obj, st, may_defer=action.may_defer)
            seen = dataclasses.replace(seen, phase=action.phase, states=None, active=None, configured=None,
                                       drained=None, aborted=None)
        elif isinstance(action, ph.ConfigureNext):
            layout = {i: list(r) for i, r in action.layout}
            configure_world(self._world_pods(pods, layout), token,
                            self._next_world(spec, op, pods, old, layout, token))
        elif isinstance(action, ph.PrepareOld):
            call_each(self._world_pods(pods, old), token, "Prepare", CALL_S, generation=gen)
        elif isinstance(action, ph.MarkPrepared):
            op["prepared"] = True
            self._set(st, op)
            seen = dataclasses.replace(seen, prepared=True)
        elif isinstance(action, ph.AskRanks):
            states = rank_states(self._agents(run, action.pods), token)
            seen = dataclasses.replace(seen, states={i: tuple(s) for i, s in states.items()})
        elif isinstance(action, ph.AskActive):
            run.switch_started = time.monotonic()  # the pause is measured from here
            active = configured_generations(self._agents(run, action.pods), token)
            seen = dataclasses.replace(seen, active=frozenset(active.values()))
        elif isinstance(action, ph.AskConfigured):
            configured = configured_generations(self._agents(run, action.pods), token)
            seen = dataclasses.replace(seen, configured=frozenset(configured.values()))
        elif isinstance(action, ph.Leave):
            self._leave(obj, st, spec, pods, {i: old[i] for i in op["leaving"] if i in old})
        elif isinstance(action, ph.Drain):
            drain_s = spec.elastic.scale_down.drain_timeout_seconds
            done = call_each(self._agents(run, action.pods), token, "Drain", drain_s + CALL_S, generation=run.world,
                             deadline_ms=drain_s * 1000)
            seen = dataclasses.replace(seen, drained=ph.Drained(
                sum(int(d.remaining) for d in done), any(d.timed_out for d in done),
                sum(int(d.remaining) for d in done if d.timed_out)))
        elif isinstance(action, ph.Abort):
            done = call_each(self._agents(run, action.pods), token, "Abort", CALL_S, generation=run.world)
            op["aborted"] = sum(int(d.aborted) for d in done)
            seen = dataclasses.replace(seen, aborted=op["aborted"])
        elif isinstance(action, ph.PauseAndSwitch):
            olds = self._world_pods(pods, old)
            call_each(olds, token, "Pause", CALL_S, generation=run.world, deadline_ms=60_000)
            self._switch_all(olds, self._world_pods(pods, {i: run.target[i] for i in action.rejoin}), token, gen)
        elif isinstance(action, ph.SwitchRecovered):
            call_each(self._agents(run, action.pods), token, "Switch", CALL_S * 3, generation=gen, recover=True)
        elif isinstance(action, ph.Finish):
            resumed = call_each(self._agents(run, action.resume), token, "Resume", CALL_S, generation=gen) \
                if action.resume else []
            pause = max([float(r.paused_seconds) for r in resumed] + [time.monotonic() - run.switch_started])
            delay = self._done(obj, st, op, pods, {i: list(r) for i, r in action.layout}, pause)
            if op["operation"] == "Recover":
                # the survivors serve now: the routers hear it at once, not after their readiness probes catch
                # up (a failed push changes nothing: the next step pushes the table again)
                try:
                    self.r.sync_router(obj, st, spec, list(pods.values()), serving=dict(action.layout))
                except (OSError, ApiException) as e:
                    log.info("routes after the recovery of %s not pushed yet: %s", obj["metadata"]["name"], e)
            return delay, seen
        elif isinstance(action, ph.Cancel):
            return self._cancel(obj, st, op, pods, action.why), seen
        elif isinstance(action, ph.Replan):
            st["elastic"] = _ended(op, f"planned again: pod(s) {list(action.gone)} went during the recovery")
            self.r.event(obj, "RecoveryReplanned", f"pod(s) {list(action.gone)} went while the survivors stood by: "
                                                   "planning the recovery without them", warning=True)
            return 0.2, seen
        elif isinstance(action, ph.RestartStuck):
            self._restart_stuck(run, action.pods)
        elif isinstance(action, ph.Waiting):
            self._log_wait(obj, action.what, {i: list(s) for i, s in (seen.states or {}).items()})
        elif isinstance(action, m.FailOperation):
            return self._fail(obj, st, op, pods, token, action.why, action.rollback), seen
        elif isinstance(action, m.Emit):
            self.r.event(obj, action.reason, action.message, warning=action.warning)
        return None, seen

    def _next_world(self, spec: InferenceDeploymentSpec, op: Obj, pods: dict[int, Obj], old: dict[int, list[int]],
                    target: dict[int, list[int]], token: AgentAuth) -> WorldLayout:
        """The next generation's layout, with an expert map that leaves every expert where a staying rank holds
        it (read from the old world's agents: call it while the old world is active, so that every call gives
        the same map); the leaving or lost ranks' only copies go to free slots and load from the weight files."""
        p_to = plan_at(spec, op["toDpa"])
        base = world_layout(spec, p_to, op["targetWorld"], op["toDpa"])
        arch = p_to.arch
        staying = {i: old[i] for i, ranks in target.items() if ranks and old.get(i)}
        if arch is None or not arch.is_moe or not staying:
            return base
        try:
            maps, newest = maps_by_pod(self._world_pods(pods, staying), token)
        except grpc.RpcError as e:
            raise WorldError(f"reading the expert maps of pods {sorted(staying)} failed: {e.code().name}") from e
        expert_map, lost = carried_map(maps, old, {i: r for i, r in target.items() if r}, arch.num_experts,
                                       spec.parallelism.moe_tp)
        if not expert_map:
            return base
        op["reloadedExperts"] = lost
        return dataclasses.replace(base, expert_map=expert_map, map_generation=newest + 1)

    def _agents(self, run: _Run, indices: Iterable[int]) -> list[WorldPod]:
        """The agents of these pods (each with its ranks in the target world, else in the serving one)."""
        ranks = {**layout_of(run.st), **run.target}
        return self._world_pods(run.pods, {i: ranks.get(i, []) for i in indices})

    def _world_pods(self, pods: dict[int, Obj], layout: dict[int, list[int]]) -> list[WorldPod]:
        out = []
        for i, ranks in sorted(layout.items()):
            q = pods.get(i)
            if q is None or not (q.get("status") or {}).get("podIP"):
                raise WorldError(f"pod {i} has no IP")
            out.append(WorldPod(i, agent_address(q, self.r.agent_port), tuple(ranks)))
        return out

    def _reindex(self, obj: Obj, st: Obj, op: Obj, pods: dict[int, Obj], target: dict[int, list[int]],
                 held: Collection[int]) -> bool:
        """New pods that exist only as terminating (deleted or evicted before they joined) move to indices no
        pod holds, so their replacements need not wait for the old names (which a lost node keeps)."""
        old = layout_of(st)
        stuck = [i for i in target if i not in old and i not in pods and i in held]
        if not stuck:
            return False
        free = (i for i in range(10_000) if i not in target and i not in held and i not in old)
        moves = {}
        for i in stuck:
            moves[i] = next(free)
            target[moves[i]] = target.pop(i)
        op["target"] = encode_layout(target)
        self._set(st, op)
        self.r.event(obj, "PodsReindexed", f"new pod(s) {stuck} went before joining and their names are still "
                                           f"held (terminating): creating {[moves[i] for i in stuck]} instead",
                     warning=True)
        return True

    def _restart_stuck(self, run: _Run, indices: tuple[int, ...]) -> None:
        """Survivors still in the broken world: their agents restart those ranks as standbys (said in an Event
        when any was). An agent that does not answer is left to the next step (and the operation's deadline)."""
        why = (f"still in broken world {run.world} {m.SURVIVOR_STUCK_S:g} s after its recovery started (blocked in a "
               "collective a lost peer never completes): restarted as a standby")
        try:
            done = call_each(self._agents(run, indices), run.token, "RestartStuck", CALL_S, generation=run.world,
                             reason=why)
        except WorldError as e:
            log.warning("%s: restarting the stuck survivors %s failed: %s", run.obj["metadata"]["name"], indices, e)
            return
        restarted = sorted(int(r) for d in done for r in d.restarted)
        if restarted:
            self.r.event(run.obj, "SurvivorsRestarted", f"rank(s) {restarted} of pod(s) {list(indices)} {why}",
                         warning=True)

    def _log_wait(self, obj: Obj, what: str, states: dict[int, list[str]]) -> None:
        """The progress of a wait on ranks (their states by pod), logged when it changes."""
        key, seen = (obj["metadata"]["namespace"], obj["metadata"]["name"]), f"{sorted(states.items())}"
        if self._waiting.get(key) != seen:
            log.info("%s/%s %s: %s", *key, what, seen)
            self._waiting[key] = seen

    def _leave(self, obj: Obj, st: Obj, spec: InferenceDeploymentSpec, pods: dict[int, Obj],
               leaving: dict[int, list[int]]) -> None:
        """Before a drain: the leaving pods labelled (the Service stops sending them requests) and the routers'
        table pushed without their groups, before the groups stop admitting (the table is pushed at the end of the
        step that started the operation too; this covers an operator restarted since)."""
        for i in leaving:
            if i in pods and pods[i]["metadata"]["labels"].get(b.LABEL_ROLE) != "leaving":
                self._label(obj, pods[i], "leaving")
        missed = self.r.sync_router(obj, st, spec, list(pods.values()))
        if missed:
            self.r.event(obj, "RouterNotUpdated", f"router pod(s) {sorted(missed)} did not take the route table "
                         f"before the drain (their requests to a leaving group are refused and retried)",
                         warning=True)

    @staticmethod
    def _switch_all(olds: list[WorldPod], rejoin: list[WorldPod], token: AgentAuth, gen: int) -> None:
        """Switch the paused old world and, at the same time (the new world forms only when every rank is there),
        the pods that rejoin it: their ranks stand by after a crash, so they switch as a recovery does."""
        if not rejoin:
            call_each(olds, token, "Switch", CALL_S * 3, generation=gen)
            return
        with ThreadPoolExecutor(1) as pool:
            rejoined = pool.submit(call_each, rejoin, token, "Switch", CALL_S * 3, generation=gen, recover=True)
            call_each(olds, token, "Switch", CALL_S * 3, generation=gen)
            rejoined.result()

    # ----------------------------------------------------------------------------------------- ending
    def _done(self, obj: Obj, st: Obj, op: Obj, pods: dict[int, Obj], layout: dict[int, list[int]],
              pause: float) -> float:
        ns = obj["metadata"]["namespace"]
        spare = op.get("spare", []) if op["operation"] == "Recover" else []
        g = max(1, int(op.get("groupSize") or 1))  # ranks per DPA group (recorded by a scale-up or -down)
        # the world switched already: a pod the API server does not take a label or deletion for now is put
        # right by the serving steps that follow (they delete pods out of the world and relabel the rest)
        with unless_unavailable("the pods of the new world"):
            for i, q in pods.items():
                if i in spare:  # out of the world, kept for the scale-up that follows (no Service selects it)
                    self._label(obj, q, "spare")
                elif i not in layout and not is_standby(q):  # (a standby pod out of the world stays standing by)
                    self.r.kube.delete("Pod", ns, q["metadata"]["name"], uid=q["metadata"].get("uid"))
            for i in [*op.get("rejoin", []), *op.get("standby", [])]:
                if i in pods and i in layout:
                    self._label(obj, pods[i], role_of(layout[i], g))
        took = self.r.clock() - seconds_at(op["startedAt"])
        verb = {"ScaleUp": "scaled up", "ScaleDown": "scaled down", "Recover": "recovered",
                "Replace": "replaced"}[op["operation"]]
        what = (f"DPA group(s) {op.get('groups')} (pods {op['leaving']} by "
                f"{sorted(i for i in layout if i not in layout_of(st))}) of dpa {op['toDpa']}"
                if op["operation"] == "Replace" else f"dpa {op['fromDpa']} -> {op['toDpa']}")
        result = (f"{verb} {what} in {took:.1f} s "
                  f"({'switch' if op['operation'] == 'Recover' else 'pause'} {pause:.2f} s)")
        if op["operation"] == "Recover" and op.get("crashed"):
            gone = [i for i in op["lost"] if i not in spare]
            if gone:
                result += (f" without pod(s) {gone} (a crashed rank or a silent agent; replaced by the scale-up "
                           "that follows)")
            if spare:
                result += (f" without pod(s) {spare} (a crashed rank, restarting in place: kept, to rejoin in the "
                           "scale-up that follows)")
        elif op["operation"] == "Recover":
            result += f" after losing pod(s) {op.get('lost', [])}"
        if op.get("rejoin"):
            result += f", pod(s) {op['rejoin']} rejoined (no new pod)"
        if op.get("standby"):
            result += f", standby pod(s) {op['standby']} joined"
        if op.get("aborted"):
            result += f", {op['aborted']} requests aborted"
        if op.get("reloadedExperts") is not None:
            n = op["reloadedExperts"]
            result += (f", {n} experts no staying rank held loaded from the weight files" if n else
                       ", every expert kept where a staying rank held it")
        st["worldGeneration"] = st["configuredWorld"] = op["targetWorld"]
        st["worldDpa"] = st["dpa"] = op["toDpa"]
        st["pods"] = [{"name": b.pod_name(obj["metadata"]["name"], i), "index": i, "ranks": r, "ready": True}
                      for i, r in sorted(layout.items())]
        if spare:
            st["spares"] = spare
        st["elastic"] = _ended(op, result, lastPauseSeconds=round(pause, 3), lastDurationSeconds=round(took, 2),
                               finishedAt=iso_at(self.r.clock()))
        self.r.metrics_op(op["operation"], took, pause)
        reason = {"ScaleUp": "ScaledUp", "ScaleDown": "ScaledDown", "Recover": "Recovered",
                  "Replace": "GroupsReplaced"}[op["operation"]]
        self.r.event(obj, reason, result)
        return 0.5

    def _relabel(self, obj: Obj, st: Obj, op: Obj, pods: dict[int, Obj]) -> None:
        """The pods that were to leave take their roles back (an operation that ended without them leaving)."""
        for i in op["leaving"]:
            if i in pods and pods[i]["metadata"]["labels"].get(b.LABEL_ROLE) == "leaving":
                self._label(obj, pods[i], role_of(layout_of(st).get(i, []), max(1, op.get("groupSize", 1))))

    def _label(self, obj: Obj, pod: Obj, role: str) -> None:
        self.r.kube.patch("Pod", obj["metadata"]["namespace"], pod["metadata"]["name"],
                          {"metadata": {"labels": {b.LABEL_ROLE: role}}})

    def _cancel(self, obj: Obj, st: Obj, op: Obj, pods: dict[int, Obj], why: str) -> float:
        self._relabel(obj, st, op, pods)
        st["elastic"] = _ended(op, f"cancelled: {why}", cancelledGeneration=op.get("generation"))
        self.r.event(obj, "ScaleDownCancelled", why, warning=True)
        return 1.0

    def _fail(self, obj: Obj, st: Obj, op: Obj, pods: dict[int, Obj], token: AgentAuth, why: str,
              rollback: bool) -> float:
        """`rollback` (before the switch, as the machines decided): the old world resumes and the new pods go;
        otherwise the world is re-formed from scratch."""
        old, target = layout_of(st), decode_layout(op["target"])
        if rollback:
            try:
                olds = self._world_pods(pods, old)
                call_each(olds, token, "Resume", CALL_S, generation=int(st["worldGeneration"]))
            except WorldError:
                pass  # nothing was paused
            for i, q in pods.items():
                # the new pods go (a standby pod the operation configured too); idle standby pods stay
                if i not in old and (i in target or not is_standby(q)):
                    self.r.kube.delete("Pod", obj["metadata"]["namespace"], q["metadata"]["name"],
                                       uid=q["metadata"].get("uid"))
            self._relabel(obj, st, op, pods)
            # a scale-up that took spares back is tried again with new pods (after the crash-loop backoff when its
            # new pods exited at start); others wait for a change
            held = {} if op.get("rejoin") else {"cancelledGeneration": op.get("generation")}
            if op.get("rejoin") and ph.EXITED_BEFORE_JOINING in why:
                old_loop = st.get("crashLoop") or {}
                loop = m.CrashLoop(int(old_loop.get("crashes") or 0),
                                   parse_iso(old_loop.get("lastAt"))).after_exit(self.r.clock())
                wait = m.crash_backoff(loop.crashes)
                st["crashLoop"] = {"crashes": loop.crashes, "lastAt": iso_at(self.r.clock()),
                                   "retryAt": iso_at(self.r.clock() + wait)}
                why = f"{why} (exit {loop.crashes} in a row; the next try in {wait:.0f} s)"
            st["elastic"] = _ended(op, f"rolled back: {why}", **held)
            self.r.event(obj, "ScalingRolledBack", why, warning=True)
            return 2.0
        st["elastic"] = _ended(op, f"failed: {why}; re-forming the world from scratch")
        self.r.event(obj, "ScalingFailed", why, warning=True)
        return self.r.restart_world(obj, st, list(pods.values()), "Recovering", why)

    # -------------------------------------------------------------------------------------- helpers
    def _set(self, st: Obj, op: Obj) -> None:
        st["elastic"] = op
        st["lastWorld"] = max(int(st.get("lastWorld") or 0), int(op.get("targetWorld") or 0))

    def _write(self, obj: Obj, st: Obj, *, may_defer: bool = False) -> None:
        """Record the operation now (before a step that pauses the world); the step's baseline follows it. With
        `may_defer`, an API server that does not answer is logged, not raised."""
        status = obj.setdefault("status", {})
        before = status.get("elastic") or {}
        try:
            self.r.kube.patch("InferenceDeployment", obj["metadata"]["namespace"], obj["metadata"]["name"],
                              {"status": {"elastic": merge_diff(before, st["elastic"]) if before else st["elastic"]}},
                              subresource="status")
        except KubeError as e:
            if not (may_defer and e.unavailable):
                raise
            log.warning("%s of %s/%s not recorded before it goes on (%s)", st["elastic"]["operation"],
                        obj["metadata"]["namespace"], obj["metadata"]["name"], e)
            return
        status["elastic"] = copy.deepcopy(st["elastic"])


@dataclasses.dataclass
class _Run:
    """What one step of an operation's phase acts on."""
    obj: Obj
    st: Obj
    spec: InferenceDeploymentSpec
    op: Obj  # status.elastic as the step changes it
    pods: dict[int, Obj]  # the deployment's pods not being deleted, by index
    target: dict[int, list[int]]
    world: int  # the serving generation
    token: AgentAuth
    switch_started: float = dataclasses.field(default_factory=time.monotonic)


@contextlib.contextmanager
def unless_unavailable(what: str) -> Iterator[None]:
    """Log instead of raising when the API server does not answer."""
    try:
        yield
    except KubeError as e:
        if not e.unavailable:
            raise
        log.warning("%s: not updated while the API server does not answer (%s)", what, e)


def pod_seen(q: Obj) -> m.PodSeen:
    """What the state machines see of a pod."""
    meta, status = q["metadata"], q.get("status") or {}
    return m.PodSeen(int(meta["labels"][b.LABEL_POD_INDEX]), meta["name"], str(meta.get("uid") or ""),
                     (meta.get("annotations") or {}).get(b.ANNOTATION_WORLD), str(status.get("phase") or ""),
                     str(status.get("podIP") or ""), ended(q))


def ended(q: Obj) -> str:
    """How a pod's container ended, as a user would want it said: `exited 1: <the last line of its termination
    message>` (the agent's fatal error, or with FallbackToLogsOnError the end of its log), `exited 137
    (OOMKilled)`; for a pod that failed without one (evicted), the pod's reason and message. Empty while it runs."""
    status = q.get("status") or {}
    for c in status.get("containerStatuses") or []:
        done = (c.get("state") or {}).get("terminated")
        if not done:
            continue
        code, reason = done.get("exitCode"), str(done.get("reason") or "")
        lines = [line.strip() for line in str(done.get("message") or "").splitlines() if line.strip()]
        out = f"exited {code}" + (f" ({reason})" if reason and reason not in ("Error", "Completed") else "")
        return out + (f": {lines[-1][:400]}" if lines else "")
    if status.get("reason") or status.get("message"):
        return f"failed ({status.get('reason') or 'Failed'}): {str(status.get('message') or '')[:400]}".rstrip(": ")
    return waiting(q)


def waiting(q: Obj) -> str:
    """Why a pod that does not run yet waits, where Kubernetes says so: a container's waiting reason other than
    the ordinary ones (`waiting (ImagePullBackOff): Back-off pulling image ...`, CreateContainerConfigError for a
    missing Secret), or the scheduler's `unschedulable: 0/2 nodes are available: ...`. Empty otherwise."""
    status = q.get("status") or {}
    for c in status.get("containerStatuses") or []:
        wait = (c.get("state") or {}).get("waiting") or {}
        reason = str(wait.get("reason") or "")
        if reason and reason not in ("ContainerCreating", "PodInitializing"):
            return f"waiting ({reason}): {str(wait.get('message') or '')[:400]}".rstrip(": ")
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and cond.get("message"):
            return f"unschedulable: {str(cond['message'])[:400]}"
    return ""


def is_standby(pod: Obj) -> bool:
    """A standby pod (`spec.elastic.standbyPods`): running beside the world, no ranks until a scale-up takes it."""
    return bool(pod["metadata"].get("labels", {}).get(b.LABEL_ROLE) == "standby")


def role_of(ranks: list[int], group_size: int) -> str:
    """A pod's `shardwise.io/role`: leader when it holds the first rank of a DPA group."""
    return "leader" if any(r % group_size == 0 for r in ranks) else "worker"


def _ended(op: Obj, result: str, **extra: object) -> Obj:
    """`status.elastic` for an operation that is over (done, cancelled, rolled back, failed or planned again)."""
    return {"operation": op["operation"], "phase": "Done", "fromDpa": op["fromDpa"], "toDpa": op["toDpa"],
            "startedAt": op["startedAt"], "lastResult": result, **extra}
