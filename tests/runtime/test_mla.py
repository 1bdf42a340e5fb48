"""MLA and DeepSeek routing in the reference runtime, one function at a time (the whole model against
transformers' greedy tokens is in test_checkpoints): the absorbed and the plain form agree, the cache holds the
latent and the RoPE key only, YaRN's frequencies are transformers' own, the router chooses with the bias and
weights without it, and a TP rank holds the MLA weights and cache the ledger counts (a DCP rank the query
weights of all its TP heads)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from shardwise.agents.runtime.engine import Shards, WorldSpec  # noqa: E402
from shardwise.agents.runtime.model import (  # noqa: E402
    LayerCache,
    mla_attention,
    rope_frequencies,
    route_grouped,
)
from shardwise.agents.runtime.sources import HuggingFaceCheckpoint  # noqa: E402

from shardwise import checkpoint, ledger  # noqa: E402
from shardwise.api import ModelArchitecture, YarnScaling  # noqa: E402
from tests.checkpoints import FAMILIES, make_checkpoint  # noqa: E402


def arch(**kw: object) -> ModelArchitecture:
    base = dict(FAMILIES["deepseek_v3"])
    return checkpoint.architecture_from_config(
        dict(transformers.DeepseekV3Config(**(base | kw)).to_dict()) | {"model_type": "deepseek_v3"})


def random_mla(a: ModelArchitecture, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = checkpoint.mla_shapes(a, 0)
    return {n: (1.0 + 0.1 * torch.randn(s, generator=g, dtype=torch.float64)) if len(s) == 1
            else torch.randn(s, generator=g, dtype=torch.float64) / s[-1] ** 0.5 for n, s in shapes.items()}


@pytest.mark.parametrize("q_lora", [19, None], ids=["q LoRA", "plain q_proj"])
def test_the_absorbed_form_equals_the_plain_one_and_caches_only_the_latent_and_rope_key(q_lora: int | None) -> None:
    a = arch(q_lora_rank=q_lora)
    w = random_mla(a)
    x = torch.randn(9, a.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    caches = {form: LayerCache() for form in (True, False)}
    outs: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    for lo, hi in ((0, 6), (6, 7), (7, 8), (8, 9)):  # a prompt, then decode steps
        for form, cache in caches.items():
            outs[form].append(mla_attention(x[lo:hi], torch.arange(lo, hi), cache, w, "layers.0.", a, absorbed=form))
    torch.testing.assert_close(torch.cat(outs[True]), torch.cat(outs[False]), rtol=1e-12, atol=1e-12)
    cache = caches[True]
    assert cache.k is not None and cache.v is not None
    assert tuple(cache.k.shape) == (9, 1, 23) and tuple(cache.v.shape) == (9, 1, 8)
    per_token = (cache.k.numel() + cache.v.numel()) * cache.k.element_size() // 9
    assert per_token == ledger.kv_bytes_per_token_per_layer(a, 1, 8) == ledger.kv_bytes_per_token_per_layer(a, 2, 8)


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7},
    {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "original_max_position_embeddings": 64,
     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
     "attention_factor": 1.3, "truncate": False},
], ids=["mscale ratio", "kimi-like", "given attention factor"])
def test_yarn_frequencies_and_scale_are_transformers_own(rope: dict[str, object]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.DeepseekV3Config(**(FAMILIES["deepseek_v3"] | {"rope_parameters": rope}))
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    a = checkpoint.architecture_from_config(config.to_dict() | {"model_type": "deepseek_v3"})
    assert isinstance(a.rope_scaling, YarnScaling)
    freq, scale = rope_frequencies(a.rope_head_dim, a.rope_theta, a.rope_scaling)
    assert torch.equal(freq, want_freq) and scale == pytest.approx(want_scale, rel=1e-15)


def router_for(a: ModelArchitecture, logits: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [1, D], router [E, D]) whose router logits are `logits`."""
    router = torch.zeros(len(logits), a.hidden_size, dtype=torch.float64)
    router[:, 0] = torch.tensor(logits, dtype=torch.float64)
    x = torch.zeros(1, a.hidden_size, dtype=torch.float64)
    x[0, 0] = 1.0
    return x, router


def test_the_bias_chooses_the_experts_but_the_unbiased_scores_weight_them() -> None:
    a = arch(n_routed_experts=6, n_group=3, topk_group=2, num_experts_per_tok=2, norm_topk_prob=False,
             routed_scaling_factor=2.0)
    logits = [3.0, 2.0, -1.0, -2.0, 0.5, 0.0]
    x, router = router_for(a, logits)
    scores = torch.tensor(logits).sigmoid()
    weights, ids = route_grouped(x, router, torch.zeros(6, dtype=torch.float64), a)
    assert sorted(ids[0].tolist()) == [0, 1]
    # a bias that lifts experts 2 and 3 (group 1) above the others: the choice moves, the weights stay unbiased
    weights, ids = route_grouped(x, router, torch.tensor([0.0, 0.0, 0.9, 0.9, 0.0, 0.0], dtype=torch.float64), a)
    got = dict(zip(ids[0].tolist(), weights[0].tolist(), strict=True))
    assert sorted(got) == [2, 3]
    assert got[2] == pytest.approx(2.0 * float(scores[2]), rel=1e-6)
    assert got[3] == pytest.approx(2.0 * float(scores[3]), rel=1e-6)
    # renormalised: the chosen unbiased scores over their sum, times the factor
    a = arch(n_routed_experts=6, n_group=3, topk_group=2, num_experts_per_tok=2, norm_topk_prob=True,
             routed_scaling_factor=2.0)
    weights, ids = route_grouped(x, router, torch.tensor([0.0, 0.0, 0.9, 0.9, 0.0, 0.0], dtype=torch.float64), a)
    total = float(scores[2] + scores[3])
    assert weights[0].tolist() == pytest.approx([2.0 * float(scores[i]) / total for i in ids[0].tolist()], rel=1e-6)


