"""The elastic state machine's plans, on a fake operator (no API server, no agents): how a scale-up, a
recovery and a rolling step choose pods and ranks. What a user sees of these is which pods are created, kept or
deleted, and which groups keep serving; these run in milliseconds where the end-to-end tests take minutes."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardwise.operator import builders as b
from shardwise.operator.elastic import Elastic
from shardwise.operator.kube import KubeError
from shardwise.operator.status import decode_layout

from shardwise.api import InferenceDeploymentSpec

ROOT = Path(__file__).resolve().parents[2]
NOW = 1_800_000_000.0


class FakeKube:
    """Records the writes an operation's end makes to pods."""

    def __init__(self) -> None:
        self.patched: dict[str, Any] = {}
        self.deleted: list[str] = []

    def patch(self, kind: str, namespace: str, name: str, body: Any, **_: Any) -> None:
        self.patched[name] = body

    def delete(self, kind: str, namespace: str, name: str, **_: Any) -> bool:
        self.deleted.append(name)
        return True


class FakeHost:
    """What `Elastic` needs of the reconciler; the start_* plans only read the clock and send events."""

    def __init__(self) -> None:
        self.kube: Any = FakeKube()
        self.clock = lambda: NOW
        self.events: list[tuple[str, str]] = []
        self.operations: list[str] = []

    @property
    def agent_port(self) -> int:
        return 50051

    @property
    def build(self) -> b.BuildOptions:
        return b.BuildOptions()

    def event(self, obj: Any, reason: str, message: str, *, warning: bool = False) -> None:
        self.events.append((reason, message))

    def sync_router(self, obj: Any, st: Any, spec: Any, pods: Any, serving: Iterable[int] = ()) -> dict[str, str]:
        raise AssertionError("a plan pushes no routes")

    def metrics_op(self, operation: str, seconds: float, pause: float) -> None:
        self.operations.append(operation)

    def restart_world(self, obj: Any, st: Any, live: Any, reason: str, message: str) -> float:
        raise AssertionError("a plan restarts no world")


def spec(**parallelism: int) -> InferenceDeploymentSpec:
    raw = yaml.safe_load((ROOT / "examples" / "tiny-moe.yaml").read_text())["spec"]
    raw["parallelism"].update(parallelism)
    return InferenceDeploymentSpec.model_validate(raw)


