"""The per-rank memory ledger (docs/domain.md section 1).

    M_rank = M_weights + M_activations + M_kv + M_workspace  <=  GPU memory x memoryFraction

Weights are counted sub-layer by sub-layer as the runtime really shards them:

- attention Q/O: split by TP over whole heads (`h_q / TP` heads per rank);
- attention K/V (GQA/MHA): split by TP down to one KV head per rank; when TP > h_kv every rank keeps one
  KV head, so the K/V weights and the KV cache are replicated `TP / h_kv` times;
- MLA: the down-projections (q_a, kv_a) are replicated on every TP rank, the up-projections (q_b, kv_b)
  and O are split by heads; the latent KV cache `(kv_lora_rank + rope_dim)` per token is the same on every
  TP rank (TP replicates it; DPA and CP divide it);
- dense FFN (SwiGLU, 3 matrices): split by the attention TP group; DPA and CP groups hold copies;
- MoE: the router (and a sigmoid router's correction bias) is replicated; routed experts are divided by EP
  and MoE-TP, `(E + redundant) / EP` expert slots per rank; shared experts are split by the attention TP
  group;
- embedding (first stage) and LM head (last stage): split by vocabulary over the TP group; a tied LM head
  on a single stage is counted once.

The KV cache takes whatever the budget leaves (as vLLM sizes its pool), rounded down to whole tokens, so
`kvCapacityTokens = floor(free budget / kvBytesPerToken)`. `kvBytesPerToken` is one token's KV cache on
this rank over all the layers the rank holds. CP divides the sequence: one request of length S needs
`ceil(S / CP)` token slots on each CP rank.

Activations are the peak tensors of one forward for the tokens in flight (`T = ceil(maxBatchTokens / CP)`
per rank): residual and normed hidden states (2D), the local Q/K/V projections, and the larger of the
dense FFN intermediate (`2 I / TP`, gate and up) and the MoE buffers (received tokens x (2D + 2 I_moe /
moeTP)). FlashAttention-style kernels never store the S x S score matrix, and only sampled positions
reach the LM head, so neither appears.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardwise.api import AttentionType, ModelArchitecture

MiB = 1024**2


@dataclass(frozen=True)
class Sharding:
    """How one rank of one pipeline stage is sharded: the numbers the ledger and cost model need."""

    tp: int
    cp: int
    dpa: int
    pp: int
    ep: int
    moe_tp: int
    ep_replicas: int
    expert_slots: int  # routed experts + redundant, per MoE layer, across one EP group
    layers: int  # layers on this stage
    moe_layers: int  # of which MoE layers
    first_stage: bool
    last_stage: bool

    @property
    def slots_per_rank(self) -> int:
        return self.expert_slots // self.ep if self.ep else 0

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers


@dataclass(frozen=True)
class WeightBreakdown:
    """Parameters on one rank, by sub-layer (all layers of the stage summed)."""

    attention: int
    dense_ffn: int
    router: int
    routed_experts: int
    shared_experts: int
    embedding: int
    lm_head: int
    norms: int

    @property
    def total(self) -> int:
        return (
            self.attention + self.dense_ffn + self.router + self.routed_experts
            + self.shared_experts + self.embedding + self.lm_head + self.norms
        )


@dataclass(frozen=True)
class LedgerEntry:
    weights_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    activation_bytes: int
    workspace_bytes: int
    budget_bytes: int
    memory_bytes: int
    kv_capacity_tokens: int
    kv_capacity_requests: int
    weights: WeightBreakdown

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.activation_bytes + self.workspace_bytes

    @property
    def free_bytes(self) -> int:
        """Device memory left outside the runtime's budget (and below it, the KV rounding remainder)."""
        return self.memory_bytes - self.total_bytes

    @property
    def fixed_bytes(self) -> int:
        """What must fit before any KV cache: weights, activations and workspace."""
        return self.weights_bytes + self.activation_bytes + self.workspace_bytes


