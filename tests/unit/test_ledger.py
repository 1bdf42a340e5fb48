"""The memory ledger: terms add up, sharding only ever shrinks a rank's weights, replication is counted."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwise.planner import plan
from tests.conftest import make_spec

GiB = 1024**3


def _ledger(**sections: object) -> dict[str, int]:
    p = plan(make_spec(**sections))  # type: ignore[arg-type]
    assert p.stage_ledger, [str(e) for e in p.errors]
    return p.to_dict()["ledger"][0]  # type: ignore[no-any-return]


@st.composite
def layouts(draw: st.DrawFn) -> dict[str, object]:
    model = draw(st.sampled_from(["Qwen3-235B-A22B", "Qwen3-30B-A3B", "DeepSeek-V3", "Mixtral-8x7B",
                                  "Llama-3.1-405B", "tiny-moe", "tiny-dense"]))
    return {
        "model": {"preset": model},
        "hardware": {"gpu": draw(st.sampled_from(["H200", "H100", "B200", "cpu"])), "gpusPerNode": 8},
        "parallelism": {"tp": draw(st.sampled_from([1, 2, 4, 8])), "dpa": draw(st.sampled_from([1, 2, 4])),
                        "pp": draw(st.sampled_from([1, 2, 4]))},
        "serving": {"maxModelLen": draw(st.sampled_from([1024, 8192])),
                    "memoryFraction": draw(st.sampled_from([0.5, 0.9]))},
    }


@settings(max_examples=120, deadline=None)
@given(layouts())
def test_ledger_terms_sum_to_the_total_on_every_rank(sections: dict[str, object]) -> None:
    p = plan(make_spec(**sections))  # type: ignore[arg-type]
    for row in p.to_dict()["ledger"]:
        parts = row["weightsBytes"] + row["kvCacheBytes"] + row["activationBytes"] + row["workspaceBytes"]
        assert parts == row["totalBytes"]
        assert row["kvCacheBytes"] == row["kvCapacityTokens"] * row["kvBytesPerToken"]
        if p.valid:
            assert row["totalBytes"] <= row["budgetBytes"]
            assert row["freeBytes"] >= 0


@settings(max_examples=120, deadline=None)
@given(layouts())
def test_a_larger_tp_never_gives_a_rank_more_weights(sections: dict[str, object]) -> None:
    par = sections["parallelism"]
    assert isinstance(par, dict)
    rows = []
    for tp in (1, 2, 4, 8):
        p = plan(make_spec(**{**sections, "parallelism": {**par, "tp": tp}}))  # type: ignore[arg-type]
        if p.stage_ledger:
            rows.append(max(e.weights_bytes for e in p.stage_ledger))
    assert rows == sorted(rows, reverse=True)


def test_tp_beyond_the_kv_heads_replicates_the_kv_cache_per_token() -> None:
    # tiny-moe: 2 KV heads of 16 dims, float32: 2 (K,V) x heads x 16 x 4 bytes x 4 layers.
    tp1 = _ledger(parallelism={"tp": 1}, model={"preset": "tiny-moe", "dtype": "float32"})
    tp2 = _ledger(parallelism={"tp": 2}, model={"preset": "tiny-moe", "dtype": "float32"})
    tp4 = _ledger(parallelism={"tp": 4}, model={"preset": "tiny-moe", "dtype": "float32"})
    assert tp1["kvBytesPerToken"] == 2 * 2 * 16 * 4 * 4
    assert tp2["kvBytesPerToken"] == tp1["kvBytesPerToken"] // 2
    assert tp4["kvBytesPerToken"] == tp2["kvBytesPerToken"], "one KV head per rank, replicated"


def test_mla_latent_cache_is_the_same_on_every_tp_rank() -> None:
    args = {"model": {"preset": "DeepSeek-V3"}, "hardware": {"gpu": "H200"}, "serving": {"maxModelLen": 8192}}
    tp8_pp2 = _ledger(parallelism={"tp": 8, "pp": 2}, **args)
    tp4_pp4 = _ledger(parallelism={"tp": 4, "pp": 4}, **args)
    # (kv_lora 512 + rope 64) x 2 bytes per layer; stage 0 holds 31 or 16 layers.
    assert tp8_pp2["kvBytesPerToken"] == 576 * 2 * 31
    assert tp4_pp4["kvBytesPerToken"] == 576 * 2 * 16


def test_cp_divides_the_positions_a_request_needs_on_a_rank() -> None:
    base = {"model": {"preset": "Qwen3-235B-A22B"}, "hardware": {"gpu": "H200"}, "serving": {"maxModelLen": 32768}}
    p1 = plan(make_spec(parallelism={"tp": 4, "dpa": 2}, **base))
    p2 = plan(make_spec(parallelism={"tp": 4, "cp": 2}, **base))
    r1, r2 = p1.stage_ledger[0], p2.stage_ledger[0]
    assert r1.kv_bytes_per_token == r2.kv_bytes_per_token
    assert r2.kv_capacity_requests == pytest.approx(2 * r1.kv_capacity_requests, abs=1)


def test_redundant_expert_slots_cost_weights_that_the_kv_cache_loses() -> None:
    base = {"model": {"preset": "Qwen3-30B-A3B"}, "hardware": {"gpu": "H100"}, "parallelism": {"dpa": 8}}
    plain = plan(make_spec(**base)).stage_ledger[0]
    extra = plan(make_spec(eplb={"redundantExperts": 32}, **base)).stage_ledger[0]
    per_expert = 48 * 3 * 2048 * 768 * 2  # layers x SwiGLU matrices x bytes
    assert extra.weights_bytes - plain.weights_bytes == 4 * per_expert  # 32 slots over EP=8
    assert extra.kv_cache_bytes < plain.kv_cache_bytes


def test_pipeline_stages_split_layers_and_only_the_ends_hold_embedding_and_head() -> None:
    p = plan(make_spec(model={"preset": "Llama-3.1-405B"}, hardware={"gpu": "H200"},
                       parallelism={"tp": 8, "pp": 4}))
    assert [len(r) for r in p.stage_layers] == [32, 32, 31, 31]
    w = [e.weights for e in p.stage_ledger]
    assert w[0].embedding > 0 and w[0].lm_head == 0
    assert w[3].lm_head > 0 and w[3].embedding == 0
    assert w[1].embedding == w[1].lm_head == 0
