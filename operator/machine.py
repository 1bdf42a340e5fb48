"""The operator's decisions as pure functions: what it sees goes in, what to do and what to record come out.

A step of a phase is `decide(seen) -> Outcome`. `seen` is a frozen observation (the deployment's status fields
the phase reads, its pods, the clock, and the agents' answers asked so far); the outcome is a list of actions for
the executor (`reconcile.Reconciler`) to apply through the API server and the agents, the status fields to write,
and the seconds until the step is due again. Nothing here reads the clock, the API server or an agent, so every
transition is a table entry in a unit test that runs in microseconds.

Asking an agent is an action too (`AskAgents`, `Configure`): the executor asks, puts the answer into the
observation and calls the same function again. An outcome that asks carries no other action, so each call is
still one decision on one observation.

Covered here: provisioning, a world formed from scratch at the spec's size (below); what a configured world whose
pods are all ready does next (`ready`); what one with a pod not ready, or an agent reporting a crash, does
(`not_ready`), with which pods a crash leaves out (`crash_recovery`), which standby pods to keep
(`standby_pods`) and whether a world the status does not record is adopted (`adoption`); and the control of an
elastic operation in progress (`operation`: a size asked for meanwhile, the deadline, an agent's error retried
or failing it, rolled back or re-formed), with the two questions an operator restarted mid-operation asks of
the agents (`switch`: has the old world switched already?, `standby`: do the survivors stand by?). Inside an
operation's phases, `phases.step` decides.

    no pods ──(backoff passed)──> record world W+1 and the gang's start ──> create the missing pods
       ^                                                                           │
       │  gang deadline passed with pods not running: delete them, retry after     │
       └──────── 30 s doubling to 10 min (Pending) <───────────────────────────────┤
                                                                                   │ all Running with an IP
    pods of another world: roll (delete all) ── a pod exited: recover (delete all) │
                                                                                   v
    ask each agent which world it runs ──> an agent does not answer (starting): ask again in 1 s
       │ some run W, some not: re-form (delete all)
       │ none runs W: Configure W ──> refused checkpoint: InvalidSpec, pods deleted, no retry until the spec changes
       │                         └──> another failure: event, Configure again in 2 s
       v
    configured world W (the serving phase takes over)

An elastic operation (`elastic`) in progress:

    deadline passed ──> fail: before the switch (Provisioning, Preparing, Draining) the old world resumes and the
       │                new pods go (rolled back); at or after it (or in a recovery) the world re-forms
       v
    run the phase ──an agent's error──> Provisioning, Preparing, Draining, Standby: retried in 2 s (ScalingRetry)
                                  └───> Switching: fail as above
    Switching asks which generation the old world's agents have active:
       the old one: pause it and switch; the new one: it switched already (resume); another: a switch issued
       before an operator restart is still completing (wait)

Within a phase: `phases`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

SETTLE_S = 30.0  # after an elastic operation, pods not ready yet are expected (probes run every 2 s)
RECOVER_POLL_S = 0.1  # while survivors wait for their broken world: serving again sooner is worth a few calls
# a survivor whose ranks still serve the broken world this long after its recovery started is blocked in a
# collective that a lost peer never completes (it would wait out the collective's 120 s timeout): restarted
SURVIVOR_STUCK_S = 5.0
BACKOFF_FIRST_S = 30.0
BACKOFF_MAX_S = 600.0
WAIT_CAP_S = 30.0  # the longest a step waiting on its pods' events sleeps (woken by them, or by a deadline, sooner)
# how an agent refuses a checkpoint at Configure (INVALID_ARGUMENT): the rest of the message is the reason
CHECKPOINT_REFUSED = "INVALID_ARGUMENT: checkpoint: "
UNANSWERED = -1  # the world of an agent that did not answer (one still starting)


CRASH_BACKOFF_FIRST_S = 10.0  # a world whose pods exit at start forms again after 10 s, doubling to 5 minutes,
CRASH_BACKOFF_MAX_S = 300.0  # as a kubelet's CrashLoopBackOff does for a container
CRASH_RESET_S = 600.0  # the count starts again once this long passed (after the last wait) with no pod exiting


def crash_backoff(crashes: int) -> float:
    """Seconds before a world forms again after its `crashes`-th exit in a row: 10 s doubling to 5 minutes."""
    return float(min(CRASH_BACKOFF_MAX_S, CRASH_BACKOFF_FIRST_S * 2 ** max(0, crashes - 1)))


@dataclass(frozen=True)
class CrashLoop:
    """status.crashLoop: how many worlds in a row lost a pod that exited while forming, and when the last did."""
    crashes: int = 0
    last_at: float | None = None

    def after_exit(self, now: float) -> CrashLoop:
        if self.last_at is None or now - self.last_at > CRASH_RESET_S + crash_backoff(self.crashes):
            return CrashLoop(1, now)
        return CrashLoop(self.crashes + 1, now)


def backoff(attempts: int) -> float:
    """Seconds before gang attempt `attempts + 1`: 30 s doubling to 10 min."""
    return float(min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, attempts - 1)))


# ------------------------------------------------------------------------------------------ observation
@dataclass(frozen=True)
class PodSeen:
    """A pod of the deployment that is not being deleted."""
    index: int
    name: str
    uid: str = ""
    world: str | None = None  # its world annotation
    phase: str = "Pending"  # the pod's status.phase
    ip: str = ""
    why: str = ""  # how it ended, from its container's terminated state ("exited 1: cannot read ...")

    @property
    def running(self) -> bool:
        return self.phase == "Running" and bool(self.ip)

    @property
    def exited(self) -> bool:
        return self.phase in ("Failed", "Succeeded")


@dataclass(frozen=True)
class Gang:
    """status.gang: when the current attempt to run all pods of a world started, how many attempts timed out, and
    when the next may start."""
    since: float | None = None
    attempts: int = 0
    retry_at: float | None = None


@dataclass(frozen=True)
class Configured:
    """An agent fleet's answer to Configure: empty `error` when every agent took the world."""
    error: str = ""