def world(layout: dict[int, list[int]], generation: int = 7) -> dict[str, Any]:
    """A serving world's status: pod index -> its ranks."""
    return {"worldGeneration": generation, "worldDpa": len({r[0] // 2 for r in layout.values() if r}),
            "pods": [{"index": i, "ranks": r} for i, r in sorted(layout.items())]}


OBJ = {"metadata": {"name": "web", "namespace": "default", "generation": 3}}


@pytest.mark.parametrize("layout,to_dpa,taken,spares,target,rejoin", [
    pytest.param({0: [0, 1], 1: [2, 3]}, 4, {0, 1}, (), {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]}, None,
                 id="new groups take the lowest free indices"),
    pytest.param({0: [0, 1], 3: [2, 3]}, 3, {0, 1, 2, 3}, (), {0: [0, 1], 3: [2, 3], 4: [4, 5]}, None,
                 id="an index a terminating pod still holds is skipped"),
    pytest.param({0: [0, 1]}, 2, {0, 1}, (1,), {0: [0, 1], 1: [2, 3]}, [1],
                 id="a spare kept by a recovery takes the new group before any new pod"),
    pytest.param({0: [0, 1]}, 3, {0, 1, 2}, (2,), {0: [0, 1], 2: [2, 3], 3: [4, 5]}, [2],
                 id="spares first, then new pods for the rest"),
])
def test_a_scale_up_places_new_groups_on_spares_first_then_on_indices_no_pod_holds(
        layout: dict[int, list[int]], to_dpa: int, taken: set[int], spares: tuple[int, ...],
        target: dict[int, list[int]], rejoin: list[int] | None) -> None:
    host = FakeHost()
    st = world(layout)
    Elastic(host).start_scale(OBJ, st, spec(), to_dpa, taken, spares)
    op = st["elastic"]
    assert (op["operation"], op["phase"], op["targetWorld"]) == ("ScaleUp", "Provisioning", 8)
    assert decode_layout(op["target"]) == target
    assert op.get("rejoin") == rejoin
    assert op["groupSize"] == 2
    [(reason, message)] = host.events
    assert reason == "ScalingStarted" and (("rejoin" in message) == bool(rejoin)), message


@pytest.mark.parametrize("spares,standby,target,joined", [
    pytest.param((), (5,), {0: [0, 1], 5: [2, 3], 1: [4, 5]}, [5],
                 id="a standby pod takes the first new group, a new pod the next"),
    pytest.param((1,), (5,), {0: [0, 1], 1: [2, 3], 5: [4, 5]}, [5],
                 id="a spare first, then the standby pod"),
    pytest.param((), (5, 6, 7), {0: [0, 1], 5: [2, 3], 6: [4, 5]}, [5, 6],
                 id="standby pods beyond the new groups keep standing by"),
])
def test_a_scale_up_takes_spares_then_standby_pods_then_new_indices(
        spares: tuple[int, ...], standby: tuple[int, ...], target: dict[int, list[int]], joined: list[int]) -> None:
    host = FakeHost()
    st = world({0: [0, 1]})
    Elastic(host).start_scale(OBJ, st, spec(), 3, {0, *spares, *standby}, spares, standby)
    op = st["elastic"]
    assert decode_layout(op["target"]) == target
    assert op["standby"] == joined
    [(_, message)] = host.events
    assert f"standby pod(s) {joined} join" in message


def test_the_end_of_a_scale_up_keeps_idle_standby_pods_and_labels_the_one_it_took() -> None:
    host = FakeHost()
    elastic = Elastic(host)
    st = world({0: [0, 1]})
    elastic.start_scale(OBJ, st, spec(), 2, {0, 4, 5}, (), (4, 5))
    op = dict(st["elastic"])
    pods = {i: {"metadata": {"name": f"web-{i}", "labels": {b.LABEL_ROLE: role}}}
            for i, role in ((0, "leader"), (4, "standby"), (5, "standby"))}
    elastic._done(OBJ, st, op, pods, decode_layout(op["target"]), 0.1)
    assert host.kube.deleted == []  # web-5 keeps standing by
    assert host.kube.patched == {"web-4": {"metadata": {"labels": {b.LABEL_ROLE: "leader"}}}}
    assert "standby pod(s) [4] joined" in st["elastic"]["lastResult"]


def test_a_scale_down_drains_the_last_groups_and_keeps_the_first() -> None:
    st = world({0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]})
    Elastic(FakeHost()).start_scale(OBJ, st, spec(), 2)
    op = st["elastic"]
    assert (op["operation"], op["phase"], op["leaving"]) == ("ScaleDown", "Draining", [2, 3])
    assert decode_layout(op["target"]) == {0: [0, 1], 1: [2, 3]}


@pytest.mark.parametrize("layout,lost,spare,target,leaving,kept", [
    pytest.param({0: [0, 1], 1: [2, 3], 2: [4, 5]}, [1], [], {0: [0, 1], 2: [2, 3]}, [], None,
                 id="the complete groups are renumbered in order"),
    pytest.param({0: [0, 1], 1: [2, 3]}, [1], [1], {0: [0, 1]}, [], [1],
                 id="a pod whose crashed rank restarts in place is kept as a spare"),
    pytest.param({0: [0, 1], 1: [2, 3]}, [1], [0], {0: [0, 1]}, [], None,
                 id="a spare must be one of the pods left out"),
])
def test_a_recovery_keeps_the_complete_groups_and_only_the_spares_it_is_told_of(
        layout: dict[int, list[int]], lost: list[int], spare: list[int], target: dict[int, list[int]],
        leaving: list[int], kept: list[int] | None) -> None:
    st = world(layout)
    assert Elastic(FakeHost()).start_recover(OBJ, st, spec(), lost, "a rank crashed", crashed=True, spare=spare)
    op = st["elastic"]
    assert (op["operation"], op["phase"], op["toDpa"], op["lost"]) == ("Recover", "Standby", len(target), lost)
    assert decode_layout(op["target"]) == target and op["leaving"] == leaving
    assert op.get("spare") == kept


