"""Model and GPU presets: public model configs and GPU data sheets (docs/domain.md section 3).

GPU memory is given as marketed (141 GB, 80 GB, ...) and read as GiB, which is what the devices report
(an H200 shows about 140 GiB). Bandwidths are bytes per second, FLOPs dense BF16 per second.
`nvlink_bandwidth` is bidirectional, as data sheets state it; one direction is half of it.
`network_bandwidth` is the per-GPU scale-out link (400 Gb/s NICs, one per GPU) used when a group spans pods.

Lookup is case-insensitive; unknown names raise `UnknownPreset` with the known names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from shardwise.api import AttentionType, ModelArchitecture

GiB = 1024**3
T = TypeVar("T")


class UnknownPreset(KeyError):
    """A preset name nobody defined; the message lists the known names."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        super().__init__(name)
        self.message = f"unknown {kind} preset {name!r}; known: {', '.join(known)}"

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    hbm_bandwidth: float  # bytes/s
    peak_flops: float  # dense BF16 FLOP/s
    nvlink_bandwidth: float  # bytes/s, bidirectional
    network_bandwidth: float  # bytes/s per GPU, one direction
    default_gpus_per_node: int

    @property
    def link_bandwidth_one_way(self) -> float:
        return self.nvlink_bandwidth / 2


MODEL_PRESETS: dict[str, ModelArchitecture] = {
    "Qwen3-235B-A22B": ModelArchitecture(
        num_layers=94, hidden_size=4096, vocab_size=151936, attention_type=AttentionType.GQA,
        num_heads=64, num_kv_heads=4, head_dim=128, intermediate_size=12288,
        num_experts=128, top_k=8, moe_intermediate_size=1536, rope_theta=1_000_000.0,
        max_position_embeddings=40960,
    ),
    "Qwen3-30B-A3B": ModelArchitecture(
        num_layers=48, hidden_size=2048, vocab_size=151936, attention_type=AttentionType.GQA,
        num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144,
        num_experts=128, top_k=8, moe_intermediate_size=768, rope_theta=1_000_000.0,
        max_position_embeddings=40960,
    ),
    "DeepSeek-V3": ModelArchitecture(
        num_layers=61, hidden_size=7168, vocab_size=129280, attention_type=AttentionType.MLA,
        num_heads=128, q_lora_rank=1536, kv_lora_rank=512, rope_head_dim=64, nope_head_dim=128,
        v_head_dim=128, intermediate_size=18432, num_experts=256, top_k=8, moe_intermediate_size=2048,
        num_shared_experts=1, first_dense_layers=3, num_expert_groups=8, topk_groups=4,
        max_position_embeddings=163840,
    ),
    "Llama-3.1-405B": ModelArchitecture(
        num_layers=126, hidden_size=16384, vocab_size=128256, attention_type=AttentionType.GQA,
        num_heads=128, num_kv_heads=8, head_dim=128, intermediate_size=53248, rope_theta=500000.0,
        max_position_embeddings=131072,
    ),
    "Mixtral-8x7B": ModelArchitecture(
        num_layers=32, hidden_size=4096, vocab_size=32000, attention_type=AttentionType.GQA,
        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336,
        num_experts=8, top_k=2, moe_intermediate_size=14336, rope_theta=1_000_000.0,
        max_position_embeddings=32768,
    ),
    # Small enough for the CPU reference runtime: a byte-level vocabulary (256 bytes + 4 specials). Seeded, never
    # trained: their 4096 positions are a choice (RoPE computes any position), the default maxModelLen.
    "tiny-moe": ModelArchitecture(
        num_layers=4, hidden_size=64, vocab_size=260, attention_type=AttentionType.GQA,
        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
        num_experts=16, top_k=2, moe_intermediate_size=32, num_shared_experts=1, max_position_embeddings=4096,
    ),
    "tiny-dense": ModelArchitecture(
        num_layers=4, hidden_size=64, vocab_size=260, attention_type=AttentionType.GQA,
        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=4096,
    ),
}

GPU_PRESETS: dict[str, GpuSpec] = {
    "H200": GpuSpec("H200", 141 * GiB, 4.8e12, 989e12, 900e9, 50e9, 8),
    "H100": GpuSpec("H100", 80 * GiB, 3.35e12, 989e12, 900e9, 50e9, 8),
    "B200": GpuSpec("B200", 180 * GiB, 8.0e12, 2.25e15, 1.8e12, 50e9, 8),
    "A100-80GB": GpuSpec("A100-80GB", 80 * GiB, 2.039e12, 312e12, 600e9, 25e9, 8),
    # A development "device": one CPU process with a few GiB, for the CPU reference runtime.
    "cpu": GpuSpec("cpu", 4 * GiB, 20e9, 100e9, 10e9, 10e9, 2),
}


def _lookup(table: dict[str, T], kind: str, name: str) -> T:
    for key, value in table.items():
        if key.lower() == name.lower():
            return value
    raise UnknownPreset(kind, name, list(table))


def model_preset(name: str) -> ModelArchitecture:
    return _lookup(MODEL_PRESETS, "model", name)


def gpu_preset(name: str) -> GpuSpec:
    return _lookup(GPU_PRESETS, "gpu", name)