@dataclass(frozen=True)
class ProvisionSeen:
    world: int  # status.worldGeneration (0: none yet)
    pod_count: int  # the plan's pods
    world_size: int  # the plan's ranks
    now: float
    gang_timeout_s: float
    gang: Gang = field(default_factory=Gang)
    phase: str | None = None  # status.phase
    pending_reason: str | None = None  # status.pendingReason: why the world is being formed (Recovering, Rolling)
    pods: tuple[PodSeen, ...] = ()
    terminating: int = 0  # pods being deleted
    # pod index -> the world its agent runs (0: none, UNANSWERED); None: not asked
    agents: Mapping[int, int] | None = None
    configured: Configured | None = None  # the answer to Configure; None: not asked
    crash_loop: CrashLoop = field(default_factory=CrashLoop)  # status.crashLoop


# ---------------------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class RecordWorld:
    """Write status.worldGeneration and status.gang before any pod of the world exists: an operator restarted in
    between finds pods of the world it recorded."""
    world: int
    gang: Gang


@dataclass(frozen=True)
class CreatePods:
    world: int
    indices: tuple[int, ...]


@dataclass(frozen=True)
class DeletePods:
    pods: tuple[PodSeen, ...]
    grace: int | None = None  # seconds (None: the pod's own)


@dataclass(frozen=True)
class Emit:
    """A Kubernetes event on the deployment."""
    reason: str
    message: str
    warning: bool = False


@dataclass(frozen=True)
class RestartWorld:
    """Delete every pod; the next world forms from scratch (`reason`: Rolling or Recovering)."""
    reason: str
    message: str


@dataclass(frozen=True)
class RefuseCheckpoint:
    """The pods found the checkpoint is not the planned model: InvalidSpec, pods deleted, no retry until the spec
    changes."""
    message: str


@dataclass(frozen=True)
class AskAgents:
    """Ask each running pod's agent which world it runs; answered in `ProvisionSeen.agents`."""


@dataclass(frozen=True)
class Configure:
    """Configure every running pod's agent for `world`; answered in `ProvisionSeen.configured`."""
    world: int


