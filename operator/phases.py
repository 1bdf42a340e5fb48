"""The phases of an elastic operation as one pure function: what the operation's record and its pods show, and
what its agents answered so far, go in; what to do comes out (`step(seen) -> PhaseOutcome`).

`machine.operation` decides around a phase (a size asked for meanwhile, the deadline, an agent's error); this
module decides inside it. The executor (`elastic.Elastic`) carries out the actions in order. Asking an agent is an
action (`AskRanks`, `AskActive`, `AskConfigured`, `Drain`, `Abort`): its answer goes into the observation and the
step is decided again; so is a change of phase (`SetPhase`, which clears the answers: a phase asks afresh) and
`MarkPrepared`. Anything else ends the step, with the outcome's delay unless an action ends the operation
(`Finish`, `Cancel`, `Replan`, `machine.FailOperation`, whose own delay counts).

    ScaleUp   Provisioning: create the new pods; one exited: fail (rolled back); wait until all run and their
                            agents answer
              Preparing:    Configure the next generation everywhere and Prepare the old pods, once; wait for the
                            new ranks to load (pods that rejoin after a crash: fail after REJOIN_S, new pods instead)
              Switching:    (below)
    ScaleDown Draining:     the leaving groups leave the route table, then Drain (timed out: cancelled, the size
                            kept) or Abort (mode abort); then Switching
    Replace   Provisioning, Preparing (Configure once, the replaced pods without ranks; wait for the new ranks),
              Draining (leave; Drain, and Abort what it did not finish in time; mode abort: Abort), Switching
    Recover   Standby:      a survivor gone: planned again; wait until every survivor stands by (`machine.standby`);
                            ranks still in the broken world SURVIVOR_STUCK_S after the start: RestartStuck
              Switching:    Configure the survivors' world and Switch them with recover, or find it switched already
    Switching (the others): ask which generation the old world has active (`machine.switch`): the old one: Pause
              and Switch (pods that rejoin switch at the same time), then Resume and finish; the new one: it
              switched before an operator restart (the pods that rejoin are switched again, idempotently), so
              Resume and finish; anything else: wait

Nothing here reads the clock or calls anything: every transition is a table entry in tests/unit/test_phases.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .machine import (
    ASK,
    RECOVER_POLL_S,
    SURVIVOR_STUCK_S,
    SWITCH,
    WAIT,
    Emit,
    FailOperation,
    PodSeen,
    rolls_back,
    standby,
    switch,
)

# how a failed operation says its new pods exited at start (elastic.py backs the next try off on it)
EXITED_BEFORE_JOINING = "exited before joining"

REJOIN_S = 60.0  # a kept pod whose restarted ranks do not stand by within this is replaced by a new pod
LOADED = ("READY", "SERVING")

Layout = tuple[tuple[int, tuple[int, ...]], ...]  # (pod index, its ranks) pairs, by index: hashable and ordered


@dataclass(frozen=True)
class Drained:
    """The leaving groups' answer to Drain: the requests left in flight, whether any group timed out, and how many
    requests were left by the groups that timed out."""
    remaining: int = 0
    timed_out: bool = False
    late: int = 0


@dataclass(frozen=True)
class PhaseSeen:
    """An elastic operation in progress (`status.elastic`), its world and pods, and its agents' answers so far."""
    operation: str  # ScaleUp, ScaleDown, Replace or Recover
    phase: str
    world: int  # the serving world's generation
    target_world: int  # the generation the operation forms
    from_dpa: int
    now: float
    started: float  # when the operation started
    old: Mapping[int, tuple[int, ...]]  # the serving world: pod index -> ranks
    target: Mapping[int, tuple[int, ...]]  # the world it forms
    pods: Mapping[int, PodSeen] = field(default_factory=dict)  # the deployment's pods not being deleted, by index
    leaving: tuple[int, ...] = ()  # pods that leave (a scale-down's, a replace's old pods, a recovery's left out)
    rejoin: tuple[int, ...] = ()  # pods a recovery kept whose restarted ranks a scale-up takes back
    prepared: bool = False  # the next generation is configured (a prepared scale-up or replace)
    abort: bool = False  # spec.elastic.scaleDown.mode is abort (else: drain)
    drain_timeout_s: int = 0
    # the agents' answers in this phase (None: not asked)
    states: Mapping[int, tuple[str, ...]] | None = None  # the awaited pods' rank states
    active: frozenset[int] | None = None  # the generations the switching pods' agents have active
    configured: frozenset[int] | None = None  # the survivors' configured generations (a recovery's standby)
    drained: Drained | None = None
    aborted: int | None = None  # requests ended by Abort


