"""Hugging Face checkpoints: the architecture from `config.json`, the tensors from the safetensors headers.

A checkpoint directory holds `config.json`, one `model.safetensors` or several shards listed by
`model.safetensors.index.json` (`weight_map`: tensor name -> file), and optionally `tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja` and `generation_config.json`. This module is pure Python (no
torch): it reads the JSON config and the JSON header at the start of each safetensors file (8 bytes of
little-endian length, then `{name: {"dtype", "shape", "data_offsets"}}`), which is enough to plan, to check a
checkpoint against a plan and to tell a rank which byte ranges are its own. The runtime reads the tensors.

Supported families (`model_type`), and what each changes in the math of the reference runtime:

| model_type  | attention                      | FFN                                                        |
|-------------|--------------------------------|------------------------------------------------------------|
| `llama`     | GQA, RoPE                      | SwiGLU                                                     |
| `mistral`   | GQA, RoPE (no sliding window)  | SwiGLU                                                     |
| `qwen3`     | GQA, RoPE, RMSNorm on q and k  | SwiGLU                                                     |
| `qwen3_moe` | GQA, RoPE, RMSNorm on q and k  | top-k of a softmax router, renormalised iff norm_topk_prob |
| `mixtral`   | GQA, RoPE (no sliding window)  | top-k of a softmax router, always renormalised             |
| `deepseek_v3` | MLA (below)                  | first_k_dense_replace dense layers, then DeepSeek routing (below) |
| `kimi_k2`   | as deepseek_v3 (its authors reuse the architecture; refused if scoring_func/topk_method differ) |

MLA: queries through a LoRA (q_a, RMSNorm, q_b) or a plain q_proj; keys and values from a latent (kv_a, RMSNorm,
kv_b) whose cache is kv_lora_rank + qk_rope_head_dim values per token; RoPE on qk_rope_head_dim (halves or
interleaved pairs, `rope_interleave`), optionally YaRN (with mscale_all_dim scaling the softmax). DeepSeek routing:
sigmoid scores; `e_score_correction_bias` added only to choose (group score = sum of the top 2 biased scores of a
group, the best topk_group groups kept, then the top num_experts_per_tok); weights are the unbiased scores,
renormalised iff norm_topk_prob, times routed_scaling_factor; shared experts on every token.

A config field that would change the math and that the runtime does not implement (rope scaling, a sliding
window, biases, another activation, quantisation) is refused by name (`UnsupportedCheckpoint`), never ignored.

Runtime tensor names (what `hf_name` maps): `embed`, `norm`, `lm_head`, and per layer `layers.{i}.` +
`attn_norm`, `ffn_norm`, `wq`, `wk`, `wv`, `wo`, `q_norm`, `k_norm`, `ffn.w1|w3|w2` (gate, up, down of a
dense FFN), `router`, and per routed expert `experts.{e}.w1|w3|w2`. MLA (deepseek_v3) has no `wk`/`wv`, and
`wq` only without a query LoRA; instead `wq_a` [q_lora, D], `q_a_norm` [q_lora], `wq_b` [H*(nope+rope), q_lora],
`wkv_a` [kv_lora + rope, D], `kv_a_norm` [kv_lora], `wkv_b` [H*(nope+v), kv_lora], `wo` [D, H*v]; its MoE layers
add `router_bias` [E] (e_score_correction_bias) and one fused shared expert `shared.0.w1|w3|w2` of width
n_shared_experts * moe_intermediate_size (one SwiGLU of that width is the sum of n of width I: the same math).
DeepSeek's multi-token-prediction layers (num_nextn_predict_layers) are not read: greedy decoding never uses them.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise.api import AttentionType, DType, ModelArchitecture, YarnScaling

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"

FAMILIES = ("llama", "mistral", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "kimi_k2")
MLA_FAMILIES = ("deepseek_v3", "kimi_k2")
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")
# families asked for that the runtime does not compute, with what is missing
REFUSED_FAMILIES = {
    "glm4_moe": "not implemented yet: its attention is GQA with partial rotary embeddings (partial_rotary_factor) "
                "and q/k/v biases, which the runtime does not compute (its router is DeepSeek-V3's, which it does)",
    "deepseek_v2": "not implemented: MLA as deepseek_v3, but a softmax router (topk_method greedy or "
                   "group_limited_greedy) that the runtime does not compute",
}
MAX_HEADER = 100 << 20  # a safetensors header larger than this is not a checkpoint this runtime reads

DTYPES = {"F64": DType.FLOAT64, "F32": DType.FLOAT32, "BF16": DType.BFLOAT16, "F16": DType.FLOAT16}
FP8 = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F4")
FP8_ADVICE = ("convert the checkpoint to bfloat16 or float32 first (for DeepSeek-V3/R1: DeepSeek's "
              "inference/fp8_cast_bf16.py) and drop quantization_config from config.json")
CONFIG_DTYPES = {"float64": DType.FLOAT64, "float32": DType.FLOAT32, "bfloat16": DType.BFLOAT16,
                 "float16": DType.FLOAT16}


class CheckpointError(ValueError):
    """A directory that is not a readable checkpoint, or a checkpoint that disagrees with itself or a plan.
    `where` names the file or the config field."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where, self.message = where, message


