"""Context parallelism in the reference runtime: which CP rank holds each position, attention over one shard of
the keys with its log-sum-exp, and the merge of shards.

Glossary (CP ranks share one attention group's TP rank and its heads; the group's hidden states are the same on
every CP rank, so only attention is split by position):

- owner: the CP rank whose KV cache holds a position. Prefill CP (`pcp`) lays a prompt of S tokens out by its
  layout (contiguous: rank r holds [r*m, (r+1)*m) with m = ceil(S / CP); zigzag: 2*CP blocks of ceil(S / 2CP),
  rank r holds blocks r and 2*CP-1-r; striped: position i on rank i mod CP); tokens generated after the prompt
  are striped (a growing sequence has no fixed length). Decode CP (`dcp`) uses one layout for every position:
  striped, or contiguous over maxModelLen.
- partial attention: the queries against the keys one rank holds, under the causal mask of global positions,
  returning the normalised output O_r and lse_r = log sum_j exp(s_j) per query and head.
- merge: with lse = log sum_r exp(lse_r), O = sum_r exp(lse_r - lse) * O_r: exactly the attention over all keys.
  A query that sees no key of a shard has lse_r = -inf and contributes nothing.
- ring attention (pcp prefill): each rank keeps the queries of its own positions and passes its K/V block around
  the CP ring (isend to the next rank, irecv from the previous one, posted before the current block is computed
  so the transfer overlaps it); the blocks merge by their LSE as they arrive (online softmax).

Shapes: q [T, H, d], k and v [S, H, d] (KV heads already repeated to the query heads), positions [T] and [S].
"""

from __future__ import annotations

import math

import torch

MODES = ("pcp", "dcp")
LAYOUTS = ("contiguous", "zigzag", "striped")


def owners(positions: torch.Tensor, cp: int, mode: str, layout: str, prompt_len: int, max_len: int) -> torch.Tensor:
    """The CP rank holding each position [T] of a request whose prompt has `prompt_len` tokens."""
    if mode == "dcp":
        if layout == "contiguous":
            return torch.div(positions, math.ceil(max_len / cp), rounding_mode="floor").clamp(max=cp - 1)
        return positions % cp
    striped = positions % cp
    in_prompt = positions < prompt_len
    if layout == "striped":
        return striped
    if layout == "contiguous":
        laid = torch.div(positions, math.ceil(prompt_len / cp), rounding_mode="floor").clamp(max=cp - 1)
    else:  # zigzag
        block = torch.div(positions, math.ceil(prompt_len / (2 * cp)), rounding_mode="floor").clamp(max=2 * cp - 1)
        laid = torch.where(block < cp, block, 2 * cp - 1 - block)
    return torch.where(in_prompt, laid, striped)


def partial_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(O_r [T, H, d], lse_r [T, H], query-key pairs computed under the causal mask) over one key shard."""
    t, h, d = q.shape
    if k.shape[0] == 0:
        return (torch.zeros(t, h, v.shape[-1], dtype=q.dtype), torch.full((t, h), float("-inf"), dtype=q.dtype), 0)
    scores = torch.einsum("thd,shd->hts", q, k) / d**0.5
    visible = k_pos[None, :] <= q_pos[:, None]  # [T, S]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, T]
    weights = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = torch.einsum("hts,shd->thd", weights, v)
    return out, lse.transpose(0, 1).contiguous(), int(visible.sum()) * h


def merge(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """outs [R, T, H, d] and lses [R, T, H] of R shards -> the attention output [T, H, d]."""
    lse = torch.logsumexp(lses, dim=0)  # [T, H]
    scale = torch.exp(lses - torch.where(torch.isfinite(lse), lse, 0.0)[None])
    scale = torch.where(torch.isfinite(lses), scale, 0.0)
    return (outs * scale[..., None]).sum(0)


def head_slices(heads: int, cp: int) -> list[tuple[int, int]]:
    """[lo, hi) of the query heads whose merged output each CP rank computes (DCP), nearly equal shares."""
    return [(r * heads // cp, (r + 1) * heads // cp) for r in range(cp)]
