"""The reference MoE transformer as functional layers over (possibly sharded) weights.

Each layer function takes exactly the weight slices a rank holds, so the single-process oracle below and a
distributed rank run the same arithmetic; the distributed runtime adds the collectives between them.

Block: x + Attn(RMSNorm(x)), then h + FFN(RMSNorm(h)); FFN is SwiGLU (dense layers) or MoE (top-k softmax
router over routed experts, weights renormalised over the chosen k, plus shared experts on every token).
Attention is GQA with RoPE (rotate-half form): Q head h reads KV head h // (h_q / h_kv).

Shapes: T tokens of one sequence, D hidden, H_q/H_kv local heads, d_h head dim, E routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shardwise.api import ModelArchitecture

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