@dataclass(frozen=True)
class StartReplace:
    """Start the elastic `Replace` of the groups holding these pods (of an old template); the executor sets the
    Progressing condition from the operation's own message."""
    pods: tuple[int, ...]


@dataclass(frozen=True)
class StartScale:
    """Start the elastic scale of the serving world to `dpa` groups."""
    dpa: int


@dataclass(frozen=True)
class AskHealth:
    """Ask each agent of the world for its health; answered in `NotReadySeen.health`."""


@dataclass(frozen=True)
class AskEngineFailure:
    """Ask the agent of pod `index` why its engine is down; answered in `NotReadySeen.engine_failure`."""
    index: int


@dataclass(frozen=True)
class RecoverCrashed:
    """A rank of the (reference engine's) world crashed: recover it (the elastic `Recover`: survivors first, or
    the world re-formed in its pods). `health`: each pod's answer."""
    crashed: tuple[int, ...]


@dataclass(frozen=True)
class QueueDpa:
    """Record that `dpa`, asked for while an operation runs, waits for it to end (status.elastic.waiting)."""
    dpa: int


@dataclass(frozen=True)
class RunPhase:
    """Run the elastic operation's current phase (its agents' calls); its delay is the phase's own."""


@dataclass(frozen=True)
class FailOperation:
    """End the operation that cannot go on: `rollback` (before the switch) resumes the old world and deletes the
    new pods; otherwise the world is re-formed from scratch."""
    why: str
    rollback: bool


Action = (RecordWorld | CreatePods | DeletePods | Emit | RestartWorld | RefuseCheckpoint | AskAgents | Configure
          | StartReplace | StartScale | AskHealth | AskEngineFailure | RecoverCrashed | QueueDpa | RunPhase
          | FailOperation)


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str


@dataclass(frozen=True)
class Outcome:
    """What a step does (`actions`, in order) and records; None fields leave the status as it is."""
    delay: float
    actions: tuple[Action, ...] = ()
    phase: str | None = None
    gang: Gang | None = None
    conditions: tuple[Condition, ...] = ()
    report_pods: bool = False  # write status.pods from the pods (those just created included)
    take_pending_reason: bool = False  # drop status.pendingReason (the world it explained is being created)
    configured: bool = False  # the world is configured: status.configuredWorld = worldGeneration
    # the world serves at its size: status.dpa and servedWorld recorded, the marks of its forming (gang, pending
    # reason, engine failures) dropped
    serves: bool = False
    engine_failure: str | None = None  # status.engineFailure: why a one-pod vLLM world's engine is down
    engine_crashes: int | None = None  # status.engineCrashes: crashes of a vLLM world since it last served
    retry_at: float | None = None  # status.gang.retryAt: when a crashed world may form again
    crash_loop: CrashLoop | None = None  # status.crashLoop after a pod exited while the world formed

    @property
    def asks(self) -> bool:
        return any(isinstance(a, (AskAgents, Configure, AskHealth, AskEngineFailure)) for a in self.actions)


@dataclass(frozen=True)
class ReadySeen:
    """A configured world whose pods are all ready and whose agents report no crash."""
    world: int  # status.worldGeneration
    world_dpa: int  # the DPA groups it runs
    want_dpa: int  # the spec's
    world_size: int  # its ranks
    pods: int  # its pods
    generation: int | None  # the deployment's metadata.generation
    eplb_busy: bool = False  # a rebalance is moving experts: no operation starts
    stale: tuple[int, ...] = ()  # its pods of an older pod template
    operation: str | None = None  # status.elastic.operation (the last one, done or not)
    cancelled_generation: int | None = None  # the spec generation whose operation failed and is not retried
    last_result: str = ""  # status.elastic.lastResult
    refusal: str | None = None  # why want_dpa cannot be reached in place (None: it can, or no change)
    router: str = ""  # why the router does not serve status.url ("": it serves, or the router is disabled)
    now: float = 0.0
    grow_at: float | None = None  # status.crashLoop.retryAt: a growth whose new pods exited waits until then


