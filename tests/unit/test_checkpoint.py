"""Reading Hugging Face checkpoints without torch: the architecture from config.json (configs written by
transformers' own config classes), refusals that name the field, the safetensors headers checked against the
architecture, admission from `model.source`, and `shardwise model inspect`."""

from __future__ import annotations

import json
import re
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardwise import checkpoint
from shardwise.api import InferenceDeploymentSpec
from shardwise.planner import plan
from tests.conftest import shardwise_command

transformers = pytest.importorskip("transformers")


def hf_config(family: str, **kw: Any) -> dict[str, Any]:
    cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig,
           "qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig,
           "mistral": transformers.MistralConfig}[family]
    return dict(json.loads(cls(**kw).to_json_string()))


@pytest.mark.parametrize("family,kw,want", [
    ("qwen3_moe", dict(num_hidden_layers=5, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                       head_dim=32, num_experts=10, num_experts_per_tok=3, moe_intermediate_size=24, vocab_size=999,
                       norm_topk_prob=False),
     dict(num_layers=5, num_heads=6, kv_heads=2, dim_head=32, num_experts=10, top_k=3, moe_intermediate_size=24,
          vocab_size=999, qk_norm=True, norm_topk_prob=False, family="qwen3_moe")),
    ("mixtral", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                     num_local_experts=8, num_experts_per_tok=2, intermediate_size=112, rope_theta=1e6),
     dict(num_layers=2, kv_heads=4, dim_head=8, num_experts=8, top_k=2, moe_intermediate_size=112,
          norm_topk_prob=True, qk_norm=False, rope_theta=1e6)),
    ("qwen3", dict(num_hidden_layers=3, hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                   intermediate_size=72),
     dict(num_experts=0, intermediate_size=72, qk_norm=True, kv_heads=3)),
    ("llama", dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                   intermediate_size=100, tie_word_embeddings=True),
     dict(tie_word_embeddings=True, kv_heads=4, intermediate_size=100, qk_norm=False)),
])
def test_the_architecture_comes_from_the_config_transformers_writes(family: str, kw: dict[str, Any],
                                                                    want: dict[str, Any]) -> None:
    arch = checkpoint.architecture_from_config(hf_config(family, **kw))
    for field, value in want.items():
        assert getattr(arch, field) == value, field


@pytest.mark.parametrize("family,kw,field", [
    ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0}), "rope"),
    ("llama", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(mlp_bias=True), "mlp_bias"),
    ("llama", dict(hidden_act="gelu"), "hidden_act"),
    ("mistral", dict(sliding_window=4096), "sliding_window"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=64, max_window_layers=0), "sliding_window"),
    ("qwen3_moe", dict(mlp_only_layers=[0]), "mlp_only_layers"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step"),
])
def test_a_config_field_that_changes_the_math_is_refused_by_name(family: str, kw: dict[str, Any], field: str) -> None:
    with pytest.raises(checkpoint.UnsupportedCheckpoint) as e:
        checkpoint.architecture_from_config(hf_config(family, **kw))
    assert field in e.value.where


@pytest.mark.parametrize("cfg,fragment", [
    ({"model_type": "gemma3"}, "'gemma3' is not supported; supported: llama"),
    ({"model_type": "gpt2"}, "'gpt2' is not supported"),
    (hf_config("llama") | {"quantization_config": {"quant_method": "fp8"}}, "fp8"),
    (hf_config("llama") | {"num_key_value_heads": 3, "num_attention_heads": 4}, "must divide num_attention_heads=4"),
    (hf_config("llama") | {"num_hidden_layers": "many"}, "num_hidden_layers: must be a non-negative integer"),
])
def test_unsupported_or_malformed_configs_say_what_is_wrong(cfg: dict[str, Any], fragment: str) -> None:
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(fragment)):
        checkpoint.architecture_from_config(cfg)


def test_an_fp8_dtype_is_refused_until_supported() -> None:
    with pytest.raises(checkpoint.UnsupportedCheckpoint, match="float8_e4m3fn checkpoints are not supported: "
                                                                "convert the checkpoint to bfloat16 or float32"):
        checkpoint.config_dtype({"dtype": "float8_e4m3fn"})


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]], truncate: int = 0) -> None:
    header: dict[str, Any] = {}
    offset = 0
    sizes = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "F64": 8}
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * max(0, offset - truncate))


@pytest.fixture
def llama_dir(tmp_path: Path) -> tuple[Path, dict[str, tuple[str, list[int]]]]:
    cfg = hf_config("llama", num_hidden_layers=1, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                    intermediate_size=12, vocab_size=10)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch = checkpoint.architecture_from_config(cfg)
    tensors = {checkpoint.hf_name(arch, n): ("F32", list(s)) for n, s in checkpoint.expected_shapes(arch).items()}
    return tmp_path, tensors


def test_a_whole_checkpoint_is_read_from_its_headers(llama_dir: Any) -> None:
    directory, tensors = llama_dir
    write_safetensors(directory / "model.safetensors", tensors)
    info = checkpoint.inspect(directory)
    assert info.model_type == "llama" and info.files == ["model.safetensors"]
    assert set(info.tensors) == set(tensors)


