"""Replica counts: how many copies of each logical expert, by D'Hondt apportionment."""

from __future__ import annotations

import numpy as np

from .layout import FloatArray, IntArray


def replica_counts(
    load: FloatArray, num_slots: int, floor: int, cap: int, spare_to_lightest: bool = False
) -> IntArray:
    """D'Hondt apportionment of ``num_slots`` replicas, ``load[L, E]`` -> ``logcnt[L, E]``.

    Giving the next replica to the largest ``load / replicas`` ends with ``logcnt = clip(ceil(load / t),
    floor, cap)`` for the smallest threshold ``t`` that fits the budget; bisect ``t`` for all layers at
    once. The few slots left over cannot lower the heaviest replica ``t``; they go to the largest
    ``load / replicas`` (D'Hondt's tie rule) or, with ``spare_to_lightest``, to the lightest experts,
    which then serve as fillers beside heavy replicas.
    """
    layers, experts = load.shape
    peak = load.max(axis=1, keepdims=True)
    load = load / np.where(peak > 0, peak, 1.0)

    def counts_at(t: FloatArray) -> IntArray:
        return np.clip(np.ceil(load / t[:, None]), floor, cap).astype(np.int64)

    hi = np.full(layers, 1.0 / floor)
    lo = np.full(layers, 1e-12)
    for _ in range(56):
        mid = 0.5 * (lo + hi)
        fits = counts_at(mid).sum(axis=1) <= num_slots
        hi = np.where(fits, mid, hi)
        lo = np.where(fits, lo, mid)
    counts = counts_at(hi)
    left = num_slots - counts.sum(axis=1)
    while left.max() > 0:
        priority = -load / (counts + 1) if spare_to_lightest else load / counts
        priority = np.where(counts < cap, priority, -np.inf)
        order = np.argsort(-priority, axis=1, kind="stable")
        give = (np.arange(experts)[None, :] < left[:, None]) & np.isfinite(
            np.take_along_axis(priority, order, axis=1)
        )
        np.put_along_axis(counts, order, np.take_along_axis(counts, order, axis=1) + give, axis=1)
        left = num_slots - counts.sum(axis=1)
    return counts