@dataclass(frozen=True)
class NotReadySeen:
    """A configured world with a pod not ready or an agent that pushed a crash."""
    world: int
    pods: int  # the world's pods
    ready: int  # of them ready
    now: float
    vllm: bool = False  # the engine is vLLM (it restarts itself; the reference engine's ranks are recovered)
    names: Mapping[int, str] = field(default_factory=dict)  # pod index -> name
    silent: Mapping[int, float] = field(default_factory=dict)  # pods not ready whose agent is silent: seconds
    available: bool = False  # the Available condition is True (the world served)
    served_world: int | None = None  # status.servedWorld
    pending_reason: str | None = None  # status.pendingReason
    operation: str | None = None  # status.elastic.operation of the last operation
    finished_at: float | None = None  # when it finished
    engine_crashes: int = 0  # status.engineCrashes
    last_engine_failure: str = ""  # status.engineFailure
    health: Mapping[int, str] | None = None  # pod index -> SERVING, DEGRADED or UNREACHABLE; None: not asked
    engine_failure: str | None = None  # the crashed pod's agent's account; None: not asked


# ------------------------------------------------------------------------------------------------ steps
def provision(seen: ProvisionSeen) -> Outcome:
    """One step of forming a world from scratch at the spec's size."""
    world, gang = seen.world, seen.gang
    foreign = [q for q in seen.pods if q.world != str(world)]
    dead = [q for q in seen.pods if q.exited]
    if foreign and world:
        return Outcome(1.0, (RestartWorld("Rolling", f"pods of another world than {world}: replacing"),))
    if dead:
        # a pod that exits while its world forms (a missing file, a bad volume, a refused setting) would exit
        # again at once: the next world waits, 10 s doubling to 5 minutes, and the pods' own words say why
        loop = seen.crash_loop.after_exit(seen.now)
        wait = crash_backoff(loop.crashes)
        said = "; ".join(f"pod {q.name} {q.why or 'exited'}" for q in dead)
        message = f"world {world}: {said} (exit {loop.crashes} in a row; the world forms again in {wait:.0f} s)"
        return Outcome(1.0, (Emit("PodExited", message, warning=True), RestartWorld("Recovering", message)),
                       gang=replace(gang, retry_at=seen.now + wait), crash_loop=loop,
                       conditions=(Condition("Degraded", "True", "CrashLoopBackOff", message),))
    if seen.terminating:
        return Outcome(1.0, report_pods=True)
    actions: list[Action] = []
    if not seen.pods:
        if gang.retry_at is not None and seen.now < gang.retry_at:
            return Outcome(max(1.0, gang.retry_at - seen.now), phase="Pending")
        world += 1
        gang = replace(gang, since=seen.now, retry_at=None)
        actions.append(RecordWorld(world, gang))
    if len(seen.pods) < seen.pod_count:
        have = {q.index for q in seen.pods}
        actions.append(CreatePods(world, tuple(i for i in range(seen.pod_count) if i not in have)))
        reason = seen.pending_reason or "Provisioning"
        progressing = Condition("Progressing", "True", reason, f"world {world}: creating {seen.pod_count} pods")
        return Outcome(1.0, tuple(actions), phase="Recovering" if reason == "Recovering" else "Provisioning",
                       gang=gang, conditions=(progressing,), report_pods=True, take_pending_reason=True)
    return _gang(seen)


