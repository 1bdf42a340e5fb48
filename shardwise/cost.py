"""Traffic per rank and roofline estimates for one step (docs/domain.md section 2).

Notation: B requests per attention group (per micro-batch with PP), S the context (decode) or the prompt
length (prefill), D hidden size, b bytes per element. Tokens one attention group runs in a step:
`B` in decode, `B * S` in prefill.

- TP: two AllReduces per block, each of `N = tokens * D * b` bytes (independent of head counts); a ring
  AllReduce sends `2 (TP-1)/TP * N` per rank. Qwen3-235B-A22B, TP=8, decode B=64: N = 512 KiB, 0.875 MiB
  sent per rank, 2 x 94 AllReduces per step.
- EP: dispatch and combine, two all-to-alls per MoE layer; with `B*S` tokens over the EP group each rank
  sends `(B*S / EP) * k * D * b * (1 - 1/EP)`.
- CP prefill (pcp, ring attention): each rank keeps its Q and passes its K/V block around the ring,
  `(CP-1) * M_KV/rank` per layer. CP decode (dcp, vLLM's ag_rs path): AllGather Q, then ReduceScatter the
  LSE-weighted partial O: `(CP-1)/CP * (M_Q + M_O)` per layer (the LSE is small and left out); the a2a
  path exchanges partial O and LSE in one all-to-all, `(CP-1)/CP * (M_O + M_LSE)`. MLA runs DCP in the
  absorbed form: a query is `kv_lora + rope` values per head and a partial output `kv_lora` (the latent,
  projected by W_UV only after the merge).
- PP: one send of `tokens * D * b` per stage boundary.

Roofline lower bounds of a step: memory = (weights read + KV read) / HBM bandwidth, compute = FLOPs /
peak, communication = bytes / link bandwidth (one direction of NVLink inside a pod, the per-GPU network
across pods). The step estimate assumes compute overlaps memory but not communication:
`step = max(compute, memory) + comm`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from shardwise.api import AttentionType, ModelArchitecture
from shardwise.ledger import (
    Sharding,
    attention_params_per_layer,
    kv_bytes_per_token_per_layer,
    moe_tokens_per_rank,
    q_heads_per_rank,
    weight_breakdown,
)


class Phase(StrEnum):
    DECODE = "decode"
    PREFILL = "prefill"


@dataclass(frozen=True)
class Workload:
    phase: Phase = Phase.DECODE
    batch: int = 64  # requests per attention group (per micro-batch)
    context: int = 4096  # decode: tokens already in the KV cache; prefill: prompt length

    @property
    def tokens_per_group(self) -> int:
        return self.batch if self.phase is Phase.DECODE else self.batch * self.context


@dataclass(frozen=True)
class Links:
    """Bandwidths (bytes/s, one direction) seen by each kind of group, given where it sits."""

    tp: float
    cp: float
    ep: float
    pp: float


@dataclass(frozen=True)
class Traffic:
    tp_all_reduce_bytes_per_rank: int
    tp_all_reduces_per_step: int
    tp_message_bytes: int
    ep_all_to_all_bytes_per_rank: int
    ep_all_to_alls_per_step: int
    cp_bytes_per_rank: int  # one layer
    cp_a2a_bytes_per_rank: int  # one layer, decode a2a path
    cp_ops_per_step: int
    pp_send_bytes_per_rank: int

    def seconds_per_step(self, links: Links) -> dict[str, float]:
        """Seconds each kind of traffic takes in one step at the given link bandwidths."""
        return {
            "tp": self.tp_all_reduce_bytes_per_rank * self.tp_all_reduces_per_step / links.tp,
            "ep": self.ep_all_to_all_bytes_per_rank * self.ep_all_to_alls_per_step / links.ep,
            "cp": self.cp_bytes_per_rank * self.cp_ops_per_step / links.cp,
            "pp": self.pp_send_bytes_per_rank / links.pp,
        }


@dataclass(frozen=True)
class Estimate:
    compute_seconds: float
    memory_seconds: float
    comm_seconds: float
    flops: float
    bytes_read: float

    @property
    def step_seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds) + self.comm_seconds


def ring_all_reduce_send_bytes(message_bytes: int, group: int) -> int:
    """Bytes one rank sends in a ring AllReduce of `message_bytes` over `group` ranks."""
    return 2 * (group - 1) * message_bytes // group if group > 1 else 0


def tokens_per_rank(w: Workload, cp: int) -> int:
    """Tokens whose hidden states one rank computes: prefill splits the sequence over CP, decode does not
    (every DCP rank needs the same new queries)."""
    return math.ceil(w.tokens_per_group / cp) if w.phase is Phase.PREFILL else w.tokens_per_group


def pcp_send_bytes(arch: ModelArchitecture, tp: int, cp: int, batch: int, seq: int, kv_b: int) -> int:
    """Ring attention, one layer: (CP-1) blocks of this rank's K/V shard."""
    local_tokens = batch * math.ceil(seq / cp)
    return (cp - 1) * local_tokens * kv_bytes_per_token_per_layer(arch, tp, kv_b)


def dcp_widths(arch: ModelArchitecture) -> tuple[int, int]:
    """(query, partial output) values per head that DCP exchanges: MLA's latent-space query (kv_lora + rope)
    and latent output (kv_lora); the q/k and v head widths otherwise."""
    if arch.attention_type is AttentionType.MLA:
        return arch.kv_lora_rank + arch.rope_head_dim, arch.kv_lora_rank
    return arch.qk_head_dim, arch.value_head_dim


