"""Carry-over: a placement for a resized world (ranks lost, joining or leaving) that keeps every expert
where a surviving GPU already holds it."""

from __future__ import annotations

import numpy as np

from .layout import FloatArray, Placement, check_load


def carry_over(
    held: list[list[list[int]]], *, num_experts: int, num_slots: int, num_gpus: int, load: FloatArray | None = None
) -> tuple[Placement, int]:
    """A placement for a changed number of GPUs that keeps experts where they already are.

    ``held[l][g]``: the logical experts GPU ``g`` of the new layout already holds in MoE layer ``l`` (empty for a
    new GPU; a survivor of a lost rank, or a rank that stays through a scale-up or scale-down, lists its slots).
    Per layer: a GPU with more experts than its ``num_slots // num_gpus`` slots keeps the ones with the fewest
    copies elsewhere; every expert that no GPU holds any more gets a slot (its weights must come from the weight
    files); the remaining free slots take copies by D'Hondt on ``load`` (without ``load``: of the experts with
    the fewest copies), never a second copy on one GPU. Returns the placement and how many (layer, expert)
    pairs had no copy left. Raises ``ValueError`` on inconsistent arguments, naming the numbers.
    """
    if num_gpus < 1 or num_slots % num_gpus:
        raise ValueError(f"num_slots={num_slots} is not divisible by num_gpus={num_gpus}")
    if num_slots < num_experts:
        raise ValueError(f"num_slots={num_slots} is less than the number of logical experts ({num_experts})")
    per_gpu = num_slots // num_gpus
    weight = np.ones((len(held), num_experts)) if load is None else check_load(load)
    if weight.shape != (len(held), num_experts):
        raise ValueError(f"load has shape {weight.shape}, expected ({len(held)}, {num_experts})")
    phy2log = np.empty((len(held), num_slots), dtype=np.int64)
    lost = 0
    for layer, gpus in enumerate(held):
        if len(gpus) != num_gpus:
            raise ValueError(f"layer {layer}: held lists {len(gpus)} GPUs, expected {num_gpus}")
        bad = sorted({e for h in gpus for e in h if not 0 <= e < num_experts})
        if bad:
            raise ValueError(f"layer {layer}: experts {bad} are outside 0..{num_experts - 1}")
        keep = [list(dict.fromkeys(h)) for h in gpus]
        copies = np.bincount([e for h in keep for e in h], minlength=num_experts)
        for g, h in enumerate(keep):
            if len(h) > per_gpu:  # fewer slots per GPU: keep the rarest
                ranked = sorted(h, key=lambda e: (copies[e], h.index(e)))
                for e in ranked[per_gpu:]:
                    copies[e] -= 1
                keep[g] = [e for e in h if e in ranked[:per_gpu]]
        lost += int((copies == 0).sum())
        w = weight[layer]
        while (copies == 0).sum() > sum(per_gpu - len(h) for h in keep):  # room for every lost expert
            # drop a copy of the most replicated expert, the lightest of those, from the fullest GPU
            g, e = max(((g, e) for g, h in enumerate(keep) for e in h if copies[e] > 1),
                       key=lambda ge: (copies[ge[1]], -w[ge[1]], len(keep[ge[0]])))
            keep[g].remove(e)
            copies[e] -= 1
        free = np.array([per_gpu - len(h) for h in keep])
        for _ in range(int(free.sum())):
            g = int(np.argmax(free))  # the GPU with the most free slots (the first of those)
            free[g] -= 1
            priority = np.where(copies == 0, np.inf, w / np.maximum(copies, 1))  # lost experts first
            if per_gpu <= num_experts:
                priority[keep[g]] = -np.inf
            e = int(np.argmax(priority))
            keep[g].append(e)
            copies[e] += 1
        phy2log[layer] = np.concatenate([np.asarray(h, dtype=np.int64) for h in keep])
    return Placement.from_phy2log(phy2log, num_experts, num_gpus), lost