# ---------------------------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class CreateNew:
    """Create the operation's new pods `indices` (each with its ranks in the target world)."""
    indices: tuple[int, ...]


@dataclass(frozen=True)
class SetPhase:
    """Move the operation to `phase`; `record`: written to the API first (the step before a pause or a switch, so
    that a restarted operator completes it), `may_defer`: unless the API server does not answer (a recovery's
    survivors serve first)."""
    phase: str
    record: bool = False
    may_defer: bool = False


@dataclass(frozen=True)
class ConfigureNext:
    """Configure the next generation on these pods (a pod without ranks leaves at the switch)."""
    layout: Layout


@dataclass(frozen=True)
class PrepareOld:
    """Prepare the old world's pods for the next generation (they keep serving)."""


@dataclass(frozen=True)
class MarkPrepared:
    """Record that the next generation is configured: later steps only wait for the new ranks."""


@dataclass(frozen=True)
class AskRanks:
    """Ask these pods' agents for their ranks' states; answered in `PhaseSeen.states`."""
    pods: tuple[int, ...]


@dataclass(frozen=True)
class AskActive:
    """Ask these pods' agents which generation they have active; answered in `PhaseSeen.active`."""
    pods: tuple[int, ...]


@dataclass(frozen=True)
class AskConfigured:
    """Ask the survivors' agents which generation they have configured; answered in `PhaseSeen.configured`."""
    pods: tuple[int, ...]


@dataclass(frozen=True)
class Leave:
    """The leaving pods labelled `leaving` and the routers' table pushed without their groups."""


@dataclass(frozen=True)
class Drain:
    """Drain these pods' groups; answered in `PhaseSeen.drained`."""
    pods: tuple[int, ...]


@dataclass(frozen=True)
class Abort:
    """End these pods' groups' requests (finish_reason aborted); answered in `PhaseSeen.aborted`."""
    pods: tuple[int, ...]


@dataclass(frozen=True)
class PauseAndSwitch:
    """Pause the old world at a step boundary and switch it into the next generation, with the pods in `rejoin`
    switching at the same time (with recover: their ranks stand by after a crash)."""
    rejoin: tuple[int, ...] = ()


@dataclass(frozen=True)
class SwitchRecovered:
    """Switch these pods with recover (their ranks stand by): the survivors of a recovery, or pods that rejoin a
    world switched already (idempotent)."""
    pods: tuple[int, ...]


@dataclass(frozen=True)
class Finish:
    """The operation is done: Resume `resume` (the pods with ranks; none after a recovery's switch), then record
    `layout` as the world."""
    layout: Layout
    resume: tuple[int, ...] = ()


@dataclass(frozen=True)
class Cancel:
    """A scale-down whose drain timed out: the leaving pods take their roles back, the size is kept."""
    why: str


@dataclass(frozen=True)
class Replan:
    """Survivors went while they stood by (nothing is configured yet): the recovery is planned again without
    them."""
    gone: tuple[int, ...]


@dataclass(frozen=True)
class RestartStuck:
    """Restart the ranks of these survivors still in the broken world (`machine.SURVIVOR_STUCK_S` after the
    recovery started): they come back as standbys for the recovery's next world."""
    pods: tuple[int, ...]


@dataclass(frozen=True)
class Waiting:
    """Log what the awaited ranks show (when it changed)."""
    what: str


PhaseAction = (CreateNew | SetPhase | ConfigureNext | PrepareOld | MarkPrepared | AskRanks | AskActive
               | AskConfigured | Leave | Drain | Abort | PauseAndSwitch | SwitchRecovered | Finish | Cancel | Replan
               | RestartStuck
               | Waiting | FailOperation | Emit)


@dataclass(frozen=True)
class PhaseOutcome:
    """What a phase's step does (`actions`, in order) and the seconds until the next step (unless an action
    ends the operation, or the step is decided again: `decides_again`)."""
    delay: float
    actions: tuple[PhaseAction, ...] = ()


ASKS = (AskRanks, AskActive, AskConfigured, Drain, Abort)
AGAIN = (*ASKS, SetPhase, MarkPrepared)  # decided again once carried out


def decides_again(out: PhaseOutcome) -> bool:
    """Whether the step is decided again after this outcome's actions (an answer or a new phase to act on)."""
    return any(isinstance(a, AGAIN) for a in out.actions)


