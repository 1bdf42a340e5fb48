"""The node agent over real gRPC and HTTP: agents as processes (`shardwise agent`), their ranks, the token,
generations, bad input that changes nothing, serving, metrics, crash detection, and a world change driven
through the API alone."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest

pytest.importorskip("torch")
grpc = pytest.importorskip("grpc")

from shardwise.agents.client import AgentClient, call_all  # noqa: E402
from shardwise.agents.localrun import LocalDeployment  # noqa: E402
from shardwise.agents.proto import agent_pb2 as pb  # noqa: E402
from shardwise.agents.runtime.oracle import complete  # noqa: E402
from shardwise.controllers.health import HealthWatch  # noqa: E402

from tests.openai_shape import flat, greedy  # noqa: E402

TOKEN = "test-token-123"


@cache
def oracle(prompt: str, n: int) -> list[int]:
    return list(complete("tiny-moe", 0, prompt, n)["token_ids"])


def post(url: str, body: Any, timeout: float = 120) -> tuple[int, dict[str, Any] | str, dict[str, str]]:
    """POST a greedy request; a completion reads as its first choice, an error as its message (`flat`)."""
    if isinstance(body, dict) and url.endswith("completions"):
        body = greedy(body)
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            ctype = r.headers.get("Content-Type", "")
            return r.status, (flat(json.loads(text)) if "json" in ctype else text), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, flat(json.loads(e.read().decode())), dict(e.headers)


@pytest.fixture(scope="module")
def deployment() -> Iterator[LocalDeployment]:
    dep = LocalDeployment(model="tiny-moe", tp=1, dpa=2, pp=1, agents=2, redundant_experts=2, token=TOKEN,
                          log=lambda _m: None)
    try:
        dep.start()
        yield dep
    finally:
        dep.stop()


def client(dep: LocalDeployment, pod: int = 0, token: str = TOKEN) -> AgentClient:
    return AgentClient(dep.procs[pod].grpc, token)


@pytest.mark.slow
def test_completions_over_http_equal_the_oracle_streamed_or_not(deployment: LocalDeployment) -> None:
    urls = deployment.serving_urls()
    assert len(urls) == 2  # each agent leads one DPA group
    status, body, _ = post(urls[0] + "/v1/completions", {"prompt": "Hello, world", "max_tokens": 8})
    assert status == 200 and isinstance(body, dict)
    assert body["token_ids"] == oracle("Hello, world", 8) and body["finish_reason"] == "length" and body["id"]
    status, text, _ = post(urls[1] + "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "stream": True})
    assert status == 200 and isinstance(text, str)
    events = [json.loads(line[6:])["choices"][0] for line in text.splitlines() if line.startswith("data: {")]
    assert [t for e in events for t in e["token_ids"]] == oracle("Hello", 4)
    assert events[-1]["finish_reason"] == "length" and text.rstrip().endswith("data: [DONE]")


@pytest.mark.slow
@pytest.mark.parametrize("body,fragment", [
    ({"prompt": 5}, "prompt must be text, a list of token ids, or a list of either"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"prompt": [1, 999]}, "token ids must be within 0..259"),
    ({"prompt": "x", "temperature": 3}, "temperature must be a number within 0..2"),
    ({"prompt": "x", "logprobs": 2}, "logprobs=2 is not supported"),
    ({"prompt": "x", "max_tokens": 5000}, "exceeds the model's maximum length maxModelLen=4096"),
])
def test_malformed_completions_get_400_with_a_one_line_reason(deployment: LocalDeployment, body: dict[str, Any],
                                                              fragment: str) -> None:
    status, answer, _ = post(deployment.serving_urls()[0] + "/v1/completions", body)
    assert status == 400 and isinstance(answer, dict) and fragment in answer["error"]
    assert answer["type"] == "invalid_request_error"
    assert "\n" not in answer["error"]


@pytest.mark.slow
def test_every_call_without_the_right_token_is_unauthenticated(deployment: LocalDeployment) -> None:
    with client(deployment, token="wrong") as c, pytest.raises(grpc.RpcError) as e:
        c.describe()
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.slow
def test_describe_and_health_report_the_pods_ranks(deployment: LocalDeployment) -> None:
    with client(deployment, 1) as c:
        d, h = c.describe(), c.health()
    assert (d.pod_index, d.generation, d.world_size) == (1, 1, 2)
    assert [r.rank for r in d.ranks] == [1] and d.ranks[0].dpa_group == 1 and d.serving_url
    assert h.status == pb.AGENT_STATUS_SERVING and [r.state for r in h.ranks] == [pb.RANK_STATE_SERVING]
    assert h.warm  # its ranks were forked from the forkserver: the probe behind `warm` ran before them


@pytest.mark.slow
def test_livez_answers_while_the_agent_polls_and_reports_a_stalled_poller(deployment: LocalDeployment) -> None:
    from shardwise.agents.agent import STALL_S, Agent, AgentConfig

    for url in deployment.serving_urls():
        with urllib.request.urlopen(url + "/livez", timeout=10) as r:
            assert r.status == 200 and json.loads(r.read())["alive"] is True
    stalled = Agent(AgentConfig())
    assert stalled.alive()[0]  # before its poller's first run (a slow start is the startup probe's)
    stalled.polled_at = time.monotonic() - STALL_S - 5
    alive, why = stalled.alive()
    assert not alive and "poller has not run for" in why


@pytest.mark.slow
@pytest.mark.parametrize("method,request_,code,fragment", [
    ("Pause", pb.PauseRequest(generation=0), "FAILED_PRECONDITION", "older than the active generation 1"),
    ("Configure", pb.ConfigureRequest(generation=0), "FAILED_PRECONDITION", "not newer"),
    ("Configure", pb.ConfigureRequest(generation=5, world_size=3, sizes=pb.ParallelSizes(tp=1, dpa=2, pp=1)),
     "INVALID_ARGUMENT", "world_size 3 != tp*dpa*cp*pp"),
    ("UpdateExpertMap", pb.UpdateExpertMapRequest(generation=1, map_generation=9,
                                                  layers=[pb.LayerMap(layer=42, phy2log=[0])]),
     "INVALID_ARGUMENT", "layer 42 is not an MoE layer"),
    ("MigrateExperts", pb.MigrateExpertsRequest(generation=1, map_generation=9, moves=[
        pb.ExpertMove(layer=0, logical_expert=2, src_rank=1, dst_rank=0, dst_slot=0)]),  # rank 1: 9..15, 0, 1
     "INVALID_ARGUMENT", "rank 1 holds no copy of expert 2"),
    ("MigrateExperts", pb.MigrateExpertsRequest(generation=1, map_generation=9, moves=[
        pb.ExpertMove(layer=0, logical_expert=0, src_rank=1, dst_rank=0, dst_slot=2)]),  # over expert 2's only copy
     "INVALID_ARGUMENT", "the moves leave expert(s) [2] of layer 0 without a copy"),
    ("Drain", pb.DrainRequest(generation=1, dpa_groups=[7]), "INVALID_ARGUMENT",
     "dpa_groups [7] do not exist: generation 1 has 2 DPA groups (0..1)"),
    ("Abort", pb.AbortRequest(generation=1, dpa_groups=[2, 9]), "INVALID_ARGUMENT", "dpa_groups [2, 9] do not exist"),
])
def test_bad_calls_are_refused_with_their_status_and_change_nothing(
    deployment: LocalDeployment, method: str, request_: Any, code: str, fragment: str
) -> None:
    with client(deployment) as c:
        before = (c.describe(), [r.state for r in c.health().ranks])
        with pytest.raises(grpc.RpcError) as e:
            c.call(method, request_, 60)
        assert e.value.code().name == code and fragment in (e.value.details() or "")
        assert (c.describe(), [r.state for r in c.health().ranks]) == before


@pytest.mark.slow
def test_a_new_expert_map_applies_once_and_repeating_it_is_idempotent(deployment: LocalDeployment) -> None:
    maps = [pb.LayerMap(layer=i, phy2log=[*range(15, -1, -1), 4, 11]) for i in range(4)]
    clients = [client(deployment, 0), client(deployment, 1)]
    request = pb.UpdateExpertMapRequest(generation=1, map_generation=1, layers=maps)
    answers = call_all(clients, "UpdateExpertMap", request, 120)  # a collective: every pod at once
    assert {a.map_generation for a in answers} == {1}
    with client(deployment) as c:
        again = c.call("UpdateExpertMap", pb.UpdateExpertMapRequest(generation=1, map_generation=1, layers=maps))
        assert again.map_generation == 1 and c.describe().map_generation == 1
    status, body, _ = post(deployment.serving_urls()[1] + "/v1/completions", {"prompt": "remapped", "max_tokens": 6})
    assert status == 200 and isinstance(body, dict) and body["token_ids"] == oracle("remapped", 6)


@pytest.mark.slow
def test_metrics_expose_tokens_queue_and_generation(deployment: LocalDeployment) -> None:
    post(deployment.serving_urls()[0] + "/v1/completions", {"prompt": "metrics", "max_tokens": 3})
    with client(deployment) as c:
        c.stats()
    deadline = time.monotonic() + 30
    while True:  # the agent refreshes its snapshot once a second; a scrape reads the latest
        with urllib.request.urlopen(deployment.procs[0].metrics, timeout=30) as r:
            text = r.read().decode()
        if "shardwise_expert_balance_ratio{" in text or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for name in ("shardwise_queue_depth", "shardwise_running_requests", "shardwise_kv_cache_usage_ratio",
                 "shardwise_generated_tokens_total", "shardwise_world_generation", "shardwise_pause_seconds",
                 "shardwise_requests_total", "shardwise_expert_balance_ratio"):
        assert name in text
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    ttft = {s.name: s.value for s in families["shardwise_time_to_first_token_seconds"].samples
            if s.labels.get("dpa_group") == "0" and s.labels.get("le") in (None, "+Inf")}
    assert ttft["shardwise_time_to_first_token_seconds_count"] >= 1  # the request above, in seconds
    assert ttft["shardwise_time_to_first_token_seconds_sum"] > 0
    tpot = [s for s in families["shardwise_time_per_output_token_seconds"].samples
            if s.name.endswith("_count") and s.labels.get("dpa_group") == "0"]
    assert tpot and tpot[0].value >= 2  # 3 tokens: 2 gaps
    every = [s.labels for f in families.values() for s in f.samples]
    assert all("pod" not in labels for labels in every)  # Prometheus' target label; ours is pod_index
    assert all(labels.get("pod_index") == "0" for labels in every if "deployment" in labels)
    assert "shardwise_tokens_per_second" not in families  # a rate is PromQL's job: rate(generated_tokens_total)
    assert "shardwise_expert_load_tokens" not in families  # per expert only with --expert-metrics per-expert
    ratio = families["shardwise_expert_balance_ratio"].samples
    assert len(ratio) == 1 and ratio[0].value >= 1.0


def wait_health(c: AgentClient, predicate: Any, what: str, timeout: float = 60) -> pb.HealthResponse:
    deadline = time.monotonic() + timeout
    while not predicate(h := c.health()):  # poll the condition, with a deadline
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {h}"
        time.sleep(0.1)
    return h


@pytest.mark.slow
def test_a_draining_group_answers_503_with_retry_after_and_a_killed_rank_is_reported_and_restarted() -> None:
    with LocalDeployment(model="tiny-moe", tp=1, dpa=1, pp=1, agents=1, token=TOKEN, log=lambda _m: None) as dep:
        dep.start()
        url = dep.serving_urls()[0]
        with client(dep) as c:
            drained = c.call("Drain", pb.DrainRequest(generation=1, deadline_ms=10_000))
            assert not drained.timed_out and drained.remaining == 0
            status, body, headers = post(url + "/v1/completions", {"prompt": "refused", "max_tokens": 2})
            assert status == 503 and "not admitting" in body["error"] and headers.get("Retry-After") == "1"

            pid = c.health().ranks[0].pid
            pushed = threading.Event()
            watch = HealthWatch({0: dep.procs[0].grpc}, TOKEN, pushed.set)  # what the operator follows
            try:
                wait_health(c, lambda h: watch.statuses() == {0: "SERVING"}, "the watch to see the pod serving")
                pushed.clear()
                os.kill(pid, signal.SIGKILL)
                h = wait_health(c, lambda h: h.status == pb.AGENT_STATUS_DEGRADED, "the crash to be reported")
                assert pushed.wait(5) and watch.degraded() == [0], "the agent did not push the crash"
            finally:
                watch.close()
            assert h.ranks[0].exit_code == -signal.SIGKILL
            h = wait_health(c, lambda h: h.ranks[0].restarts == 1 and h.ranks[0].state == pb.RANK_STATE_READY,
                            "the restarted rank to stand by")
            assert h.ranks[0].pid != pid and h.ranks[0].exit_code == -signal.SIGKILL
            # a rank standing by is not stuck in the broken world: RestartStuck leaves it (and any other world)
            assert list(c.call("RestartStuck", pb.RestartStuckRequest(generation=1)).restarted) == []
            assert list(c.call("RestartStuck", pb.RestartStuckRequest(generation=7)).restarted) == []
            assert c.health().ranks[0].pid == h.ranks[0].pid


@pytest.mark.slow
def test_a_world_grows_from_two_to_four_groups_through_the_agent_api_alone() -> None:
    """Configure -> Prepare -> Pause -> Switch -> Resume on every pod, as the elastic controller will do:
    in-flight requests on the old pods finish with the oracle's tokens, the new pods serve too."""
    from shardwise.agents.agent_main import AgentOptions, configure_request

    with LocalDeployment(model="tiny-moe", tp=1, dpa=2, pp=1, agents=2, token=TOKEN, log=lambda _m: None) as dep:
        dep.start()
        old_urls = dep.serving_urls()
        for pod in (2, 3):
            dep.add_agent(pod)
        clients = [client(dep, pod) for pod in range(4)]
        old, new = clients[:2], clients[2:]
        results: dict[str, Any] = {}

        def ask(url: str, prompt: str, n: int) -> None:
            results[prompt] = post(url + "/v1/completions", {"prompt": prompt, "max_tokens": n})[1]

        import threading

        in_flight = [threading.Thread(target=ask, args=(u, f"in flight {i}", 48)) for i, u in enumerate(old_urls)]
        for t in in_flight:
            t.start()
        opts = AgentOptions(deployment="local", pod_index=0, host="127.0.0.1", grpc_port=0, http_port=0,
                            metrics_port=0, generation=2, ranks=(0,), rendezvous=dep.rendezvous, tp=1, dpa=4)
        conf = configure_request(opts)  # pods of one rank each: rank r on pod r
        assert {tuple(a.local_ranks) for a in call_all(clients, "Configure", conf, 60)} == {(0,), (1,), (2,), (3,)}
        call_all(old, "Prepare", pb.PrepareRequest(generation=2), 120)
        call_all(old, "Pause", pb.PauseRequest(generation=1, deadline_ms=60_000), 120)
        switched = call_all(old, "Switch", pb.SwitchRequest(generation=2), 300)
        assert {(s.generation, s.previous_generation) for s in switched} == {(2, 1)}
        resumed = call_all(clients, "Resume", pb.ResumeRequest(generation=2), 120)
        assert max(r.paused_seconds for r in resumed) > 0
        for t in in_flight:
            t.join(120)
        for i in range(2):
            assert results[f"in flight {i}"]["token_ids"] == oracle(f"in flight {i}", 48)
        with new[0] as c:
            d = c.describe()
        assert (d.generation, d.world_size, d.ranks[0].dpa_group) == (2, 4, 2)
        status, body, _ = post(d.serving_url + "/v1/completions", {"prompt": "on a new pod", "max_tokens": 6})
        assert status == 200 and body["token_ids"] == oracle("on a new pod", 6)
        with pytest.raises(grpc.RpcError) as e:
            old[0].call("Pause", pb.PauseRequest(generation=1), 30)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.slow