def _gang(seen: ProvisionSeen) -> Outcome:
    """Every pod exists: wait for all to run (within the gang deadline), then configure the world."""
    world, gang = seen.world, seen.gang
    running = [q for q in seen.pods if q.running]
    if len(running) < seen.pod_count:
        since = seen.now if gang.since is None else gang.since
        if seen.now - since > seen.gang_timeout_s:
            attempts = gang.attempts + 1
            wait = backoff(attempts)
            waits = "; ".join(f"pod {q.name} {q.why}" for q in seen.pods if not q.running and q.why)
            message = (f"{len(running)} of {seen.pod_count} pods of world {world} running after "
                       f"{seen.gang_timeout_s:.0f} s{f' ({waits})' if waits else ''}: deleting them, retry {attempts} "
                       f"in {wait:.0f} s")
            return Outcome(1.0, (Emit("GangTimeout", message, warning=True), DeletePods(seen.pods)),
                           phase="Pending", gang=replace(gang, attempts=attempts, retry_at=seen.now + wait),
                           conditions=(Condition("Degraded", "True", "GangTimeout", message),), report_pods=True)
        # a pod's change wakes the step (the cache's watch): until then only the gang deadline is due
        due = min(WAIT_CAP_S, max(0.1, since + seen.gang_timeout_s - seen.now + 0.05))
        phase = "Recovering" if seen.phase == "Recovering" else "Provisioning"
        waits = "; ".join(f"pod {q.name} {q.why}" for q in seen.pods if not q.running and q.why)
        said = (Condition("Progressing", "True", phase, f"world {world}: {len(running)} of {seen.pod_count} pods "
                          f"running; {waits}"),) if waits else ()  # an image not pulled, a Secret missing: said now
        return Outcome(due, phase=phase, gang=gang, report_pods=True, conditions=said)
    if seen.agents is None:
        return Outcome(0.0, (AskAgents(),), gang=gang, report_pods=True)
    worlds = set(seen.agents.values())
    if UNANSWERED in worlds:
        return Outcome(1.0, gang=gang, report_pods=True)  # an agent is still starting
    if world in worlds and worlds != {world}:
        return Outcome(1.0, (RestartWorld("Recovering", f"only some agents run world {world}"),), gang=gang,
                       report_pods=True)
    if worlds != {world}:
        if seen.configured is None:
            return Outcome(0.0, (Configure(world),), gang=gang, report_pods=True)
        error = seen.configured.error
        if CHECKPOINT_REFUSED in error:
            return Outcome(60.0, (RefuseCheckpoint(error.split(CHECKPOINT_REFUSED, 1)[1]),))
        if error:
            return Outcome(2.0, (Emit("ConfigureFailed", error, warning=True),), gang=gang, report_pods=True)
        done = Emit("WorldConfigured", f"world {world}: {seen.world_size} ranks on {seen.pod_count} pods")
        return Outcome(0.5, (done,), gang=gang, report_pods=True, configured=True)
    return Outcome(0.5, gang=gang, report_pods=True, configured=True)


def ready(seen: ReadySeen) -> Outcome:
    """A world that serves at its size: Running (Rebalancing while experts move), then the change the spec asks
    for, one at a time: a new pod template group by group (Replace), a dpa change in place (Scale) or by a roll.
    A change waits while a rebalance moves experts (it is queued, not dropped), and one whose operation failed for
    this spec generation is not retried until the spec changes."""
    msg = f"world {seen.world}: {seen.world_size} ranks serving on {seen.pods} pods"
    # Available means a client can use status.url: with the router enabled, only once a router pod serves
    available = Condition("Available", "False", "RouterNotReady", f"{msg}; {seen.router}") if seen.router else \
        Condition("Available", "True", "Serving", msg)
    serving = (available, Condition("Degraded", "False", "AsExpected", ""))
    phase = "Rebalancing" if seen.eplb_busy else "Running"
    cancelled = seen.cancelled_generation is not None and seen.cancelled_generation == seen.generation
    if seen.stale and seen.operation == "Replace" and cancelled:
        failed = Condition("Progressing", "False", "RollFailed",
                           f"{len(seen.stale)} pods keep the old template: {seen.last_result}")
        return Outcome(10.0, phase=phase, conditions=(*serving, failed), serves=True)
    if seen.stale and not seen.eplb_busy:
        return Outcome(0.2, (StartReplace(seen.stale),), phase="Rolling", conditions=serving, serves=True)
    change = f"dpa {seen.world_dpa} -> {seen.want_dpa}"
    rescale = seen.want_dpa != seen.world_dpa and not cancelled
    if rescale and seen.grow_at is not None and seen.now < seen.grow_at and seen.want_dpa > seen.world_dpa:
        # the last growth's new pods exited at start: the next one waits (10 s doubling to 5 minutes)
        held = Condition("Progressing", "True", "CrashLoopBackOff",
                         f"{change} in {seen.grow_at - seen.now:.0f} s: {seen.last_result}")
        return Outcome(max(1.0, seen.grow_at - seen.now), phase=phase, conditions=(*serving, held), serves=True)
    if rescale and not seen.eplb_busy:
        if seen.refusal is None:
            scaling = Condition("Progressing", "True", "Scaling", change)
            return Outcome(0.2, (StartScale(seen.want_dpa),), phase="Scaling", conditions=(*serving, scaling),
                           serves=True)
        return Outcome(1.0, (RestartWorld("Rolling", f"{change} rolls: {seen.refusal}"),), phase=phase, serves=True)
    if seen.stale or rescale:  # only while a rebalance moves experts
        what = change if rescale else f"replacing {len(seen.stale)} pods of an older pod template"
        queued = Condition("Progressing", "True", "Queued", f"{what}: starts once the rebalance moving experts ends")
        return Outcome(2.0, phase=phase, conditions=(*serving, queued), serves=True)
    if seen.want_dpa != seen.world_dpa:
        reason = "ScaleDownCancelled" if seen.operation == "ScaleDown" else "ScalingRolledBack"
        progressing = Condition("Progressing", "False", reason, seen.last_result)
    else:
        progressing = Condition("Progressing", "False", "Complete", msg)
    return Outcome(10.0, phase=phase, conditions=(*serving, progressing), serves=True)