def kv_heads_per_rank(arch: ModelArchitecture, tp: int) -> int:
    """KV heads a TP rank holds: split down to one, replicated beyond (GQA/MHA)."""
    return max(1, arch.kv_heads // tp)


def q_heads_per_rank(arch: ModelArchitecture, tp: int) -> int:
    return arch.num_heads // tp


def attention_params_per_layer(arch: ModelArchitecture, tp: int) -> int:
    d, hq = arch.hidden_size, q_heads_per_rank(arch, tp)
    if arch.attention_type is AttentionType.MLA:
        qk, v = arch.qk_head_dim, arch.v_head_dim
        r = arch.q_lora_rank
        q = d * r + r + r * hq * qk if r else d * hq * qk
        kv_a = d * (arch.kv_lora_rank + arch.rope_head_dim) + arch.kv_lora_rank
        kv_b = arch.kv_lora_rank * hq * (arch.nope_head_dim + v)
        return q + kv_a + kv_b + hq * v * d
    dh, hkv = arch.dim_head, kv_heads_per_rank(arch, tp)
    return d * hq * dh + 2 * d * hkv * dh + hq * dh * d


def kv_bytes_per_token_per_layer(arch: ModelArchitecture, tp: int, kv_dtype_bytes: int) -> int:
    if arch.attention_type is AttentionType.MLA:
        return (arch.kv_lora_rank + arch.rope_head_dim) * kv_dtype_bytes
    return 2 * kv_heads_per_rank(arch, tp) * arch.dim_head * kv_dtype_bytes


def weight_breakdown(arch: ModelArchitecture, s: Sharding) -> WeightBreakdown:
    d = arch.hidden_size
    vocab_shard = math.ceil(arch.vocab_size / s.tp) * d
    embedding = vocab_shard if s.first_stage else 0
    tied_once = arch.tie_word_embeddings and s.first_stage and s.last_stage
    lm_head = vocab_shard if s.last_stage and not tied_once else 0
    expert = 3 * d * arch.moe_intermediate_size // s.moe_tp
    return WeightBreakdown(
        attention=s.layers * attention_params_per_layer(arch, s.tp),
        dense_ffn=s.dense_layers * 3 * d * arch.intermediate_size // s.tp,
        router=s.moe_layers * (d + (arch.router_scoring == "sigmoid")) * arch.num_experts,  # + correction bias
        routed_experts=s.moe_layers * s.slots_per_rank * expert,
        shared_experts=s.moe_layers * arch.num_shared_experts * 3 * d * arch.shared_width // s.tp,
        embedding=embedding,
        lm_head=lm_head,
        norms=s.layers * 2 * d + (d if s.last_stage else 0),
    )


def moe_tokens_per_rank(arch: ModelArchitecture, s: Sharding, tokens_per_group: int) -> float:
    """Token-expert pairs a rank computes in one MoE layer when every attention group runs
    `tokens_per_group` tokens and the routing is balanced."""
    if not s.moe_layers:
        return 0.0
    return tokens_per_group * s.dpa * arch.top_k / (s.ep * s.ep_replicas)


def activation_bytes(arch: ModelArchitecture, s: Sharding, max_batch_tokens: int, act_bytes: int) -> int:
    d = arch.hidden_size
    t = math.ceil(max_batch_tokens / s.cp)
    hq = q_heads_per_rank(arch, s.tp)
    if arch.attention_type is AttentionType.MLA:
        qkv = hq * (arch.qk_head_dim + arch.qk_head_dim + arch.v_head_dim) + arch.kv_lora_rank
    else:
        qkv = hq * arch.dim_head + 2 * kv_heads_per_rank(arch, s.tp) * arch.dim_head
    ffn = 2 * arch.intermediate_size // s.tp * t if s.dense_layers else 0
    if s.moe_layers:
        recv = math.ceil(moe_tokens_per_rank(arch, s, max_batch_tokens))
        shared = t * 2 * arch.num_shared_experts * arch.shared_width // s.tp
        ffn = max(ffn, recv * (2 * d + 2 * arch.moe_intermediate_size // s.moe_tp) + shared)
    return (t * (2 * d + qkv) + ffn) * act_bytes


def ledger_entry(
    arch: ModelArchitecture,
    s: Sharding,
    *,
    memory_bytes: int,
    memory_fraction: float,
    max_batch_tokens: int,
    max_model_len: int,
    workspace_bytes: int,
    weight_dtype_bytes: int,
    kv_dtype_bytes: int,
) -> LedgerEntry:
    weights = weight_breakdown(arch, s)
    weights_bytes = weights.total * weight_dtype_bytes
    act = activation_bytes(arch, s, max_batch_tokens, weight_dtype_bytes)
    per_token = s.layers * kv_bytes_per_token_per_layer(arch, s.tp, kv_dtype_bytes)
    budget = int(memory_bytes * memory_fraction)
    pool = max(0, budget - weights_bytes - act - workspace_bytes)
    tokens = pool // per_token
    return LedgerEntry(
        weights_bytes=weights_bytes,
        kv_cache_bytes=tokens * per_token,
        kv_bytes_per_token=per_token,
        activation_bytes=act,
        workspace_bytes=workspace_bytes,
        budget_bytes=budget,
        memory_bytes=memory_bytes,
        kv_capacity_tokens=tokens,
        kv_capacity_requests=tokens // math.ceil(max_model_len / s.cp),
        weights=weights,
    )