def test_a_pod_of_one_group_split_over_two_pods_takes_its_partner_out_with_it() -> None:
    # tp=2 on pods of one GPU: a group is two pods, and losing one leaves the other without a group
    s = spec()
    s = s.model_copy(update={"hardware": s.hardware.model_copy(update={"gpus_per_node": 1})})
    st = world({0: [0], 1: [1], 2: [2], 3: [3]})
    assert Elastic(FakeHost()).start_recover(OBJ, st, s, [3], "pod 3 lost")
    op = st["elastic"]
    assert decode_layout(op["target"]) == {0: [0], 1: [1]} and op["leaving"] == [2]


def test_nothing_is_kept_when_every_group_lost_a_pod() -> None:
    st = world({0: [0, 1], 1: [2, 3]})
    assert not Elastic(FakeHost()).start_recover(OBJ, st, spec(), [0, 1], "both crashed")
    assert "elastic" not in st


@pytest.mark.parametrize("at_once,dpa,chosen", [(1, 3, [0]), (2, 3, [0, 1]), (5, 3, [0, 1]), (1, 1, [0])])
def test_a_rolling_step_replaces_at_most_max_unavailable_groups_and_leaves_one_serving_where_there_are_two(
        at_once: int, dpa: int, chosen: list[int]) -> None:
    s = spec(dpa=dpa)
    s = s.model_copy(update={"elastic": s.elastic.model_copy(update={"max_unavailable_groups": at_once})})
    layout = {i: [2 * i, 2 * i + 1] for i in range(dpa)}
    st = world(layout)
    Elastic(FakeHost()).start_replace(OBJ, st, s, stale=list(layout), taken=set(layout))
    op = st["elastic"]
    assert op["groups"] == chosen and op["leaving"] == chosen
    new = {i: r for i, r in decode_layout(op["target"]).items() if i not in layout}
    assert sorted(new) == [dpa + k for k in range(len(chosen))]  # new pods under new names
    assert sorted(map(tuple, new.values())) == [tuple(layout[g]) for g in chosen]  # taking the replaced ranks


def pods_named(*indices: int) -> dict[int, Any]:
    return {i: {"metadata": {"name": f"web-{i}", "uid": f"u{i}", "labels": {b.LABEL_POD_INDEX: str(i)}}}
            for i in indices}


def test_the_end_of_a_recovery_keeps_its_spare_out_of_every_service_and_deletes_the_rest() -> None:
    host = FakeHost()
    st = world({0: [0, 1], 1: [2, 3], 2: [4, 5]})
    elastic = Elastic(host)
    assert elastic.start_recover(OBJ, st, spec(dpa=3), [1, 2], "ranks crashed", crashed=True, spare=[1])
    elastic._done(OBJ, st, st["elastic"], pods_named(0, 1, 2), {0: [0, 1]}, 0.1)
    assert host.kube.patched == {"web-1": {"metadata": {"labels": {"shardwise.io/role": "spare"}}}}
    assert host.kube.deleted == ["web-2"] and st["spares"] == [1]
    assert (st["worldGeneration"], st["worldDpa"], st["elastic"]["phase"]) == (8, 1, "Done")
    result = st["elastic"]["lastResult"]
    assert "without pod(s) [2] (a crashed rank or a silent agent; replaced" in result, result
    assert "without pod(s) [1] (a crashed rank, restarting in place: kept" in result, result
    assert "after losing" not in result and host.operations == ["Recover"]


def test_the_end_of_a_scale_up_that_took_a_spare_back_labels_it_by_its_new_ranks() -> None:
    host = FakeHost()
    st = world({0: [0, 1]})
    elastic = Elastic(host)
    elastic.start_scale(OBJ, st, spec(), 3, {0, 1}, spares=[1])
    op = st["elastic"]
    elastic._done(OBJ, st, op, pods_named(0, 1, 2), decode_layout(op["target"]), 0.2)
    assert host.kube.patched == {"web-1": {"metadata": {"labels": {"shardwise.io/role": "leader"}}}}
    assert host.kube.deleted == [] and "spares" not in st
    assert "pod(s) [1] rejoined (no new pod)" in st["elastic"]["lastResult"]
    assert [p["index"] for p in st["pods"]] == [0, 1, 2]


class DownKube(FakeKube):
    """An API server that does not answer (KubeError status 0), as during an outage."""

    def patch(self, kind: str, namespace: str, name: str, body: Any, **_: Any) -> None:
        raise KubeError(0, "connection refused")

    def delete(self, kind: str, namespace: str, name: str, **_: Any) -> bool:
        raise KubeError(0, "connection refused")


