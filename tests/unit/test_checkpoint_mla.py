"""The DeepSeek-V3 family (MLA attention, DeepSeek routing) read from config.json without torch: every field as
transformers' DeepseekV3Config reads it, DeepSeek's own and Kimi-K2's published configs, each contradiction or
unimplemented field refused by name, `shardwise model inspect`'s MLA block, and the ledger's MLA numbers."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardwise import checkpoint, ledger
from shardwise.api import AttentionType, InferenceDeploymentSpec
from shardwise.planner import plan
from shardwise.presets import model_preset
from tests.conftest import shardwise_command
from tests.unit.test_checkpoint import write_safetensors

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=331, hidden_size=48, intermediate_size=40, moe_intermediate_size=14, num_hidden_layers=3,
             num_attention_heads=6, q_lora_rank=19, kv_lora_rank=23, qk_nope_head_dim=12, qk_rope_head_dim=8,
             v_head_dim=10, n_routed_experts=6, n_group=3, topk_group=2, num_experts_per_tok=3, n_shared_experts=2,
             first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=False, rope_interleave=True,
             max_position_embeddings=512)

# DeepSeek-V3's published config.json (its fp8 quantization_config apart), in DeepSeek's own format: rope_scaling
# with `type`, rope_theta beside it, scoring_func and topk_method
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# Kimi-K2's published config.json: the same architecture under its own model_type
KIMI_K2 = DEEPSEEK_V3 | {
    "model_type": "kimi_k2", "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "n_routed_experts": 384,
    "num_attention_heads": 64, "num_key_value_heads": 64, "routed_scaling_factor": 2.827, "vocab_size": 163840,
    "max_position_embeddings": 131072, "rope_theta": 50000.0,
    "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}


def ds_config(**kw: Any) -> dict[str, Any]:
    """config.json as transformers' DeepseekV3Config writes it."""
    return dict(json.loads(transformers.DeepseekV3Config(**(SMALL | kw)).to_json_string()))