def layout(ranks: Mapping[int, tuple[int, ...]]) -> Layout:
    return tuple(sorted((i, tuple(r)) for i, r in ranks.items()))


# ------------------------------------------------------------------------------------------------- step
def step(seen: PhaseSeen) -> PhaseOutcome:
    """One decision of the operation's current phase."""
    if seen.operation == "ScaleUp":
        return _scale_up(seen)
    if seen.operation == "ScaleDown":
        return _scale_down(seen)
    if seen.operation == "Replace":
        return _replace(seen)
    return _recover(seen)


def _new(seen: PhaseSeen) -> dict[int, tuple[int, ...]]:
    return {i: r for i, r in seen.target.items() if i not in seen.old}


def _full(seen: PhaseSeen) -> dict[int, tuple[int, ...]]:
    """The target world with the leaving pods in it without ranks (they are configured to leave at the switch)."""
    return {**seen.target, **{i: () for i in seen.leaving if i in seen.old}}


def _provisioning(seen: PhaseSeen, new: Mapping[int, tuple[int, ...]]) -> PhaseOutcome:
    """Create the new pods; on to Preparing once they run and their agents answer."""
    missing = tuple(i for i in new if i not in seen.pods)
    created = (CreateNew(missing),) if missing else ()
    failed = [i for i in new if i in seen.pods and seen.pods[i].exited]
    if failed:
        said = "; ".join(f"{seen.pods[i].name} {seen.pods[i].why}" for i in failed if seen.pods[i].why)
        why = f"new pod(s) {failed} {EXITED_BEFORE_JOINING}" + (f" ({said})" if said else "")
        return PhaseOutcome(0.0, (*created, FailOperation(why, rolls_back(seen.operation, seen.phase))))
    if missing or not all(seen.pods[i].running for i in new):
        return PhaseOutcome(1.0, created)
    if seen.states is None:
        return PhaseOutcome(0.0, (AskRanks(tuple(new)),))
    if any(s == ("UNREACHABLE",) for s in seen.states.values()):
        return PhaseOutcome(1.0)  # an agent still starting
    return PhaseOutcome(0.0, (SetPhase("Preparing"),))


def _loaded(seen: PhaseSeen, new: Mapping[int, tuple[int, ...]]) -> PhaseOutcome | None:
    """Ask for the new ranks' states; None once every one has loaded (else: the outcome to return)."""
    if seen.states is None:
        return PhaseOutcome(0.0, (AskRanks(tuple(new)),))
    if all(s and all(x in LOADED for x in s) for s in seen.states.values()):
        return None
    return PhaseOutcome(0.5, (Waiting(f"{seen.operation}: new ranks not loaded yet"),))


def _scale_up(seen: PhaseSeen) -> PhaseOutcome:
    new = _new(seen)
    if seen.phase == "Provisioning":
        return _provisioning(seen, new)
    if seen.phase == "Preparing":
        if not seen.prepared:  # once: the later steps only wait for the new ranks to load
            return PhaseOutcome(0.0, (ConfigureNext(layout(seen.target)), PrepareOld(), MarkPrepared()))
        waiting = _loaded(seen, new)
        if waiting is not None:
            if seen.rejoin and seen.states is not None and seen.now - seen.started > REJOIN_S:
                why = f"pod(s) {list(seen.rejoin)} did not stand by again within {REJOIN_S:.0f} s: new pods instead"
                return PhaseOutcome(0.0, (*waiting.actions, FailOperation(why, rolls_back(seen.operation, seen.phase))))
            return waiting  # the new ranks load their weights while the old world serves
        return PhaseOutcome(0.0, (SetPhase("Switching", record=True),))
    return _switching(seen, seen.target)


def _scale_down(seen: PhaseSeen) -> PhaseOutcome:
    leaving = tuple(i for i in seen.leaving if i in seen.old)
    if seen.phase == "Draining":
        if seen.abort and seen.aborted is None:
            return PhaseOutcome(0.0, (Leave(), Abort(leaving)))
        if not seen.abort and seen.drained is None:
            return PhaseOutcome(0.0, (Leave(), Drain(leaving)))
        if seen.drained is not None and seen.drained.timed_out:
            return PhaseOutcome(1.0, (Cancel(f"drain timed out after {seen.drain_timeout_s} s with "
                                        f"{seen.drained.remaining} requests still in flight: keeping dpa "
                                        f"{seen.from_dpa}"),))
        return PhaseOutcome(0.0, (SetPhase("Switching", record=True),))
    return _switching(seen, _full(seen))