def test_a_recovery_switched_while_the_api_server_is_down_ends_in_memory_for_the_step_to_write_later() -> None:
    host = FakeHost()
    host.kube = DownKube()
    st = world({0: [0, 1], 1: [2, 3], 2: [4, 5]})
    elastic = Elastic(host)
    assert elastic.start_recover(OBJ, st, spec(dpa=3), [1, 2], "ranks crashed", crashed=True, spare=[1])
    st["elastic"]["phase"] = "Switching"
    obj = {**OBJ, "status": {}}
    elastic._write(obj, st, may_defer=True)  # logged: the survivors switch anyway
    assert obj["status"] == {}  # nothing is taken for written
    elastic._done(obj, st, st["elastic"], pods_named(0, 1, 2), {0: [0, 1]}, 0.1)
    # the world is the survivors' one; the spare's label and pod 2's deletion wait for the serving steps
    assert (st["worldGeneration"], st["worldDpa"], st["elastic"]["phase"], st["spares"]) == (8, 1, "Done", [1])
    assert [reason for reason, _ in host.events] == ["RecoveryStarted", "Recovered"]


def test_other_operations_do_not_go_on_without_recording_their_phase() -> None:
    host = FakeHost()
    host.kube = DownKube()
    st = world({0: [0, 1], 1: [2, 3]})
    elastic = Elastic(host)
    elastic.start_scale(OBJ, st, spec(), 4, {0, 1})
    with pytest.raises(KubeError):
        elastic._write({**OBJ, "status": {}}, st)  # before a pause: the world keeps serving meanwhile


def test_an_operation_never_forms_again_a_generation_an_earlier_one_chose() -> None:
    """The agents that took a generation keep it configured and its ranks' addresses stay in the rendezvous store:
    a rolled-back scale-up's retry, and a recovery that cuts an operation short, each form a world of their own."""
    host = FakeHost()
    st = world({0: [0, 1], 1: [2, 3]})  # serving world 7
    elastic = Elastic(host)
    elastic.start_scale(OBJ, st, spec(), 4, {0, 1})
    assert st["elastic"]["targetWorld"] == 8
    # rolled back before its switch (the world still 7), as `_fail` leaves it; then tried again
    st["elastic"] = {"operation": "ScaleUp", "phase": "Done", "fromDpa": 2, "toDpa": 4,
                     "startedAt": st["elastic"]["startedAt"], "lastResult": "rolled back: a pod did not start"}
    elastic.start_scale(OBJ, st, spec(), 4, {0, 1})
    assert (st["elastic"]["targetWorld"], st["lastWorld"]) == (9, 9)
    assert "(world 7 -> 9" in host.events[-1][1]
    # a rank crashes while that one prepares: the survivors' world is not 9 either
    assert elastic.start_recover(OBJ, st, spec(), [1], "a rank crashed")
    assert (st["elastic"]["targetWorld"], st["lastWorld"], st["worldGeneration"]) == (10, 10, 7)


def test_an_operation_configures_its_world_for_new_ranks_that_wait_for_the_switch_and_a_first_world_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A new pod's ranks go to the rendezvous as soon as they have loaded; in a world the running one switches
    into, they must wait for that switch however late the operator sends it, not give up at the rendezvous
    timeout. A first world's ranks are all told at once: a rank that does not come is a failure to report."""
    from shardwise.controllers import world as w
    from shardwise.operator.elastic import plan_at, world_layout

    sent: list[Any] = []
    monkeypatch.setattr(w, "rendezvous_of", lambda pod, token: "10.0.0.1:29500")
    monkeypatch.setattr(w, "_clients", lambda pods, token: [])
    monkeypatch.setattr(w, "call_all", lambda clients, method, request, timeout: sent.append(request))
    pods = [w.WorldPod(0, "10.0.0.1:50051", (0, 1)), w.WorldPod(1, "10.0.0.2:50051", (2, 3))]
    s = spec()
    w.configure_world(pods, "token", world_layout(s, plan_at(s, 2), 8, 2))
    w.configure_world(pods, "token", w.WorldLayout(generation=1, model="tiny-moe", tp=2, dpa=2, pp=1))
    assert [r.joins_running_world for r in sent] == [True, False]
