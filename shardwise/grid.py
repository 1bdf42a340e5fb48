"""The rank grid: every parallel group is a slice of one array.

    grid = arange(world).reshape(PP, DPA, CP, TP)

TP is innermost, so a TP group is consecutive ranks and therefore consecutive GPUs of one pod (rank `r`
lives on pod `r // gpus_per_pod`, GPU `r % gpus_per_pod`). Then CP, then DPA, then PP outermost.

Groups (each a list of global ranks):

- tp:  grid[p, d, c, :]              ranks that split the heads of one attention shard
- cp:  grid[p, d, :, t]              ranks that hold different sequence positions of one shard
- dpa: grid[:, d, :, :]              one attention group: all ranks that serve group d's requests
- pp:  grid[:, d, c, t]              one pipeline through the stages
- ep:  per stage, the stage's ranks `grid[p].ravel()` reshaped (replicas, EP, moeTP): ranks with the same
       replica and moeTP index form one EP group; `moe_tp` groups are the innermost runs.

Worked example (8 GPUs, TP=4): CP=2 gives TP groups {0,1,2,3} {4,5,6,7} and CP groups {0,4} {1,5} {2,6}
{3,7}; DPA=2 instead gives attention groups {0..3} {4..7}.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class RankGrid:
    pp: int
    dpa: int
    cp: int
    tp: int
    ep: int
    moe_tp: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "dpa", "cp", "tp", "ep", "moe_tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.stage_size % (self.ep * self.moe_tp):
            raise ValueError(
                f"ep * moeTp = {self.ep} * {self.moe_tp} = {self.ep * self.moe_tp} does not divide the "
                f"{self.stage_size} ranks of a stage"
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.dpa * self.cp * self.tp

    @property
    def stage_size(self) -> int:
        return self.dpa * self.cp * self.tp

    @property
    def ep_replicas(self) -> int:
        """Copies of the full expert set within one stage."""
        return self.stage_size // (self.ep * self.moe_tp)

    @cached_property
    def grid(self) -> IntArray:
        """[PP, DPA, CP, TP] global ranks."""
        return np.arange(self.world_size, dtype=np.int64).reshape(self.pp, self.dpa, self.cp, self.tp)

    @cached_property
    def _moe_grid(self) -> IntArray:
        """[PP, replicas, EP, moeTP] global ranks."""
        return self.grid.reshape(self.pp, self.ep_replicas, self.ep, self.moe_tp)

    # Groups, each [n_groups, group_size].
    def tp_groups(self) -> IntArray:
        return self.grid.reshape(-1, self.tp)

    def cp_groups(self) -> IntArray:
        return self.grid.transpose(0, 1, 3, 2).reshape(-1, self.cp)

    def dpa_groups(self) -> IntArray:
        return self.grid.transpose(1, 0, 2, 3).reshape(self.dpa, -1)

    def pp_groups(self) -> IntArray:
        return self.grid.transpose(1, 2, 3, 0).reshape(-1, self.pp)

    def ep_groups(self) -> IntArray:
        return self._moe_grid.transpose(0, 1, 3, 2).reshape(-1, self.ep)

    def moe_tp_groups(self) -> IntArray:
        return self._moe_grid.reshape(-1, self.moe_tp)

    def stage_groups(self) -> IntArray:
        return self.grid.reshape(self.pp, -1)

    def coordinates(self) -> dict[str, IntArray]:
        """Per global rank: its index in each dimension, arrays of length world_size."""
        pp, dpa, cp, tp = np.unravel_index(np.arange(self.world_size), self.grid.shape)
        _, _, ep, moe_tp = np.unravel_index(np.arange(self.world_size), self._moe_grid.shape)
        return {
            "pp": pp.astype(np.int64),
            "dpa": dpa.astype(np.int64),
            "cp": cp.astype(np.int64),
            "tp": tp.astype(np.int64),
            "ep": ep.astype(np.int64),
            "moe_tp": moe_tp.astype(np.int64),
        }