def test_every_deepseek_field_is_read_as_transformers_reads_it() -> None:
    arch = checkpoint.architecture_from_config(ds_config(rope_parameters={
        "rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "beta_fast": 16, "beta_slow": 2, "mscale": 0.9, "mscale_all_dim": 0.7}))
    assert arch.attention_type is AttentionType.MLA and arch.family == "deepseek_v3"
    assert (arch.num_heads, arch.q_lora_rank, arch.kv_lora_rank) == (6, 19, 23)
    assert (arch.nope_head_dim, arch.rope_head_dim, arch.v_head_dim) == (12, 8, 10)
    assert (arch.num_experts, arch.top_k, arch.moe_intermediate_size, arch.intermediate_size) == (6, 3, 14, 40)
    assert (arch.num_expert_groups, arch.topk_groups, arch.first_dense_layers) == (3, 2, 1)
    assert (arch.num_shared_experts, arch.shared_width) == (1, 28)  # 2 shared experts: one SwiGLU of 2 x 14
    assert arch.router_scoring == "sigmoid" and arch.routed_scaling_factor == 2.5 and not arch.norm_topk_prob
    assert arch.rope_interleave and arch.rope_theta == 5000.0
    y = arch.rope_scaling
    assert y is not None and (y.factor, y.original_max_position_embeddings) == (4.0, 128)
    assert (y.beta_fast, y.beta_slow, y.mscale, y.mscale_all_dim) == (16, 2, 0.9, 0.7)


def test_a_null_q_lora_rank_is_a_plain_q_proj() -> None:
    arch = checkpoint.architecture_from_config(ds_config(q_lora_rank=None, rope_interleave=False))
    assert arch.q_lora_rank == 0 and not arch.rope_interleave and arch.rope_scaling is None
    shapes = checkpoint.expected_shapes(arch)
    assert shapes["layers.0.wq"] == (6 * 20, 48) and "layers.0.wq_a" not in shapes
    assert checkpoint.hf_name(arch, "layers.0.wq") == "model.layers.0.self_attn.q_proj.weight"


def test_deepseeks_published_config_is_the_preset_and_kimi_k2_reads_the_same() -> None:
    arch = checkpoint.architecture_from_config(DEEPSEEK_V3)
    assert checkpoint.mismatches(model_preset("DeepSeek-V3"), arch) == []
    assert arch.rope_scaling is not None and arch.rope_scaling.factor == 40
    kimi = checkpoint.architecture_from_config(KIMI_K2)
    assert kimi.family == "kimi_k2" and kimi.num_experts == 384 and kimi.num_expert_groups == 1
    assert kimi.routed_scaling_factor == 2.827 and kimi.rope_theta == 50000.0


@pytest.mark.parametrize("cfg,where,fragment", [
    (ds_config() | {"kv_lora_rank": 0}, "kv_lora_rank",
     "must be at least 1: it is the width of the latent KV cache, got 0"),
    (ds_config() | {"topk_group": 4}, "topk_group", "topk_group=4 exceeds n_group=3"),
    (ds_config() | {"n_group": 4}, "n_group", "n_routed_experts=6 is not divisible by n_group=4"),
    (ds_config() | {"n_group": 6, "topk_group": 2}, "n_group", "a group's score is the sum of its top 2 experts"),
    (ds_config() | {"num_experts_per_tok": 5}, "num_experts_per_tok",
     "5 must be within 1..4, the experts of the topk_group=2 groups of 2"),
    (ds_config() | {"first_k_dense_replace": 4}, "first_k_dense_replace", "4 exceeds num_hidden_layers=3"),
    (ds_config() | {"qk_rope_head_dim": 7}, "qk_rope_head_dim", "must be even"),
    (ds_config() | {"quantization_config": FP8}, "quantization_config",
     "fp8 weights are not supported: convert the checkpoint to bfloat16 or float32 first (for DeepSeek-V3/R1: "
     "DeepSeek's inference/fp8_cast_bf16.py)"),
    (DEEPSEEK_V3 | {"quantization_config": FP8}, "quantization_config", "fp8_cast_bf16.py"),
    (ds_config() | {"moe_layer_freq": 2}, "moe_layer_freq", "it must be 1, got 2"),
    (KIMI_K2 | {"scoring_func": "softmax"}, "scoring_func", "implemented with sigmoid scores, got 'softmax'"),
    (DEEPSEEK_V3 | {"topk_method": "greedy"}, "topk_method", "got 'greedy'"),
    (ds_config() | {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     "rope_parameters.rope_type", "'dynamic' is not implemented (default and yarn are)"),
    (ds_config() | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "original_max_position_embeddings", "yarn needs a positive integer, got None"),
    (ds_config() | {"attention_bias": True}, "attention_bias", "biases"),
    ({"model_type": "glm4_moe"}, "model_type", "'glm4_moe' is not implemented yet: its attention is GQA with partial "
                                               "rotary embeddings"),
    (ds_config() | {"model_type": "deepseek_v2"}, "model_type", "a softmax router"),
])
def test_a_contradiction_or_an_unimplemented_field_is_refused_by_name(cfg: dict[str, Any], where: str,
                                                                      fragment: str) -> None:
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(fragment)) as e:
        checkpoint.architecture_from_config(cfg)
    assert where in e.value.where


@pytest.fixture
def ds_dir(tmp_path: Path) -> Path:
    """A deepseek_v3 checkpoint of headers only (zero bytes of data): enough to inspect and plan."""
    cfg = ds_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = checkpoint.architecture_from_config(cfg)
    tensors = {checkpoint.hf_name(arch, n): ("F32", list(s)) for n, s in checkpoint.expected_shapes(arch).items()}
    write_safetensors(tmp_path / "model.safetensors", tensors)
    return tmp_path


def test_a_checkpoint_names_its_mla_router_bias_and_fused_shared_expert_tensors(ds_dir: Path) -> None:
    info = checkpoint.inspect(ds_dir)
    names = set(info.tensors)
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in names
    assert info.tensors["model.layers.1.self_attn.kv_b_proj.weight"].shape == (6 * (12 + 10), 23)
    assert info.tensors["model.layers.1.mlp.gate.e_score_correction_bias"].shape == (6,)
    assert info.tensors["model.layers.2.mlp.shared_experts.gate_proj.weight"].shape == (28, 48)
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names


def spec(directory: Path, tp: int) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({"model": {"source": {"path": str(directory)}},
                                                   "hardware": {"gpu": "cpu", "gpusPerNode": 4},
                                                   "parallelism": {"tp": tp}})


def test_the_plan_refuses_a_tp_that_does_not_divide_the_heads(ds_dir: Path) -> None:
    p = plan(spec(ds_dir, 4))
    assert ("spec.parallelism.tp", "numHeads=6 is not divisible by tp=4") in [(e.field, e.message) for e in p.errors]
    assert plan(spec(ds_dir, 2)).valid


def test_model_inspect_prints_the_mla_block_and_a_model_block_that_plans(ds_dir: Path) -> None:
    out = subprocess.run([*shardwise_command(), "model", "inspect", str(ds_dir)], capture_output=True, text=True,
                         check=True).stdout
    assert "# MLA: 6 heads x (nope 12 + rope 8) query/key dims, value 10; q LoRA rank 19" in out
    assert "# MLA KV cache: latent 23 + rope key 8 = 31 values per token per layer, the same on every TP rank" in out
    assert "# routing: sigmoid scores, 6 experts in 3 groups of 2, 2 group(s) kept, top 3" in out
    block = yaml.safe_load(out)["model"]
    assert block["architecture"]["attentionType"] == "mla" and block["architecture"]["routerScoring"] == "sigmoid"
    block["source"] = {"pvc": {"claimName": "models"}}
    p = plan(InferenceDeploymentSpec.model_validate({"model": block, "hardware": {"gpu": "cpu", "gpusPerNode": 2},
                                                     "parallelism": {"tp": 2}}))
    assert p.valid, p.errors


@pytest.mark.parametrize("q_lora", [19, None], ids=["q LoRA", "plain q_proj"])
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_the_ledger_counts_the_latent_cache_and_the_mla_weights_a_tp_rank_holds(q_lora: int | None, tp: int) -> None:
    arch = checkpoint.architecture_from_config(ds_config(q_lora_rank=q_lora))
    # the latent cache: kv_lora + rope values per token per layer, the same on every TP rank
    assert ledger.kv_bytes_per_token_per_layer(arch, tp, 2) == (23 + 8) * 2
    # weights: q_a, kv_a and their norms whole on every rank; q_b (or q_proj), kv_b and o split by heads
    whole = checkpoint.mla_shapes(arch, 0)
    replicated = ("wq_a", "q_a_norm", "wkv_a", "kv_a_norm")
    held = 0
    for name, shape in whole.items():
        n = 1
        for d in shape:
            n *= d
        held += n if name.split(".")[-1] in replicated else n // tp
    assert ledger.attention_params_per_layer(arch, tp) == held


def test_the_plan_takes_decode_cp_but_refuses_prefill_cp_for_an_mla_checkpoint(ds_dir: Path) -> None:
    def cp(mode: str) -> InferenceDeploymentSpec:
        return InferenceDeploymentSpec.model_validate({"model": {"source": {"path": str(ds_dir)}},
                                                       "hardware": {"gpu": "cpu", "gpusPerNode": 4},
                                                       "parallelism": {"tp": 1, "cp": 2, "cpMode": mode}})
    assert [(e.field, e.message) for e in plan(cp("pcp")).errors] == [
        ("spec.parallelism.cpMode", "the reference runtime does not run prefill context parallelism (cpMode pcp) for "
                                    "MLA checkpoints (deepseek_v3) yet: use cpMode dcp, which splits the latent KV "
                                    "cache by position")]
    assert plan(cp("dcp")).valid, plan(cp("dcp")).errors
