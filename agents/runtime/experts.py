"""The physical expert map of one MoE layer and how a token picks a replica.

Glossary: a *logical* expert is one of the model's E experts; a *physical* expert (slot) is a copy of one on
an EP rank; with `redundant` extra slots there are `S = E + redundant` slots, `S / EP` per EP rank, slot `s`
on EP rank `s // (S / EP)`.

- `phy2log [S]`: the logical expert in each slot;
- `logcnt [E]`: replicas of each logical expert;
- `log2phy [E, max_replicas]`: the slots of each logical expert, padded with -1.

A token routed to logical expert `e` uses replica `token_index mod logcnt[e]`, so replicas share the
tokens and no work is done twice; every replica holds the same weights, so the choice never changes a value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

IntArray = npt.NDArray[np.int64]


def round_robin(num_experts: int, num_slots: int) -> IntArray:
    """The map before any load is known: slot s holds expert s mod E."""
    if num_slots < num_experts:
        raise ValueError(f"{num_slots} slots cannot hold {num_experts} experts")
    return np.arange(num_slots, dtype=np.int64) % num_experts


@dataclass(frozen=True)
class ExpertMap:
    phy2log: IntArray  # [S]
    num_experts: int
    ep: int

    def __post_init__(self) -> None:
        s = self.phy2log.shape[0]
        if s % self.ep:
            raise ValueError(f"{s} slots are not divisible by ep={self.ep}")
        missing = sorted(set(range(self.num_experts)) - set(self.phy2log.tolist()))
        if missing:
            raise ValueError(f"logical experts {missing[:8]} have no slot")
        if self.phy2log.min() < 0 or self.phy2log.max() >= self.num_experts:
            raise ValueError(f"phy2log holds ids outside 0..{self.num_experts - 1}")

    @property
    def num_slots(self) -> int:
        return int(self.phy2log.shape[0])

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.ep

    def logcnt(self) -> IntArray:
        return np.bincount(self.phy2log, minlength=self.num_experts).astype(np.int64)

    def log2phy(self) -> IntArray:
        cnt = self.logcnt()
        out = np.full((self.num_experts, int(cnt.max())), -1, dtype=np.int64)
        fill = np.zeros(self.num_experts, dtype=np.int64)
        for slot, e in enumerate(self.phy2log.tolist()):
            out[e, fill[e]] = slot
            fill[e] += 1
        return out

    def local_slots(self, ep_rank: int) -> list[int]:
        per = self.slots_per_rank
        return list(range(ep_rank * per, (ep_rank + 1) * per))

    def slot_of(self, expert_ids: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        """expert_ids [N], token_index [N] -> the slot each (token, expert) pair uses [N]."""
        table = torch.from_numpy(self.log2phy()).to(expert_ids.device)
        cnt = torch.from_numpy(self.logcnt()).to(expert_ids.device)
        replica = token_index % cnt[expert_ids]
        return table[expert_ids, replica]
