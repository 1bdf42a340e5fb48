"""The reference MoE transformer as functional layers over (possibly sharded) weights.

Each layer function takes exactly the weight slices a rank holds, so the single-process oracle below and a
distributed rank run the same arithmetic; the distributed runtime adds the collectives between them.

Block: x + Attn(RMSNorm(x)), then h + FFN(RMSNorm(h)); FFN is SwiGLU (dense layers) or MoE (top-k softmax
router over routed experts, weights renormalised over the chosen k, plus shared experts on every token).
Attention is GQA with RoPE (rotate-half form): Q head h reads KV head h // (h_q / h_kv).

Shapes: T tokens of one sequence, D hidden, H_q/H_kv local heads, d_h head dim, E routed experts.

MLA (DeepSeek-V3, `mla_attention`): per head a query of nope + rope dims; keys and values come from one latent
per token (kv_lora_rank values after kv_a's RMSNorm) and one RoPE key shared by the heads (rope dims), which is
all the cache holds: `LayerCache.k` [S, 1, kv_lora] and `LayerCache.v` [S, 1, rope]. Two forms, the same math:

- plain: up-project the cached latents through kv_b to per-head keys (nope) and values, then attention;
- absorbed: fold kv_b's key half into the query (q_nope W_UK: a query in latent space), score it against the
  latents directly, average the latents, and fold kv_b's value half into the output (W_UV). Its work grows with
  the cache by kv_lora + rope per key instead of H * (nope + rope + v). Which runs when (`WorldSpec.mla_absorb`,
  default "decode"): prompts plain, decode tokens absorbed; under decode CP every query is absorbed (the
  latent-space query is what crosses the CP ranks). Both forms equal transformers' greedy tokens (the layouts of
  tests/runtime/test_checkpoints.py run each throughout).

DeepSeek routing (`route_grouped`): sigmoid scores; a correction bias per expert chooses (group-limited top-k)
but does not weight; the weights are the unbiased scores of the chosen experts, renormalised iff
norm_topk_prob, times routed_scaling_factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shardwise.api import ModelArchitecture, YarnScaling

DTYPE = torch.float64


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, f32: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension. `f32`: normalise in float32 and scale in the working dtype, as the
    Hugging Face implementations of every supported family do (so a float64 run agrees with theirs)."""
    if f32:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, H, d_h], positions [T] -> rotated x (rotate-half form). The angles are computed in float32, then
    their cos/sin cast to x's dtype, exactly as the reference implementations do."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    ang = positions.float()[:, None] * inv_freq[None, :].to(positions.device)  # [T, half]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    half = dim // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 when the context is not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(dim: int, theta: float, yarn: YarnScaling | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] in float32, cos/sin scale) of RoPE over `dim` dims, with YaRN when given:
    frequency i blends its extrapolated (original) and interpolated (divided by `factor`) values by a linear
    ramp over the dims between the correction range [low, high] of beta_fast and beta_slow rotations within
    the original context; the cos/sin scale is the attention factor (given, or mscale ratios)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if yarn is None:
        return 1.0 / (theta ** exponents), 1.0
    base = theta ** exponents
    original, interpolated = 1.0 / base, 1.0 / (yarn.factor * base)

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength makes `rotations` turns
        return dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the original frequency
    inv_freq = interpolated * (1 - keep) + original * keep
    if yarn.attention_factor:
        scale = yarn.attention_factor
    elif yarn.mscale and yarn.mscale_all_dim:
        scale = yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    else:
        scale = yarn_mscale(yarn.factor)
    return inv_freq, float(scale)