class UnsupportedCheckpoint(CheckpointError):
    """A valid checkpoint whose architecture (or a config field of it) the runtime does not implement."""


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str  # safetensors dtype code: F32, BF16, ...
    shape: tuple[int, ...]
    offsets: tuple[int, int]  # byte range within the file's data section


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint directory holds, read from its config and headers only."""

    directory: Path
    model_type: str
    architecture: ModelArchitecture
    dtype: DType
    tensors: dict[str, TensorInfo] = field(repr=False)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    has_tokenizer: bool = False

    @property
    def files(self) -> list[str]:
        return sorted({t.file for t in self.tensors.values()})


# ---------------------------------------------------------------------------------------------- config
def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(str(path), "missing") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(str(path), f"not valid JSON: {e}") from e
    except OSError as e:
        raise CheckpointError(str(path), f"cannot be read: {e.strerror or e}") from e


def read_config(directory: Path) -> dict[str, Any]:
    if not directory.is_dir():
        raise CheckpointError(str(directory), "not a directory")
    cfg = _load_json(directory / CONFIG)
    if not isinstance(cfg, dict):
        raise CheckpointError(str(directory / CONFIG), "must hold a JSON object")
    return cfg


def is_checkpoint(directory: Path) -> bool:
    """A Hugging Face checkpoint (config.json with a model_type), as opposed to shardwise's seeded weights."""
    try:
        return "model_type" in read_config(directory)
    except CheckpointError:
        return False


