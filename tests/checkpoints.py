"""Small random-weight Hugging Face checkpoints made by transformers itself, and transformers' greedy decode
on them in float64: the independent oracle of every test that serves a checkpoint. Nothing is downloaded.

`make_checkpoint(dir, family)` writes config.json and safetensors with `save_pretrained` (sharded into many
files when `shard=True`), a byte-level BPE tokenizer trained here with the `tokenizers` library and saved by
transformers' `PreTrainedTokenizerFast` together with a ChatML chat template, and generation_config.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "elastic expert parallel inference on many GPUs",
    "attention groups serve their own requests with their own KV cache",
    "a router sends each request to the group that can start it soonest",
    "hello world, hello shardwise: tensors, pipelines and experts",
] * 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Odd sizes on purpose: 3 layers, 6 query heads over 2 or 3 KV heads, 5 or 6 experts, a vocabulary of 331.
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(vocab_size=331, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
                      num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                      num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512),
    "mixtral": dict(vocab_size=331, hidden_size=48, intermediate_size=40, num_hidden_layers=3,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=32, num_local_experts=5,
                    num_experts_per_tok=2, max_position_embeddings=512, rope_theta=1_000_000.0),
    "qwen3": dict(vocab_size=331, hidden_size=48, intermediate_size=72, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=3, head_dim=32, max_position_embeddings=512),
    "llama": dict(vocab_size=331, hidden_size=64, intermediate_size=72, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=True),
    # MLA with a query LoRA, interleaved RoPE under YaRN (attention factor and softmax mscale both != 1), a first
    # dense layer, group-limited routing (3 groups of 2, 2 kept, top 3) with a random correction bias, a shared
    # expert, renormalised weights times 2.5
    "deepseek_v3": dict(vocab_size=331, hidden_size=48, intermediate_size=40, moe_intermediate_size=14,
                        num_hidden_layers=3, num_attention_heads=6, q_lora_rank=19, kv_lora_rank=23,
                        qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=6, n_group=3,
                        topk_group=2, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
                        max_position_embeddings=512,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 128, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7}),
    # MLA with a plain q_proj and RoPE on halves, every layer MoE (2 groups of 3, 1 kept, top 2) with two shared
    # experts (one fused SwiGLU of 2 x 14), weights not renormalised, times 1.7
    "deepseek_v3_plain": dict(vocab_size=331, hidden_size=40, intermediate_size=40, moe_intermediate_size=14,
                              num_hidden_layers=3, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=17,
                              qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=12, n_routed_experts=6, n_group=2,
                              topk_group=1, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=0,
                              routed_scaling_factor=1.7, norm_topk_prob=False, rope_interleave=False,
                              max_position_embeddings=512, rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 5000.0}),
}


def _classes(family: str) -> tuple[Any, Any]:
    import transformers as tf

    return {
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
        "deepseek_v3_plain": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
    }[family]


def make_tokenizer(directory: Path, vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(directory))
    return fast


def make_checkpoint(directory: Path, family: str, *, seed: int = 0, shard: bool = False, tokenizer: bool = True,
                    **overrides: Any) -> Path:
    """A random checkpoint of `family` in `directory` (weights float32 on disk, as most checkpoints are)."""
    import torch

    config_cls, model_cls = _classes(family)
    kwargs = FAMILIES[family] | overrides
    directory.mkdir(parents=True, exist_ok=True)
    fast = make_tokenizer(directory, 300) if tokenizer else None
    eos = fast.convert_tokens_to_ids("<|im_end|>") if fast is not None else 2
    config = config_cls(**kwargs, eos_token_id=eos, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # transformers' init is small-std: widen it so greedy decoding visits many tokens
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
        for name, buf in model.named_buffers():  # DeepSeek's correction bias: saved, and it changes the choice
            if name.endswith("e_score_correction_bias"):
                buf.uniform_(-0.3, 0.3)
    model.generation_config.eos_token_id = eos
    model.save_pretrained(str(directory), max_shard_size="60KB" if shard else "1GB")
    return directory


_LOADED: dict[tuple[Path, str], Any] = {}


def transformers_model(directory: Path, dtype: str = "float64") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    key = (directory.resolve(), dtype)
    if key not in _LOADED:
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=getattr(torch, dtype),
                                                     experts_implementation="eager")
        _LOADED[key] = model.eval()
    return _LOADED[key]


def greedy(directory: Path, prompt: list[int], max_new_tokens: int, dtype: str = "float64") -> list[int]:
    """transformers' greedy decode on CPU (float64 unless told: vLLM is compared with its float32 run): the new
    token ids (stops at the checkpoint's EOS)."""
    import torch

    model = transformers_model(directory, dtype)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]
