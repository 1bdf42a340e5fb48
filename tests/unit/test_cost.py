"""Traffic and roofline figures against the worked examples in docs/domain.md section 2."""

from __future__ import annotations

import pytest

from shardwise.api import CpLayout
from shardwise.cost import (
    Phase,
    Workload,
    attention_projection_flops,
    attention_score_flops,
    dcp_send_bytes,
    pcp_send_bytes,
)
from shardwise.cp import causal_work, imbalance, positions
from shardwise.ledger import kv_bytes_per_token_per_layer
from shardwise.planner import plan
from shardwise.presets import gpu_preset, model_preset
from tests.conftest import make_spec

QWEN = model_preset("Qwen3-235B-A22B")
H200 = gpu_preset("H200")
MiB = 1024**2


def test_qwen3_235b_tp8_decode_b64_sends_the_documented_tp_allreduce_bytes() -> None:
    spec = make_spec(model={"preset": "Qwen3-235B-A22B"}, hardware={"gpu": "H200"}, parallelism={"tp": 8})
    tr = plan(spec, Workload(Phase.DECODE, batch=64, context=1)).to_dict()["traffic"]
    assert tr["tpMessageBytes"] == 524288  # 512 KiB per AllReduce
    assert tr["tpAllReduceBytesPerRank"] == 917504  # 0.875 MiB sent per rank
    assert tr["tpAllReducesPerStep"] == 2 * 94
    total = tr["tpAllReduceBytesPerRank"] * tr["tpAllReducesPerStep"]
    assert total / MiB == pytest.approx(164.5)


