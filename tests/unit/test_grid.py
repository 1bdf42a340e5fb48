"""The rank grid: the docs/domain.md examples (section 7), and groups that partition the world for every layout."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.grid import RankGrid


def test_tp4_cp2_on_8_gpus_gives_the_documented_tp_and_cp_groups() -> None:
    g = RankGrid(pp=1, dpa=1, cp=2, tp=4, ep=8)
    assert g.tp_groups().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g.cp_groups().tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_tp4_dpa2_on_8_gpus_gives_two_attention_groups_and_one_ep_group() -> None:
    g = RankGrid(pp=1, dpa=2, cp=1, tp=4, ep=8)
    assert g.dpa_groups().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g.ep_groups().tolist() == [list(range(8))]


def test_pipeline_groups_run_through_the_stages_at_the_same_position() -> None:
    g = RankGrid(pp=2, dpa=1, cp=1, tp=4, ep=4)
    assert g.pp_groups().tolist() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.ep_groups().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_moe_tp_splits_consecutive_ranks_and_ep_groups_take_one_of_each() -> None:
    g = RankGrid(pp=1, dpa=4, cp=1, tp=1, ep=2, moe_tp=2)
    assert g.moe_tp_groups().tolist() == [[0, 1], [2, 3]]
    assert g.ep_groups().tolist() == [[0, 2], [1, 3]]


def test_ep_times_moe_tp_must_divide_a_stage() -> None:
    import pytest

    with pytest.raises(ValueError, match=r"ep \* moeTp = 3 \* 1 = 3 does not divide the 4 ranks"):
        RankGrid(pp=1, dpa=2, cp=1, tp=2, ep=3)


def _divisor_of(n: int) -> st.SearchStrategy[int]:
    return st.sampled_from([d for d in range(1, n + 1) if n % d == 0])


@st.composite
def grids(draw: st.DrawFn) -> RankGrid:
    pp, dpa, cp, tp = (draw(st.sampled_from([1, 2, 3, 4])) for _ in range(4))
    stage = dpa * cp * tp
    moe_tp = draw(_divisor_of(stage))
    ep = draw(_divisor_of(stage // moe_tp))
    return RankGrid(pp=pp, dpa=dpa, cp=cp, tp=tp, ep=ep, moe_tp=moe_tp)


@settings(max_examples=150, deadline=None)
@given(grids())
def test_every_kind_of_group_partitions_the_world(g: RankGrid) -> None:
    world = set(range(g.world_size))
    for groups in (g.tp_groups(), g.cp_groups(), g.dpa_groups(), g.pp_groups(), g.ep_groups(),
                   g.moe_tp_groups(), g.stage_groups()):
        flat = groups.ravel().tolist()
        assert sorted(flat) == sorted(world), "each rank in exactly one group of each kind"


@settings(max_examples=150, deadline=None)
@given(grids())
def test_tp_groups_are_consecutive_ranks_and_coordinates_agree_with_groups(g: RankGrid) -> None:
    c = g.coordinates()
    for group in g.tp_groups().tolist():
        assert group == list(range(group[0], group[0] + g.tp))
        assert [int(c["tp"][r]) for r in group] == list(range(g.tp))
    for group in g.ep_groups().tolist():
        assert sorted(int(c["ep"][r]) for r in group) == list(range(g.ep))
        assert len({int(c["pp"][r]) for r in group}) == 1, "an EP group stays inside one stage"
    for d, group in enumerate(g.dpa_groups().tolist()):
        assert {int(c["dpa"][r]) for r in group} == {d}