def test_a_new_pods_ranks_wait_for_a_switch_that_comes_after_the_rendezvous_timeout() -> None:
    """A new pod is configured for the world a running one switches into, and its ranks go to that world's
    rendezvous once loaded. The old world comes only when the operator switches it, which can be after the
    rendezvous timeout (an API outage, an operator restart): the new ranks wait for it, and the grown world serves.
    They used to give up at the timeout and restart as standbys, so the switch failed."""
    from shardwise.agents.agent_main import AgentOptions, configure_request
    from shardwise.agents.runtime.engine import RENDEZVOUS_TIMEOUT_ENV

    with LocalDeployment(model="tiny-moe", tp=1, dpa=1, pp=1, agents=1, token=TOKEN, log=lambda _m: None,
                         pod_env={1: {RENDEZVOUS_TIMEOUT_ENV: "2"}}) as dep:
        dep.start()
        dep.add_agent(1)
        clients = [client(dep, pod) for pod in range(2)]
        old, new = clients
        opts = AgentOptions(deployment="local", pod_index=0, host="127.0.0.1", grpc_port=0, http_port=0,
                            metrics_port=0, generation=2, ranks=(0,), rendezvous=dep.rendezvous, tp=1, dpa=2)
        conf = configure_request(opts)
        conf.joins_running_world = True  # as the operator's scale-up sends it
        call_all(clients, "Configure", conf, 60)
        wait_health(new, lambda h: [r.state for r in h.ranks] == [pb.RANK_STATE_READY], "the new rank to load",
                    timeout=120)
        deadline = time.monotonic() + 6  # three rendezvous timeouts before the switch comes
        while time.monotonic() < deadline:
            h = new.health()
            assert h.ranks[0].restarts == 0 and h.ranks[0].state == pb.RANK_STATE_READY, h
            time.sleep(0.1)
        call_all([old], "Pause", pb.PauseRequest(generation=1, deadline_ms=60_000), 120)
        call_all([old], "Switch", pb.SwitchRequest(generation=2), 300)
        call_all(clients, "Resume", pb.ResumeRequest(generation=2), 120)
        d = new.describe()
        status, body, _ = post(d.serving_url + "/v1/completions", {"prompt": "on the new pod", "max_tokens": 6})
        assert status == 200 and body["token_ids"] == oracle("on the new pod", 6)
        assert new.health().ranks[0].restarts == 0
        for c in clients:
            c.close()


