"""Runtime control between steps: live expert migration, new world generations in the same processes,
drain (with its deadline) and abort — each checked against the single-process oracle."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from functools import cache
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from shardwise.agents.runtime.engine import RENDEZVOUS_TIMEOUT_ENV, WorldSpec
from shardwise.agents.runtime.oracle import complete
from shardwise.agents.runtime.pool import LocalWorld, WorldError


@cache
def oracle(prompt: str, max_tokens: int) -> list[int]:
    return list(complete("tiny-moe", 0, prompt, max_tokens)["token_ids"])


def check(world: LocalWorld, rid: str, prompt: str, max_tokens: int) -> None:
    got = world.result(rid)
    assert got["token_ids"] == oracle(prompt, max_tokens), prompt
    assert got["finish_reason"] == "length"


@pytest.fixture(scope="module")
def world() -> Iterator[LocalWorld]:
    with LocalWorld({"generation": 1, "model": "tiny-moe", "tp": 1, "dpa": 2, "pp": 1,
                     "redundant_experts": 2}) as w:
        w.wait_ready()
        yield w


@pytest.mark.slow
def test_migrating_experts_during_serving_keeps_outputs_and_reports_what_moved(world: LocalWorld) -> None:
    prompts = [f"in flight {i}" for i in range(4)]
    rids = [world.submit(p, 24) for p in prompts]
    rng = np.random.default_rng(7)
    target = {layer: rng.permutation([*range(16), 3, 5]).tolist() for layer in range(4)}
    moved, nbytes, seconds = world.migrate(world.stats()[0]["mapGeneration"] + 1, target)
    expert_bytes = 3 * 64 * 32 * 8  # w1, w3, w2 of one tiny expert in float64
    assert moved > 0 and nbytes == moved * expert_bytes and seconds > 0
    for p, rid in zip(prompts, rids, strict=True):
        check(world, rid, p, 24)
    stats = world.stats()
    assert len({s["mapGeneration"] for s in stats}) == 1
    assert stats[0]["phy2log"][0] == target[0]
    check(world, world.submit("after the move", 12), "after the move", 12)


@pytest.mark.slow
def test_a_map_generation_that_is_not_newer_is_refused_and_changes_nothing(world: LocalWorld) -> None:
    current = world.stats()[0]["mapGeneration"]
    world.migrate(current + 1, {layer: [*range(16), 7, 9] for layer in range(4)})
    before = world.stats()[0]["phy2log"]
    with pytest.raises(WorldError, match=f"map generation {current + 1} is not newer than {current + 1}"):
        world.migrate(current + 1, {layer: [*range(16), 0, 1] for layer in range(4)})
    assert world.stats()[0]["phy2log"] == before


@pytest.mark.slow
def test_a_drain_past_its_deadline_gives_up_and_admission_resumes(world: LocalWorld) -> None:
    long_rid = world.submit("long", 400, group=1)
    assert world.drain([1], timeout=0.2) is False
    check(world, world.submit("still admitted", 6, group=1), "still admitted", 6)
    world.abort(long_rid, group=1)
    assert world.result(long_rid)["finish_reason"] == "aborted"


@pytest.mark.slow
def test_abort_all_ends_every_in_flight_request_of_a_group_with_aborted(world: LocalWorld) -> None:
    world.pause()
    rids = [world.submit(f"doomed {i}", 300, group=0) for i in range(3)]
    keep = world.submit("kept", 8, group=1)
    world.commands[world.spec.leader(0)].put(("abort_all",))
    world.resume()
    assert {world.result(r)["finish_reason"] for r in rids} == {"aborted"}
    check(world, keep, "kept", 8)


@pytest.mark.slow
def test_two_to_four_to_two_groups_keeps_in_flight_requests_and_outputs() -> None:
    with LocalWorld({"generation": 1, "model": "tiny-moe", "tp": 1, "dpa": 2, "pp": 1}) as w:
        w.wait_ready()
        first = {w.submit(f"grow {i}", 40, group=i): f"grow {i}" for i in range(2)}
        w.change_world(4)  # two new rank processes join; the old two keep their KV caches
        assert w.spec.generation == 2 and w.spec.world_size == 4
        joined = {w.submit(f"new group {g}", 10, group=g): f"new group {g}" for g in (2, 3)}
        for rid, p in {**first, **joined}.items():
            check(w, rid, p, 40 if p.startswith("grow") else 10)
        assert [s["group"] for s in w.stats()] == [0, 1, 2, 3]
        assert all(s["generatedTokens"] > 0 for s in w.stats())

        staying = {w.submit(f"shrink {i}", 30, group=i): f"shrink {i}" for i in range(2)}
        leaving = {w.submit(f"leaving {g}", 12, group=g): f"leaving {g}" for g in (2, 3)}
        assert w.drain([2, 3], timeout=120) is True  # drain: every leaving request finishes first
        for rid, p in leaving.items():
            check(w, rid, p, 12)
        w.change_world(2)
        assert w.spec.generation == 3 and len(w.left) == 2
        for rid, p in staying.items():
            check(w, rid, p, 30)
        check(w, w.submit("after shrink", 8), "after shrink", 8)


def switch_to(w: LocalWorld, new: WorldSpec) -> None:
    """Phase 2 of a world change whose new ranks were prepared already: pause, switch, wait, resume."""
    w.pause(120)
    w.switch(new, list(range(new.world_size)))
    w.wait_ready(120)
    w.resume(120)


@pytest.mark.slow
def test_a_new_rank_waits_at_the_rendezvous_for_as_long_as_the_old_world_takes_to_switch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator can take longer than the rendezvous timeout between preparing a scale-up and switching the
    old world (an API server outage, an operator restarted meanwhile). A prepared rank used to give up after the
    timeout, leaving under the new generation's keys an address no listener had, where the old ranks then failed:
    the switch failed and the world was re-formed from scratch, with requests lost."""
    with LocalWorld({"generation": 1, "model": "tiny-moe", "tp": 1, "dpa": 1, "pp": 1}) as w:
        w.wait_ready()
        monkeypatch.setenv(RENDEZVOUS_TIMEOUT_ENV, "2")  # in the ranks started from now on
        new = dataclasses.replace(w.spec, generation=2, dpa=2)
        assert w.prepare(new, [0, 1]) == [1]
        w.wait_for(lambda: 1 in w.loaded, 120, "the new rank to load its weights")
        _, proc, _ = w.prepared[1]
        proc.join(6)  # three timeouts, as the operator might take: a rank that gives up ends within them
        assert proc.is_alive() and not w.crashes
        switch_to(w, new)
        assert w.spec.generation == 2 and [s["group"] for s in w.stats()] == [0, 1]
        for g in (0, 1):
            check(w, w.submit(f"group {g} after the late switch", 10, group=g), f"group {g} after the late switch",
                  10)


