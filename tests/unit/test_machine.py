"""The operator's pure state machine (`operator/machine.py`): each transition of provisioning and of a world whose
pods are all ready or not as a table entry, then whole gang histories driven on a fake cluster and clock. Microseconds
each; the end-to-end runs of the same behaviour are in tests/operator (test_gang, test_operator, test_elastic)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from shardwise.operator import machine as m
from shardwise.operator.machine import (
    AskAgents,
    Condition,
    Configure,
    Configured,
    CrashLoop,
    CreatePods,
    DeletePods,
    Emit,
    Gang,
    Outcome,
    PodSeen,
    ProvisionSeen,
    RecordWorld,
    RefuseCheckpoint,
    RestartWorld,
)

NOW = 1_000_000.0
TIMEOUT = 300.0
EXITED = "world 1: pod d-1 exited 1: cannot read the agent token (exit 1 in a row; the world forms again in 10 s)"
FOURTH = "world 1: pod d-0 exited (exit 4 in a row; the world forms again in 80 s)"
AGAIN = "world 1: pod d-0 exited (exit 1 in a row; the world forms again in 10 s)"


def pod(i: int, world: int = 1, phase: str = "Running", ip: bool = True) -> PodSeen:
    return PodSeen(i, f"d-{i}", f"uid-{i}", str(world), phase, f"10.0.0.{i + 1}" if ip else "")


def seen(**kw: object) -> ProvisionSeen:
    base = ProvisionSeen(world=1, pod_count=2, world_size=4, now=NOW, gang_timeout_s=TIMEOUT,
                         gang=Gang(since=NOW - 10))
    return replace(base, **kw)  # type: ignore[arg-type]


RUNNING = (pod(0), pod(1))


@dataclass(frozen=True)
class Case:
    name: str
    seen: ProvisionSeen | m.ReadySeen | m.NotReadySeen
    want: Outcome


CASES = [
    Case("a deployment without pods or world records world 1 before it creates every pod",
         seen(world=0, gang=Gang()),
         Outcome(1.0, (RecordWorld(1, Gang(since=NOW)), CreatePods(1, (0, 1))), phase="Provisioning",
                 gang=Gang(since=NOW), conditions=(Condition("Progressing", "True", "Provisioning",
                                                             "world 1: creating 2 pods"),),
                 report_pods=True, take_pending_reason=True)),
    Case("a world re-formed after a loss is recorded as the next one and shows Recovering",
         seen(world=3, gang=Gang(), pending_reason="Recovering", phase="Recovering"),
         Outcome(1.0, (RecordWorld(4, Gang(since=NOW)), CreatePods(4, (0, 1))), phase="Recovering",
                 gang=Gang(since=NOW), conditions=(Condition("Progressing", "True", "Recovering",
                                                             "world 4: creating 2 pods"),),
                 report_pods=True, take_pending_reason=True)),
    Case("a gang waiting out its backoff stays Pending and is due when the backoff ends",
         seen(world=1, gang=Gang(since=NOW - 400, attempts=1, retry_at=NOW + 12)),
         Outcome(12.0, phase="Pending")),
    Case("a backoff that ends in under a second is looked at again in one second, not sooner",
         seen(world=1, gang=Gang(attempts=1, retry_at=NOW + 0.2)),
         Outcome(1.0, phase="Pending")),
    Case("a gang whose backoff passed starts the next world and keeps its count of attempts",
         seen(world=1, gang=Gang(since=NOW - 400, attempts=2, retry_at=NOW - 1)),
         Outcome(1.0, (RecordWorld(2, Gang(since=NOW, attempts=2)), CreatePods(2, (0, 1))), phase="Provisioning",
                 gang=Gang(since=NOW, attempts=2), conditions=(Condition("Progressing", "True", "Provisioning",
                                                                         "world 2: creating 2 pods"),),
                 report_pods=True, take_pending_reason=True)),
    Case("an operator restarted after creating some pods creates only the missing ones, in the same world",
         seen(pods=(pod(1, phase="Pending", ip=False),)),
         Outcome(1.0, (CreatePods(1, (0,)),), phase="Provisioning", gang=Gang(since=NOW - 10),
                 conditions=(Condition("Progressing", "True", "Provisioning", "world 1: creating 2 pods"),),
                 report_pods=True, take_pending_reason=True)),
    Case("pods of another world than the recorded one are all replaced (a roll)",
         seen(pods=(pod(0, world=1), pod(1, world=7))),
         Outcome(1.0, (RestartWorld("Rolling", "pods of another world than 1: replacing"),))),
    Case("a pod that exited while the world formed re-forms it from scratch after 10 s, saying how it ended",
         seen(pods=(pod(0), replace(pod(1, phase="Failed"), why="exited 1: cannot read the agent token"))),
         Outcome(1.0, (Emit("PodExited", EXITED, warning=True), RestartWorld("Recovering", EXITED)),
                 gang=Gang(since=NOW - 10, retry_at=NOW + 10), crash_loop=CrashLoop(1, NOW),
                 conditions=(Condition("Degraded", "True", "CrashLoopBackOff", EXITED),))),
    Case("the fourth exit in a row waits 80 s",
         seen(pods=(pod(0, phase="Failed"),), crash_loop=CrashLoop(3, NOW - 50)),
         Outcome(1.0, (Emit("PodExited", FOURTH, warning=True), RestartWorld("Recovering", FOURTH)),
                 gang=Gang(since=NOW - 10, retry_at=NOW + 80), crash_loop=CrashLoop(4, NOW),
                 conditions=(Condition("Degraded", "True", "CrashLoopBackOff", FOURTH),))),
    Case("an exit 10 minutes after the last wait ended counts from one again",
         seen(pods=(pod(0, phase="Failed"),), crash_loop=CrashLoop(3, NOW - 600 - 40 - 1)),
         Outcome(1.0, (Emit("PodExited", AGAIN, warning=True), RestartWorld("Recovering", AGAIN)),
                 gang=Gang(since=NOW - 10, retry_at=NOW + 10), crash_loop=CrashLoop(1, NOW),
                 conditions=(Condition("Degraded", "True", "CrashLoopBackOff", AGAIN),))),
    Case("no world forms before the backoff is over",
         seen(world=2, pods=(), gang=Gang(retry_at=NOW + 7)),
         Outcome(7.0, phase="Pending")),
    Case("while pods are still being deleted nothing new is created",
         seen(world=2, pods=(), terminating=2),
         Outcome(1.0, report_pods=True)),
    Case("a pod that cannot start says why while the gang waits (its container's waiting reason)",
         seen(gang=Gang(since=NOW - 290), pods=(pod(0), replace(pod(1, phase="Pending", ip=False),
                                                                why="waiting (ImagePullBackOff): no image x"))),
         Outcome(10.05, phase="Provisioning", gang=Gang(since=NOW - 290), report_pods=True, conditions=(
             Condition("Progressing", "True", "Provisioning",
                       "world 1: 1 of 2 pods running; pod d-1 waiting (ImagePullBackOff): no image x"),))),
    Case("pods not all running wait for the gang deadline, woken sooner by their events",
         seen(gang=Gang(since=NOW - 290), pods=(pod(0), pod(1, phase="Pending", ip=False))),
         Outcome(10.05, phase="Provisioning", gang=Gang(since=NOW - 290), report_pods=True)),
    Case("a far gang deadline is looked at again after at most 30 s",
         seen(gang=Gang(since=NOW - 10), pods=(pod(0), pod(1, phase="Pending", ip=False))),
         Outcome(30.0, phase="Provisioning", gang=Gang(since=NOW - 10), report_pods=True)),
    Case("a running pod without an IP yet is not counted as running",
         seen(gang=Gang(since=NOW - 10), phase="Recovering", pods=(pod(0), pod(1, ip=False))),
         Outcome(30.0, phase="Recovering", gang=Gang(since=NOW - 10), report_pods=True)),
    Case("a gang past its deadline is reported, its pods deleted, and retried after 30 s",
         seen(gang=Gang(since=NOW - 301), pods=(pod(0), pod(1, phase="Pending", ip=False))),
         Outcome(1.0, (Emit("GangTimeout", "1 of 2 pods of world 1 running after 300 s: deleting them, retry 1 in "
                                           "30 s", warning=True),
                       DeletePods((pod(0), pod(1, phase="Pending", ip=False)))),
                 phase="Pending", gang=Gang(since=NOW - 301, attempts=1, retry_at=NOW + 30),
                 conditions=(Condition("Degraded", "True", "GangTimeout", "1 of 2 pods of world 1 running after "
                                                                          "300 s: deleting them, retry 1 in 30 s"),),
                 report_pods=True)),
    Case("the third timed-out attempt waits 120 s",
         seen(gang=Gang(since=NOW - 301, attempts=2), pods=(pod(0, phase="Pending"), pod(1, phase="Pending"))),
         Outcome(1.0, (Emit("GangTimeout", "0 of 2 pods of world 1 running after 300 s: deleting them, retry 3 in "
                                           "120 s", warning=True),
                       DeletePods((pod(0, phase="Pending"), pod(1, phase="Pending")))),
                 phase="Pending", gang=Gang(since=NOW - 301, attempts=3, retry_at=NOW + 120),
                 conditions=(Condition("Degraded", "True", "GangTimeout", "0 of 2 pods of world 1 running after "
                                                                          "300 s: deleting them, retry 3 in 120 s"),),
                 report_pods=True)),
    Case("a gang without a recorded start (status lost) counts its deadline from now",
         seen(gang=Gang(), pods=(pod(0), pod(1, phase="Pending"))),
         Outcome(30.0, phase="Provisioning", gang=Gang(), report_pods=True)),
    Case("all pods running: the agents are asked which world they run, and nothing else is done",
         seen(pods=RUNNING),
         Outcome(0.0, (AskAgents(),), gang=Gang(since=NOW - 10), report_pods=True)),
    Case("an agent that does not answer yet is asked again in a second",
         seen(pods=RUNNING, agents={0: 0, 1: m.UNANSWERED}),
         Outcome(1.0, gang=Gang(since=NOW - 10), report_pods=True)),
    Case("some agents already in the world and some not: the world is re-formed",
         seen(pods=RUNNING, agents={0: 1, 1: 0}),
         Outcome(1.0, (RestartWorld("Recovering", "only some agents run world 1"),), gang=Gang(since=NOW - 10),
                 report_pods=True)),
    Case("agents in no world yet are configured for the recorded one",
         seen(pods=RUNNING, agents={0: 0, 1: 0}),
         Outcome(0.0, (Configure(1),), gang=Gang(since=NOW - 10), report_pods=True)),
    Case("agents left in an older world are configured for the recorded one",
         seen(world=5, pods=(pod(0, world=5), pod(1, world=5)), agents={0: 4, 1: 4}),
         Outcome(0.0, (Configure(5),), gang=Gang(since=NOW - 10), report_pods=True)),
    Case("a configured world is recorded with an event naming its ranks and pods",
         seen(pods=RUNNING, agents={0: 0, 1: 0}, configured=Configured()),
         Outcome(0.5, (Emit("WorldConfigured", "world 1: 4 ranks on 2 pods"),), gang=Gang(since=NOW - 10),
                 report_pods=True, configured=True)),
    Case("a checkpoint the pods refuse becomes InvalidSpec with the agent's reason, not a retry",
         seen(pods=RUNNING, agents={0: 0, 1: 0},
              configured=Configured("pod 0: INVALID_ARGUMENT: checkpoint: hidden_size 64, the plan says 128")),
         Outcome(60.0, (RefuseCheckpoint("hidden_size 64, the plan says 128"),))),
    Case("any other Configure failure is reported and tried again in 2 s",
         seen(pods=RUNNING, agents={0: 0, 1: 0}, configured=Configured("pod 1: UNAVAILABLE")),
         Outcome(2.0, (Emit("ConfigureFailed", "pod 1: UNAVAILABLE", warning=True),), gang=Gang(since=NOW - 10),
                 report_pods=True)),
    Case("an operator restarted after configuring finds every agent in the world and does not configure again",
         seen(pods=RUNNING, agents={0: 1, 1: 1}),
         Outcome(0.5, gang=Gang(since=NOW - 10), report_pods=True, configured=True)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_provisioning_transition(case: Case) -> None:
    assert isinstance(case.seen, ProvisionSeen)
    assert m.provision(case.seen) == case.want


def test_an_outcome_that_asks_an_agent_does_nothing_else() -> None:
    for case in [*CASES, *READY_CASES, *NOT_READY_CASES]:
        if case.want.asks:
            assert len(case.want.actions) == 1, case.name


class FakeCluster:
    """Applies a machine's actions to a set of pods and a status, as the executor does against the API server;
    `fits`: how many pods the scheduler can run."""

    def __init__(self, fits: int, pod_count: int = 2) -> None:
        self.fits, self.pod_count = fits, pod_count
        self.now, self.world, self.gang = NOW, 0, Gang()
        self.pods: dict[int, PodSeen] = {}
        self.events: list[str] = []
        self.configured = 0
        self.agents: dict[int, int] = {}

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.schedule()
            s = ProvisionSeen(self.world, self.pod_count, 2 * self.pod_count, self.now, TIMEOUT, self.gang,
                              pods=tuple(self.pods[i] for i in sorted(self.pods)))
            out = m.provision(s)
            while out.asks:
                if isinstance(out.actions[0], AskAgents):
                    s = replace(s, agents={i: self.agents.get(i, 0) for i in self.pods})
                else:
                    self.agents = {i: self.world for i in self.pods}
                    s = replace(s, configured=Configured())
                out = m.provision(s)
            self.apply(out)
            self.now += max(out.delay, 0.1)

    def schedule(self) -> None:
        for i in sorted(self.pods)[:self.fits]:
            self.pods[i] = replace(self.pods[i], phase="Running", ip=f"10.0.0.{i}")

    def apply(self, out: Outcome) -> None:
        for a in out.actions:
            if isinstance(a, RecordWorld):
                self.world, self.gang = a.world, a.gang
            elif isinstance(a, CreatePods):
                self.pods.update({i: PodSeen(i, f"d-{i}", world=str(a.world)) for i in a.indices})
            elif isinstance(a, DeletePods):
                for q in a.pods:
                    self.pods.pop(q.index)
            elif isinstance(a, Emit):
                self.events.append(a.reason)
        if out.gang is not None:
            self.gang = out.gang
        self.configured = self.world if out.configured else self.configured


def test_a_gang_that_never_fits_is_retried_in_new_worlds_with_the_backoff_growing() -> None:
    c = FakeCluster(fits=1)
    starts = []
    for _ in range(5):
        c.run(1)
        while c.world == 0 or c.gang.attempts < len(starts) + 1:
            c.run(1)
        starts.append((c.world, c.gang.retry_at - c.now if c.gang.retry_at else None))
    assert c.configured == 0 and c.events.count("GangTimeout") == 5
    assert [w for w, _ in starts] == [1, 2, 3, 4, 5]
    waits = [round(wait or 0) for _, wait in starts]
    assert waits == [29, 59, 119, 239, 479]  # the backoff less the step that noticed the deadline


def test_a_gang_that_fits_is_configured_once_and_then_left_alone() -> None:
    c = FakeCluster(fits=2)
    c.run(10)
    assert c.world == 1 and c.configured == 1 and c.events == ["WorldConfigured"]
    assert sorted(c.pods) == [0, 1]


# ------------------------------------------------------------------------------- a world whose pods are all ready
def ready_seen(**kw: object) -> m.ReadySeen:
    base = m.ReadySeen(world=3, world_dpa=2, want_dpa=2, world_size=4, pods=2, generation=5)
    return replace(base, **kw)  # type: ignore[arg-type]


SERVING = (Condition("Available", "True", "Serving", "world 3: 4 ranks serving on 2 pods"),
           Condition("Degraded", "False", "AsExpected", ""))
COMPLETE = Condition("Progressing", "False", "Complete", "world 3: 4 ranks serving on 2 pods")

NO_ROUTER = "world 3: 4 ranks serving on 2 pods; the router is not serving: 0 of 1 router pods ready"

READY_CASES = [
    Case("a world at the spec's size with nothing to change runs and is looked at every 10 s",
         ready_seen(), Outcome(10.0, phase="Running", conditions=(*SERVING, COMPLETE), serves=True)),
    Case("a growth whose new pods exited at start waits out the crash-loop backoff before the next try",
         ready_seen(want_dpa=3, now=NOW, grow_at=NOW + 20, last_result="rolled back: new pod(s) [2] exited"),
         Outcome(20.0, phase="Running", serves=True, conditions=(*SERVING, Condition(
             "Progressing", "True", "CrashLoopBackOff", "dpa 2 -> 3 in 20 s: rolled back: new pod(s) [2] exited")))),
    Case("once the backoff is over the growth is tried again",
         ready_seen(want_dpa=3, now=NOW, grow_at=NOW - 1),
         Outcome(0.2, (m.StartScale(3),), phase="Scaling", serves=True,
                 conditions=(*SERVING, Condition("Progressing", "True", "Scaling", "dpa 2 -> 3")))),
    Case("a world whose router does not serve status.url is not Available, and says so",
         ready_seen(router="the router is not serving: 0 of 1 router pods ready"),
         Outcome(10.0, phase="Running", serves=True, conditions=(
             Condition("Available", "False", "RouterNotReady", NO_ROUTER), SERVING[1], COMPLETE))),
    Case("a world whose experts are being moved shows Rebalancing",
         ready_seen(eplb_busy=True), Outcome(10.0, phase="Rebalancing", conditions=(*SERVING, COMPLETE), serves=True)),
    Case("pods of an older pod template are replaced group by group while the rest serve",
         ready_seen(stale=(0, 1)),
         Outcome(0.2, (m.StartReplace((0, 1)),), phase="Rolling", conditions=SERVING, serves=True)),
    Case("a replacement that failed for this spec generation is not retried, and says why",
         ready_seen(stale=(1,), operation="Replace", cancelled_generation=5, last_result="rolled back: image"),
         Outcome(10.0, phase="Running", conditions=(*SERVING, Condition(
             "Progressing", "False", "RollFailed", "1 pods keep the old template: rolled back: image")), serves=True)),
    Case("a replacement that failed for an older spec generation is tried again",
         ready_seen(stale=(1,), operation="Replace", cancelled_generation=4),
         Outcome(0.2, (m.StartReplace((1,)),), phase="Rolling", conditions=SERVING, serves=True)),
    Case("a dpa change the world can make in place starts an elastic scale",
         ready_seen(want_dpa=4),
         Outcome(0.2, (m.StartScale(4),), phase="Scaling",
                 conditions=(*SERVING, Condition("Progressing", "True", "Scaling", "dpa 2 -> 4")), serves=True)),
    Case("a dpa change that cannot be made in place rolls the world, saying why",
         ready_seen(want_dpa=3, refusal="pp=2: a dpa change renumbers every later stage's ranks"),
         Outcome(1.0, (RestartWorld("Rolling", "dpa 2 -> 3 rolls: pp=2: a dpa change renumbers every later stage's "
                                               "ranks"),), phase="Running", serves=True)),
    Case("a dpa change waits while a rebalance moves experts, and says it is queued",
         ready_seen(want_dpa=1, eplb_busy=True),
         Outcome(2.0, phase="Rebalancing", conditions=(*SERVING, Condition(
             "Progressing", "True", "Queued", "dpa 2 -> 1: starts once the rebalance moving experts ends")),
             serves=True)),
    Case("a template change waits while a rebalance moves experts, and says it is queued",
         ready_seen(stale=(0,), eplb_busy=True),
         Outcome(2.0, phase="Rebalancing", conditions=(*SERVING, Condition(
             "Progressing", "True", "Queued",
             "replacing 1 pods of an older pod template: starts once the rebalance moving experts ends")),
             serves=True)),
    Case("a queued dpa change starts once the rebalance ended",
         ready_seen(want_dpa=1),
         Outcome(0.2, (m.StartScale(1),), phase="Scaling",
                 conditions=(*SERVING, Condition("Progressing", "True", "Scaling", "dpa 2 -> 1")), serves=True)),
    Case("a scale-down cancelled for this spec generation is not retried, and says why",
         ready_seen(want_dpa=1, operation="ScaleDown", cancelled_generation=5,
                    last_result="cancelled: drain timed out"),
         Outcome(10.0, phase="Running", conditions=(*SERVING, Condition(
             "Progressing", "False", "ScaleDownCancelled", "cancelled: drain timed out")), serves=True)),
    Case("a scale-up rolled back for this spec generation is not retried, and is not called a cancelled scale-down",
         ready_seen(want_dpa=4, operation="ScaleUp", cancelled_generation=5, last_result="rolled back: no nodes"),
         Outcome(10.0, phase="Running", conditions=(*SERVING, Condition(
             "Progressing", "False", "ScalingRolledBack", "rolled back: no nodes")), serves=True)),
    Case("a new spec generation after a cancelled scale-down tries the change again",
         ready_seen(want_dpa=1, operation="ScaleDown", cancelled_generation=4),
         Outcome(0.2, (m.StartScale(1),), phase="Scaling",
                 conditions=(*SERVING, Condition("Progressing", "True", "Scaling", "dpa 2 -> 1")), serves=True)),
]


@pytest.mark.parametrize("case", READY_CASES, ids=[c.name for c in READY_CASES])
def test_ready_world_transition(case: Case) -> None:
    assert isinstance(case.seen, m.ReadySeen)
    assert m.ready(case.seen) == case.want


# ---------------------------------------------------------------- a world with a pod not ready or a crash
NAMES = {0: "d-0", 1: "d-1"}


def not_ready_seen(**kw: object) -> m.NotReadySeen:
    base = m.NotReadySeen(world=3, pods=2, ready=1, now=NOW, names=NAMES, available=True, served_world=3)
    return replace(base, **kw)  # type: ignore[arg-type]


HEALTHY = {0: "SERVING", 1: "SERVING"}

NOT_READY_CASES = [
    Case("an agent silent for three heartbeats whose pod is not ready has its pod deleted at once, saying so",
         not_ready_seen(silent={1: 6.4}),
         Outcome(m.RECOVER_POLL_S, (DeletePods((PodSeen(1, "d-1"),), grace=1), Emit(
             "AgentsHung", "world 3: no health from the agents of d-1 for 6 s and their pods are not ready: deleting "
                           "them, the survivors re-form without them", warning=True)))),
    Case("without a silent agent the agents are asked for their health, and nothing else is done",
         not_ready_seen(), Outcome(0.0, (m.AskHealth(),))),
    Case("a pod not ready with every agent healthy is Degraded, counting the pods",
         not_ready_seen(health=HEALTHY),
         Outcome(2.0, phase="Degraded",
                 conditions=(Condition("Degraded", "True", "PodsNotReady", "1 of 2 pods are not ready"),))),
    Case("a world that never served yet is still forming, not Degraded",
         not_ready_seen(health=HEALTHY, available=False), Outcome(1.0, phase="Provisioning")),
    Case("a world re-formed after a loss that has not served yet shows Recovering",
         not_ready_seen(health=HEALTHY, available=False, pending_reason="Recovering"),
         Outcome(1.0, phase="Recovering")),
    Case("a vLLM world that has not served since it formed is still forming (vLLM takes tens of seconds)",
         not_ready_seen(health=HEALTHY, vllm=True, served_world=2), Outcome(1.0, phase="Provisioning")),
    Case("pods not ready within 30 s of a finished scale are the probes catching up, shown as Scaling",
         not_ready_seen(health=HEALTHY, operation="ScaleUp", finished_at=NOW - 5), Outcome(1.0, phase="Scaling")),
    Case("within 30 s of a finished recovery the phase stays Recovering",
         not_ready_seen(health=HEALTHY, operation="Recover", finished_at=NOW - 29), Outcome(1.0, phase="Recovering")),
    Case("within 30 s of a finished replacement the phase stays Rolling",
         not_ready_seen(health=HEALTHY, operation="Replace", finished_at=NOW - 1), Outcome(1.0, phase="Rolling")),
    Case("31 s after an operation a pod not ready is Degraded",
         not_ready_seen(health=HEALTHY, operation="ScaleUp", finished_at=NOW - 31),
         Outcome(2.0, phase="Degraded",
                 conditions=(Condition("Degraded", "True", "PodsNotReady", "1 of 2 pods are not ready"),))),
    Case("a crashed rank of the reference engine is recovered",
         not_ready_seen(health={0: "DEGRADED", 1: "UNREACHABLE"}),
         Outcome(m.RECOVER_POLL_S, (m.RecoverCrashed((0,)),))),
    Case("a crashed vLLM engine: its agent is asked why",
         not_ready_seen(vllm=True, health={0: "SERVING", 1: "DEGRADED"}), Outcome(0.0, (m.AskEngineFailure(1),))),
    Case("a one-pod vLLM world whose vLLM exited is Degraded with the agent's reason while its agent restarts it",
         not_ready_seen(vllm=True, pods=1, ready=0, health={0: "DEGRADED"}, engine_failure="exit code 1: OOM"),
         Outcome(2.0, (Emit("EngineRestarting", "pod d-0: exit code 1: OOM", warning=True),), phase="Degraded",
                 engine_failure="pod d-0: exit code 1: OOM", conditions=(
                     Condition("Degraded", "True", "EngineRestarting", "pod d-0: exit code 1: OOM"),
                     Condition("Available", "False", "EngineRestarting", "pod d-0: exit code 1: OOM")))),
    Case("the same vLLM failure seen again is not a second event",
         not_ready_seen(vllm=True, pods=1, ready=0, health={0: "DEGRADED"}, engine_failure="exit code 1: OOM",
                        last_engine_failure="pod d-0: exit code 1: OOM"),
         Outcome(2.0, phase="Degraded", engine_failure="pod d-0: exit code 1: OOM", conditions=(
             Condition("Degraded", "True", "EngineRestarting", "pod d-0: exit code 1: OOM"),
             Condition("Available", "False", "EngineRestarting", "pod d-0: exit code 1: OOM")))),
    Case("a vLLM failure the agent cannot explain reads 'vLLM exited'",
         not_ready_seen(vllm=True, pods=1, ready=0, health={0: "DEGRADED"}, engine_failure=""),
         Outcome(2.0, (Emit("EngineRestarting", "pod d-0: vLLM exited", warning=True),), phase="Degraded",
                 engine_failure="pod d-0: vLLM exited", conditions=(
                     Condition("Degraded", "True", "EngineRestarting", "pod d-0: vLLM exited"),
                     Condition("Available", "False", "EngineRestarting", "pod d-0: vLLM exited")))),
    Case("a crash in a multi-pod vLLM world re-forms it after the gang backoff, counting the crashes",
         not_ready_seen(vllm=True, health={0: "SERVING", 1: "DEGRADED"}, engine_failure="exit code 9",
                        engine_crashes=2),
         Outcome(1.0, (RestartWorld("Recovering", "pod(s) [1] of world 3: exit code 9: re-forming the world"),),
                 engine_crashes=3, retry_at=NOW + 120, conditions=(Condition(
                     "Degraded", "True", "EngineCrashed",
                     "pod(s) [1] of world 3: exit code 9 (crash 3; the world re-forms in 120 s)"),))),
]


@pytest.mark.parametrize("case", NOT_READY_CASES, ids=[c.name for c in NOT_READY_CASES])
def test_not_ready_world_transition(case: Case) -> None:
    assert isinstance(case.seen, m.NotReadySeen)
    assert m.not_ready(case.seen) == case.want


# ------------------------------------------------------------------------------------- elastic operations
def op_seen(**kw: object) -> m.OperationSeen:
    base = m.OperationSeen("ScaleUp", "Preparing", 2, 3, want_dpa=3, now=NOW, deadline=NOW + 100)
    return replace(base, **kw)  # type: ignore[arg-type]


QUEUED_4 = (m.QueueDpa(4), Emit("ScalingQueued", "dpa 4 requested during ScaleUp 2 -> 3: it waits for it to end"))
OPERATION_CASES = [
    Case("an operation within its deadline runs its phase", op_seen(), Outcome(0.0, (m.RunPhase(),))),
    Case("a size asked for during a scale-up is recorded and announced once, and the scale-up goes on",
         op_seen(want_dpa=4), Outcome(0.0, (*QUEUED_4, m.RunPhase()))),
    Case("a size already announced as waiting is not announced again", op_seen(want_dpa=4, waiting=4),
         Outcome(0.0, (m.RunPhase(),))),
    Case("a size asked for during a recovery is not queued: the scale-up after it restores the spec's",
         op_seen(operation="Recover", phase="Standby", to_dpa=1, want_dpa=2), Outcome(0.0, (m.RunPhase(),))),
    Case("a scale-up past its deadline while it prepares is rolled back (the old world resumes)",
         op_seen(now=NOW + 101),
         Outcome(0.0, (m.FailOperation("ScaleUp passed its deadline in phase Preparing", rollback=True),))),
    Case("a scale-down past its deadline while it drains is rolled back",
         op_seen(operation="ScaleDown", phase="Draining", to_dpa=1, want_dpa=1, now=NOW + 101),
         Outcome(0.0, (m.FailOperation("ScaleDown passed its deadline in phase Draining", rollback=True),))),
    Case("an operation past its deadline while it switches re-forms the world from scratch",
         op_seen(phase="Switching", now=NOW + 101),
         Outcome(0.0, (m.FailOperation("ScaleUp passed its deadline in phase Switching", rollback=False),))),
    Case("a recovery past its deadline re-forms the world even while its survivors stand by",
         op_seen(operation="Recover", phase="Standby", to_dpa=1, want_dpa=2, now=NOW + 101),
         Outcome(0.0, (m.FailOperation("Recover passed its deadline in phase Standby", rollback=False),))),
    Case("a size asked for as the deadline passes is still announced before the operation fails",
         op_seen(want_dpa=4, now=NOW + 101),
         Outcome(0.0, (*QUEUED_4, m.FailOperation("ScaleUp passed its deadline in phase Preparing", rollback=True)))),
    Case("an agent's error while a scale-up provisions is retried in 2 s with a ScalingRetry event",
         op_seen(phase="Provisioning", error="pod 2 has no IP"),
         Outcome(2.0, (Emit("ScalingRetry", "ScaleUp Provisioning: pod 2 has no IP", warning=True),))),
    Case("an agent's error while a prepare configures the new world is retried, not rolled back at once",
         op_seen(error="Configure on pod 2: UNAVAILABLE"),
         Outcome(2.0, (Emit("ScalingRetry", "ScaleUp Preparing: Configure on pod 2: UNAVAILABLE", warning=True),))),
    Case("an agent's error while survivors stand by is retried",
         op_seen(operation="Recover", phase="Standby", to_dpa=1, want_dpa=2, error="Health on pod 0: DEADLINE"),
         Outcome(2.0, (Emit("ScalingRetry", "Recover Standby: Health on pod 0: DEADLINE", warning=True),))),
    Case("an agent's error during the switch fails the operation and the world re-forms",
         op_seen(phase="Switching", error="Switch on pod 1: INTERNAL"),
         Outcome(0.0, (m.FailOperation("Switch on pod 1: INTERNAL", rollback=False),))),
    Case("a replace whose drain errs is retried (its groups still serve)",
         op_seen(operation="Replace", phase="Draining", from_dpa=2, to_dpa=2, want_dpa=2, error="Drain: UNAVAILABLE"),
         Outcome(2.0, (Emit("ScalingRetry", "Replace Draining: Drain: UNAVAILABLE", warning=True),))),
]


@pytest.mark.parametrize("case", OPERATION_CASES, ids=[c.name for c in OPERATION_CASES])
def test_elastic_operation_transition(case: Case) -> None:
    assert isinstance(case.seen, m.OperationSeen)
    assert m.operation(case.seen) == case.want


@pytest.mark.parametrize(("active", "want"), [
    (frozenset({3}), m.SWITCH),  # the old world runs: pause it and switch
    (frozenset({4}), m.RESUME),  # an operator restarted after the switch: only resume
    (frozenset({3, 4}), m.WAIT),  # a switch issued before a restart is completing on some pods
    (frozenset({0}), m.WAIT),  # an agent restarted without a world: the deadline decides
])
def test_a_switching_step_resumed_after_an_operator_restart_does_each_call_once(active: frozenset[int],
                                                                                 want: str) -> None:
    assert m.switch(active, world=3, target=4) == want


@pytest.mark.parametrize(("states", "configured", "want"), [
    ({0: ("READY",), 1: ("READY", "READY")}, None, m.SWITCH),  # every survivor stands by
    ({0: ("READY",), 1: ("SERVING",)}, None, m.WAIT),  # one still in the broken world
    ({0: ("READY",), 1: ()}, None, m.WAIT),  # one without ranks yet (restarting)
    ({0: ("STARTING",), 1: ("READY",)}, None, m.WAIT),
    ({0: ("SERVING",), 1: ("SERVING",)}, None, m.ASK),  # all serve: switched already, or not broken yet?
    ({0: ("SERVING",), 1: ("SERVING",)}, frozenset({4}), m.SWITCH),  # switched while the API server was down
    ({0: ("SERVING",), 1: ("SERVING",)}, frozenset({3}), m.WAIT),  # the old world has not broken yet
])
def test_survivors_switch_once_they_stand_by_or_once_they_serve_the_recovered_world_already(
        states: dict[int, tuple[str, ...]], configured: frozenset[int] | None, want: str) -> None:
    assert m.standby(states, configured, target=4) == want


@pytest.mark.parametrize(("states", "health", "want"), [
    # the crashed pod's rank restarts in place: left out of the survivors' world and kept for the scale-up
    ({1: ("CRASHED",)}, {0: "DEGRADED", 1: "DEGRADED"},
     m.CrashRecovery((1,), (1,), "a rank on pod(s) [1] of world 3 crashed")),
    ({1: ("STARTING", "READY")}, {0: "DEGRADED", 1: "DEGRADED"},
     m.CrashRecovery((1,), (1,), "a rank on pod(s) [1] of world 3 crashed")),
    # an agent silent while its world broke is left out and not kept (its pod is deleted)
    ({1: ("UNREACHABLE",)}, {0: "DEGRADED", 1: "UNREACHABLE"},
     m.CrashRecovery((1,), (), "world 3 broke and the agents of pod(s) [1] do not answer")),
    # a crashed pod and a silent one: both left out, only the crashed one kept
    ({0: ("EXITED",), 1: ("UNREACHABLE",)}, {0: "DEGRADED", 1: "UNREACHABLE"},
     m.CrashRecovery((0, 1), (0,), "world 3 broke and the agents of pod(s) [1] do not answer")),
    # every rank stands by again already: nothing is left out (the world re-forms in its pods)
    ({1: ("READY", "READY")}, {0: "DEGRADED", 1: "DEGRADED"},
     m.CrashRecovery((), (), "a rank on pod(s) [1] of world 3 crashed")),
])
def test_a_crash_leaves_out_the_restarting_and_the_silent_pods_and_keeps_the_restarting_ones(
        states: dict[int, tuple[str, ...]], health: dict[int, str], want: m.CrashRecovery) -> None:
    assert m.crash_recovery(3, (1,), states, health) == want


@pytest.mark.parametrize(("want", "pods", "stale", "plan"), [
    (1, {}, (), m.StandbyPlan((), 1, ())),  # none yet: one is created
    (1, {5: pod(5)}, (), m.StandbyPlan((), 0, (5,))),  # one running: kept, listed
    (1, {5: pod(5, phase="Pending", ip=False)}, (), m.StandbyPlan((), 0, ())),  # starting: kept, not listed yet
    (1, {5: pod(5, phase="Failed")}, (), m.StandbyPlan((5,), 1, ())),  # exited: replaced
    (1, {5: pod(5)}, (5,), m.StandbyPlan((5,), 1, ())),  # of an older pod template: replaced
    (1, {5: pod(5), 6: pod(6)}, (), m.StandbyPlan((6,), 0, (5,))),  # one too many: the highest goes
    (0, {5: pod(5)}, (), m.StandbyPlan((5,), 0, ())),  # standbyPods lowered to 0
    (2, {5: pod(5)}, (), m.StandbyPlan((), 1, (5,))),  # raised: the missing one is created
])
def test_standby_pods_are_kept_at_the_specs_count_of_the_current_template(
        want: int, pods: dict[int, PodSeen], stale: tuple[int, ...], plan: m.StandbyPlan) -> None:
    assert m.standby_pods(want, pods, stale) == plan


@pytest.mark.parametrize(("worlds", "want"), [
    # the survivors (pod 0) serve world 5 at dpa 1; pod 1, whose rank crashed, is back without a world: a spare
    ({0: (5, (0, 1), 2), 1: (0, (), 0)}, m.Adoption(5, 1, {0: (0, 1)}, (1,))),
    # every pod of the recorded world 4: nothing ahead
    ({0: (4, (0, 1), 4), 1: (4, (2, 3), 4)}, None),
    # world 5 ahead but its ranks are not all there (pod 1 holds 2 and 3 of 6): left to the usual checks
    ({0: (5, (0, 1), 6), 1: (5, (2, 3), 6)}, None),
    # two whole groups of world 6 on pods 0 and 2; the standby pod 3 stays standby, pod 1 becomes a spare
    ({0: (6, (0, 1), 4), 1: (4, (2, 3), 4), 2: (6, (2, 3), 4), 3: (0, (), 0)},
     m.Adoption(6, 2, {0: (0, 1), 2: (2, 3)}, (1,))),
])
def test_a_world_the_status_does_not_record_is_adopted_only_when_whole(
        worlds: dict[int, tuple[int, tuple[int, ...], int]], want: m.Adoption | None) -> None:
    assert m.adoption(4, worlds, 2, list(worlds), standby=[3]) == want


@pytest.mark.parametrize(("status", "said"), [
    ({"phase": "Running"}, ""),
    ({"phase": "Failed", "containerStatuses": [{"state": {"terminated": {
        "exitCode": 1, "reason": "Error",
        "message": "Traceback (most recent call last):\n  ...\nagent: cannot read the agent token from /t\n"}}}]},
     "exited 1: agent: cannot read the agent token from /t"),
    ({"phase": "Failed", "containerStatuses": [{"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]},
     "exited 137 (OOMKilled)"),
    ({"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."},
     "failed (Evicted): The node was low on resource: memory."),
])
def test_a_pods_end_is_said_as_its_container_said_it(status: dict[str, object], said: str) -> None:
    from shardwise.operator.elastic import ended

    assert ended({"metadata": {"name": "p"}, "status": status}) == said


def test_a_gang_timeout_names_why_each_pod_did_not_run() -> None:
    stuck = replace(pod(1, phase="Pending", ip=False), why="unschedulable: 0/2 nodes are available")
    out = m.provision(seen(gang=Gang(since=NOW - TIMEOUT - 1), pods=(pod(0), stuck)))
    said = out.conditions[0].message
    assert said.startswith("1 of 2 pods of world 1 running after 300 s (pod d-1 unschedulable: 0/2 nodes are "
                           "available): deleting them"), said


@pytest.mark.parametrize(("status", "said"), [
    ({"phase": "Pending", "containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]}, ""),
    ({"phase": "Pending", "containerStatuses": [{"state": {"waiting": {
        "reason": "ImagePullBackOff", "message": 'Back-off pulling image "shardwise:9"'}}}]},
     'waiting (ImagePullBackOff): Back-off pulling image "shardwise:9"'),
    ({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                          "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}]},
     "unschedulable: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu."),
])
def test_a_waiting_pod_says_what_kubernetes_says_it_waits_for(status: dict[str, object], said: str) -> None:
    from shardwise.operator.elastic import ended

    assert ended({"metadata": {"name": "p"}, "status": status}) == said