def _int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None and default is not None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointError(f"{CONFIG}: {key}", f"must be a non-negative integer, got {value!r}")
    return value


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    for name, block in (("rope_parameters", params), ("rope_scaling", scaling)):
        if isinstance(block, dict):
            kind = block.get("rope_type", block.get("type", "default"))
            if kind not in (None, "default"):
                raise UnsupportedCheckpoint(f"{CONFIG}: {name}.rope_type",
                                            f"rope scaling {kind!r} is not implemented by the reference runtime")
        elif block is not None:
            raise CheckpointError(f"{CONFIG}: {name}", f"must be an object or null, got {block!r}")
    theta = (params or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise CheckpointError(f"{CONFIG}: rope_theta", f"must be a positive number, got {theta!r}")
    if float(cfg.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise UnsupportedCheckpoint(f"{CONFIG}: partial_rotary_factor", "partial rotary embeddings are not implemented")
    return float(theta)


def _refuse_unsupported(cfg: dict[str, Any], model_type: str) -> None:
    def refuse(key: str, why: str) -> None:
        raise UnsupportedCheckpoint(f"{CONFIG}: {key}", why)

    if cfg.get("quantization_config") is not None:
        method = (cfg["quantization_config"] or {}).get("quant_method", "?")
        if method == "fp8":
            refuse("quantization_config", f"fp8 weights are not supported: {FP8_ADVICE}")
        refuse("quantization_config", f"quantised checkpoints ({method}, fp8 included) are not supported yet")
    if cfg.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"only silu (SwiGLU) is implemented, got {cfg.get('hidden_act')!r}")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            refuse(key, "biases on attention or MLP projections are not implemented")
    window = cfg.get("sliding_window")
    uses_window = cfg.get("use_sliding_window", True) and window is not None
    if uses_window or "sliding_attention" in (cfg.get("layer_types") or []):
        refuse("sliding_window", f"sliding-window attention ({window}) is not implemented")
    if model_type == "qwen3_moe":
        if cfg.get("mlp_only_layers"):
            refuse("mlp_only_layers", "dense layers among the MoE layers are not implemented")
        if _int(cfg, "decoder_sparse_step", 1) != 1:
            refuse("decoder_sparse_step", "MoE on every n-th layer only is not implemented (it must be 1)")
        if cfg.get("shared_expert_intermediate_size"):
            refuse("shared_expert_intermediate_size", "gated shared experts are not implemented")


def architecture_from_config(cfg: dict[str, Any]) -> ModelArchitecture:
    """The ModelArchitecture of a Hugging Face config; UnsupportedCheckpoint names what is not implemented."""
    model_type = cfg.get("model_type")
    if model_type in REFUSED_FAMILIES:
        raise UnsupportedCheckpoint(f"{CONFIG}: model_type", f"{model_type!r} is {REFUSED_FAMILIES[model_type]}")
    if model_type not in FAMILIES:
        raise UnsupportedCheckpoint(f"{CONFIG}: model_type",
                                    f"{model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    _refuse_unsupported(cfg, model_type)
    if model_type in MLA_FAMILIES:
        return _mla_architecture(cfg, model_type)
    heads = _int(cfg, "num_attention_heads")
    hidden = _int(cfg, "hidden_size")
    if heads < 1 or hidden < 1:
        raise CheckpointError(f"{CONFIG}: num_attention_heads", f"hidden_size={hidden} and num_attention_heads="
                                                               f"{heads} must be positive")
    kv = _int(cfg, "num_key_value_heads", heads)
    head_dim = _int(cfg, "head_dim", hidden // heads)
    if kv < 1 or heads % kv:
        raise CheckpointError(f"{CONFIG}: num_key_value_heads", f"{kv} must divide num_attention_heads={heads}")
    if head_dim < 2 or head_dim % 2:
        raise CheckpointError(f"{CONFIG}: head_dim", f"must be even and at least 2 for RoPE, got {head_dim}")
    fields: dict[str, Any] = {
        "family": model_type, "num_layers": _int(cfg, "num_hidden_layers"), "hidden_size": hidden,
        "vocab_size": _int(cfg, "vocab_size"), "attention_type": AttentionType.GQA if kv < heads else AttentionType.MHA,
        "num_heads": heads, "num_kv_heads": kv, "head_dim": head_dim,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)), "rope_theta": _rope_theta(cfg),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)), "qk_norm": model_type in QK_NORM_FAMILIES,
        "max_position_embeddings": _int(cfg, "max_position_embeddings", 0),
    }
    if model_type == "qwen3_moe":
        experts = _int(cfg, "num_experts", None) if "num_experts" in cfg else _int(cfg, "num_local_experts")
        fields |= {"num_experts": experts, "top_k": _int(cfg, "num_experts_per_tok"),
                   "moe_intermediate_size": _int(cfg, "moe_intermediate_size"),
                   "norm_topk_prob": bool(cfg.get("norm_topk_prob", False))}
    elif model_type == "mixtral":
        fields |= {"num_experts": _int(cfg, "num_local_experts"), "top_k": _int(cfg, "num_experts_per_tok"),
                   "moe_intermediate_size": _int(cfg, "intermediate_size"), "norm_topk_prob": True}
    else:
        fields["intermediate_size"] = _int(cfg, "intermediate_size")
    try:
        return ModelArchitecture.model_validate(fields)
    except ValueError as e:
        raise CheckpointError(CONFIG, str(e).splitlines()[-1].strip()) from e

# DeepSeek-V3's defaults, as transformers' DeepseekV3Config has them: a field a config leaves out takes these
DEEPSEEK_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "moe_intermediate_size": 2048, "num_experts_per_tok": 8,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 3,
    "rope_interleave": True, "intermediate_size": 18432,
}


def _number(cfg: dict[str, Any], key: str, default: float) -> float:
    value = cfg.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{CONFIG}: {key}", f"must be a positive number, got {value!r}")
    return float(value)


