"""Recovery through the agent API alone: a pod dies, the ranks of the others stand by, and the survivors form a
smaller world in the processes they have (a pod whose DPA group is renumbered keeps its weights), then serve
like the oracle. Requests of the groups that survive whole finish in the new world with their KV caches;
those of a group that lost a rank end with an explicit error."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from typing import Any

import pytest

pytest.importorskip("torch")
grpc = pytest.importorskip("grpc")

from shardwise.agents.client import AgentClient, call_all, world_request  # noqa: E402
from shardwise.agents.localrun import LocalDeployment  # noqa: E402
from shardwise.agents.proto import agent_pb2 as pb  # noqa: E402

from tests.runtime.test_agent import TOKEN, oracle, post  # noqa: E402

pytestmark = pytest.mark.slow
# a survivor notices a lost peer when a collective fails: at once when the peer's sockets close, and a peer that
# stood by drops every group, so a rank blocked on it fails at once too; the bound is below the collectives' 120 s
# timeout, so a survivor left blocked on a peer that keeps a group open fails the test
STANDBY_S = 60


def wait_until(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)  # polling other processes' state


def standing_by(c: AgentClient) -> bool:
    h = c.health()
    return bool(h.ranks) and all(r.state == pb.RANK_STATE_READY for r in h.ranks)


class InFlight:
    """A 300-token completion sent in the background, to be in flight when something breaks."""

    def __init__(self, url: str, prompt: str, max_tokens: int = 300) -> None:
        self.prompt, self.max_tokens, self.answer = prompt, max_tokens, {}
        self.thread = threading.Thread(target=lambda: self.answer.update(
            r=post(url + "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens}, timeout=240)))
        self.thread.start()

    def waiting(self) -> bool:
        return self.thread.is_alive()

    def result(self, timeout: float = 240) -> tuple[int, Any]:
        self.thread.join(timeout)
        status, body, _ = self.answer["r"]
        return status, body

    def assert_like_the_oracle(self) -> None:
        status, body = self.result()
        assert status == 200 and body["token_ids"] == oracle(self.prompt, self.max_tokens), body


def assert_serves_like_the_oracle(urls: list[str], label: str) -> None:
    for i, url in enumerate(urls):
        status, body, _ = post(url + "/v1/completions", {"prompt": f"{label} {i}", "max_tokens": 8})
        assert status == 200 and body["token_ids"] == oracle(f"{label} {i}", 8), body


def test_survivors_of_a_lost_pod_form_a_smaller_world_and_finish_their_requests_like_the_oracle() -> None:
    # 18 expert slots: 6 per rank over 3 ranks, 9 over the 2 that survive
    with LocalDeployment(model="tiny-moe", tp=1, dpa=3, pp=1, agents=3, redundant_experts=2, token=TOKEN,
                         log=lambda _m: None) as dep:
        dep.start()
        urls = dep.serving_urls()
        clients = [AgentClient(ap.grpc, TOKEN) for ap in dep.procs]
        first = InFlight(urls[0], "in flight on pod 0 when pod 1 dies")
        third = InFlight(urls[2], "in flight on pod 2 when pod 1 dies")
        for c in (clients[0], clients[2]):
            wait_until(lambda c=c: c.stats().running_requests, 30, "the requests to run")
        os.killpg(dep.procs[1].proc.pid, signal.SIGKILL)  # the whole pod: agent and ranks
        dep.procs[1].proc.wait(10)

        survivors = [clients[0], clients[2]]
        for c in survivors:
            wait_until(lambda c=c: standing_by(c), STANDBY_S, "the survivors' ranks to stand by")
            assert c.status() == "DEGRADED"
        assert first.waiting() and third.waiting()  # the survivors' requests wait for the next world
        conf = world_request(generation=2, model="tiny-moe", tp=1, dpa=2, pp=1, pods=[[0], [], [1]],
                             rendezvous=dep.rendezvous, redundant_experts=2, map_generation=1)
        call_all(survivors, "Configure", conf, 60)
        switched = call_all(survivors, "Switch", pb.SwitchRequest(generation=2, recover=True), 120)
        assert {(s.generation, s.previous_generation) for s in switched} == {(2, 1)}

        d = clients[2].describe()  # pod 2 led group 2; it now leads group 1 with the same processes
        assert (d.generation, d.world_size, [r.rank for r in d.ranks], d.ranks[0].dpa_group) == (2, 2, [1], 1)
        # in-flight requests of the surviving groups resume with their KV caches and end like the oracle
        first.assert_like_the_oracle()
        third.assert_like_the_oracle()
        for c in survivors:
            assert c.status() == "SERVING"
        assert_serves_like_the_oracle([urls[0], urls[2]], "after recovery")
        for c in clients:
            c.close()


def test_a_killed_rank_fails_only_its_groups_requests_and_the_others_finish_after_recovery() -> None:
    with LocalDeployment(model="tiny-moe", tp=1, dpa=2, pp=1, agents=2, token=TOKEN, log=lambda _m: None) as dep:
        dep.start()
        urls = dep.serving_urls()
        clients = [AgentClient(ap.grpc, TOKEN) for ap in dep.procs]
        kept = InFlight(urls[0], "on the group that survives")
        lost = InFlight(urls[1], "on the group whose rank dies")
        for c in clients:
            wait_until(lambda c=c: c.stats().running_requests, 30, "the requests to run")
        os.kill(clients[1].health().ranks[0].pid, signal.SIGKILL)  # the rank process only: the agent lives
        status, body = lost.result(60)
        assert status == 500 and "rank 1, the leader of its DPA group, died" in body["error"], body
        with urllib.request.urlopen(dep.procs[1].metrics, timeout=10) as r:
            lost_metric = [line for line in r.read().decode().splitlines()
                           if line.startswith("shardwise_requests_total") and 'finish_reason="error"' in line]
        assert lost_metric and lost_metric[0].endswith(" 1.0"), lost_metric
        for c in clients:
            wait_until(lambda c=c: standing_by(c), STANDBY_S, "the ranks to stand by (pod 1's restarted)")
        assert kept.waiting()
        conf = world_request(generation=2, model="tiny-moe", tp=1, dpa=2, pp=1, pods=[[0], [1]],
                             rendezvous=dep.rendezvous)
        call_all(clients, "Configure", conf, 60)
        call_all(clients, "Switch", pb.SwitchRequest(generation=2, recover=True), 120)
        kept.assert_like_the_oracle()
        assert_serves_like_the_oracle(urls, "after recovery")
        for c in clients:
            c.close()


def test_a_group_whose_non_leader_rank_restarted_recomputes_its_requests_and_finishes_them_like_the_oracle() -> None:
    # one TP=2 group in one pod: rank 1 holds half of every layer, and its KV caches die with it
    with LocalDeployment(model="tiny-moe", tp=2, dpa=1, pp=1, agents=1, token=TOKEN, log=lambda _m: None) as dep:
        dep.start()
        [url] = dep.serving_urls()
        [c] = [AgentClient(ap.grpc, TOKEN) for ap in dep.procs]
        running = InFlight(url, "on the group whose second rank dies")
        wait_until(lambda: c.stats().generated_tokens_total >= 20, 60, "the request to generate tokens")
        os.kill(c.health().ranks[1].pid, signal.SIGKILL)  # the TP mate, not the leader: the scheduler lives
        wait_until(lambda: standing_by(c), STANDBY_S, "the leader to stand by and rank 1 to restart as a standby")
        assert running.waiting()
        conf = world_request(generation=2, model="tiny-moe", tp=2, dpa=1, pp=1, pods=[[0, 1]],
                             rendezvous=dep.rendezvous)
        call_all([c], "Configure", conf, 60)
        call_all([c], "Switch", pb.SwitchRequest(generation=2, recover=True), 120)
        # the group lost half its KV cache: the leader runs the prompt and the tokens sent so far again, and the
        # answer is the oracle's, every token once
        running.assert_like_the_oracle()
        assert_serves_like_the_oracle([url], "after the recompute")
        c.close()


def test_a_leaving_pod_is_configured_without_ranks_and_leaves_at_the_switch() -> None:
    with LocalDeployment(model="tiny-moe", tp=1, dpa=2, pp=1, agents=2, token=TOKEN, log=lambda _m: None) as dep:
        dep.start()
        urls = dep.serving_urls()
        clients = [AgentClient(ap.grpc, TOKEN) for ap in dep.procs]
        conf = world_request(generation=2, model="tiny-moe", tp=1, dpa=1, pp=1, pods=[[0], []],
                             rendezvous=dep.rendezvous)
        assert [list(a.local_ranks) for a in call_all(clients, "Configure", conf, 60)] == [[0], []]
        call_all(clients, "Prepare", pb.PrepareRequest(generation=2), 60)
        call_all(clients, "Pause", pb.PauseRequest(generation=1, deadline_ms=30_000), 60)
        call_all(clients, "Switch", pb.SwitchRequest(generation=2), 120)
        call_all(clients, "Resume", pb.ResumeRequest(generation=2), 60)
        assert clients[1].describe().world_size == 1 and not clients[1].describe().ranks
        assert not clients[1].describe().serving_url
        status, body, _ = post(urls[0] + "/v1/completions", {"prompt": "one group left", "max_tokens": 6})
        assert status == 200 and body["token_ids"] == oracle("one group left", 6)
        for c in clients:
            c.close()


def test_a_migration_not_agreed_before_its_deadline_is_cancelled_and_routing_stays_consistent() -> None:
    """EPLB's executor: a migration only some ranks take part in is cancelled at its deadline, every rank keeps
    routing by the map in force, outputs stay equal to the oracle, and a complete migration then succeeds."""
    with LocalDeployment(model="tiny-moe", tp=1, dpa=2, pp=1, agents=2, redundant_experts=2, token=TOKEN,
                         log=lambda _m: None) as dep:
        dep.start()
        urls = dep.serving_urls()
        clients = [AgentClient(ap.grpc, TOKEN) for ap in dep.procs]
        phy = list(clients[0].expert_load().layers[0].phy2log)  # 18 slots, 9 per rank
        counts = {e: phy.count(e) for e in phy}
        dst_slot = next(j for j in range(9) if counts[phy[9 + j]] > 1)  # overwrite a duplicated copy on rank 1
        expert = next(e for e in phy[:9] if e not in phy[9:])  # an expert rank 1 lacks
        moves = [pb.ExpertMove(layer=layer, logical_expert=expert, src_rank=0, dst_rank=1, dst_slot=dst_slot)
                 for layer in range(4)]
        request = pb.MigrateExpertsRequest(generation=1, map_generation=1, moves=moves, deadline_ms=1500)
        with pytest.raises(grpc.RpcError) as e:  # only pod 0 is asked: pod 1's rank never agrees
            clients[0].call("MigrateExperts", request, 60)
        assert e.value.code() == grpc.StatusCode.ABORTED
        assert [c.describe().map_generation for c in clients] == [0, 0]
        assert_serves_like_the_oracle(urls, "after the cut")
        done = call_all(clients, "MigrateExperts", pb.MigrateExpertsRequest(
            generation=1, map_generation=1, moves=moves, deadline_ms=60_000), 120)
        assert {(d.map_generation, d.experts_moved) for d in done} == {(1, 4)}  # each reports the whole move
        assert list(clients[1].expert_load().layers[0].phy2log)[9 + dst_slot] == expert
        assert_serves_like_the_oracle(urls, "after the move")
        for c in clients:
            c.close()


def test_a_migration_cut_short_by_a_dying_rank_leaves_consistent_maps_and_oracle_outputs() -> None:
    """Pod 1's rank dies right after moving the second of tiny-moe's four MoE layers (fault injection). The
    migration fails loudly; the survivors hold the new map for the layers every rank finished and the old one
    for the rest; an in-flight request of a surviving group waits, and after the survivors re-form a world
    with a map carried over from what each of them holds, it ends like the oracle, as do new requests."""
    from shardwise.agents.runtime.engine import FAULT_EXIT_AFTER_LAYERS_ENV
    from shardwise.controllers.eplb import carried_map, maps_by_pod
    from shardwise.controllers.world import WorldPod

    with LocalDeployment(model="tiny-moe", tp=1, dpa=3, pp=1, agents=3, redundant_experts=2, token=TOKEN,
                         log=lambda _m: None, pod_env={1: {FAULT_EXIT_AFTER_LAYERS_ENV: "2"}}) as dep:
        dep.start()
        urls = dep.serving_urls()
        clients = [AgentClient(ap.grpc, TOKEN) for ap in dep.procs]
        before = {layer.layer: list(layer.phy2log) for layer in clients[0].expert_load().layers}
        after = {layer: phy[6:] + phy[:6] for layer, phy in before.items()}  # every rank's experts move on
        kept = InFlight(urls[0], "in flight during the migration")
        wait_until(lambda: clients[0].stats().running_requests, 30, "the request to run")
        request = pb.UpdateExpertMapRequest(generation=1, map_generation=1, layers=[
            pb.LayerMap(layer=layer, phy2log=phy) for layer, phy in sorted(after.items())])
        with pytest.raises(grpc.RpcError) as e:
            call_all(clients, "UpdateExpertMap", request, 120)
        assert e.value.code() in (grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE), e.value.details()

        survivors = [clients[0], clients[2]]
        for c in survivors:
            wait_until(lambda c=c: standing_by(c), STANDBY_S, "the survivors' ranks to stand by")
            assert c.describe().map_generation == 0  # the new map was never declared in force
        held = {layer.layer: list(layer.phy2log) for layer in clients[0].expert_load().layers}
        moved = sorted(layer for layer in held if held[layer] == after[layer])
        assert moved == sorted(after)[:2] and all(held[k] == before[k] for k in sorted(after)[2:]), held
        assert kept.waiting()

        pods = [WorldPod(0, dep.procs[0].grpc, (0,)), WorldPod(2, dep.procs[2].grpc, (2,))]
        maps, newest = maps_by_pod(pods, TOKEN)
        expert_map, _lost = carried_map(maps, {0: [0], 1: [1], 2: [2]}, {0: [0], 2: [1]}, num_experts=16)
        conf = world_request(generation=2, model="tiny-moe", tp=1, dpa=2, pp=1, pods=[[0], [], [1]],
                             rendezvous=dep.rendezvous, expert_map=expert_map, map_generation=newest + 1)
        call_all(survivors, "Configure", conf, 60)
        call_all(survivors, "Switch", pb.SwitchRequest(generation=2, recover=True), 120)
        assert {layer.layer: list(layer.phy2log) for layer in clients[2].expert_load().layers} == expert_map
        kept.assert_like_the_oracle()
        assert_serves_like_the_oracle([urls[0], urls[2]], "after the cut")
        for c in clients:
            c.close()
