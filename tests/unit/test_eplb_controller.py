"""The EPLB controller's decision, pure: when to rebalance and what it reports."""

from __future__ import annotations

import numpy as np
from shardwise.controllers.eplb import Observation, carried_map, decide

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


def test_a_smaller_world_keeps_the_survivors_experts_and_counts_those_only_the_lost_pod_held() -> None:
    rr = [s % 16 for s in range(24)]  # tiny-moe's round robin: 24 slots over 4 ranks, 6 each
    maps = {0: {1: rr, 2: rr}}  # pod 0 (ranks 0, 1) survives; pod 1 (ranks 2, 3) is lost
    new_map, lost = carried_map(maps, old={0: [0, 1], 1: [2, 3]}, new={0: [0, 1]}, num_experts=16)
    assert lost == 2 * 4  # experts 12..15 were only on rank 2, in each of the 2 MoE layers
    for slots in new_map.values():
        assert slots[:6] == rr[:6] and slots[12:18] == rr[6:12]  # rank 0 and rank 1 keep what they hold
        assert sorted(set(slots)) == list(range(16)) and len(slots) == 24


def test_a_renumbered_pod_keeps_its_experts_and_a_new_pod_fills_free_slots() -> None:
    rr = [s % 16 for s in range(24)]
    # pod 0 (ranks 0, 1) is lost: pod 2 (ranks 2, 3) becomes ranks 0, 1, and a new pod 3 takes ranks 2, 3
    new_map, lost = carried_map({2: {0: rr}}, old={0: [0, 1], 2: [2, 3]}, new={2: [0, 1], 3: [2, 3]},
                                num_experts=16)
    slots = new_map[0]
    assert lost == 16 - len(set(rr[12:24]))
    assert set(slots[:6]) == set(rr[12:18]) and set(slots[6:12]) == set(rr[18:24])
    assert sorted(set(slots)) == list(range(16))


def test_with_moe_tp_a_pods_two_ranks_are_one_ep_rank_and_keep_its_experts() -> None:
    rr = [s % 8 for s in range(12)]  # 12 slots over ep 2 (ranks 0, 1 = EP rank 0; ranks 2, 3 = EP rank 1)
    # the world grows from 4 ranks (ep 2) to 8 (ep 4): pods 0 and 1 keep their ranks, pods 2 and 3 are new
    new_map, lost = carried_map({0: {0: rr}, 1: {0: rr}}, old={0: [0, 1], 1: [2, 3]},
                                new={0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]}, num_experts=8, moe_tp=2)
    slots = new_map[0]
    assert len(slots) == 12 and sorted(set(slots)) == list(range(8))
    assert set(slots[:3]) <= set(rr[:6]) and set(slots[3:6]) <= set(rr[6:12])  # EP ranks 0, 1 keep what they held
    assert lost == 8 - len(set(slots[:6]))  # what no staying EP rank kept loads from the weight files