def _yarn(cfg: dict[str, Any]) -> tuple[float, YarnScaling | None]:
    """(rope_theta, YaRN scaling or None) of an MLA config: `rope_parameters` (transformers 5) or `rope_scaling`
    with `rope_theta` beside it (DeepSeek's own configs). Another rope type is refused by name."""
    block: Any = None
    name = "rope_parameters"
    for key in ("rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None:
            block, name = cfg[key], key
            break
    if block is not None and not isinstance(block, dict):
        raise CheckpointError(f"{CONFIG}: {name}", f"must be an object or null, got {block!r}")
    block = block or {}
    theta = block.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or theta <= 0:
        raise CheckpointError(f"{CONFIG}: rope_theta", f"must be a positive number, got {theta!r}")
    if float(block.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise UnsupportedCheckpoint(f"{CONFIG}: partial_rotary_factor", "partial rotary embeddings are not implemented")
    kind = block.get("rope_type", block.get("type", "default"))
    if kind in (None, "default"):
        return float(theta), None
    if kind != "yarn":
        raise UnsupportedCheckpoint(f"{CONFIG}: {name}.rope_type",
                                    f"rope scaling {kind!r} is not implemented (default and yarn are)")
    where = f"{name}"
    original = block.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise CheckpointError(f"{CONFIG}: {where}.original_max_position_embeddings",
                              f"yarn needs a positive integer, got {original!r}")
    factor = block.get("factor")
    if factor is None:  # transformers: the ratio of the context lengths
        factor = _int(cfg, "max_position_embeddings") / original
    if not isinstance(factor, int | float) or isinstance(factor, bool) or factor < 1:
        raise CheckpointError(f"{CONFIG}: {where}.factor", f"yarn needs a factor of at least 1, got {factor!r}")
    values: dict[str, Any] = {"factor": float(factor), "original_max_position_embeddings": original}
    for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
        v = block.get(key)
        if v is None or v == 0:
            continue  # transformers reads 0 and null as not set
        if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
            raise CheckpointError(f"{CONFIG}: {where}.{key}", f"must be a non-negative number, got {v!r}")
        values[key] = float(v)
    values["truncate"] = bool(block.get("truncate", True))
    return float(theta), YarnScaling.model_validate(values)


def _mla_architecture(cfg: dict[str, Any], model_type: str) -> ModelArchitecture:
    """deepseek_v3 (and kimi_k2, which reuses its architecture and fields): every field read as transformers'
    DeepseekV3Config reads it (an absent field takes DeepSeek-V3's value), contradictions refused by name."""
    d = DEEPSEEK_DEFAULTS

    def refuse(key: str, why: str) -> None:
        raise UnsupportedCheckpoint(f"{CONFIG}: {key}", why)

    def bad(key: str, why: str) -> None:
        raise CheckpointError(f"{CONFIG}: {key}", why)

    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        refuse("scoring_func", f"{model_type} routing is implemented with sigmoid scores, got {scoring!r}")
    method = cfg.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        refuse("topk_method", f"only noaux_tc (group-limited top-k over bias-corrected sigmoid scores) is "
                              f"implemented, got {method!r}")
    freq = cfg.get("moe_layer_freq", 1)
    if freq != 1:
        refuse("moe_layer_freq", f"MoE on every n-th layer only is not implemented (transformers' deepseek_v3 "
                                 f"ignores it too): it must be 1, got {freq!r}")
    heads, hidden = _int(cfg, "num_attention_heads"), _int(cfg, "hidden_size")
    if heads < 1 or hidden < 1:
        bad("num_attention_heads", f"hidden_size={hidden} and num_attention_heads={heads} must be positive")
    layers = _int(cfg, "num_hidden_layers")
    q_lora = cfg.get("q_lora_rank", d["q_lora_rank"])
    if q_lora is not None:
        q_lora = _int(cfg, "q_lora_rank")
        if q_lora < 1:
            bad("q_lora_rank", f"must be a positive integer or null (a plain q_proj), got {q_lora}")
    kv_lora = _int(cfg, "kv_lora_rank", d["kv_lora_rank"])
    if kv_lora < 1:
        bad("kv_lora_rank", f"must be at least 1: it is the width of the latent KV cache, got {kv_lora}")
    nope = _int(cfg, "qk_nope_head_dim", d["qk_nope_head_dim"])
    rope_dim = _int(cfg, "qk_rope_head_dim", d["qk_rope_head_dim"])
    if rope_dim < 2 or rope_dim % 2:
        bad("qk_rope_head_dim", f"must be even and at least 2 for RoPE, got {rope_dim}")
    v_dim = _int(cfg, "v_head_dim", d["v_head_dim"])
    if v_dim < 1:
        bad("v_head_dim", f"must be at least 1, got {v_dim}")
    experts = _int(cfg, "n_routed_experts", d["n_routed_experts"])
    if experts < 1:
        bad("n_routed_experts", f"must be at least 1, got {experts}")
    groups, topk_groups = _int(cfg, "n_group", d["n_group"]), _int(cfg, "topk_group", d["topk_group"])
    if groups < 1 or topk_groups < 1:
        bad("n_group", f"n_group={groups} and topk_group={topk_groups} must be at least 1")
    if topk_groups > groups:
        bad("topk_group", f"topk_group={topk_groups} exceeds n_group={groups}")
    if experts % groups:
        bad("n_group", f"n_routed_experts={experts} is not divisible by n_group={groups}")
    per_group = experts // groups
    if per_group < 2:
        bad("n_group", f"each of the n_group={groups} groups holds {per_group} expert of n_routed_experts="
                       f"{experts}: a group's score is the sum of its top 2 experts, so it needs at least 2")
    top_k = _int(cfg, "num_experts_per_tok", d["num_experts_per_tok"])
    if not 1 <= top_k <= topk_groups * per_group:
        bad("num_experts_per_tok", f"{top_k} must be within 1..{topk_groups * per_group}, the experts of the "
                                   f"topk_group={topk_groups} groups of {per_group} a token may choose")
    first_dense = _int(cfg, "first_k_dense_replace", d["first_k_dense_replace"])
    if first_dense > layers:
        bad("first_k_dense_replace", f"{first_dense} exceeds num_hidden_layers={layers}")
    moe_width = _int(cfg, "moe_intermediate_size", d["moe_intermediate_size"])
    shared = _int(cfg, "n_shared_experts", d["n_shared_experts"])
    theta, yarn = _yarn(cfg)
    scaling = _number(cfg, "routed_scaling_factor", d["routed_scaling_factor"])
    fields: dict[str, Any] = {
        "family": model_type, "num_layers": layers, "hidden_size": hidden, "vocab_size": _int(cfg, "vocab_size"),
        "attention_type": AttentionType.MLA, "num_heads": heads, "q_lora_rank": q_lora or 0,
        "kv_lora_rank": kv_lora, "nope_head_dim": nope, "rope_head_dim": rope_dim, "v_head_dim": v_dim,
        "intermediate_size": _int(cfg, "intermediate_size", d["intermediate_size"]), "num_experts": experts,
        "top_k": top_k, "moe_intermediate_size": moe_width, "num_shared_experts": 1 if shared else 0,
        "shared_intermediate_size": shared * moe_width, "first_dense_layers": first_dense,
        "num_expert_groups": groups, "topk_groups": topk_groups, "router_scoring": "sigmoid",
        "routed_scaling_factor": scaling, "norm_topk_prob": bool(cfg.get("norm_topk_prob", d["norm_topk_prob"])),
        "rope_interleave": bool(cfg.get("rope_interleave", d["rope_interleave"])), "rope_theta": theta,
        "rope_scaling": yarn, "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": _int(cfg, "max_position_embeddings", 0),
    }
    try:
        return ModelArchitecture.model_validate(fields)
    except ValueError as e:
        raise CheckpointError(CONFIG, str(e).splitlines()[-1].strip()) from e


def config_dtype(cfg: dict[str, Any]) -> DType:
    name = cfg.get("dtype", cfg.get("torch_dtype", "float32")) or "float32"
    if isinstance(name, str) and "float8" in name:
        raise UnsupportedCheckpoint(f"{CONFIG}: dtype", f"{name} checkpoints are not supported: {FP8_ADVICE}")
    if name not in CONFIG_DTYPES:
        raise UnsupportedCheckpoint(f"{CONFIG}: dtype", f"{name!r} is not one of {', '.join(CONFIG_DTYPES)}")
    return CONFIG_DTYPES[name]


# --------------------------------------------------------------------------------------------- tensors
def safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors one safetensors file declares (its header only; no tensor data is read)."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(str(path), "not a safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER:
                raise CheckpointError(str(path), f"not a safetensors file (a header of {n} bytes)")
            header = json.loads(f.read(n).decode("utf-8"))
            size = path.stat().st_size - 8 - n
    except FileNotFoundError as e:
        raise CheckpointError(str(path), "missing (named by the index)") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(str(path), f"not a safetensors file (header: {e})") from e
    except OSError as e:
        raise CheckpointError(str(path), f"cannot be read: {e.strerror or e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(str(path), "not a safetensors file (header is not an object)")
    out: dict[str, TensorInfo] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            lo, hi = (int(x) for x in info["data_offsets"])
            out[name] = TensorInfo(path.name, str(info["dtype"]), tuple(int(d) for d in info["shape"]), (lo, hi))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(str(path), f"tensor {name!r} has a malformed header entry") from e
        if hi > size:
            raise CheckpointError(str(path), f"tensor {name!r} ends at byte {hi} of a {size}-byte data section "
                                             "(a truncated file)")
    return out


def tensor_index(directory: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint: from the index's weight map when sharded, else model.safetensors."""
    index = directory / INDEX
    if index.exists():
        data = _load_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(str(index), "has no weight_map")
        files = sorted(set(weight_map.values()))
    elif (directory / SINGLE).exists():
        files, weight_map = [SINGLE], None
    else:
        raise CheckpointError(str(directory), f"holds neither {SINGLE} nor {INDEX}")
    out: dict[str, TensorInfo] = {}
    for name in files:
        if "/" in name or name.startswith("."):
            raise CheckpointError(str(index), f"names a file outside the directory: {name!r}")
        out |= safetensors_header(directory / name)
    if weight_map is not None:
        missing = sorted(k for k in weight_map if k not in out)
        if missing:
            raise CheckpointError(str(index), f"{len(missing)} tensor(s) of the weight map are in no file, "
                                              f"e.g. {missing[0]!r}")
    return out


MLA_NAMES = {"wq_a": "self_attn.q_a_proj.weight", "q_a_norm": "self_attn.q_a_layernorm.weight",
             "wq_b": "self_attn.q_b_proj.weight", "wkv_a": "self_attn.kv_a_proj_with_mqa.weight",
             "kv_a_norm": "self_attn.kv_a_layernorm.weight", "wkv_b": "self_attn.kv_b_proj.weight"}


def mla_shapes(arch: ModelArchitecture, layer: int) -> dict[str, tuple[int, ...]]:
    """Runtime name -> shape of one MLA layer's attention tensors (whole, before any TP split)."""
    d, h, r, c = arch.hidden_size, arch.num_heads, arch.q_lora_rank, arch.kv_lora_rank
    p = f"layers.{layer}."
    qk = arch.nope_head_dim + arch.rope_head_dim
    out: dict[str, tuple[int, ...]] = {}
    if r:
        out |= {p + "wq_a": (r, d), p + "q_a_norm": (r,), p + "wq_b": (h * qk, r)}
    else:
        out[p + "wq"] = (h * qk, d)
    return out | {p + "wkv_a": (c + arch.rope_head_dim, d), p + "kv_a_norm": (c,),
                  p + "wkv_b": (h * (arch.nope_head_dim + arch.v_head_dim), c), p + "wo": (d, h * arch.v_head_dim)}


def hf_name(arch: ModelArchitecture, name: str) -> str:
    """The Hugging Face tensor name of a runtime tensor name (see the module docstring)."""
    if name == "embed" or (name == "lm_head" and arch.tie_word_embeddings):
        return "model.embed_tokens.weight"
    if name == "lm_head":
        return "lm_head.weight"
    if name == "norm":
        return "model.norm.weight"
    _, layer, rest = name.split(".", 2)
    p = f"model.layers.{layer}."
    simple = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "wq": "self_attn.q_proj",
              "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
              "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm", "ffn.w1": "mlp.gate_proj",
              "ffn.w3": "mlp.up_proj", "ffn.w2": "mlp.down_proj"}
    if rest in simple:
        return p + simple[rest] + ".weight"
    if rest in MLA_NAMES:
        return p + MLA_NAMES[rest]
    moe = "block_sparse_moe" if arch.family == "mixtral" else "mlp"
    if rest == "router":
        return f"{p}{moe}.gate.weight"
    if rest == "router_bias":
        return f"{p}mlp.gate.e_score_correction_bias"
    if rest.startswith("shared."):  # shared.0.w1: DeepSeek's one fused shared expert
        return f"{p}mlp.shared_experts.{ {'w1': 'gate_proj', 'w3': 'up_proj', 'w2': 'down_proj'}[rest[-2:]]}.weight"
    _, expert, which = rest.split(".")  # experts.{e}.w1
    if arch.family == "mixtral":
        return f"{p}{moe}.experts.{expert}.{which}.weight"
    return f"{p}{moe}.experts.{expert}.{ {'w1': 'gate_proj', 'w3': 'up_proj', 'w2': 'down_proj'}[which]}.weight"


def expected_shapes(arch: ModelArchitecture) -> dict[str, tuple[int, ...]]:
    """Runtime tensor name -> shape, for every tensor of the checkpoint (routed experts one by one)."""
    d, v, dh = arch.hidden_size, arch.vocab_size, arch.dim_head
    hq, hkv = arch.num_heads, arch.kv_heads
    out: dict[str, tuple[int, ...]] = {"embed": (v, d), "norm": (d,), "lm_head": (v, d)}
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        out |= {p + "attn_norm": (d,), p + "ffn_norm": (d,)}
        if arch.attention_type is AttentionType.MLA:
            out |= mla_shapes(arch, i)
        else:
            out |= {p + "wq": (hq * dh, d), p + "wk": (hkv * dh, d), p + "wv": (hkv * dh, d), p + "wo": (d, hq * dh)}
        if arch.qk_norm:
            out |= {p + "q_norm": (dh,), p + "k_norm": (dh,)}
        if arch.is_moe_layer(i):
            w = arch.moe_intermediate_size
            out[p + "router"] = (arch.num_experts, d)
            if arch.router_scoring == "sigmoid":
                out[p + "router_bias"] = (arch.num_experts,)
            if arch.family in MLA_FAMILIES and arch.num_shared_experts:
                sw = arch.shared_width
                out |= {p + "shared.0.w1": (sw, d), p + "shared.0.w3": (sw, d), p + "shared.0.w2": (d, sw)}
            for e in range(arch.num_experts):
                out |= {p + f"experts.{e}.w1": (w, d), p + f"experts.{e}.w3": (w, d), p + f"experts.{e}.w2": (d, w)}
        else:
            w = arch.intermediate_size
            out |= {p + "ffn.w1": (w, d), p + "ffn.w3": (w, d), p + "ffn.w2": (d, w)}
    return out


def check_tensors(arch: ModelArchitecture, tensors: dict[str, TensorInfo]) -> None:
    """Every tensor the architecture needs is present with its shape and a supported dtype."""
    for name, shape in expected_shapes(arch).items():
        key = hf_name(arch, name)
        info = tensors.get(key)
        if info is None:
            raise CheckpointError(key, "missing from the checkpoint (a missing shard, or another architecture)")
        if info.dtype in FP8:
            raise UnsupportedCheckpoint(f"{info.file}: {key}", f"{info.dtype} tensors are not supported: {FP8_ADVICE}")
        if info.dtype not in DTYPES:
            raise CheckpointError(f"{info.file}: {key}", f"dtype {info.dtype} is not one of {', '.join(DTYPES)}")
        if info.shape != shape:
            raise CheckpointError(f"{info.file}: {key}", f"shape {list(info.shape)}, the config implies {list(shape)}")


def _token_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


def inspect(directory: Path) -> Checkpoint:
    """Read and check a checkpoint directory; CheckpointError (or UnsupportedCheckpoint) names what is wrong."""
    cfg = read_config(directory)
    arch = architecture_from_config(cfg)
    dtype = config_dtype(cfg)
    tensors = tensor_index(directory)
    check_tensors(arch, tensors)
    gen: dict[str, Any] = {}
    if (directory / GENERATION_CONFIG).exists():
        loaded = _load_json(directory / GENERATION_CONFIG)
        gen = loaded if isinstance(loaded, dict) else {}
    eos = _token_ids(gen.get("eos_token_id")) or _token_ids(cfg.get("eos_token_id"))
    bos = _token_ids(gen.get("bos_token_id")) or _token_ids(cfg.get("bos_token_id"))
    return Checkpoint(directory=directory, model_type=str(cfg["model_type"]), architecture=arch, dtype=dtype,
                      tensors=tensors, eos_token_ids=eos, bos_token_id=bos[0] if bos else None,
                      has_tokenizer=(directory / TOKENIZER).exists())


def mla_summary(arch: ModelArchitecture) -> list[str]:
    """The MLA block `shardwise model inspect` prints (nothing for other attention): the query and latent
    shapes, the KV cache per token next to the GQA/MHA cache of the same heads, RoPE, and DeepSeek routing."""
    if arch.attention_type is not AttentionType.MLA:
        return []
    h, nope, rd, v = arch.num_heads, arch.nope_head_dim, arch.rope_head_dim, arch.v_head_dim
    latent = arch.kv_lora_rank + rd
    query = f"q LoRA rank {arch.q_lora_rank} (q_a, RMSNorm, q_b)" if arch.q_lora_rank else "plain q_proj"
    y = arch.rope_scaling
    pairs = "interleaved pairs" if arch.rope_interleave else "halves"
    rope_line = f"RoPE theta {arch.rope_theta:g} on {rd} dims, {pairs}"
    if y is not None:
        rope_line += (f", YaRN factor {y.factor:g} of {y.original_max_position_embeddings} positions "
                      f"(mscale {y.mscale:g}, mscale_all_dim {y.mscale_all_dim:g})")
    lines = [
        f"MLA: {h} heads x (nope {nope} + rope {rd}) query/key dims, value {v}; {query}",
        f"MLA KV cache: latent {arch.kv_lora_rank} + rope key {rd} = {latent} values per token per layer, the same "
        f"on every TP rank (MHA of these heads: {h * (nope + rd + v)})",
        rope_line,
    ]
    if arch.is_moe:
        per = arch.num_experts // arch.num_expert_groups
        lines.append(f"routing: {arch.router_scoring} scores, {arch.num_experts} experts in {arch.num_expert_groups} "
                     f"groups of {per}, {arch.topk_groups} group(s) kept, top {arch.top_k}, "
                     f"{'renormalised' if arch.norm_topk_prob else 'not renormalised'}, "
                     f"x {arch.routed_scaling_factor:g}; "
                     f"shared width {arch.shared_width if arch.num_shared_experts else 0}; "
                     f"{arch.first_dense_layers} dense layer(s) first")
    return lines


def mismatches(planned: ModelArchitecture, actual: ModelArchitecture) -> list[str]:
    """The fields on which a checkpoint's architecture differs from the one a plan was made for, with both
    values, e.g. ["numKvHeads: planned 4, checkpoint 2"]."""
    shape = {"numLayers": "num_layers", "hiddenSize": "hidden_size", "vocabSize": "vocab_size",
             "numHeads": "num_heads", "numKvHeads": "kv_heads", "headDim": "dim_head",
             "intermediateSize": "intermediate_size", "numExperts": "num_experts", "topK": "top_k",
             "moeIntermediateSize": "moe_intermediate_size", "numSharedExperts": "num_shared_experts",
             "firstDenseLayers": "first_dense_layers"}
    out = []
    for label, attr in shape.items():
        p, c = getattr(planned, attr), getattr(actual, attr)
        if p != c:
            out.append(f"{label}: planned {p}, checkpoint {c}")
    return out


def model_architecture(preset: str, weights_dir: str | Path | None) -> ModelArchitecture:
    """The architecture a runtime computes: a Hugging Face checkpoint's config, the config shardwise wrote
    next to seeded weights (`shardwise weights generate`), or the named preset when there is no directory."""
    if not weights_dir:
        from shardwise.presets import model_preset

        return model_preset(preset)
    cfg = read_config(Path(weights_dir))
    if "model_type" in cfg:
        return architecture_from_config(cfg)
    if "architecture" not in cfg:
        raise CheckpointError(str(Path(weights_dir) / CONFIG), "has neither model_type (a Hugging Face checkpoint) "
                                                               "nor architecture (seeded weights)")
    return ModelArchitecture.model_validate(cfg["architecture"])


def sampling_defaults(weights_dir: str | Path | None) -> tuple[float, float, int]:
    """(temperature, top_p, top_k) a checkpoint asks for in generation_config.json, applied as vLLM applies
    them (the values present; `do_sample` is not read); absent values are OpenAI's defaults (1, 1, all)."""
    if not weights_dir or not (Path(weights_dir) / GENERATION_CONFIG).exists():
        return 1.0, 1.0, 0
    gen = _load_json(Path(weights_dir) / GENERATION_CONFIG)
    if not isinstance(gen, dict):
        return 1.0, 1.0, 0

    def number(key: str, default: float) -> float:
        v = gen.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else default

    return number("temperature", 1.0), number("top_p", 1.0), int(number("top_k", 0))