def test_a_switch_asked_twice_while_its_world_forms_forms_it_once() -> None:
    """An operator restarted mid-switch asks again (Pause of the old generation, Switch to the new one) while the
    agents' first Switch still waits for its world to form. The world of the same pods at a new generation (what a
    roll or a recovery of every group switches to) forms once: both calls answer with it, and it serves like the
    oracle. Sent through again, the second Switch took every rank to a second rendezvous under the same
    generation's keys, where they met the first one's addresses."""
    from shardwise.agents.agent_main import AgentOptions, configure_request

    with LocalDeployment(model="tiny-moe", tp=1, dpa=2, pp=1, agents=2, token=TOKEN, log=lambda _m: None) as dep:
        dep.start()
        clients = [client(dep, pod) for pod in range(2)]
        opts = AgentOptions(deployment="local", pod_index=0, host="127.0.0.1", grpc_port=0, http_port=0,
                            metrics_port=0, generation=2, ranks=(0,), rendezvous=dep.rendezvous, tp=1, dpa=2)
        call_all(clients, "Configure", configure_request(opts), 60)
        call_all(clients, "Pause", pb.PauseRequest(generation=1, deadline_ms=60_000), 120)
        pids = {r.pid for c in clients for r in c.health().ranks}
        answers: list[Any] = []

        def switch(c: AgentClient) -> None:
            answers.append(c.call("Switch", pb.SwitchRequest(generation=2), 300))

        # pod 0 switches first: its world cannot form before pod 1's rank joins, so its second Switch (and Pause)
        # arrive while the first one waits; pod 1 is asked twice at once
        first = [threading.Thread(target=switch, args=(clients[0],))]
        first[0].start()
        assert clients[0].call("Pause", pb.PauseRequest(generation=1, deadline_ms=60_000), 120).generation == 1
        again = [threading.Thread(target=switch, args=(c,)) for c in (clients[0], clients[1], clients[1])]
        for t in again:
            t.start()
        for t in first + again:
            t.join(300)
        assert [(a.generation, a.previous_generation) for a in answers] == [(2, 1)] * 4, answers
        call_all(clients, "Resume", pb.ResumeRequest(generation=2), 120)
        d = clients[1].describe()
        assert (d.generation, d.world_size) == (2, 2)
        status, body, _ = post(d.serving_url + "/v1/completions", {"prompt": "switched once", "max_tokens": 6})
        assert status == 200 and body["token_ids"] == oracle("switched once", 6)
        assert {r.pid for c in clients for r in c.health().ranks} == pids  # the same processes, no second start
        for c in clients:
            c.close()