def dcp_send_bytes(arch: ModelArchitecture, tp: int, cp: int, batch: int, b: int) -> int:
    """DCP ag_rs path, one layer: (CP-1)/CP * (M_Q + M_O)."""
    hq = q_heads_per_rank(arch, tp)
    q_width, o_width = dcp_widths(arch)
    m_q = batch * hq * q_width * b
    m_o = batch * hq * o_width * b
    return (cp - 1) * (m_q + m_o) // cp


def dcp_a2a_send_bytes(arch: ModelArchitecture, tp: int, cp: int, batch: int, b: int) -> int:
    """DCP a2a path, one layer: (CP-1)/CP * (M_O + M_LSE), the LSE in float32."""
    hq = q_heads_per_rank(arch, tp)
    return (cp - 1) * (batch * hq * dcp_widths(arch)[1] * b + batch * hq * 4) // cp


def traffic(arch: ModelArchitecture, s: Sharding, w: Workload, b: int, kv_b: int) -> Traffic:
    t_rank = tokens_per_rank(w, s.cp)
    message = t_rank * arch.hidden_size * b
    ep_tokens = w.tokens_per_group * s.dpa / (s.ep * s.ep_replicas)
    ep_bytes = int(ep_tokens * arch.top_k * arch.hidden_size * b * (1 - 1 / s.ep)) if s.moe_layers else 0
    if s.cp > 1 and w.phase is Phase.PREFILL:
        cp_bytes = pcp_send_bytes(arch, s.tp, s.cp, w.batch, w.context, kv_b)
        cp_a2a = cp_bytes
    elif s.cp > 1:
        cp_bytes = dcp_send_bytes(arch, s.tp, s.cp, w.batch, b)
        cp_a2a = dcp_a2a_send_bytes(arch, s.tp, s.cp, w.batch, b)
    else:
        cp_bytes = cp_a2a = 0
    return Traffic(
        tp_all_reduce_bytes_per_rank=ring_all_reduce_send_bytes(message, s.tp),
        tp_all_reduces_per_step=2 * s.layers if s.tp > 1 else 0,
        tp_message_bytes=message,
        ep_all_to_all_bytes_per_rank=ep_bytes,
        ep_all_to_alls_per_step=2 * s.moe_layers if s.ep > 1 else 0,
        cp_bytes_per_rank=cp_bytes,
        cp_a2a_bytes_per_rank=cp_a2a,
        cp_ops_per_step=s.layers if s.cp > 1 else 0,
        pp_send_bytes_per_rank=message if s.pp > 1 and not s.last_stage else 0,
    )


def attention_score_flops(
    arch: ModelArchitecture, tp: int, queries: int, keys_per_query: float, batch: int = 1
) -> float:
    """QK^T and PV of one layer on one TP rank: 2 * q * k * h * (d_qk + d_v)."""
    hq = q_heads_per_rank(arch, tp)
    return 2.0 * batch * queries * keys_per_query * hq * (arch.qk_head_dim + arch.value_head_dim)


def attention_projection_flops(arch: ModelArchitecture, tp: int, tokens: int) -> float:
    return 2.0 * tokens * attention_params_per_layer(arch, tp)


def expected_distinct(slots: int, draws: float) -> float:
    """Expected distinct local expert slots touched by `draws` uniformly routed token-expert pairs."""
    if slots <= 0:
        return 0.0
    return float(slots * (1.0 - (1.0 - 1.0 / slots) ** draws))


def estimate(
    arch: ModelArchitecture,
    s: Sharding,
    w: Workload,
    *,
    b: int,
    kv_b: int,
    peak_flops: float,
    hbm_bandwidth: float,
    links: Links,
    cp_keys_busiest: float,
) -> Estimate:
    """Roofline of one step on one rank of a stage. `cp_keys_busiest` is, for prefill, the causal K/V
    positions processed by the busiest CP rank for one sequence (from `shardwise.cp.causal_work`)."""
    d = arch.hidden_size
    t_rank = tokens_per_rank(w, s.cp)
    wb = weight_breakdown(arch, s)
    if w.phase is Phase.DECODE:
        score = attention_score_flops(arch, s.tp, w.batch, w.context / s.cp)
        kv_read = w.batch * (w.context / s.cp) * s.layers * kv_bytes_per_token_per_layer(arch, s.tp, kv_b)
    else:
        score = attention_score_flops(arch, s.tp, 1, cp_keys_busiest, batch=w.batch)
        kv_read = w.batch * math.ceil(w.context / s.cp) * s.layers * kv_bytes_per_token_per_layer(
            arch, s.tp, kv_b
        )
    recv = moe_tokens_per_rank(arch, s, w.tokens_per_group)
    expert_params = 3 * d * arch.moe_intermediate_size // s.moe_tp
    sampled = w.batch if s.last_stage else 0
    flops = (
        s.layers * (attention_projection_flops(arch, s.tp, t_rank) + score)
        + 2.0 * t_rank * (wb.dense_ffn + wb.shared_experts + wb.router)
        + 2.0 * recv * expert_params * s.moe_layers
        + 2.0 * sampled * wb.lm_head
    )
    touched = expected_distinct(s.slots_per_rank, recv) * expert_params * s.moe_layers
    non_expert = wb.total - wb.routed_experts - wb.embedding
    bytes_read = (non_expert + touched) * b + kv_read
    tr = traffic(arch, s, w, b, kv_b)
    comm = sum(tr.seconds_per_step(links).values())
    return Estimate(
        compute_seconds=flops / peak_flops,
        memory_seconds=bytes_read / hbm_bandwidth,
        comm_seconds=comm,
        flops=flops,
        bytes_read=bytes_read,
    )