def not_ready(seen: NotReadySeen) -> Outcome:
    """A configured world with a pod not ready or a crash pushed by an agent: a silent agent's pod is deleted (its
    world re-forms without it), a crash is recovered (a vLLM world re-forms after the gang backoff; a one-pod
    vLLM world waits for its agent to restart vLLM), a world still joining or settling after an operation waits,
    and anything else is Degraded."""
    world = seen.world
    if seen.silent:
        said = ", ".join(f"{seen.names.get(i, i)} for {t:.0f} s" for i, t in sorted(seen.silent.items()))
        hung = tuple(PodSeen(i, seen.names.get(i, str(i))) for i in sorted(seen.silent))
        return Outcome(RECOVER_POLL_S, (DeletePods(hung, grace=1), Emit(
            "AgentsHung", f"world {world}: no health from the agents of {said} and their pods are not ready: "
                          "deleting them, the survivors re-form without them", warning=True)))
    if seen.health is None:
        return Outcome(0.0, (AskHealth(),))
    crashed = tuple(sorted(i for i, h in seen.health.items() if h == "DEGRADED"))
    if crashed and seen.vllm:
        if seen.engine_failure is None:
            return Outcome(0.0, (AskEngineFailure(crashed[0]),))
        return _engine_crashed(seen, crashed)
    if crashed:
        return Outcome(RECOVER_POLL_S, (RecoverCrashed(crashed),))
    if not seen.available or (seen.vllm and seen.served_world != world):
        # a new world whose ranks are still joining (a vLLM world takes its start, tens of seconds, to serve)
        return Outcome(1.0, phase="Recovering" if seen.pending_reason == "Recovering" else "Provisioning")
    if seen.finished_at is not None and seen.now - seen.finished_at < SETTLE_S:  # readiness probes catch up
        return Outcome(1.0, phase={"Recover": "Recovering", "Replace": "Rolling"}.get(seen.operation or "", "Scaling"))
    message = f"{seen.pods - seen.ready} of {seen.pods} pods are not ready"
    return Outcome(2.0, phase="Degraded", conditions=(Condition("Degraded", "True", "PodsNotReady", message),))


