"""Layout search: only valid layouts, and a front where nothing is dominated."""

from __future__ import annotations

import pytest

from shardwise.layout_search import pareto, search
from shardwise.presets import UnknownPreset


def test_the_front_is_non_dominated_and_spans_throughput_to_speed() -> None:
    r = search("Qwen3-30B-A3B", "H100", 16)
    assert r.layouts_valid > 0 and r.front
    for p in r.front:
        for q in r.points:
            better = (q.tokens_per_second_per_gpu >= p.tokens_per_second_per_gpu
                      and q.tokens_per_second_per_user >= p.tokens_per_second_per_user)
            strictly = (q.tokens_per_second_per_gpu > p.tokens_per_second_per_gpu
                        or q.tokens_per_second_per_user > p.tokens_per_second_per_user)
            assert not (better and strictly), f"{q.layout()} b={q.batch} dominates {p.layout()} b={p.batch}"
    speeds = [p.tokens_per_second_per_user for p in r.front]
    rates = [p.tokens_per_second_per_gpu for p in r.front]
    assert speeds == sorted(speeds) and rates == sorted(rates, reverse=True)


def test_every_layout_on_the_front_uses_all_gpus_and_fits() -> None:
    r = search("Llama-3.1-405B", "H200", 16)
    for p in r.front:
        assert p.tp * p.pp * p.cp * p.dpa == 16
        assert p.tp <= 8 and p.batch <= p.kv_capacity_requests


def test_a_model_too_big_for_the_gpus_has_no_valid_layout() -> None:
    r = search("DeepSeek-V3", "H100", 2)
    assert r.layouts_valid == 0 and not r.front


def test_unknown_presets_are_named() -> None:
    with pytest.raises(UnknownPreset, match="unknown model preset 'GPT-9'"):
        search("GPT-9", "H200", 8)


def test_pareto_keeps_only_undominated_points() -> None:
    from shardwise.layout_search import Point

    def pt(gpu: float, user: float) -> Point:
        return Point(1, 1, 1, 1, 1, 1, 1.0, gpu, user, 1)

    front = pareto([pt(10, 1), pt(5, 5), pt(4, 4), pt(1, 10), pt(10, 0.5)])
    assert [(p.tokens_per_second_per_gpu, p.tokens_per_second_per_user) for p in front] == [(10, 1), (5, 5), (1, 10)]
