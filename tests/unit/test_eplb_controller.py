"""The EPLB controller's decision, pure: when to rebalance and what it reports."""

from __future__ import annotations

import numpy as np
from shardwise.controllers.eplb import Observation, decide

from shardwise.api import EplbSpec
from shardwise.eplb import balance


def observation(load: list[list[float]], phy2log: list[list[int]], map_generation: int = 3) -> Observation:
    return Observation(generation=2, map_generation=map_generation, layers=list(range(len(load))),
                       load=np.asarray(load, dtype=float), phy2log=np.asarray(phy2log))


# 8 experts on 4 GPUs, 2 slots each; experts 0 and 1 (on GPU 0) take most of the tokens
SKEWED = observation([[40, 40, 1, 1, 1, 1, 1, 1]] * 2, [[0, 1, 2, 3, 4, 5, 6, 7]] * 2)


def test_a_skewed_load_is_rebalanced_to_a_better_placement() -> None:
    out = decide(SKEWED, EplbSpec(enabled=True, balance_threshold=1.2), ep=4, nodes=2, seconds_since_last=5)
    assert out.action == "planned"
    assert out.map_generation == 4
    assert out.balance_after < out.balance_before
    assert abs(out.balance_before - balance(SKEWED.load, SKEWED.phy2log, 4)) < 1e-9
    new = np.asarray(out.phy2log)
    assert abs(out.balance_after - balance(SKEWED.load, new, 4)) < 1e-9
    assert out.slots_moved == int((new != SKEWED.phy2log).sum()) > 0
    for row in new:  # every expert still placed, no GPU with two copies of one expert
        assert sorted(row.tolist()) == list(range(8))
        assert all(len(set(row[g * 2:(g + 1) * 2])) == 2 for g in range(4))


def test_max_moves_caps_the_slots_changed() -> None:
    out = decide(SKEWED, EplbSpec(enabled=True, max_moves_per_rebalance=2), ep=4, nodes=1, seconds_since_last=5)
    assert out.action == "planned" and out.slots_moved <= 2


def test_within_the_threshold_nothing_moves_until_the_interval() -> None:
    even = observation([[5] * 8] * 2, [[0, 1, 2, 3, 4, 5, 6, 7]] * 2)
    spec = EplbSpec(enabled=True, balance_threshold=1.2, interval_seconds=300)
    out = decide(even, spec, ep=4, nodes=1, seconds_since_last=10)
    assert out.action == "skipped" and "within the threshold" in out.reason
    due = decide(even, spec, ep=4, nodes=1, seconds_since_last=301)
    assert due.action == "skipped" and "no better placement" in due.reason  # due, but already balanced


def test_no_tokens_no_layers_no_decision() -> None:
    idle = observation([[0] * 8], [[0, 1, 2, 3, 4, 5, 6, 7]])
    assert decide(idle, EplbSpec(enabled=True), ep=4, nodes=1, seconds_since_last=None).action == "skipped"
    dense = Observation(1, 0, [], np.zeros((0, 0)), np.zeros((0, 0), dtype=np.int64))
    assert "no MoE layer" in decide(dense, EplbSpec(enabled=True), ep=4, nodes=1, seconds_since_last=None).reason