def _engine_crashed(seen: NotReadySeen, crashed: tuple[int, ...]) -> Outcome:
    if seen.pods == 1:
        # its agent restarts vLLM with backoff: Degraded with vLLM's exit code and last error line until it serves
        message = f"pod {seen.names.get(crashed[0], crashed[0])}: {seen.engine_failure or 'vLLM exited'}"
        said = () if seen.last_engine_failure == message else (Emit("EngineRestarting", message, warning=True),)
        return Outcome(2.0, said, phase="Degraded", engine_failure=message, conditions=(
            Condition("Degraded", "True", "EngineRestarting", message),
            Condition("Available", "False", "EngineRestarting", message)))
    # a world that keeps crashing is re-formed after the gang backoff (30 s doubling to 10 min), not at once
    crashes = seen.engine_crashes + 1
    wait = backoff(crashes)
    message = f"pod(s) {list(crashed)} of world {seen.world}: {seen.engine_failure or 'vLLM exited'}"
    return Outcome(1.0, (RestartWorld("Recovering", message + ": re-forming the world"),), engine_crashes=crashes,
                   retry_at=seen.now + wait, conditions=(Condition(
                       "Degraded", "True", "EngineCrashed",
                       f"{message} (crash {crashes}; the world re-forms in {wait:.0f} s)"),))


@dataclass(frozen=True)
class CrashRecovery:
    """How a world that a crashed rank broke is recovered: the pods left out of the survivors' world, those of
    them kept as spares (their agents restart the crashed rank in place), and why (for the event)."""
    left_out: tuple[int, ...]
    spare: tuple[int, ...]
    why: str


def crash_recovery(world: int, crashed: tuple[int, ...], states: Mapping[int, tuple[str, ...]],
                   health: Mapping[int, str]) -> CrashRecovery:
    """From the crashed pods' rank states and every pod's health: the pods whose rank process died (restarting
    it) and those whose agent does not answer while the world broke (hung, or the pod going) are left out;
    survivors first, the restarting ones are kept for the scale-up that restores the size. Every pod of a broken
    world reports DEGRADED, so only these answers tell the crashed pod from its group's partners."""
    restarting = sorted(i for i, s in states.items() if set(s) & {"CRASHED", "EXITED", "STARTING"})
    silent = sorted(i for i, h in health.items() if h == "UNREACHABLE")
    why = f"a rank on pod(s) {restarting or list(crashed)} of world {world} crashed"
    if silent:
        why = f"world {world} broke and the agents of pod(s) {silent} do not answer"
    return CrashRecovery(tuple(sorted({*restarting, *silent})), tuple(i for i in restarting if i not in silent), why)


@dataclass(frozen=True)
class StandbyPlan:
    """What keeps `spec.elastic.standbyPods` standby pods beside a serving world: the pods to delete, how many to
    create, and the standby pods running (status.standby)."""
    delete: tuple[int, ...]
    create: int
    running: tuple[int, ...]


def standby_pods(want: int, pods: Mapping[int, PodSeen], stale: Collection[int]) -> StandbyPlan:
    """The standby pods kept: not exited, of the current pod template (`stale`: those of an older one), the
    lowest indices first up to `want`; the others go, and the missing ones are created."""
    usable = [i for i in sorted(pods) if not pods[i].exited and i not in stale]
    kept = usable[:want]
    return StandbyPlan(tuple(i for i in sorted(pods) if i not in kept), want - len(kept),
                       tuple(i for i in kept if pods[i].running))


@dataclass(frozen=True)
class Adoption:
    """A later world the agents serve and the status does not record, taken as the current one: its generation,
    groups and layout (pod index -> ranks), and the pods out of it kept as spares."""
    world: int
    dpa: int
    layout: Mapping[int, tuple[int, ...]]
    spares: tuple[int, ...]


