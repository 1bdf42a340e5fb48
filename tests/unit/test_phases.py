"""The phases of an elastic operation (`operator/phases.py`): each transition as a table entry, then whole
operations driven on a fake fleet of agents, started in every phase as an operator restarted there finds them.
Microseconds each; the end-to-end runs of the same operations are in tests/operator/test_elastic.py."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from shardwise.operator import phases as ph
from shardwise.operator.machine import RECOVER_POLL_S, FailOperation, PodSeen

NOW = 2_000_000.0
Out = ph.PhaseOutcome


def pod(i: int, phase: str = "Running", ip: bool = True) -> PodSeen:
    return PodSeen(i, f"d-{i}", f"uid-{i}", "3", phase, f"10.0.0.{i + 1}" if ip else "")


OLD = {0: (0, 1), 1: (2, 3)}  # world 3: dpa 2, tp 2, one group per pod
UP = {**OLD, 2: (4, 5)}  # a scale-up to dpa 3 on the new pod 2


def up(**kw: object) -> ph.PhaseSeen:
    base = ph.PhaseSeen(operation="ScaleUp", phase="Provisioning", world=3, target_world=4, from_dpa=2, now=NOW,
                        started=NOW - 5, old=OLD, target=UP, pods={0: pod(0), 1: pod(1), 2: pod(2)})
    return replace(base, **kw)  # type: ignore[arg-type]


def down(**kw: object) -> ph.PhaseSeen:
    base = ph.PhaseSeen(operation="ScaleDown", phase="Draining", world=3, target_world=4, from_dpa=2, now=NOW,
                        started=NOW - 5, old=OLD, target={0: (0, 1)}, leaving=(1,), pods={0: pod(0), 1: pod(1)},
                        drain_timeout_s=30)
    return replace(base, **kw)  # type: ignore[arg-type]


def roll(**kw: object) -> ph.PhaseSeen:
    """A replace of group 1 (pod 1) by the new pod 2."""
    base = ph.PhaseSeen(operation="Replace", phase="Provisioning", world=3, target_world=4, from_dpa=2, now=NOW,
                        started=NOW - 5, old=OLD, target={0: (0, 1), 2: (2, 3)}, leaving=(1,),
                        pods={0: pod(0), 1: pod(1), 2: pod(2)})
    return replace(base, **kw)  # type: ignore[arg-type]


def recover(**kw: object) -> ph.PhaseSeen:
    """Pod 1 lost: group 0 on pod 0 forms world 4 alone."""
    base = ph.PhaseSeen(operation="Recover", phase="Standby", world=3, target_world=4, from_dpa=2, now=NOW,
                        started=NOW - 1, old=OLD, target={0: (0, 1)}, pods={0: pod(0)})
    return replace(base, **kw)  # type: ignore[arg-type]


FINISH_UP = ph.Finish(((0, (0, 1)), (1, (2, 3)), (2, (4, 5))), resume=(0, 1, 2))
FINISH_DOWN = ph.Finish(((0, (0, 1)),), resume=(0,))
FINISH_ROLL = ph.Finish(((0, (0, 1)), (2, (2, 3))), resume=(0, 2))
LOADED = {2: ("READY", "READY")}


@dataclass(frozen=True)
class Case:
    name: str
    seen: ph.PhaseSeen
    want: ph.PhaseOutcome


CASES = [
    # ---------------------------------------------------------------- ScaleUp: Provisioning
    Case("a scale-up creates its new pods and looks again in a second", up(pods={0: pod(0), 1: pod(1)}),
         Out(1.0, (ph.CreateNew((2,)),))),
    Case("a new pod still pending is waited for", up(pods={0: pod(0), 1: pod(1), 2: pod(2, "Pending", ip=False)}),
         Out(1.0)),
    Case("a new pod that exited before joining rolls the scale-up back",
         up(pods={0: pod(0), 1: pod(1), 2: pod(2, "Failed")}),
         Out(0.0, (FailOperation("new pod(s) [2] exited before joining", rollback=True),))),
    Case("once the new pods run, their agents are asked for their ranks", up(), Out(0.0, (ph.AskRanks((2,)),))),
    Case("a new pod whose agent does not answer yet is waited for", up(states={2: ("UNREACHABLE",)}),
         Out(1.0)),
    Case("new pods whose agents answer move the scale-up to Preparing", up(states={2: ("STARTING",)}),
         Out(0.0, (ph.SetPhase("Preparing"),))),
    # ---------------------------------------------------------------- ScaleUp: Preparing
    Case("preparing configures the next world everywhere and prepares the old pods, once", up(phase="Preparing"),
         Out(0.0, (ph.ConfigureNext(ph.layout(UP)), ph.PrepareOld(), ph.MarkPrepared()))),
    Case("a prepared scale-up asks only for the new ranks' states", up(phase="Preparing", prepared=True),
         Out(0.0, (ph.AskRanks((2,)),))),
    Case("new ranks still loading their weights are waited for while the old world serves",
         up(phase="Preparing", prepared=True, states={2: ("READY", "STARTING")}),
         Out(0.5, (ph.Waiting("ScaleUp: new ranks not loaded yet"),))),
    Case("a pod rejoining after a crash is waited for within the rejoin limit",
         up(phase="Preparing", prepared=True, rejoin=(2,), started=NOW - 59, states={2: ("STARTING",)}),
         Out(0.5, (ph.Waiting("ScaleUp: new ranks not loaded yet"),))),
    Case("a pod not standing by again after the rejoin limit rolls the scale-up back (new pods next time)",
         up(phase="Preparing", prepared=True, rejoin=(2,), started=NOW - 61, states={2: ("STARTING",)}),
         Out(0.0, (ph.Waiting("ScaleUp: new ranks not loaded yet"), FailOperation(
             "pod(s) [2] did not stand by again within 60 s: new pods instead", rollback=True)))),
    Case("loaded new ranks move the scale-up to Switching, recorded before the pause",
         up(phase="Preparing", prepared=True, states=LOADED),
         Out(0.0, (ph.SetPhase("Switching", record=True),))),
    # ---------------------------------------------------------------- Switching (every operation but Recover)
    Case("switching first asks the old world which generation it has active", up(phase="Switching", prepared=True),
         Out(0.0, (ph.AskActive((0, 1)),))),
    Case("an old world still at its generation is paused, switched, resumed and recorded",
         up(phase="Switching", prepared=True, active=frozenset({3})),
         Out(0.5, (ph.PauseAndSwitch(), FINISH_UP))),
    Case("pods rejoining after a crash switch at the same time as the paused world",
         up(phase="Switching", prepared=True, rejoin=(2,), active=frozenset({3})),
         Out(0.5, (ph.PauseAndSwitch((2,)), FINISH_UP))),
    Case("an operator restarted after the switch only resumes (no second pause)",
         up(phase="Switching", prepared=True, active=frozenset({4})), Out(0.5, (FINISH_UP,))),
    Case("an operator restarted after the switch switches rejoining pods again (idempotent), then resumes",
         up(phase="Switching", prepared=True, rejoin=(2,), active=frozenset({4})),
         Out(0.5, (ph.SwitchRecovered((2,)), FINISH_UP))),
    Case("a switch half done by an operator before its restart is waited for (the deadline bounds it)",
         up(phase="Switching", prepared=True, active=frozenset({3, 4})), Out(0.5)),
    # ---------------------------------------------------------------- ScaleDown
    Case("a scale-down takes its leaving groups off the route table and drains them", down(),
         Out(0.0, (ph.Leave(), ph.Drain((1,))))),
    Case("a scale-down in abort mode ends the leaving groups' requests instead", down(abort=True),
         Out(0.0, (ph.Leave(), ph.Abort((1,))))),
    Case("drained groups move the scale-down to Switching, recorded first", down(drained=ph.Drained()),
         Out(0.0, (ph.SetPhase("Switching", record=True),))),
    Case("aborted groups move it to Switching too", down(abort=True, aborted=3),
         Out(0.0, (ph.SetPhase("Switching", record=True),))),
    Case("a drain that timed out cancels the scale-down with the requests left, keeping the size",
         down(drained=ph.Drained(remaining=2, timed_out=True, late=2)),
         Out(1.0, (ph.Cancel("drain timed out after 30 s with 2 requests still in flight: keeping dpa 2"),))),
    Case("a scale-down's switch configures the leaving pods without ranks and resumes only those that stay",
         down(phase="Switching", active=frozenset({3})),
         Out(0.5, (ph.ConfigureNext(((0, (0, 1)), (1, ()))), ph.PauseAndSwitch(), FINISH_DOWN))),
    # ---------------------------------------------------------------- Replace
    Case("a rolling step creates the replacement pods", roll(pods={0: pod(0), 1: pod(1)}),
         Out(1.0, (ph.CreateNew((2,)),))),
    Case("a rolling step configures the replaced pods without ranks, once", roll(phase="Preparing"),
         Out(0.0, (ph.ConfigureNext(((0, (0, 1)), (1, ()), (2, (2, 3)))), ph.MarkPrepared()))),
    Case("loaded replacements move the rolling step to Draining (nothing paused yet)",
         roll(phase="Preparing", prepared=True, states=LOADED), Out(0.0, (ph.SetPhase("Draining"),))),
    Case("a rolling step drains the replaced groups", roll(phase="Draining", prepared=True),
         Out(0.0, (ph.Leave(), ph.Drain((1,))))),
    Case("what a rolling step's drain did not finish in time is aborted, not cancelled",
         roll(phase="Draining", prepared=True, drained=ph.Drained(remaining=1, timed_out=True, late=1)),
         Out(0.0, (ph.Abort((1,)),))),
    Case("a drain that timed out with nothing left aborts nothing",
         roll(phase="Draining", prepared=True, drained=ph.Drained(timed_out=True)),
         Out(0.0, (ph.SetPhase("Switching", record=True),))),
    Case("a rolling step in abort mode aborts the replaced groups' requests",
         roll(phase="Draining", prepared=True, abort=True), Out(0.0, (ph.Leave(), ph.Abort((1,))))),
    Case("after the abort the rolling step switches",
         roll(phase="Draining", prepared=True, drained=ph.Drained(remaining=1, timed_out=True, late=1), aborted=1),
         Out(0.0, (ph.SetPhase("Switching", record=True),))),
    Case("a rolling step's switch resumes the staying and new groups",
         roll(phase="Switching", prepared=True, active=frozenset({3})),
         Out(0.5, (ph.PauseAndSwitch(), FINISH_ROLL))),
    # ---------------------------------------------------------------- Recover
    Case("a recovery asks its survivors for their ranks' states", recover(), Out(0.0, (ph.AskRanks((0,)),))),
    Case("survivors still in the broken world after 5 s are restarted (the agents restart only ranks still in it)",
         recover(started=NOW - 5, states={0: ("SERVING", "READY")}),
         Out(RECOVER_POLL_S, (ph.Waiting("recovery: survivors [0] not standing by yet"), ph.RestartStuck((0,))))),
    Case("survivors restarting (not in the broken world any more) are only waited for",
         recover(started=NOW - 9, states={0: ("STARTING", "CRASHED")}),
         Out(RECOVER_POLL_S, (ph.Waiting("recovery: survivors [0] not standing by yet"),))),
    Case("survivors still in the broken world are polled again soon", recover(states={0: ("SERVING", "READY")}),
         Out(RECOVER_POLL_S, (ph.Waiting("recovery: survivors [0] not standing by yet"),))),
    Case("survivors that all serve are asked which world they have configured", recover(states={0: ("SERVING",)}),
         Out(0.0, (ph.AskConfigured((0,)),))),
    Case("survivors standing by move the recovery to Switching, recorded unless the API does not answer",
         recover(states={0: ("READY", "READY")}),
         Out(0.0, (ph.SetPhase("Switching", record=True, may_defer=True),))),
    Case("survivors serving the recovered world already (switched while the API was down) go on to Switching",
         recover(states={0: ("SERVING",)}, configured=frozenset({4})),
         Out(0.0, (ph.SetPhase("Switching", record=True, may_defer=True),))),
    Case("a survivor gone while the others stood by plans the recovery again", recover(pods={}),
         Out(0.2, (ph.Replan((0,)),))),
    Case("a survivor whose pod exited plans the recovery again", recover(pods={0: pod(0, "Failed")}),
         Out(0.2, (ph.Replan((0,)),))),
    Case("a recovery's switch configures the survivors and switches them with recover; nothing to resume",
         recover(phase="Switching", active=frozenset({3})),
         Out(0.5, (ph.ConfigureNext(((0, (0, 1)),)), ph.SwitchRecovered((0,)), ph.Finish(((0, (0, 1)),))))),
    Case("a recovery switched before an operator restart is only recorded",
         recover(phase="Switching", active=frozenset({4})), Out(0.5, (ph.Finish(((0, (0, 1)),)),))),
    Case("a recovery's switch half done is waited for", recover(phase="Switching", active=frozenset({3, 4})),
         Out(0.5)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_phase_transition(case: Case) -> None:
    assert ph.step(case.seen) == case.want


def test_an_outcome_that_asks_carries_nothing_after_its_asks() -> None:
    """The executor answers asks in order and decides again: an action after an ask would act on no answer."""
    for case in CASES:
        kinds = [isinstance(a, ph.ASKS) for a in ph.step(case.seen).actions]
        assert kinds == sorted(kinds), case.name  # every ask comes last


# ------------------------------------------------------------------------------- whole operations, resumed
@dataclass
class FakeFleet:
    """The agents of a world as the operations see them: which generation each pod's agent has active, which it
    has configured, its ranks' states; `calls` records every action carried out that reaches an agent."""
    active: dict[int, int]
    ranks: dict[int, tuple[str, ...]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def carry_out(self, seen: ph.PhaseSeen, action: object) -> tuple[float | None, ph.PhaseSeen]:
        self.calls.append(type(action).__name__)
        if isinstance(action, ph.SetPhase):
            seen = replace(seen, phase=action.phase, states=None, active=None, configured=None, drained=None,
                           aborted=None)
        elif isinstance(action, ph.MarkPrepared):
            seen = replace(seen, prepared=True)
        elif isinstance(action, ph.AskRanks):
            seen = replace(seen, states={i: self.ranks.get(i, ("READY",)) for i in action.pods})
        elif isinstance(action, ph.AskActive):
            seen = replace(seen, active=frozenset(self.active[i] for i in action.pods))
        elif isinstance(action, ph.AskConfigured):
            seen = replace(seen, configured=frozenset(self.active[i] for i in action.pods))
        elif isinstance(action, ph.Drain):
            seen = replace(seen, drained=ph.Drained())
        elif isinstance(action, (ph.PauseAndSwitch, ph.SwitchRecovered)):
            for i in self.active:
                self.active[i] = seen.target_world
        elif isinstance(action, (ph.Finish, ph.Cancel, ph.Replan, FailOperation)):
            return 0.5, seen
        return None, seen


def drive(seen: ph.PhaseSeen, fleet: FakeFleet, steps: int = 20) -> list[str]:
    """Steps of the operation as the executor takes them (each step's actions, then decided again while it asks)
    until one finishes it; the actions carried out."""
    for _ in range(steps):
        while True:
            out = ph.step(seen)
            ended = None
            for action in out.actions:
                ended, seen = fleet.carry_out(seen, action)
                if ended is not None:
                    return fleet.calls
            if not ph.decides_again(out):
                break
    raise AssertionError(f"not finished after {steps} steps: {fleet.calls}")


def test_a_scale_up_from_its_start_makes_each_call_once_in_order() -> None:
    fleet = FakeFleet({0: 3, 1: 3, 2: 0}, {2: ("READY", "READY")})
    assert drive(up(), fleet) == ["AskRanks", "SetPhase", "ConfigureNext", "PrepareOld", "MarkPrepared",
                                  "AskRanks", "SetPhase", "AskActive", "PauseAndSwitch", "Finish"]


@pytest.mark.parametrize(("phase", "prepared", "switched", "want"), [
    ("Provisioning", False, False, ["AskRanks", "SetPhase", "ConfigureNext", "PrepareOld", "MarkPrepared",
                                    "AskRanks", "SetPhase", "AskActive", "PauseAndSwitch", "Finish"]),
    ("Preparing", False, False, ["ConfigureNext", "PrepareOld", "MarkPrepared", "AskRanks", "SetPhase", "AskActive",
                                 "PauseAndSwitch", "Finish"]),
    ("Preparing", True, False, ["AskRanks", "SetPhase", "AskActive", "PauseAndSwitch", "Finish"]),
    ("Switching", True, False, ["AskActive", "PauseAndSwitch", "Finish"]),
    ("Switching", True, True, ["AskActive", "Finish"]),
])
def test_an_operator_restarted_in_each_phase_of_a_scale_up_completes_it_without_repeating_a_done_call(
        phase: str, prepared: bool, switched: bool, want: list[str]) -> None:
    fleet = FakeFleet({0: 4 if switched else 3, 1: 4 if switched else 3, 2: 4 if switched else 0},
                      {2: ("READY", "READY")})
    assert drive(up(phase=phase, prepared=prepared), fleet) == want


@pytest.mark.parametrize(("phase", "switched", "want"), [
    ("Draining", False, ["Leave", "Drain", "SetPhase", "AskActive", "ConfigureNext", "PauseAndSwitch", "Finish"]),
    ("Switching", False, ["AskActive", "ConfigureNext", "PauseAndSwitch", "Finish"]),
    ("Switching", True, ["AskActive", "Finish"]),
])
def test_an_operator_restarted_in_each_phase_of_a_scale_down_completes_it(phase: str, switched: bool,
                                                                          want: list[str]) -> None:
    fleet = FakeFleet({0: 4 if switched else 3, 1: 4 if switched else 3})
    assert drive(down(phase=phase), fleet) == want


@pytest.mark.parametrize(("phase", "switched", "want"), [
    ("Standby", False, ["AskRanks", "SetPhase", "AskActive", "ConfigureNext", "SwitchRecovered", "Finish"]),
    # switched while the API server was down, by the operator before this one: recorded, nothing called again
    ("Standby", True, ["AskRanks", "AskConfigured", "SetPhase", "AskActive", "Finish"]),
    ("Switching", False, ["AskActive", "ConfigureNext", "SwitchRecovered", "Finish"]),
    ("Switching", True, ["AskActive", "Finish"]),
])
def test_an_operator_restarted_in_each_phase_of_a_recovery_completes_it(phase: str, switched: bool,
                                                                        want: list[str]) -> None:
    fleet = FakeFleet({0: 4 if switched else 3}, {0: ("SERVING",) if switched else ("READY", "READY")})
    assert drive(recover(phase=phase), fleet) == want


def test_a_scale_up_whose_new_ranks_load_slowly_waits_a_step_at_a_time_then_switches() -> None:
    fleet = FakeFleet({0: 3, 1: 3, 2: 0}, {2: ("STARTING", "READY")})
    seen = up(phase="Preparing", prepared=True)
    out = ph.step(replace(seen, states={2: fleet.ranks[2]}))
    assert out == Out(0.5, (ph.Waiting("ScaleUp: new ranks not loaded yet"),))
    assert not ph.decides_again(out)  # the step ends: woken again in 0.5 s
    fleet.ranks[2] = ("READY", "READY")
    assert drive(seen, fleet)[-2:] == ["PauseAndSwitch", "Finish"]