def _replace(seen: PhaseSeen) -> PhaseOutcome:
    new, full = _new(seen), _full(seen)
    leaving = tuple(i for i in seen.leaving if i in seen.old)
    if seen.phase == "Provisioning":
        return _provisioning(seen, new)
    if seen.phase == "Preparing":
        if not seen.prepared:  # the replaced pods are configured without ranks
            return PhaseOutcome(0.0, (ConfigureNext(layout(full)), MarkPrepared()))
        waiting = _loaded(seen, new)
        if waiting is not None:
            return waiting  # the new pods load while every group serves
        return PhaseOutcome(0.0, (SetPhase("Draining"),))
    if seen.phase == "Draining":
        if seen.abort and seen.aborted is None:
            return PhaseOutcome(0.0, (Leave(), Abort(leaving)))
        if not seen.abort and seen.drained is None:
            return PhaseOutcome(0.0, (Leave(), Drain(leaving)))
        # what a drain did not finish in time ends now, explicitly (a roll is not cancelled)
        if seen.drained is not None and seen.drained.late and seen.aborted is None:
            return PhaseOutcome(0.0, (Abort(leaving),))
        return PhaseOutcome(0.0, (SetPhase("Switching", record=True),))
    return _switching(seen, full)


def _switching(seen: PhaseSeen, full: Mapping[int, tuple[int, ...]]) -> PhaseOutcome:
    """Pause and switch the old world into the next generation (or find it switched), then resume and finish."""
    if seen.active is None:
        return PhaseOutcome(0.0, (AskActive(tuple(sorted(seen.old))),))
    decided = switch(seen.active, seen.world, seen.target_world)
    if decided == WAIT:
        return PhaseOutcome(0.5)  # a switch issued before an operator restart is still completing (else: the deadline)
    staying = {i: r for i, r in full.items() if r}
    done = Finish(layout(staying), resume=tuple(sorted(staying)))
    if decided == SWITCH:
        configure = () if seen.prepared else (ConfigureNext(layout(full)),)  # (a scale-up configured it already)
        return PhaseOutcome(0.5, (*configure, PauseAndSwitch(seen.rejoin), done))
    rejoined = (SwitchRecovered(seen.rejoin),) if seen.rejoin else ()
    return PhaseOutcome(0.5, (*rejoined, done))


def _recover(seen: PhaseSeen) -> PhaseOutcome:
    everyone = [*seen.target, *seen.leaving]
    survivors = {i: seen.target.get(i, ()) for i in everyone if i in seen.pods}
    members = tuple(survivors)
    if seen.phase == "Standby":
        gone = tuple(sorted(i for i in everyone if i not in seen.pods or seen.pods[i].exited))
        if gone:  # nothing is configured yet: plan again without them
            return PhaseOutcome(0.2, (Replan(gone),))
        if seen.states is None:
            return PhaseOutcome(0.0, (AskRanks(members),))
        decided = standby(seen.states, seen.configured, seen.target_world)
        if decided == ASK:
            return PhaseOutcome(0.0, (AskConfigured(members),))
        if decided == WAIT:
            waiting = sorted(i for i, s in seen.states.items() if not s or any(x != "READY" for x in s))
            # their old world must break first (the ranks stand by, or restart: 1 s backoff, then their weights)
            note = Waiting(f"recovery: survivors {waiting} not standing by yet")
            stuck = tuple(i for i in waiting if any(x in ("SERVING", "PAUSED") for x in seen.states[i]))
            if stuck and seen.now - seen.started >= SURVIVOR_STUCK_S:  # (the agents restart only ranks still in it)
                return PhaseOutcome(RECOVER_POLL_S, (note, RestartStuck(stuck)))
            return PhaseOutcome(RECOVER_POLL_S, (note,))
        # recorded before the switch where the API answers; while it does not, the survivors serve first
        return PhaseOutcome(0.0, (SetPhase("Switching", record=True, may_defer=True),))
    if seen.active is None:
        return PhaseOutcome(0.0, (AskActive(members),))
    decided = switch(seen.active, seen.world, seen.target_world)
    if decided == WAIT:
        return PhaseOutcome(0.5)
    done = Finish(layout(seen.target))
    if decided == SWITCH:
        return PhaseOutcome(0.5, (ConfigureNext(layout(survivors)), SwitchRecovered(members), done))
    return PhaseOutcome(0.5, (done,))