def adoption(world: int, worlds: Mapping[int, tuple[int, tuple[int, ...], int]], group: int,
             pods: Collection[int], standby: Collection[int] = ()) -> Adoption | None:
    """From each answering agent's (generation, its ranks in it, that world's size): the world ahead of `world`
    when its pods hold every rank of it in whole DPA groups of `group` ranks; the other `pods` (standby pods apart)
    become spares for the scale-up that restores the size. None: no such world (the usual checks handle the rest).
    A recovery that switched while the API server was down, with the operator restarted before it could record
    it, leaves such a world."""
    ahead = max((gen for gen, _ranks, _size in worlds.values()), default=0)
    if ahead <= world:
        return None
    layout = {i: ranks for i, (gen, ranks, _size) in worlds.items() if gen == ahead and ranks}
    size = next(n for gen, _ranks, n in worlds.values() if gen == ahead)
    if not size or size % group or sorted(r for ranks in layout.values() for r in ranks) != list(range(size)):
        return None
    spares = tuple(sorted(i for i in pods if i not in layout and i not in standby))
    return Adoption(ahead, size // group, dict(sorted(layout.items())), spares)


# ----------------------------------------------------------------------------------- elastic operations
ROLLBACK_PHASES = ("Provisioning", "Preparing", "Draining")  # before the switch: the old world still serves
RETRY_PHASES = (*ROLLBACK_PHASES, "Standby")  # an agent's error is retried until the deadline
SWITCH, RESUME, WAIT, ASK = "switch", "resume", "wait", "ask"


@dataclass(frozen=True)
class OperationSeen:
    """An elastic operation in progress (status.elastic) and, once its phase ran, how that went."""
    operation: str  # ScaleUp, ScaleDown, Replace or Recover
    phase: str  # the phase it is in (after a failed run: the phase that failed)
    from_dpa: int
    to_dpa: int
    want_dpa: int  # the spec's
    now: float
    deadline: float
    waiting: int | None = None  # a dpa asked for meanwhile and already announced (status.elastic.waiting)
    error: str | None = None  # why the phase's run failed (an agent's error); None: not run, or it went well


def rolls_back(operation: str, phase: str) -> bool:
    """Whether an operation that fails in `phase` is rolled back (the old world resumes) rather than re-formed."""
    return phase in ROLLBACK_PHASES and operation != "Recover"


def operation(seen: OperationSeen) -> Outcome:
    """One step of an elastic operation in progress, before and after its phase runs: a size asked for meanwhile
    waits for it (announced once), a deadline passed fails it, and an agent's error is retried in the phases
    before the switch (and while survivors stand by) or fails it."""
    op, phase = seen.operation, seen.phase
    actions: list[Action] = []
    if op != "Recover" and seen.want_dpa != seen.to_dpa and seen.waiting != seen.want_dpa:
        actions += [QueueDpa(seen.want_dpa), Emit("ScalingQueued", f"dpa {seen.want_dpa} requested during {op} "
                                                                   f"{seen.from_dpa} -> {seen.to_dpa}: it waits "
                                                                   "for it to end")]
    if seen.now > seen.deadline:
        why = f"{op} passed its deadline in phase {phase}"
        return Outcome(0.0, (*actions, FailOperation(why, rolls_back(op, phase))))
    if seen.error is None:
        return Outcome(0.0, (*actions, RunPhase()))
    if phase in RETRY_PHASES:
        return Outcome(2.0, (*actions, Emit("ScalingRetry", f"{op} {phase}: {seen.error}", warning=True)))
    return Outcome(0.0, (*actions, FailOperation(seen.error, rolls_back(op, phase))))


def switch(active: frozenset[int], world: int, target: int) -> str:
    """What the Switching phase does, from the generations the old world's agents have active: SWITCH (the old
    world `world` still runs: pause it, switch), RESUME (every agent runs `target` already: the switch was made,
    by this or an operator that was restarted since) or WAIT (a switch issued before a restart is completing; the
    deadline bounds it)."""
    if active == {world}:
        return SWITCH
    if active == {target}:
        return RESUME
    return WAIT


def standby(states: Mapping[int, tuple[str, ...]], configured: frozenset[int] | None, target: int) -> str:
    """Whether a recovery's survivors go on to Switching into `target`, from their ranks' states (pod index ->
    states): SWITCH once every rank stands by (READY); WAIT while any is still in the broken world or restarting.
    Survivors that all serve may have switched already (by an operator that could not record it: the API server
    was down): then `configured` (the generations their agents have configured; None: not asked yet, and the
    answer is ASK) decides: SWITCH when it is `target` alone (`switch` then finds the switch made), else WAIT."""
    waiting = [i for i, s in states.items() if not s or any(x != "READY" for x in s)]
    if not waiting:
        return SWITCH
    serving = all(s and all(x == "SERVING" for x in s) for s in states.values())
    if not serving:
        return WAIT
    if configured is None:
        return ASK
    return SWITCH if configured == {target} else WAIT