def test_zigzag_s32_cp4_gives_every_rank_132_positions() -> None:
    assert causal_work(32, 4, CpLayout.ZIGZAG) == [132, 132, 132, 132]
    assert positions(32, 4, CpLayout.ZIGZAG)[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    assert imbalance(32, 4, CpLayout.ZIGZAG) == 1.0


def test_contiguous_layout_loads_the_last_rank_most_and_striped_is_nearly_balanced() -> None:
    work = causal_work(32, 4, CpLayout.CONTIGUOUS)
    assert work == sorted(work) and work[-1] > work[0]
    assert imbalance(32, 4, CpLayout.CONTIGUOUS) > 1.5
    assert imbalance(4096, 4, CpLayout.STRIPED) < 1.001 < imbalance(4096, 4, CpLayout.CONTIGUOUS)
    assert positions(8, 2, CpLayout.STRIPED)[1].tolist() == [1, 3, 5, 7]


@pytest.mark.parametrize("layout,seq,cp,message", [
    (CpLayout.ZIGZAG, 30, 4, r"S % \(2\*CP\) == 0, got S=30, 2\*CP=8"),
    (CpLayout.CONTIGUOUS, 30, 4, r"S % CP == 0, got S=30, CP=4"),
])
def test_layouts_that_need_a_divisible_length_say_which_numbers_fail(
    layout: CpLayout, seq: int, cp: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        positions(seq, cp, layout)


class TestSeedPrefillCp:
    """Qwen3-235B-A22B on H200, B=1, S=32768, TP=4, no causal mask (docs/domain.md section 2)."""

    S = 32768

    def test_without_cp_a_rank_does_8_8_tflops_of_attention_and_holds_16_mib_of_kv_per_layer(self) -> None:
        attn = attention_score_flops(QWEN, 4, self.S, self.S)
        proj = attention_projection_flops(QWEN, 4, self.S)
        assert attn / 1e12 == pytest.approx(8.8, abs=0.05)
        assert proj / 1e12 == pytest.approx(1.2, abs=0.05)
        assert (attn + proj) / H200.peak_flops * 1e3 == pytest.approx(10.08, abs=0.01)
        assert self.S * kv_bytes_per_token_per_layer(QWEN, 4, 2) == 16 * MiB

    def test_cp2_halves_the_work_and_the_ring_sends_8_mib_in_about_18_64_us(self) -> None:
        attn = attention_score_flops(QWEN, 4, self.S // 2, self.S)
        proj = attention_projection_flops(QWEN, 4, self.S // 2)
        assert attn / 1e12 == pytest.approx(4.4, abs=0.05)
        assert (attn + proj) / H200.peak_flops * 1e3 == pytest.approx(5.04, abs=0.01)
        sent = pcp_send_bytes(QWEN, tp=4, cp=2, batch=1, seq=self.S, kv_b=2)
        assert sent == 8 * MiB
        assert sent / H200.link_bandwidth_one_way * 1e6 == pytest.approx(18.64, abs=0.01)


class TestSeedDecodeCp:
    """Qwen3-235B-A22B on H200, B=64, S=32768, TP=4, decode."""

    def test_without_cp_attention_is_17_2_gflops_and_scanning_1_gib_of_kv_takes_223_7_us(self) -> None:
        flops = attention_score_flops(QWEN, 4, 64, 32768)
        assert flops / 1e9 == pytest.approx(17.2, abs=0.05)
        assert flops / H200.peak_flops * 1e6 == pytest.approx(17.37, abs=0.01)
        kv = 64 * 32768 * kv_bytes_per_token_per_layer(QWEN, 4, 2)
        assert kv == 1024 * MiB
        assert kv / H200.hbm_bandwidth * 1e6 == pytest.approx(223.70, abs=0.01)

    def test_cp2_halves_both_and_the_ag_rs_path_sends_256_kib_in_about_0_58_us(self) -> None:
        flops = attention_score_flops(QWEN, 4, 64, 32768 / 2)
        assert flops / H200.peak_flops * 1e6 == pytest.approx(8.69, abs=0.01)
        assert 64 * 16384 * kv_bytes_per_token_per_layer(QWEN, 4, 2) / H200.hbm_bandwidth * 1e6 == pytest.approx(
            111.85, abs=0.01)
        sent = dcp_send_bytes(QWEN, tp=4, cp=2, batch=64, b=2)
        assert sent == 256 * 1024
        assert sent / H200.link_bandwidth_one_way * 1e6 == pytest.approx(0.58, abs=0.01)


def test_the_plan_reports_cp_traffic_for_the_phase_it_is_asked_about() -> None:
    spec = make_spec(model={"preset": "Qwen3-235B-A22B"}, hardware={"gpu": "H200"},
                     parallelism={"tp": 4, "cp": 2}, serving={"maxModelLen": 32768})
    decode = plan(spec, Workload(Phase.DECODE, 64, 32768)).to_dict()["traffic"]
    prefill = plan(spec, Workload(Phase.PREFILL, 1, 32768)).to_dict()["traffic"]
    assert decode["cpBytesPerRank"] == 256 * 1024
    assert prefill["cpBytesPerRank"] == 8 * MiB
    assert decode["cpOpsPerStep"] == prefill["cpOpsPerStep"] == 94


def test_ep_all_to_all_follows_the_documented_formula() -> None:
    # 4 groups x 64 tokens over EP=16: (256/16) * 8 * 4096 * 2 * (1 - 1/16) bytes per rank.
    spec = make_spec(model={"preset": "Qwen3-235B-A22B"}, hardware={"gpu": "H200"},
                     parallelism={"tp": 4, "dpa": 4})
    tr = plan(spec, Workload(Phase.DECODE, 64, 4096)).to_dict()["traffic"]
    assert tr["epAllToAllBytesPerRank"] == int(16 * 8 * 4096 * 2 * 15 / 16)
    assert tr["epAllToAllsPerStep"] == 2 * 94


def test_decode_is_memory_bound_and_prefill_compute_bound_for_a_large_moe() -> None:
    spec = make_spec(model={"preset": "Qwen3-235B-A22B"}, hardware={"gpu": "H200"}, parallelism={"tp": 8})
    d = plan(spec, Workload(Phase.DECODE, 8, 4096)).to_dict()["estimates"]
    p = plan(spec, Workload(Phase.PREFILL, 4, 4096)).to_dict()["estimates"]
    assert d["memorySeconds"] > d["computeSeconds"]
    assert p["computeSeconds"] > p["memorySeconds"]
    assert d["stepSeconds"] == pytest.approx(max(d["memorySeconds"], d["computeSeconds"]) + d["commSeconds"])