@pytest.mark.slow
def test_a_scale_up_prepared_again_after_a_rollback_forms_with_ranks_started_for_it() -> None:
    """A rolled-back scale-up leaves its prepared rank waiting at its generation's rendezvous, where no world will
    come; the retry takes a new generation. Kept, that rank would be switched into the retry's world while it waits
    at the other rendezvous."""
    with LocalWorld({"generation": 1, "model": "tiny-moe", "tp": 1, "dpa": 1, "pp": 1}) as w:
        w.wait_ready()
        first = dataclasses.replace(w.spec, generation=2, dpa=2)
        w.prepare(first, [0, 1])
        _, abandoned, _ = w.prepared[1]
        retry = dataclasses.replace(w.spec, generation=3, dpa=2)
        assert w.prepare(retry, [0, 1]) == [1]
        assert not abandoned.is_alive() and w.prepared[1][2] == 3
        w.wait_for(lambda: 1 in w.loaded, 120, "the new rank to load its weights")
        switch_to(w, retry)
        assert w.spec.generation == 3
        check(w, w.submit("on the retried group", 10, group=1), "on the retried group", 10)


def test_a_rank_that_loads_before_its_pool_has_recorded_it_reads_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm rank start takes 0.1 s: its "loaded" event can reach the pool before the pool has recorded the rank.
    It read STARTING for good, so a scale-up waiting for its new ranks to load waited until its deadline (seen in
    the elastic bench, with both ranks at the rendezvous)."""
    import queue
    import threading

    from shardwise.agents.runtime import pool as pool_module

    spec = WorldSpec(generation=1, tp=1, dpa=1, pp=1, store_host="127.0.0.1", store_port=1, model="tiny-moe")
    pool = pool_module.RankPool(spec, [0])
    pumps: list[threading.Thread] = []

    class Started:  # the process, already loaded: its pump applies "loaded" as soon as it can take the lock
        pid = 4242

    def start(rank: int, spec: WorldSpec, standby: bool = False, patient: bool = False) -> tuple[Any, Any]:
        def pump() -> None:
            with pool.lock:
                pool._apply(("loaded", rank, spec.generation))
        pumps.append(threading.Thread(target=pump))
        pumps[-1].start()
        pumps[-1].join(0.5)  # the pump goes first wherever the pool lets it
        return queue.Queue(), Started()

    monkeypatch.setattr(pool, "_start", start)
    pool.start()
    pumps[0].join(10)
    assert pool.ranks[0].state == "ready"