@pytest.mark.parametrize("damage,fragment", [
    ("drop lm_head", "lm_head.weight: missing from the checkpoint"),
    ("wrong shape", "model.layers.0.self_attn.k_proj.weight: shape [5, 8], the config implies [4, 8]"),
    ("fp8", "F8_E4M3 tensors are not supported: convert the checkpoint to bfloat16 or float32"),
    ("truncated", "a truncated file"),
    ("no weights", "holds neither model.safetensors nor model.safetensors.index.json"),
    ("missing shard", "missing (named by the index)"),
    ("not json config", "config.json: not valid JSON"),
])
def test_a_broken_checkpoint_is_refused_naming_the_file_and_tensor(llama_dir: Any, damage: str,
                                                                   fragment: str) -> None:
    directory, tensors = llama_dir
    if damage == "drop lm_head":
        tensors.pop("lm_head.weight")
    if damage == "wrong shape":
        tensors["model.layers.0.self_attn.k_proj.weight"] = ("F32", [5, 8])
    if damage == "fp8":
        tensors["model.norm.weight"] = ("F8_E4M3", [8])
    if damage == "missing shard":
        (directory / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {name: "model-00002-of-00002.safetensors" for name in tensors}}))
    elif damage == "not json config":
        (directory / "config.json").write_text("{")
    elif damage != "no weights":
        write_safetensors(directory / "model.safetensors", tensors, truncate=4 if damage == "truncated" else 0)
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(fragment)):
        checkpoint.inspect(directory)


def spec_with(model: dict[str, Any]) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({"model": model, "hardware": {"gpu": "cpu", "gpusPerNode": 2},
                                                   "parallelism": {"tp": 2}})


def test_admission_reads_the_architecture_where_it_can_read_the_path(llama_dir: Any) -> None:
    directory, tensors = llama_dir
    write_safetensors(directory / "model.safetensors", tensors)
    p = plan(spec_with({"source": {"path": str(directory)}, "dtype": "float32"}))
    assert p.valid, p.errors
    assert p.arch is not None and p.arch.family == "llama" and p.arch.num_kv_heads == 1


def test_a_source_the_operator_cannot_read_needs_the_architecture_block() -> None:
    p = plan(spec_with({"source": {"pvc": {"claimName": "models", "subPath": "qwen"}}}))
    assert not p.valid
    assert [e.field for e in p.errors] == ["spec.model.architecture"]
    assert "shardwise model inspect DIR" in p.errors[0].message


def test_the_plan_validates_tp_against_the_checkpoints_heads(llama_dir: Any) -> None:
    directory, _tensors = llama_dir
    cfg = json.loads((directory / "config.json").read_text()) | {"num_attention_heads": 2, "num_key_value_heads": 2,
                                                                 "head_dim": 4}
    (directory / "config.json").write_text(json.dumps(cfg))
    spec = InferenceDeploymentSpec.model_validate({"model": {"source": {"path": str(directory)}},
                                                   "hardware": {"gpu": "cpu", "gpusPerNode": 4},
                                                   "parallelism": {"tp": 4}})
    p = plan(spec)
    assert [(e.field, e.message) for e in p.errors] == [("spec.parallelism.tp", "numHeads=2 is not divisible by tp=4")]


def test_mismatches_list_each_differing_number() -> None:
    a = checkpoint.architecture_from_config(hf_config("llama", num_key_value_heads=4))
    b = checkpoint.architecture_from_config(hf_config("llama", num_key_value_heads=8))
    assert checkpoint.mismatches(a, b) == ["numKvHeads: planned 4, checkpoint 8"]


def test_model_inspect_prints_a_model_block_that_plans(llama_dir: Any, tmp_path: Path) -> None:
    directory, tensors = llama_dir
    write_safetensors(directory / "model.safetensors", tensors)
    out = subprocess.run([*shardwise_command(), "model", "inspect", str(directory)], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith(f"# {directory}: llama")
    block = yaml.safe_load(out)["model"]
    assert block["source"] == {"path": str(directory)} and block["architecture"]["numKvHeads"] == 1
    block["source"] = {"pvc": {"claimName": "models"}}  # where the operator cannot read it: the block suffices
    assert plan(spec_with(block)).valid


def test_model_inspect_exits_2_naming_the_file(tmp_path: Path) -> None:
    r = subprocess.run([*shardwise_command(), "model", "inspect", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr == f"error: {tmp_path / 'config.json'}: missing\n"


def test_plan_search_takes_a_checkpoint_directory(llama_dir: Any) -> None:
    directory, tensors = llama_dir
    write_safetensors(directory / "model.safetensors", tensors)
    out = subprocess.run([*shardwise_command(), "plan", "--search", "--model", str(directory), "--gpu", "cpu",
                          "--gpus", "2", "-o", "json"], capture_output=True, text=True, check=True).stdout
    front = json.loads(out)["front"]
    assert front and all(p["tp"] * p["dpa"] * p["pp"] * p["cp"] == 2 for p in front)
    assert max(p["tp"] for p in front) <= 2  # 2 query heads: tp 2 at most