def test_an_agent_starting_its_ranks_reads_unconfigured_not_serving_until_its_world_is_active(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Health takes no lock: while Configure starts the ranks of a pod's first world, it must not see a pool
    without ranks (an empty set reads SERVING) nor generation 0 active; a start script that waits for SERVING and
    then drains generation 1 was refused "generation 1 is not active (active: 0)" on a busy machine."""
    from shardwise.agents import agent as agent_module
    from shardwise.agents.client import world_request

    started, release = threading.Event(), threading.Event()

    class SlowPool:  # the real pool spawns processes; this one holds its start until released
        def __init__(self, spec: Any, local: list[int], start_method: str = "spawn", **_: Any) -> None:
            self.ranks: dict[int, Any] = {}
            self.procs: dict[int, Any] = {}

        def start(self) -> None:
            started.set()
            assert release.wait(10)

        def poll_processes(self) -> list[tuple[int, int]]:
            return []

    monkeypatch.setattr(agent_module, "RankPool", SlowPool)
    agent = agent_module.Agent(agent_module.AgentConfig())
    request = world_request(generation=1, model="tiny-moe", tp=1, dpa=1, pp=1, pods=[[0]], rendezvous="127.0.0.1:1")
    configuring = threading.Thread(target=agent.configure, args=(request,))
    configuring.start()
    try:
        assert started.wait(10), "Configure did not start the pool"
        during = agent.health()
    finally:
        release.set()
        configuring.join(10)
    assert during.status == pb.AGENT_STATUS_UNCONFIGURED, pb.AgentStatus.Name(during.status)
    assert agent.health().generation == 1


def test_stats_taken_before_a_scale_down_name_only_the_groups_the_new_world_has() -> None:
    """The stats snapshot is refreshed about once a second; right after a scale-down it still lists the groups
    that left. `GET /v1/stats` (and gRPC Stats) used to fail then, on an index past the new world's groups."""
    import types

    from shardwise.agents import agent as agent_module
    from shardwise.agents.runtime.engine import WorldSpec

    agent = agent_module.Agent(agent_module.AgentConfig())
    spec = WorldSpec(generation=3, tp=1, dpa=1, pp=1, store_host="127.0.0.1", store_port=1, model="tiny-moe")
    agent.pool = types.SimpleNamespace(spec=spec, last_pause_seconds=0.0)  # type: ignore[assignment]
    agent.active = 3
    row = {"queueDepth": 0, "running": 1, "cachedTokens": 10, "kvCapacityTokens": 100, "generatedTokens": 7,
           "admitting": True}
    agent.snapshot = agent_module.Snapshot(stats=[{**row, "rank": 0, "group": 0}, {**row, "rank": 1, "group": 1}])
    stats = agent.stats()
    assert [g.dpa_group for g in stats.groups] == [0] and stats.running_requests == 1
