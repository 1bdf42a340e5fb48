"""The operator's decisions as pure functions: what it sees goes in, what to do and what to record come out.

A step of a phase is `decide(seen) -> Outcome`. `seen` is a frozen observation (the deployment's status fields
the phase reads, its pods, the clock, and the agents' answers asked so far); the outcome is a list of actions for
the executor (`reconcile.Reconciler`) to apply through the API server and the agents, the status fields to write,
and the seconds until the step is due again. Nothing here reads the clock, the API server or an agent, so every
transition is a table entry in a unit test that runs in microseconds.

Asking an agent is an action too (`AskAgents`, `Configure`): the executor asks, puts the answer into the
observation and calls the same function again. An outcome that asks carries no other action, so each call is
still one decision on one observation.

Covered here: provisioning, a world formed from scratch at the spec's size.

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

The serving, rolling, elastic and recovery phases still decide and act in one place (`reconcile`, `elastic`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

BACKOFF_FIRST_S = 30.0
BACKOFF_MAX_S = 600.0
WAIT_CAP_S = 30.0  # the longest a step waiting on its pods' events sleeps (woken by them, or by a deadline, sooner)
# how an agent refuses a checkpoint at Configure (INVALID_ARGUMENT): the rest of the message is the reason
CHECKPOINT_REFUSED = "INVALID_ARGUMENT: checkpoint: "
UNANSWERED = -1  # the world of an agent that did not answer (one still starting)


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


Action = RecordWorld | CreatePods | DeletePods | Emit | RestartWorld | RefuseCheckpoint | AskAgents | Configure


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

    @property
    def asks(self) -> bool:
        return any(isinstance(a, (AskAgents, Configure)) for a in self.actions)


# ------------------------------------------------------------------------------------------------ steps
def provision(seen: ProvisionSeen) -> Outcome:
    """One step of forming a world from scratch at the spec's size."""
    world, gang = seen.world, seen.gang
    foreign = [q for q in seen.pods if q.world != str(world)]
    dead = [q for q in seen.pods if q.exited]
    if foreign and world:
        return Outcome(1.0, (RestartWorld("Rolling", f"pods of another world than {world}: replacing"),))
    if dead:
        names = ", ".join(q.name for q in dead)
        return Outcome(1.0, (RestartWorld("Recovering", f"pod {names} of world {world} exited"),))
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
            message = (f"{len(running)} of {seen.pod_count} pods of world {world} running after "
                       f"{seen.gang_timeout_s:.0f} s: deleting them, retry {attempts} in {wait:.0f} s")
            return Outcome(1.0, (Emit("GangTimeout", message, warning=True), DeletePods(seen.pods)),
                           phase="Pending", gang=replace(gang, attempts=attempts, retry_at=seen.now + wait),
                           conditions=(Condition("Degraded", "True", "GangTimeout", message),), report_pods=True)
        # a pod's change wakes the step (the cache's watch): until then only the gang deadline is due
        due = min(WAIT_CAP_S, max(0.1, since + seen.gang_timeout_s - seen.now + 0.05))
        return Outcome(due, phase="Recovering" if seen.phase == "Recovering" else "Provisioning", gang=gang,
                       report_pods=True)
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
