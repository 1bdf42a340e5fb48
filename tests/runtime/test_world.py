"""Distributed worlds of real rank processes on gloo: every layout answers with the oracle's tokens, under
continuous batching, and obeys pause, resume and abort at step boundaries."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest

pytest.importorskip("torch")

from shardwise.agents.runtime.oracle import complete
from shardwise.agents.runtime.pool import LocalWorld, WorldError

PROMPTS = ["Hello, world", "shardwise", "a", "The quick brown fox jumps over the lazy dog"]


@cache
def oracle(model: str, prompt: str, max_tokens: int) -> tuple[int, ...]:
    return tuple(complete(model, 0, prompt, max_tokens)["token_ids"])


LAYOUTS = [
    ("tp1", {"tp": 1, "dpa": 1, "pp": 1}),
    ("tp2", {"tp": 2, "dpa": 1, "pp": 1}),
    ("dpa2 ep2", {"tp": 1, "dpa": 2, "pp": 1}),
    ("tp2 dpa2 ep4", {"tp": 2, "dpa": 2, "pp": 1}),
    ("dpa2 ep2 with 2 redundant experts", {"tp": 1, "dpa": 2, "pp": 1, "redundant_experts": 2}),
    ("dpa4 ep4 with 4 redundant experts", {"tp": 1, "dpa": 4, "pp": 1, "redundant_experts": 4}),
    ("pp2", {"tp": 1, "dpa": 1, "pp": 2}),
    ("tp4 beyond the 2 kv heads", {"tp": 4, "dpa": 1, "pp": 1}),
]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [args for _, args in LAYOUTS], ids=[name for name, _ in LAYOUTS])
def test_every_layout_returns_the_oracle_tokens_for_concurrent_requests(layout: dict[str, Any]) -> None:
    with LocalWorld({"generation": 1, "model": "tiny-moe", "seed": 0, **layout}) as world:
        world.wait_ready()
        rids = [world.submit(p, 10) for p in PROMPTS]  # all in flight together: continuous batching
        for prompt, rid in zip(PROMPTS, rids, strict=True):
            got = world.result(rid)
            assert tuple(got["token_ids"]) == oracle("tiny-moe", prompt, 10), (layout, prompt)
            assert got["finish_reason"] == "length"


@pytest.mark.slow
def test_the_dense_model_with_tp2_and_dpa2_returns_the_oracle_tokens() -> None:
    with LocalWorld({"generation": 1, "model": "tiny-dense", "tp": 2, "dpa": 2, "pp": 1}) as world:
        world.wait_ready()
        for prompt in PROMPTS[:2]:
            assert tuple(world.complete(prompt, 8)["token_ids"]) == oracle("tiny-dense", prompt, 8)


@pytest.fixture(scope="module")
def world() -> Iterator[LocalWorld]:
    with LocalWorld({"generation": 1, "model": "tiny-moe", "tp": 2, "dpa": 2, "pp": 1}) as w:
        w.wait_ready()
        yield w


@pytest.mark.slow
def test_a_request_submitted_while_paused_completes_correctly_after_resume(world: LocalWorld) -> None:
    world.pause()
    assert world.paused_ranks == set(range(4))
    rid = world.submit("paused prompt", 6)
    assert all(s["paused"] for s in world.stats())
    world.resume()
    assert tuple(world.result(rid)["token_ids"]) == oracle("tiny-moe", "paused prompt", 6)


@pytest.mark.slow
def test_an_aborted_request_ends_with_aborted_and_its_neighbours_are_untouched(world: LocalWorld) -> None:
    world.pause()  # hold both requests at a step boundary so the abort lands mid-generation
    long_rid = world.submit("a long one", 200, group=0)
    other = world.submit("Hello, world", 10, group=0)
    world.abort(long_rid, group=0)
    world.resume()
    got = world.result(long_rid)
    assert got["finish_reason"] == "aborted" and len(got["token_ids"]) < 200
    assert tuple(world.result(other)["token_ids"]) == oracle("tiny-moe", "Hello, world", 10)


@pytest.mark.slow
def test_a_prompt_longer_than_the_step_budget_is_refused_with_the_numbers(world: LocalWorld) -> None:
    with pytest.raises(WorldError, match="prompt of 601 tokens exceeds maxBatchTokens=512"):
        world.complete([65] * 601, 4)


@pytest.mark.slow
def test_stats_count_generated_tokens_and_expert_load_per_layer(world: LocalWorld) -> None:
    before = sum(s["generatedTokens"] for s in world.stats())
    world.complete("count me", 5, group=1)
    stats = world.stats()
    assert sum(s["generatedTokens"] for s in stats) == before + 5
    load = [s["expertLoad"] for s in stats]
    assert all(set(layer_load) == {0, 1, 2, 3} for layer_load in load)
    assert all(len(v) == 16 for layer_load in load for v in layer_load.values())
    assert {(s["device"], s["backend"]) for s in stats} == {("cpu", "gloo")}  # no CUDA on the test machines


@pytest.mark.slow
def test_a_rank_killed_before_it_reports_fails_the_wait_for_the_world_at_once() -> None:
    """A rank process that dies while it loads (the OOM killer, say) ends `wait_ready` with a crash naming it, not
    with the 180 s deadline."""
    with LocalWorld({"generation": 1, "model": "tiny-moe", "tp": 1, "dpa": 2, "pp": 1}) as world:
        pid = world.ranks[1].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # still importing torch: it has reported nothing
        with pytest.raises(WorldError, match=r"rank 1 crashed: its process ended \(exit code -9\) before it reported"):
            world.wait_ready()
