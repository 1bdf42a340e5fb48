"""Fuzzing the node agent's gRPC API on a live world (two agents, tiny-moe, experts spread over both): whatever a
client sends to the expert-map, drain, abort and pause calls, every pod answers with a result or a status that
names the problem (never UNKNOWN, INTERNAL or a hang), no rank crashes, and afterwards both groups still answer
with the oracle's tokens, whatever valid placements the fuzzer made them apply."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest

pytest.importorskip("torch")

import grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from shardwise.agents.client import AgentClient, call_all
from shardwise.agents.localrun import LocalDeployment
from shardwise.agents.proto import agent_pb2 as pb
from shardwise.agents.runtime.oracle import complete

from tests.runtime.test_agent import post

TOKEN = "fuzz-token"
EXPERTS, SLOTS, RANKS, LAYERS = 16, 18, 2, 4  # tiny-moe with 2 redundant experts over 2 EP ranks
# what a refused call may answer: each names the problem in its details
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.OUT_OF_RANGE}
CALL_S = 60
NEXT = 2**64 - 7  # a map generation the test replaces with the pods' own plus one


@cache
def oracle(prompt: str, n: int) -> list[int]:
    return list(complete("tiny-moe", 0, prompt, n)["token_ids"])


@pytest.fixture(scope="module")
def world() -> Iterator[tuple[LocalDeployment, list[AgentClient]]]:
    dep = LocalDeployment(model="tiny-moe", tp=1, dpa=2, pp=1, agents=2, redundant_experts=2, token=TOKEN,
                          log=lambda _m: None)
    try:
        dep.start()
        clients = [AgentClient(ap.grpc, TOKEN) for ap in dep.procs]
        yield dep, clients
        for c in clients:
            c.close()
    finally:
        dep.stop()


# ---------------------------------------------------------------------------------------------- requests

small = st.integers(min_value=0, max_value=2**32 - 1) | st.integers(min_value=0, max_value=20)
generations = st.sampled_from([0, 2, 3, 1000, 2**63 - 1]) | st.integers(min_value=0, max_value=2**64 - 1)


@st.composite
def placements(draw: st.DrawFn) -> list[int]:
    """A physical map of one layer: a valid one (every expert, two extra copies) or one a mutation broke."""
    phy = draw(st.permutations(list(range(EXPERTS))))
    phy = [*phy, *draw(st.lists(st.integers(0, EXPERTS - 1), min_size=2, max_size=2))]
    broken = draw(st.sampled_from(["valid"] * 6 + ["short", "long", "out of range", "negative", "missing"]))
    if broken == "short":
        phy = phy[:draw(st.integers(0, SLOTS - 1))]
    elif broken == "long":
        phy = [*phy, 0]
    elif broken == "out of range":
        phy[draw(st.integers(0, SLOTS - 1))] = draw(st.integers(EXPERTS, 2**31 - 1))
    elif broken == "negative":
        phy[draw(st.integers(0, SLOTS - 1))] = draw(st.integers(-(2**31), -1))
    elif broken == "missing":
        phy = [e if e != phy[0] else (phy[0] + 1) % EXPERTS for e in phy]
    return phy


layers = st.sampled_from(range(LAYERS)) | st.sampled_from(range(LAYERS)) | st.sampled_from(range(LAYERS)) | small
moves = st.builds(pb.ExpertMove, layer=layers, logical_expert=st.integers(0, EXPERTS + 1) | small,
                  src_rank=st.integers(0, RANKS) | small, dst_rank=st.integers(0, RANKS) | small,
                  dst_slot=st.integers(0, SLOTS // RANKS) | small)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, Any]:
    """(method, request) with the world's own generation (1) half the time, so the checks behind it are reached."""
    gen = 1 if draw(st.integers(0, 3)) else draw(generations)
    kind = draw(st.sampled_from(["UpdateExpertMap", "MigrateExperts", "Drain", "Abort", "Pause"]))
    # the next map generation (set by the test: the one after the pods' own) most of the time, so that valid
    # placements are applied; else an old, a repeated or any one
    map_gen = NEXT if draw(st.integers(0, 3)) else draw(st.integers(0, 3) | st.integers(0, 2**64 - 1))
    if kind == "UpdateExpertMap":
        maps = draw(st.lists(st.builds(pb.LayerMap, layer=layers, phy2log=placements()), min_size=1,
                             max_size=LAYERS))
        return kind, pb.UpdateExpertMapRequest(generation=gen, map_generation=map_gen, layers=maps)
    if kind == "MigrateExperts":
        return kind, pb.MigrateExpertsRequest(generation=gen, map_generation=map_gen,
                                              moves=draw(st.lists(moves, max_size=6)), deadline_ms=30_000)
    groups = draw(st.lists(st.integers(2, 8) | st.integers(2, 2**32 - 1), min_size=1, max_size=3))  # it has 0, 1
    if kind == "Drain":  # a drain of a real group stops it for good: only groups the world lacks, or old worlds
        return kind, pb.DrainRequest(generation=gen, deadline_ms=1000, dpa_groups=groups if gen == 1 else [])
    if kind == "Abort":
        ids = draw(st.lists(st.text(max_size=20), max_size=3))
        return kind, pb.AbortRequest(generation=gen, dpa_groups=groups if not ids else [], request_ids=ids)
    return kind, pb.PauseRequest(generation=gen if gen != 1 else 0, deadline_ms=1000)  # a pause of an old world


# ----------------------------------------------------------------------------------------------- the test

def answer(clients: list[AgentClient], method: str, request: Any) -> list[str]:
    """Each pod's answer: "OK" or its status code; a collective call goes to every pod at once."""
    out = []
    try:
        call_all(clients, method, request, CALL_S)
        out = ["OK"] * len(clients)
    except grpc.RpcError:
        for c in clients:  # which pods refused, and how (an idempotent repeat of what was refused)
            try:
                c.call(method, request, CALL_S)
                out.append("OK")
            except grpc.RpcError as e:
                assert e.code() in REFUSALS, f"{method} {request}: {e.code().name} {e.details()}"
                assert e.details(), f"{method}: {e.code().name} without a reason"
                out.append(e.code().name)
    return out


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(call=requests())
def test_any_control_call_is_answered_or_refused_with_a_reason_and_no_rank_breaks(
        world: tuple[LocalDeployment, list[AgentClient]], call: tuple[str, Any]) -> None:
    _, clients = world
    method, request = call
    if getattr(request, "map_generation", None) == NEXT:
        request.map_generation = clients[0].describe().map_generation + 1
    answers = answer(clients, method, request)
    assert len(set(answers)) == 1, f"{method}: the pods disagree: {answers}"  # same world, same checks
    event(f"{method}: {answers[0]}")  # what the fuzzer reached (pytest --hypothesis-show-statistics)
    for c in clients:
        assert c.health().status == pb.AGENT_STATUS_SERVING, f"after {method}: {c.health()}"


@pytest.mark.slow
def test_after_the_fuzzing_both_groups_answer_like_the_oracle(world: tuple[LocalDeployment, list[AgentClient]]
                                                             ) -> None:
    dep, clients = world
    assert len({c.describe().map_generation for c in clients}) == 1
    for url in dep.serving_urls():
        status, body, _ = post(url + "/v1/completions", {"prompt": "after fuzzing", "max_tokens": 8})
        assert status == 200 and isinstance(body, dict) and body["token_ids"] == oracle("after fuzzing", 8)