def softmax_scale(arch: ModelArchitecture) -> float:
    """MLA's 1/sqrt(nope + rope), times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = float((arch.nope_head_dim + arch.rope_head_dim) ** -0.5)  # as transformers computes it
    y = arch.rope_scaling
    if y is not None and y.mscale_all_dim:
        scale *= yarn_mscale(y.factor, y.mscale_all_dim) ** 2
    return scale


def rope_mla(x: torch.Tensor, positions: torch.Tensor, arch: ModelArchitecture) -> torch.Tensor:
    """x [T, H, rope] -> rotated x: RoPE of `arch` (YaRN frequencies and cos/sin scale when set), on the two
    halves of the dims or, with rope_interleave, on the pairs (x0, x1), (x2, x3), ... whose rotated values are
    laid out evens first, then odds (queries and keys alike, so every dot product is the interleaved one)."""
    inv_freq, scale = rope_frequencies(x.shape[-1], arch.rope_theta, arch.rope_scaling)
    ang = positions.float()[:, None] * inv_freq[None, :].to(positions.device)  # [T, half]
    cos, sin = (ang.cos() * scale).to(x.dtype)[:, None, :], (ang.sin() * scale).to(x.dtype)[:, None, :]
    if arch.rope_interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass
class LayerCache:
    """K/V of one sequence for one layer on one rank: [T_cached, H_kv_local, d_h]."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    pos: torch.Tensor | None = None  # with context parallelism: the positions this rank holds, in order

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k])
        self.v = v if self.v is None else torch.cat([self.v, v])
        return self.k, self.v

    def append_at(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Keep the K/V of some positions only (this rank's shard of the sequence)."""
        self.append(k, v)
        self.pos = pos if self.pos is None else torch.cat([self.pos, pos])

    @property
    def length(self) -> int:
        return 0 if self.k is None else int(self.k.shape[0])

    def truncate(self, n: int) -> None:
        """Forget the positions from `n` on (a step that did not complete on every rank is undone)."""
        if self.pos is not None and self.k is not None and self.v is not None:
            keep = self.pos < n
            self.k, self.v, self.pos = self.k[keep], self.v[keep], self.pos[keep]
        elif self.k is not None and self.v is not None and self.k.shape[0] > n:
            self.k, self.v = self.k[:n], self.v[:n]


@dataclass
class SequenceCache:
    layers: list[LayerCache] = field(default_factory=list)

    @classmethod
    def empty(cls, num_layers: int) -> SequenceCache:
        return cls([LayerCache() for _ in range(num_layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def truncate(self, n: int) -> None:
        for layer in self.layers:
            layer.truncate(n)


def attention(
    x: torch.Tensor, positions: torch.Tensor, cache: LayerCache, *, wq: torch.Tensor, wk: torch.Tensor,
    wv: torch.Tensor, wo: torch.Tensor, head_dim: int, theta: float, q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None, eps: float = 1e-6,
) -> torch.Tensor:
    """x [T, D] (normed) -> this rank's partial attention output [T, D] (sum over ranks = full output).

    wq [H_q*d_h, D], wk/wv [H_kv*d_h, D], wo [D, H_q*d_h] are this rank's head slices; q_norm/k_norm [d_h]
    (Qwen3) normalise each query and key head before RoPE.
    """
    t = x.shape[0]
    q = (x @ wq.T).view(t, -1, head_dim)
    k = (x @ wk.T).view(t, -1, head_dim)
    v = (x @ wv.T).view(t, -1, head_dim)
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm(q, q_norm, eps, f32=True), rms_norm(k, k_norm, eps, f32=True)
    q, k = rope(q, positions, theta), rope(k, positions, theta)
    keys, values = cache.append(k, v)
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)  # [S, H_q, d_h]
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, keys) / head_dim**0.5
    key_pos = torch.arange(keys.shape[0])
    mask = key_pos[None, :] > positions[:, None]  # causal: a query sees keys at positions <= its own
    scores = scores.masked_fill(mask[None], float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), values).reshape(t, -1)
    return out @ wo.T


def mla_project(x: torch.Tensor, positions: torch.Tensor, w: dict[str, torch.Tensor], prefix: str,
                arch: ModelArchitecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, D] (normed) -> (q_nope [T, H, nope], rotated q_rope [T, H, rope], latent [T, kv_lora] after kv_a's
    RMSNorm, rotated RoPE key [T, rope]): what MLA computes from the new tokens before any cached one is read
    (weights as `mla_attention` takes them)."""
    t, eps = x.shape[0], arch.rms_norm_eps
    nope, rd, c = arch.nope_head_dim, arch.rope_head_dim, arch.kv_lora_rank
    if prefix + "wq_a" in w:
        q = rms_norm(x @ w[prefix + "wq_a"].T, w[prefix + "q_a_norm"], eps, f32=True) @ w[prefix + "wq_b"].T
    else:
        q = x @ w[prefix + "wq"].T
    q = q.view(t, -1, nope + rd)
    compressed = x @ w[prefix + "wkv_a"].T  # [T, kv_lora + rope]
    latent = rms_norm(compressed[:, :c], w[prefix + "kv_a_norm"], eps, f32=True)
    k_rope = rope_mla(compressed[:, None, c:], positions, arch)[:, 0]
    return q[..., :nope], rope_mla(q[..., nope:], positions, arch), latent, k_rope


def mla_attention(
    x: torch.Tensor, positions: torch.Tensor, cache: LayerCache, w: dict[str, torch.Tensor], prefix: str,
    arch: ModelArchitecture, *, absorbed: bool,
) -> torch.Tensor:
    """x [T, D] (normed) -> this rank's partial MLA output [T, D] (sum over TP ranks = full output).

    `w[prefix + name]`: `wq_a` [q_lora, D], `q_a_norm` [q_lora] and `wq_b` [H*(nope+rope), q_lora] (or `wq`
    [H*(nope+rope), D] without a query LoRA), `wkv_a` [kv_lora+rope, D], `kv_a_norm` [kv_lora], `wkv_b`
    [H*(nope+v), kv_lora], `wo` [D, H*v]; H is this rank's heads (q_b, kv_b, o split by heads; q_a, kv_a and the
    latent cache the same on every rank). The cache gets the latents [T, 1, kv_lora] and rotated RoPE keys
    [T, 1, rope] of the new tokens. `absorbed`: the absorbed form (module docstring), else the plain one.
    """
    t = x.shape[0]
    nope, rd, vd, c = arch.nope_head_dim, arch.rope_head_dim, arch.v_head_dim, arch.kv_lora_rank
    q_nope, q_rope, latent, k_rope = mla_project(x, positions, w, prefix, arch)
    heads = q_nope.shape[1]
    latents, rope_keys = cache.append(latent[:, None, :], k_rope[:, None, :])
    lat, kr = latents[:, 0], rope_keys[:, 0]  # [S, kv_lora], [S, rope]
    s = lat.shape[0]
    scale = softmax_scale(arch)
    mask = torch.arange(s)[None, :] > positions[:, None]  # causal: a query sees keys at positions <= its own
    wkv_b = w[prefix + "wkv_b"].view(heads, nope + vd, c)
    if absorbed:
        q_latent = torch.einsum("thn,hnc->thc", q_nope, wkv_b[:, :nope])  # W_UK folded into the query
        scores = (torch.einsum("thc,sc->hts", q_latent, lat) + torch.einsum("thr,sr->hts", q_rope, kr)) * scale
        probs = scores.masked_fill(mask[None], float("-inf")).softmax(-1)
        out = torch.einsum("thc,hvc->thv", torch.einsum("hts,sc->thc", probs, lat), wkv_b[:, nope:])  # W_UV
    else:
        kv = torch.einsum("sc,hec->she", lat, wkv_b)  # [S, H, nope + v]
        keys = torch.cat([kv[..., :nope], kr[:, None, :].expand(s, heads, rd)], dim=-1)
        scores = torch.einsum("thd,shd->hts", torch.cat([q_nope, q_rope], dim=-1), keys) * scale
        probs = scores.masked_fill(mask[None], float("-inf")).softmax(-1)
        out = torch.einsum("hts,shd->thd", probs, kv[..., nope:])
    return out.reshape(t, heads * vd) @ w[prefix + "wo"].T


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, *, renormalise: bool = True,
          f32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], router [E, D] -> (weights [T, k], expert ids [T, k]): the top-k of a softmax over the experts,
    renormalised to sum to 1 when `renormalise`. `f32`: the softmax in float32, as the Hugging Face MoE
    families compute it."""
    logits = x @ router.T
    probs = logits.float().softmax(-1) if f32 else logits.softmax(-1)
    w, ids = probs.topk(top_k, dim=-1)
    if renormalise:
        w = w / w.sum(-1, keepdim=True)
    return w.to(x.dtype), ids


def route_grouped(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, arch: ModelArchitecture
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router. x [T, D], router [E, D], bias [E] -> (weights [T, k], expert ids [T, k]).

    In float32, as the Hugging Face implementation keeps the router: scores = sigmoid(x W^T); the biased scores
    (scores + bias) choose: a group's score is the sum of its 2 best biased scores, the topkGroups best groups stay
    and the top-k biased scores among their experts are chosen. The weights are the unbiased scores of the
    chosen experts, divided by their sum (+1e-20) when norm_topk_prob, then times routed_scaling_factor."""
    scores = (x.float() @ router.float().T).sigmoid()  # [T, E]
    choice = scores + bias.float()
    t, e = scores.shape
    groups = arch.num_expert_groups
    group_score = choice.view(t, groups, e // groups).topk(2, dim=-1).values.sum(-1)  # [T, groups]
    kept = group_score.topk(arch.topk_groups, dim=-1).indices
    allowed = torch.zeros(t, groups, dtype=torch.bool).scatter_(1, kept, True).repeat_interleave(e // groups, dim=1)
    ids = choice.masked_fill(~allowed, float("-inf")).topk(arch.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if arch.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return (weights * arch.routed_scaling_factor).to(x.dtype), ids


def experts_forward(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
    w2: torch.Tensor, local_ids: list[int],
) -> torch.Tensor:
    """Weighted sum over the chosen experts that are among `local_ids` (w1/w3 [n, I, D], w2 [n, D, I] in the
    order of `local_ids`). Token order within an expert does not change any value: each token's product is
    computed on its own row."""
    out = torch.zeros_like(x)
    for j, e in enumerate(local_ids):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        if rows.numel():
            y = swiglu(x[rows], w1[j], w3[j], w2[j])
            out.index_add_(0, rows, y * weights[rows, slot][:, None])
    return out


class ReferenceModel:
    """The whole model in one process: the oracle every distributed layout must match."""

    def __init__(self, arch: ModelArchitecture, weights: dict[str, torch.Tensor]) -> None:
        self.arch = arch
        self.w = {k: v.to(DTYPE) for k, v in weights.items()}

    def forward(self, tokens: list[int], cache: SequenceCache) -> torch.Tensor:
        """Run new tokens of one sequence; returns logits of the last one [V]."""
        a, w = self.arch, self.w
        start = cache.length
        positions = torch.arange(start, start + len(tokens))
        x = w["embed"][torch.tensor(tokens)]
        for i in range(a.num_layers):
            p = f"layers.{i}."
            h = rms_norm(x, w[p + "attn_norm"], a.rms_norm_eps)
            x = x + attention(h, positions, cache.layers[i], wq=w[p + "wq"], wk=w[p + "wk"], wv=w[p + "wv"],
                              wo=w[p + "wo"], head_dim=a.dim_head, theta=a.rope_theta)
            h = rms_norm(x, w[p + "ffn_norm"], a.rms_norm_eps)
            x = x + self.ffn(i, h)
        x = rms_norm(x[-1:], w["norm"], a.rms_norm_eps)
        return (x @ w["lm_head"].T)[0]

    def ffn(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        a, w, p = self.arch, self.w, f"layers.{layer}."
        if not a.is_moe_layer(layer):
            return swiglu(h, w[p + "ffn.w1"], w[p + "ffn.w3"], w[p + "ffn.w2"])
        weights, ids = route(h, w[p + "router"], a.top_k)
        out = experts_forward(h, ids, weights, w[p + "experts.w1"], w[p + "experts.w3"], w[p + "experts.w2"],
                              list(range(a.num_experts)))
        for s in range(a.num_shared_experts):
            out = out + swiglu(h, w[p + f"shared.{s}.w1"], w[p + f"shared.{s}.w3"], w[p + f"shared.{s}.w2"])
        return out

    def generate(self, prompt: list[int], max_tokens: int, eos: int | None = None) -> tuple[list[int], str]:
        """Greedy decoding; returns (new token ids, finish reason 'stop' or 'length')."""
        cache = SequenceCache.empty(self.arch.num_layers)
        out: list[int] = []
        logits = self.forward(prompt, cache)
        while len(out) < max_tokens:
            token = int(logits.argmax())
            out.append(token)
            if eos is not None and token == eos:
                return out, "stop"
            if len(out) < max_tokens:
                logits = self.forward([token], cache)
        return out, "length"