def test_routing_is_limited_to_the_best_groups_by_their_top_two_scores() -> None:
    # expert 0 has the best score, but its group (0, 1) sums to less with its second best than groups 1 and 2
    logits = [3.0, -3.0, 0.5, 0.4, 0.3, 0.2]
    zero = torch.zeros(6, dtype=torch.float64)
    limited = arch(n_routed_experts=6, n_group=3, topk_group=2, num_experts_per_tok=2)
    x, router = router_for(limited, logits)
    assert sorted(route_grouped(x, router, zero, limited)[1][0].tolist()) == [2, 3]
    free = arch(n_routed_experts=6, n_group=1, topk_group=1, num_experts_per_tok=2)
    assert sorted(route_grouped(x, router, zero, free)[1][0].tolist()) == [0, 2]


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ds"), "deepseek_v3", tokenizer=False)


def count(held_by: dict[str, int], *names: str) -> int:
    return sum(held_by.get(n, 0) for n in names)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_a_tp_rank_holds_the_mla_weights_the_ledger_counts(ds_dir: Path, tp: int) -> None:
    """Attention and router per rank exactly; the FFNs (split by width, 14 and 40 not always divisible) summed
    over the TP group equal the ledger's even share times TP."""
    source = HuggingFaceCheckpoint(ds_dir)
    a = source.arch
    spec = WorldSpec(generation=1, tp=tp, dpa=1, pp=1, store_host="127.0.0.1", store_port=0, model="deepseek_v3",
                     weights_dir=str(ds_dir))
    sharding = ledger.Sharding(tp=tp, cp=1, dpa=1, pp=1, ep=tp, moe_tp=1, ep_replicas=1, expert_slots=6, layers=3,
                               moe_layers=2, first_stage=True, last_stage=True)
    wb = ledger.weight_breakdown(a, sharding)
    group: dict[str, int] = {}
    for tp_rank in range(tp):
        shards = Shards(source, spec, tp_rank, tp_rank, range(a.num_layers))
        held_by: dict[str, int] = {}
        for n, t in shards.w.items():
            if n.startswith("layers."):
                held_by[n.split(".", 2)[2]] = held_by.get(n.split(".", 2)[2], 0) + t.numel()
                group[n.split(".", 2)[2]] = group.get(n.split(".", 2)[2], 0) + t.numel()
        assert wb.attention == count(held_by, "wq", "wq_a", "q_a_norm", "wq_b", "wkv_a", "kv_a_norm", "wkv_b", "wo")
        assert wb.attention == 3 * ledger.attention_params_per_layer(a, tp)
        assert wb.router == count(held_by, "router", "router_bias")
        assert torch.equal(shards.w["layers.1.wkv_a"], source.tensor("layers.1.wkv_a").double())  # replicated
    assert wb.shared_experts * tp == count(group, "shared.0.w1", "shared.0.w3", "shared.0.w2")
    assert wb.dense_ffn * tp == count(group, "ffn.w1", "ffn.w3", "ffn.w2")



def test_every_dcp_rank_already_holds_the_query_weights_of_its_tp_heads(ds_dir: Path) -> None:
    """Under decode CP a rank's attention weights are those of its TP rank, the same on every CP rank: each DCP
    rank computes the queries of all its TP heads itself (the query-replicate layout), and the ledger's
    attention per rank, which CP does not divide, counts them."""
    source = HuggingFaceCheckpoint(ds_dir)
    a = source.arch
    spec = WorldSpec(generation=1, tp=1, dpa=1, pp=1, store_host="127.0.0.1", store_port=0, model="deepseek_v3",
                     weights_dir=str(ds_dir), cp=2, cp_mode="dcp")
    sharding = ledger.Sharding(tp=1, cp=2, dpa=1, pp=1, ep=2, moe_tp=1, ep_replicas=1, expert_slots=6, layers=3,
                               moe_layers=2, first_stage=True, last_stage=True)
    attention = ("wq", "wq_a", "q_a_norm", "wq_b", "wkv_a", "kv_a_norm", "wkv_b", "wo")
    held = [{n: t for n, t in shards.w.items() if n.startswith("layers.") and n.split(".", 2)[2] in attention}
            for shards in (Shards(source, spec, 0, r, range(a.num_layers), attn_index=r) for r in range(2))]
    for rank in held:
        assert ledger.weight_breakdown(a, sharding).attention == sum(t.numel() for t in rank.values())
        assert torch.equal(rank["layers.1.wq_b"], source.tensor("layers.1.wq_b").double())  # every head's rows
        assert rank.keys() == held[0].keys() and all(torch.equal(t, held[0][n]) for n, t in rank.items())

def test_a_tp_that_does_not_divide_the_heads_is_refused_by_the_rank(ds_dir: Path) -> None:
    source = HuggingFaceCheckpoint(ds_dir)
    spec = WorldSpec(generation=1, tp=4, dpa=1, pp=1, store_host="127.0.0.1", store_port=0, model="deepseek_v3",
                     weights_dir=str(ds_dir))
    with pytest.raises(ValueError, match="numHeads=6 is not divisible by tp=4"):
        Shards(source, spec, 0, 0, range(3))
