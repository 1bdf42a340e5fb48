"""Expert-parallel load balancing (EPLB): how many copies of each expert, and on which GPU.

Glossary
--------
logical expert
    One of the model's ``E`` experts in a MoE layer (what the router picks).
physical expert, slot
    A copy of a logical expert's weights on one GPU. A layer has ``R`` slots, ``R // G`` on each of the
    ``G`` GPUs: slot ``s`` lives on GPU ``s // (R // G)``, GPU ``g`` on node ``g // (G // N)``.
redundant experts
    The ``R - E`` slots beyond one per logical expert; EPLB spends them on copies of the busiest experts.
``phy2log[L, R]``
    Logical expert held by each slot.
``logcnt[L, E]``
    Number of slots (replicas) of each logical expert; sums to ``R`` in every layer.
``log2phy[L, E, max_replicas]``
    The slots of each logical expert, padded with -1; inverts ``phy2log``.

Formula
-------
A token routed to expert ``e`` is served by one of its replicas (e.g. token index mod ``logcnt``), so each
replica carries ``load[e] / logcnt[e]`` and no work is duplicated. GPU ``g`` carries the sum over its slots,
and the figure of merit is ``balance = mean over layers of max_g(gpu_load) / mean_g(gpu_load)``; the
slowest GPU sets the pace of every MoE layer, so 1.00 is perfect and 1.20 wastes a sixth of the fleet.

Lower bound (per layer, :func:`lower_bound`). The busiest GPU carries at least the mean,
``sum(load) / G``, and at least the heaviest single replica. Whatever the replica counts, the heaviest
replica weighs at least ``t* = min over counts of max_e load[e] / logcnt[e]`` subject to
``sum(logcnt) = R``, ``logcnt >= 1`` (``>= min_distinct`` when the budget allows) and ``logcnt <= G`` (no
GPU holds an expert twice). D'Hondt apportionment attains ``t*``, so ``max(sum(load) / G, t*)`` is a
valid bound; it covers "the heaviest expert split over at most ``G`` replicas" and the slot-budget limit
at once. It ignores how replicas pack, so it is loose when a GPU holds few replicas (two per GPU leaves
a few percent that no pairing of the replicas can remove).

Worked example
--------------
4 GPUs with 2 slots each (8 slots), experts E0..E3 with loads 120, 40, 20, 20. Without redundancy the GPU
holding E0 carries 120 while the mean is 50. Apportionment gives the 4 extra slots one at a time to the
largest ``load / replicas``: E0 (120 -> 60), E0 (60 -> 40), E1 (40 -> 20), E0 (40 -> 30), so
``logcnt = [4, 2, 1, 1]`` and the replicas weigh 30, 30, 30, 30, 20, 20, 20, 20. Pairing heaviest with
lightest gives every GPU 30 + 20 = 50: the busiest GPU carries 50 instead of 120 (balance 1.00).

Algorithm
---------
1. Replica counts by D'Hondt, vectorised (bisection on the per-replica load threshold), capped at ``G``.
2. Placement by the balanced largest-differencing method (Karmarkar-Karp with equal-size bins): rounds of
   ``G`` replicas are merged lightest-with-heaviest, re-pairing where a GPU would get an expert twice;
   then count-preserving swaps repair the spread rule and move load off the busiest GPU. Small problems
   also try the reference's greedy loop (without duplicates) and keep the better.
3. With ``previous``: each layer walks from the current placement. Broken rules are repaired first; then
   rounds of steps, each a swap of two slots or a rewrite of one slot (counts change), are taken by load
   cut above the target per changed slot. Over all layers, the cheapest stretches of those walks (balance
   gained per changed slot) are kept until the mean balance is within ``KEEP_TOLERANCE`` of a fresh
   placement's, or ``max_moves`` is spent.
4. With ``num_groups``: the hierarchical placement (groups packed onto nodes, replicas kept in the node)
   is the start of such a walk towards the global placement's balance, so replicas leave their group's
   node only as far as balance needs (``GROUP_TOLERANCE``).

Hazards
-------
The reference ignores the current placement, so a rerun after a small drift moves most experts; its
hierarchical variant caps balance at the heaviest node's share of the load (max/mean 1.17-1.77 on 8 nodes
where the global one gets 1.00-1.03); it can put two copies of one expert on a GPU (a wasted slot); its
placement loop is slow in Python. Moving an expert costs migration bytes and a redundant slot costs
KV-cache memory, so rebalance on drift with a move budget rather than chase 1.00.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "GROUP_TOLERANCE",
    "KEEP_TOLERANCE",
    "Placement",
    "balance",
    "carry_over",
    "lower_bound",
    "rebalance",
    "reference_greedy",
    "round_robin",
]

IntArray = NDArray[np.int64]
FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]

KEEP_TOLERANCE = 0.008
"""With ``previous``: moving stops once the mean balance is within this share of a fresh placement's."""
GROUP_TOLERANCE = 0.002
"""With ``num_groups``: replicas leave their group's node only until balance is this close to global."""

_REL_EPS = 1e-9
_REFINE_SLACK = 1e-4  # fresh placements stop refining this close to the lower bound
_REFINE_ROUNDS = 64  # swap rounds for fresh placements (each round: one swap in every layer)
_GREEDY_MAX_WORK = 1 << 20  # layers * slots * GPUs up to which the reference-style greedy is also tried
_FOCUS = 16  # overloaded GPUs whose swaps are scored in one search round
_PARTNERS = 32  # at least this many of the lightest GPUs (or half of all) are swap partners
_PARTNER_TRIES = 16  # best partners tried per overloaded GPU before it waits for the next round
_CANDIDATES = 24  # rewrites scored exactly per round, picked by a cheap estimate


@dataclass(frozen=True)
class Placement:
    """Where every expert copy lives, for all MoE layers.

    ``phy2log[L, R]``, ``logcnt[L, E]`` and ``log2phy[L, E, max_replicas]`` (padded with -1) are int64.
    """

    phy2log: IntArray
    logcnt: IntArray
    log2phy: IntArray
    num_gpus: int

    @classmethod
    def from_phy2log(cls, phy2log: IntArray, num_experts: int, num_gpus: int) -> Placement:
        """Derive ``logcnt`` and ``log2phy`` from ``phy2log[L, R]``."""
        p2l = np.ascontiguousarray(phy2log, dtype=np.int64)
        logcnt = _logcnt(p2l, num_experts)
        return cls(phy2log=p2l, logcnt=logcnt, log2phy=_log2phy(p2l, logcnt), num_gpus=num_gpus)

    def gpu_loads(self, load: FloatArray) -> FloatArray:
        """Load carried by each GPU, ``[L, G]``, for expert loads ``load[L, E]``."""
        return _gpu_loads(np.asarray(load, dtype=np.float64) / np.maximum(self.logcnt, 1), self.phy2log,
                          self.num_gpus)

    def balance(self, load: FloatArray) -> float:
        """Mean over layers of max GPU load / mean GPU load (1.0 is perfect)."""
        return balance(load, self.phy2log, self.num_gpus)

    def slots_changed(self, previous: IntArray) -> int:
        """Number of slots whose logical expert differs from ``previous[L, R]``."""
        return int(np.count_nonzero(self.phy2log != previous))


# --------------------------------------------------------------------------------------------------
# Public helpers


def balance(load: FloatArray, phy2log: IntArray, num_gpus: int) -> float:
    """Mean over layers of (max GPU load / mean GPU load); each replica carries ``load / logcnt``.

    ``load[L, E]``, ``phy2log[L, R]``. A layer with no load counts as perfectly balanced.
    """
    return float(_layer_ratio(np.asarray(load, dtype=np.float64), np.asarray(phy2log), num_gpus).mean())


def lower_bound(load: FloatArray, num_slots: int, num_gpus: int, min_distinct: int = 1) -> float:
    """A balance no placement of ``num_slots`` slots on ``num_gpus`` GPUs can beat (module docstring).

    ``load[L, E]``. Per layer: ``max(total / G, t*) / (total / G)``, averaged over layers.
    """
    arr = _check_load(load)
    _check_layout(arr.shape[1], num_slots, num_gpus, 1, None, min_distinct)
    floor, cap = _count_limits(arr.shape[1], num_slots, num_gpus, min_distinct)
    return float(_layer_lower_bound(arr, _replica_counts(arr, num_slots, floor, cap), num_gpus).mean())


def round_robin(load: FloatArray, num_slots: int, num_gpus: int) -> Placement:
    """Baseline without EPLB: slot ``s`` holds expert ``s mod E`` in every layer."""
    layers, experts = np.shape(load)
    phy2log = np.tile(np.arange(num_slots, dtype=np.int64) % experts, (layers, 1))
    return Placement.from_phy2log(phy2log, experts, num_gpus)


def reference_greedy(load: FloatArray, num_slots: int, num_gpus: int) -> Placement:
    """The reference two-step greedy (docs/domain.md section 4), written plainly as a baseline.

    (1) Start from one replica each and give the next replica to the largest ``load / replicas``.
    (2) Place replicas heaviest first, each on the least-loaded GPU with a free slot. Duplicates on a GPU
    are not prevented, as in the reference.
    """
    arr = np.asarray(load, dtype=np.float64)
    layers, experts = arr.shape
    per_gpu = num_slots // num_gpus
    phy2log = np.empty((layers, num_slots), dtype=np.int64)
    for layer in range(layers):
        counts = np.ones(experts, dtype=np.int64)
        heap = [(-float(arr[layer, e]), e) for e in range(experts)]
        heapq.heapify(heap)
        for _ in range(num_slots - experts):
            _, e = heapq.heappop(heap)
            counts[e] += 1
            heapq.heappush(heap, (-float(arr[layer, e]) / counts[e], e))
        replicas = np.repeat(np.arange(experts), counts)
        weights = arr[layer, replicas] / counts[replicas]
        gpu_load = np.zeros(num_gpus)
        free = np.full(num_gpus, per_gpu)
        for r in np.argsort(-weights, kind="stable"):
            g = int(np.argmin(np.where(free > 0, gpu_load, np.inf)))
            phy2log[layer, g * per_gpu + per_gpu - free[g]] = replicas[r]
            gpu_load[g] += weights[r]
            free[g] -= 1
    return Placement.from_phy2log(phy2log, experts, num_gpus)


# --------------------------------------------------------------------------------------------------
# Entry point


def rebalance(
    load: FloatArray,
    *,
    num_slots: int,
    num_gpus: int,
    num_nodes: int = 1,
    num_groups: int | None = None,
    previous: IntArray | None = None,
    max_moves: int | None = None,
    min_distinct: int = 1,
) -> Placement:
    """Place ``num_slots`` expert copies per layer on ``num_gpus`` GPUs for expert loads ``load[L, E]``.

    ``num_nodes``: GPUs per node is ``num_gpus // num_nodes``; ``min_distinct`` then counts nodes.
    ``num_groups``: experts ``[k * E / num_groups, (k + 1) * E / num_groups)`` form group ``k``
    (group-limited routing); replicas stay on their group's node unless balance needs them elsewhere
    (within ``GROUP_TOLERANCE`` of the global placement). Ignored with ``min_distinct >= 2`` on several
    nodes, which asks for the opposite.
    ``previous[L, R]``: the current ``phy2log``; the result changes as few slots as it can, and at most
    ``max_moves`` slots in total (a hard cap, even over repairing ``previous``'s constraint violations).
    ``min_distinct``: every expert on at least that many GPUs (nodes when ``num_nodes >= 2``) where the
    slot budget allows (``num_slots >= min_distinct * E``); otherwise each replicated expert is spread as
    far as its replica count allows.
    No GPU holds two copies of one expert unless slots per GPU exceed ``E``.
    Raises ``ValueError`` on inconsistent arguments, naming the numbers.
    """
    arr = _check_load(load)
    peak = arr.max(axis=1, keepdims=True)
    arr = arr / np.where(peak > 0, peak, 1.0)  # placements are scale-free per layer; this keeps bisection tame
    layers, experts = arr.shape
    _check_layout(experts, num_slots, num_gpus, num_nodes, num_groups, min_distinct)
    prev = _check_previous(previous, max_moves, layers, num_slots, experts)
    layout = _Layout(experts, num_slots, num_gpus, num_nodes, min_distinct)

    if prev is not None and max_moves == 0:
        return Placement.from_phy2log(prev, experts, num_gpus)
    if num_groups is not None and num_nodes >= 2 and min_distinct < 2:
        fresh = _group_aware(arr, layout, num_groups)
    else:
        fresh = _fresh(arr, layout)
    if prev is None:
        return Placement.from_phy2log(fresh, experts, num_gpus)

    fresh_top = _gpu_loads(arr / _logcnt(fresh, experts), fresh, num_gpus).max(axis=1)
    result = _incremental(arr, prev, layout, fresh_top, max_moves)
    return Placement.from_phy2log(result, experts, num_gpus)


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
    weight = np.ones((len(held), num_experts)) if load is None else _check_load(load)
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


# --------------------------------------------------------------------------------------------------
# Argument checks


def _check_load(load: FloatArray) -> FloatArray:
    arr = np.asarray(load, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"load must be a non-empty [layers, experts] array, got shape {arr.shape}")
    for what, bad in (("NaN", np.isnan(arr)), ("infinite", np.isinf(arr)), ("negative", arr < 0)):
        if bad.any():
            layer, expert = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"load has {int(bad.sum())} {what} entries, first at layer {layer}, expert {expert} "
                f"({arr[layer, expert]})"
            )
    return arr


def _check_layout(
    experts: int, num_slots: int, num_gpus: int, num_nodes: int, num_groups: int | None, min_distinct: int
) -> None:
    if num_gpus < 1 or num_nodes < 1:
        raise ValueError(f"num_gpus={num_gpus} and num_nodes={num_nodes} must both be at least 1")
    if num_slots < experts:
        raise ValueError(f"num_slots={num_slots} is less than the number of logical experts ({experts})")
    if num_slots % num_gpus:
        raise ValueError(f"num_slots={num_slots} is not divisible by num_gpus={num_gpus}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus={num_gpus} is not divisible by num_nodes={num_nodes}")
    if num_groups is not None:
        if num_groups < 1 or experts % num_groups:
            raise ValueError(f"num_groups={num_groups} does not divide the {experts} experts")
        if num_groups % num_nodes:
            raise ValueError(f"num_groups={num_groups} is not divisible by num_nodes={num_nodes}")
    domain, unit = (num_nodes, "nodes") if num_nodes >= 2 else (num_gpus, "GPUs")
    if min_distinct < 1 or min_distinct > domain:
        raise ValueError(f"min_distinct={min_distinct} must be between 1 and the {domain} {unit}")


def _check_previous(
    previous: IntArray | None, max_moves: int | None, layers: int, num_slots: int, experts: int
) -> IntArray | None:
    if max_moves is not None and max_moves < 0:
        raise ValueError(f"max_moves={max_moves} must be non-negative")
    if previous is None:
        if max_moves is not None:
            raise ValueError(f"max_moves={max_moves} needs previous (moves are counted against it)")
        return None
    prev = np.asarray(previous)
    if prev.shape != (layers, num_slots):
        raise ValueError(f"previous has shape {prev.shape}, expected ({layers}, {num_slots}) [layers, slots]")
    if not np.issubdtype(prev.dtype, np.integer):
        raise ValueError(f"previous must hold integer expert ids, got dtype {prev.dtype}")
    if prev.min() < 0 or prev.max() >= experts:
        raise ValueError(f"previous holds expert ids {prev.min()}..{prev.max()}, expected 0..{experts - 1}")
    missing = _logcnt(prev.astype(np.int64), experts) == 0
    if missing.any():
        layer, expert = (int(i) for i in np.argwhere(missing)[0])
        raise ValueError(
            f"previous has no slot for {int(missing.sum())} experts, first layer {layer}, expert {expert}"
        )
    return np.array(prev, dtype=np.int64)


# --------------------------------------------------------------------------------------------------
# Layout and shared arithmetic


@dataclass(frozen=True)
class _Layout:
    experts: int
    slots: int
    gpus: int
    nodes: int
    min_distinct: int

    @property
    def per_gpu(self) -> int:
        return self.slots // self.gpus

    @property
    def allow_dup(self) -> bool:
        """Slots per GPU exceed the experts: some GPU must hold an expert twice."""
        return self.per_gpu > self.experts

    @property
    def domains(self) -> int:
        """What ``min_distinct`` counts: nodes when there are several, else GPUs."""
        return self.nodes if self.nodes >= 2 else self.gpus

    @property
    def spread(self) -> bool:
        """Spread must be tracked: ``min_distinct`` counts nodes, or GPUs may hold duplicates. (Across GPUs
        without duplicates it follows from the replica counts.)"""
        return self.min_distinct >= 2 and (self.nodes >= 2 or self.allow_dup)

    @property
    def gpu_of_slot(self) -> IntArray:
        return np.arange(self.slots, dtype=np.int64) // self.per_gpu

    @property
    def domain_of_gpu(self) -> IntArray:
        return np.arange(self.gpus, dtype=np.int64) // (self.gpus // self.domains)

    def limits(self) -> tuple[int, int]:
        return _count_limits(self.experts, self.slots, self.gpus, self.min_distinct)

    def need(self, counts: IntArray) -> IntArray:
        """Distinct domains each expert must span given its replica count (0 when not tracked)."""
        if not self.spread:
            return np.zeros_like(counts)
        return np.minimum(np.minimum(counts, self.min_distinct), self.domains)


def _count_limits(experts: int, num_slots: int, num_gpus: int, min_distinct: int) -> tuple[int, int]:
    """(floor, cap) on replicas per expert: ``min_distinct`` if the budget allows, at most ``G``."""
    floor = min_distinct if num_slots >= min_distinct * experts else 1
    cap = num_gpus if num_slots // num_gpus <= experts else num_slots
    return floor, cap


def _logcnt(phy2log: IntArray, experts: int) -> IntArray:
    """``phy2log[L, R]`` -> ``logcnt[L, E]``."""
    layers = phy2log.shape[0]
    flat = (np.arange(layers, dtype=np.int64)[:, None] * experts + phy2log).ravel()
    return np.bincount(flat, minlength=layers * experts).reshape(layers, experts).astype(np.int64)


def _log2phy(phy2log: IntArray, logcnt: IntArray) -> IntArray:
    """``phy2log[L, R]`` -> ``log2phy[L, E, max_replicas]``, slots ascending, padded with -1."""
    layers, slots = phy2log.shape
    order = np.argsort(phy2log, axis=1, kind="stable")
    experts_sorted = np.take_along_axis(phy2log, order, axis=1)
    first = np.cumsum(logcnt, axis=1) - logcnt
    rank = np.arange(slots)[None, :] - np.take_along_axis(first, experts_sorted, axis=1)
    out = np.full((layers, logcnt.shape[1], max(int(logcnt.max()), 1)), -1, dtype=np.int64)
    out[np.arange(layers)[:, None], experts_sorted, rank] = order
    return out


def _gpu_loads(weight: FloatArray, phy2log: IntArray, num_gpus: int) -> FloatArray:
    """Per-replica load ``weight[L, E]`` and ``phy2log[L, R]`` -> GPU loads ``[L, G]``."""
    per_slot = np.take_along_axis(weight, phy2log, axis=1)
    result: FloatArray = per_slot.reshape(phy2log.shape[0], num_gpus, phy2log.shape[1] // num_gpus).sum(axis=2)
    return result


def _layer_ratio(load: FloatArray, phy2log: IntArray, num_gpus: int) -> FloatArray:
    """Max / mean GPU load per layer, ``[L]``."""
    counts = np.maximum(_logcnt(phy2log.astype(np.int64), load.shape[1]), 1)
    gpu = _gpu_loads(load / counts, phy2log.astype(np.int64), num_gpus)
    mean = gpu.mean(axis=1)
    return np.where(mean > 0, gpu.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)


def _layer_lower_bound(load: FloatArray, counts: IntArray, num_gpus: int) -> FloatArray:
    mean = load.sum(axis=1) / num_gpus
    heaviest = (load / counts).max(axis=1)
    return np.where(mean > 0, np.maximum(mean, heaviest) / np.where(mean > 0, mean, 1.0), 1.0)


def _replica_counts(
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


# --------------------------------------------------------------------------------------------------
# Fresh placement


def _fresh(load: FloatArray, layout: _Layout) -> IntArray:
    """A placement from scratch, ``load[L, E]`` -> ``phy2log[L, R]``; per layer the best of:

    - D'Hondt counts placed by differencing (:func:`_place`);
    - the same with the spare slots given to the lightest experts, as fillers (layers where that differs);
    - for small problems (``layers * slots * gpus <= _GREEDY_MAX_WORK``), D'Hondt counts placed by the
      reference's greedy loop without duplicates, so that a small placement is never worse than the
      reference's unless the reference doubles an expert on a GPU. On larger problems differencing
      measured better on every benchmark configuration, and the loop would cost tens of milliseconds.
    """
    floor, cap = layout.limits()
    counts = _replica_counts(load, layout.slots, floor, cap)
    best = _place(load, counts, layout)
    # broken rules weigh more than any balance (max / mean <= G)
    best_key = _layer_ratio(load, best, layout.gpus) + (layout.gpus + 1) * _violations(best, layout)
    candidates: list[tuple[IntArray, IntArray, IntArray | None]] = []  # rows, counts, placement
    fillers = _replica_counts(load, layout.slots, floor, cap, spare_to_lightest=True)
    rows = np.flatnonzero((fillers != counts).any(axis=1))
    if len(rows):
        candidates.append((rows, fillers[rows], None))
    if load.shape[0] * layout.slots * layout.gpus <= _GREEDY_MAX_WORK:
        greedy = _greedy(load, counts, layout)
        rows = np.flatnonzero(_layer_ratio(load, greedy, layout.gpus) < best_key * (1 - 1e-12))
        greedy = greedy[rows]
        _repair(load[rows], greedy, layout)
        _refine_swaps(load[rows] / counts[rows], greedy, layout, _bound(load[rows], counts[rows], layout))
        candidates.append((rows, counts[rows], greedy))
    for rows, cand_counts, placed in candidates:
        if not len(rows):
            continue
        other = _place(load[rows], cand_counts, layout) if placed is None else placed
        key = _layer_ratio(load[rows], other, layout.gpus) + (layout.gpus + 1) * _violations(other, layout)
        better = key < best_key[rows] * (1 - 1e-12)
        best[rows[better]] = other[better]
        best_key[rows[better]] = key[better]
    return best


def _violations(phy2log: IntArray, layout: _Layout) -> IntArray:
    """Broken placement rules per layer, ``[L]``: duplicates on a GPU plus missing spread."""
    layers = phy2log.shape[0]
    result = np.zeros(layers, dtype=np.int64)
    if not layout.allow_dup:
        grid = np.sort(phy2log.reshape(layers, layout.gpus, layout.per_gpu), axis=2)
        result += (grid[:, :, 1:] == grid[:, :, :-1]).sum(axis=(1, 2))
    if layout.spread:
        domain = layout.domain_of_gpu[layout.gpu_of_slot]
        flat = (np.arange(layers)[:, None] * layout.experts + phy2log) * layout.domains + domain[None, :]
        seen = np.bincount(flat.ravel(), minlength=layers * layout.experts * layout.domains) > 0
        distinct = seen.reshape(layers, layout.experts, layout.domains).sum(axis=2)
        result += np.maximum(layout.need(_logcnt(phy2log, layout.experts)) - distinct, 0).sum(axis=1)
    return result


def _bound(load: FloatArray, counts: IntArray, layout: _Layout) -> FloatArray:
    """The lower bound on each layer's busiest GPU, in load units, ``[L]``."""
    mean = load.sum(axis=1) / layout.gpus
    result: FloatArray = np.maximum(mean, (load / counts).max(axis=1))
    return result


def _greedy(load: FloatArray, counts: IntArray, layout: _Layout) -> IntArray:
    """The reference's placement loop, minus duplicates, for all layers at once: ``counts[L, E]`` ->
    ``phy2log[L, R]``. Replicas go heaviest first to the least-loaded GPU with a free slot that does not
    hold the expert yet (ties to the lower GPU, as the reference), so where the reference places no
    duplicate this reproduces it exactly.
    """
    layers = load.shape[0]
    gpus, per = layout.gpus, layout.per_gpu
    rows = np.arange(layers)
    labels = np.stack([np.repeat(np.arange(layout.experts, dtype=np.int64), c) for c in counts])
    weights = np.take_along_axis(load / counts, labels, axis=1)
    order = np.argsort(-weights, axis=1, kind="stable")
    labels = np.take_along_axis(labels, order, axis=1)
    weights = np.take_along_axis(weights, order, axis=1)
    gl = np.zeros((layers, gpus))
    free = np.full((layers, gpus), per)
    has = np.zeros((layers, gpus, layout.experts), dtype=bool)
    phy2log = np.empty((layers, layout.slots), dtype=np.int64)
    for i in range(layout.slots):
        e = labels[:, i]
        open_ = np.where(free > 0, gl, np.inf)
        g = np.argmin(open_, axis=1)
        if not layout.allow_dup:
            fresh = np.where(has[rows, :, e], np.inf, open_)
            g_fresh = np.argmin(fresh, axis=1)
            g = np.where(np.isfinite(fresh[rows, g_fresh]), g_fresh, g)  # else a duplicate, repaired later
        phy2log[rows, g * per + per - free[rows, g]] = e
        gl[rows, g] += weights[:, i]
        free[rows, g] -= 1
        has[rows, g, e] = True
    return phy2log


def _place(load: FloatArray, counts: IntArray, layout: _Layout) -> IntArray:
    """Differencing placement, repair and swap refinement for ``counts[L, E]`` -> ``phy2log[L, R]``."""
    weight = load / counts
    phy2log = np.empty((load.shape[0], layout.slots), dtype=np.int64)
    # bins that differencing leaves side by side often share an expert: deal them round the nodes
    per_node = layout.gpus // layout.nodes
    bins = np.arange(layout.gpus)
    gpu_of_bin = (bins % layout.nodes) * per_node + bins // layout.nodes
    for layer in range(load.shape[0]):
        labels = np.repeat(np.arange(layout.experts, dtype=np.int64), counts[layer])
        members = _difference_pack(weight[layer, labels], labels, layout.gpus, layout.allow_dup)
        grid = np.empty_like(members)
        grid[gpu_of_bin] = members
        phy2log[layer] = labels[grid].ravel()
    _repair(load, phy2log, layout)
    _refine_swaps(weight, phy2log, layout, _bound(load, counts, layout))
    return phy2log


def _difference_pack(weights: FloatArray, labels: IntArray, bins: int, allow_dup: bool) -> IntArray:
    """Balanced largest differencing: ``weights[n]`` into ``bins`` bins of ``n // bins`` items.

    Returns item indices ``[bins, n // bins]``. Items sorted heaviest first are cut into rounds of
    ``bins``; the two partial solutions with the widest spread are merged, lightest bin of one with the
    heaviest of the other, until one remains. Pairs that would put one label twice in a bin trade
    partners with the nearest pair that can take them.
    """
    order = np.lexsort((labels, -weights))
    per_bin = len(weights) // bins
    heap: list[tuple[float, int, FloatArray, IntArray]] = []
    for k in range(per_bin):
        items = order[k * bins : (k + 1) * bins]
        sums = weights[items]
        heap.append((-float(sums[0] - sums[-1]), k, sums, items[:, None]))
    heapq.heapify(heap)
    seq = per_bin
    while len(heap) > 1:
        _, _, sums_a, mem_a = heapq.heappop(heap)
        _, _, sums_b, mem_b = heapq.heappop(heap)
        ia = np.argsort(sums_a, kind="stable")
        ib = np.argsort(-sums_b, kind="stable")
        if not allow_dup:
            _untangle(labels[mem_a[ia]], labels[mem_b[ib]], ib)
        sums = sums_a[ia] + sums_b[ib]
        members = np.concatenate([mem_a[ia], mem_b[ib]], axis=1)
        heapq.heappush(heap, (-float(sums.max() - sums.min()), seq, sums, members))
        seq += 1
    return heap[0][3]


def _untangle(lab_a: IntArray, lab_b: IntArray, ib: IntArray) -> None:
    """Permute ``ib`` (and ``lab_b``) in place so no row of ``lab_a`` shares a label with its ``lab_b``."""
    clash = (lab_a[:, :, None] == lab_b[:, None, :]).any(axis=(1, 2))
    rows = np.arange(len(ib))
    for i in np.flatnonzero(clash):
        if not (lab_a[i][:, None] == lab_b[i][None, :]).any():
            continue
        ok = ~(lab_a[i][None, :, None] == lab_b[:, None, :]).any(axis=(1, 2))
        ok &= ~(lab_a[:, :, None] == lab_b[i][None, None, :]).any(axis=(1, 2))
        if not ok.any():
            continue  # left to the repair pass
        j = int(np.argmin(np.where(ok, np.abs(rows - i), len(ib))))
        pair = np.array([i, j])
        ib[pair] = ib[pair[::-1]]
        lab_b[pair] = lab_b[pair[::-1]]


def _repair(load: FloatArray, phy2log: IntArray, layout: _Layout) -> None:
    """Fix duplicates on a GPU and experts crowded on one node by count-preserving swaps, in place.

    ``load[L, E]``, ``phy2log[L, R]``. Each fix takes the swap that raises the busier of the two GPUs
    least; a violation no single swap can fix is left (and counted by :func:`_violations`).
    """
    for layer in np.flatnonzero(_violations(phy2log, layout)):
        search = _Search(load[layer], phy2log[layer], None, layout)
        for _ in range(2 * layout.slots):
            kind, which = search.violation()
            if not kind:
                break
            step = search.repair(kind, which, rewrite=False)
            if step is None:
                expert = int(search.p2l[which]) if kind == "dup" else which
                if search.waived[expert]:
                    break
                search.waived[expert] = True
                continue
            search.apply(step)
        phy2log[layer] = search.p2l


def _refine_swaps(weight: FloatArray, phy2log: IntArray, layout: _Layout, bound: FloatArray) -> None:
    """Swap local search on all layers at once, in place: ``weight[L, E]``, ``phy2log[L, R]``.

    Each round, every layer whose busiest GPU is above ``bound[L]`` (absolute load) swaps one of that
    GPU's replicas with a lighter replica elsewhere, the swap that leaves the busier of the two GPUs
    lightest; a layer stops when no swap lowers it. Counts never change, so neither do weights.
    """
    if layout.per_gpu < 2:
        return
    layers, slots = phy2log.shape
    s_per = layout.per_gpu
    gos = layout.gpu_of_slot
    nos = layout.domain_of_gpu[gos]
    need = layout.need(_logcnt(phy2log, layout.experts))
    nodecnt = np.zeros((layers, layout.experts, layout.domains if layout.spread else 1), dtype=np.int64)
    if layout.spread:
        np.add.at(nodecnt, (np.arange(layers)[:, None], phy2log, nos[None, :]), 1)
    active = np.ones(layers, dtype=bool)
    scale = np.maximum(bound, 1e-300)
    for _ in range(_REFINE_ROUNDS):
        idx = np.flatnonzero(active)
        if len(idx) == 0:
            return
        p2l = phy2log[idx]
        w = np.take_along_axis(weight[idx], p2l, axis=1)  # [A, R]
        gl = w.reshape(len(idx), layout.gpus, s_per).sum(axis=2)
        g = gl.argmax(axis=1)
        top = gl[np.arange(len(idx)), g]
        still = top > bound[idx] * (1 + _REFINE_SLACK)
        gslots = g[:, None] * s_per + np.arange(s_per)[None, :]  # [A, S]
        eg = np.take_along_axis(p2l, gslots, axis=1)
        wg = np.take_along_axis(w, gslots, axis=1)
        d = wg[:, :, None] - w[:, None, :]  # [A, S, R]
        lh = gl[:, gos]  # [A, R]
        pair = np.maximum(top[:, None, None] - d, lh[:, None, :] + d)
        ok = (d > _REL_EPS * scale[idx, None, None]) & (gos[None, None, :] != g[:, None, None])
        if not layout.allow_dup:
            grid = p2l.reshape(len(idx), layout.gpus, s_per)
            on_h = (grid[:, None, :, :] == eg[:, :, None, None]).any(axis=3)[:, :, gos]  # eg on h? [A,S,R]
            on_g = (p2l[:, None, :] == eg[:, :, None]).any(axis=1)  # slot's expert on g? [A, R]
            ok &= ~on_h & ~on_g[:, None, :]
        if layout.spread:
            ok &= _spread_ok(nodecnt[idx], need[idx], eg, p2l, layout.domain_of_gpu[g], nos)
        pair = np.where(ok, pair, np.inf)
        flat = pair.reshape(len(idx), -1).argmin(axis=1)
        best = pair.reshape(len(idx), -1)[np.arange(len(idx)), flat]
        apply = still & (best < top * (1 - 1e-12))
        active[idx[~apply]] = False
        if not apply.any():
            continue
        rows = idx[apply]
        s = gslots[apply, flat[apply] // slots]
        t = flat[apply] % slots
        es, et = phy2log[rows, s].copy(), phy2log[rows, t].copy()
        phy2log[rows, s], phy2log[rows, t] = et, es
        if layout.spread:
            np.add.at(nodecnt, (rows, es, nos[s]), -1)
            np.add.at(nodecnt, (rows, es, nos[t]), 1)
            np.add.at(nodecnt, (rows, et, nos[t]), -1)
            np.add.at(nodecnt, (rows, et, nos[s]), 1)


def _spread_ok(
    nodecnt: IntArray, need: IntArray, eg: IntArray, p2l: IntArray, node_g: IntArray, nos: IntArray
) -> BoolArray:
    """Swap validity for node spread: ``eg[A, S]`` moves to each slot's node, each slot's expert to g's."""
    a = np.arange(len(eg))[:, None, None]
    distinct = (nodecnt > 0).sum(axis=2)  # [A, E]
    ng = node_g[:, None, None]
    nh = nos[None, None, :]
    e = eg[:, :, None]
    after_e = distinct[a, e] - (nodecnt[a, e, ng] == 1) + (nodecnt[a, e, nh] == 0)
    ok_e = (ng == nh) | (after_e >= np.minimum(need[a, e], distinct[a, e]))
    x = p2l[:, None, :]
    after_x = distinct[a, x] - (nodecnt[a, x, nh] == 1) + (nodecnt[a, x, ng] == 0)
    ok_x = (ng == nh) | (after_x >= np.minimum(need[a, x], distinct[a, x]))
    result: BoolArray = ok_e & ok_x
    return result


# --------------------------------------------------------------------------------------------------
# Group-aware placement


def _group_aware(load: FloatArray, layout: _Layout, num_groups: int) -> IntArray:
    """Start from the node-local (hierarchical) placement and move only the replicas needed to come
    within ``GROUP_TOLERANCE`` of the global placement's balance; layers where the local one already is
    stay wholly local, layers the walk cannot bring there take the global placement."""
    glob = _fresh(load, layout)
    local = _group_local(load, layout, num_groups)
    top = _gpu_loads(load / _logcnt(glob, layout.experts), glob, layout.gpus).max(axis=1)
    walked = _incremental(load, local, layout, top, None, GROUP_TOLERANCE)
    # a walk that got stuck short of the global balance gives way to the global placement
    stuck = _layer_ratio(load, walked, layout.gpus) > _layer_ratio(load, glob, layout.gpus) * (1 + GROUP_TOLERANCE)
    walked[stuck] = glob[stuck]
    return walked


def _group_local(load: FloatArray, layout: _Layout, num_groups: int) -> IntArray:
    """Groups packed onto nodes by load (equal count per node), then a fresh placement inside each node."""
    layers, experts = load.shape
    nodes = layout.nodes
    per_group = experts // num_groups
    group_load = load.reshape(layers, num_groups, per_group).sum(axis=2)
    node_groups = np.empty((layers, nodes, num_groups // nodes), dtype=np.int64)
    for layer in range(layers):
        node_groups[layer] = _difference_pack(
            group_load[layer], np.arange(num_groups, dtype=np.int64), nodes, allow_dup=True
        )
    # experts of node n in layer l, [L, N, E / N]
    node_experts = (node_groups[:, :, :, None] * per_group + np.arange(per_group)).reshape(layers, nodes, -1)
    sub = _Layout(experts // nodes, layout.slots // nodes, layout.gpus // nodes, 1, layout.min_distinct)
    sub_load = np.take_along_axis(load, node_experts.reshape(layers, -1), axis=1).reshape(layers * nodes, -1)
    sub_p2l = _fresh(sub_load, sub).reshape(layers, nodes, -1)
    return np.take_along_axis(node_experts, sub_p2l, axis=2).reshape(layers, -1)


# --------------------------------------------------------------------------------------------------
# Local search with replica counts free to change (incremental, and polishing fresh layers)


@dataclass(frozen=True)
class _Step:
    swap: bool  # swap slots a and b, else slot a now holds expert b
    a: int
    b: int
    cost: int  # change in the number of slots that differ from previous
    forced: bool = False  # repairs a constraint violation
    top: float = np.inf  # busiest GPU's load after the step


_Scores = tuple[BoolArray, FloatArray, FloatArray, IntArray]  # valid, busiest GPU after, gain, cost


class _Search:
    """One layer's placement, moved a step at a time: rewrite a slot (counts change) or swap two slots.

    Steps cut the load above a target ``T``, ``excess = sum_g max(0, gpu_load_g - T)``, and never raise
    the busiest GPU; with a previous placement they are ranked by excess cut per changed slot. Each round
    takes the best rewrite for the busiest GPU, or the best swaps of up to ``_FOCUS`` overloaded GPUs that
    touch disjoint GPUs (their effects then add up exactly).
    """

    def __init__(self, load: FloatArray, phy2log: IntArray, previous: IntArray | None, layout: _Layout) -> None:
        self.load = load
        self.p2l = phy2log.copy()
        self.prev = previous
        self.layout = layout
        self.gos = layout.gpu_of_slot
        self.nog = layout.domain_of_gpu
        self.nos = self.nog[self.gos]
        experts, gpus = layout.experts, layout.gpus
        self.floor, self.cap = layout.limits()
        self.cnt = np.bincount(self.p2l, minlength=experts).astype(np.int64)
        self.hold = np.zeros((gpus, experts), dtype=np.int64)
        np.add.at(self.hold, (self.gos, self.p2l), 1)
        self.nodecnt = np.zeros((experts, layout.domains), dtype=np.int64)
        np.add.at(self.nodecnt, (self.p2l, self.nos), 1)
        self.distinct = (self.nodecnt > 0).sum(axis=1)
        self.waived = np.zeros(experts, dtype=bool)  # violations found impossible to repair

    # state ------------------------------------------------------------------------------------------
    def loads(self) -> FloatArray:
        w = self.load / self.cnt
        result: FloatArray = w[self.p2l].reshape(self.layout.gpus, -1).sum(axis=1)
        return result

    def rewrite(self, s: int, y: int) -> None:
        x, g = int(self.p2l[s]), int(self.gos[s])
        n = int(self.nog[g])
        self.hold[g, x] -= 1
        self.hold[g, y] += 1
        self.cnt[x] -= 1
        self.cnt[y] += 1
        self.nodecnt[x, n] -= 1
        self.nodecnt[y, n] += 1
        self.distinct[x] = int(np.count_nonzero(self.nodecnt[x]))
        self.distinct[y] = int(np.count_nonzero(self.nodecnt[y]))
        self.p2l[s] = y

    def apply(self, step: _Step) -> None:
        if step.swap:
            x, y = int(self.p2l[step.a]), int(self.p2l[step.b])
            self.rewrite(step.a, y)
            self.rewrite(step.b, x)
        else:
            self.rewrite(step.a, step.b)

    def _changed(self, slots: IntArray, experts: IntArray) -> IntArray:
        """1 where slot ``slots`` holding ``experts`` would differ from previous (broadcast)."""
        if self.prev is None:
            return np.zeros(np.broadcast(slots, experts).shape, dtype=np.int64)
        result: IntArray = (experts != self.prev[slots]).astype(np.int64)
        return result

    # scoring ----------------------------------------------------------------------------------------
    def rewrites(self, s: IntArray, y: IntArray, gl: FloatArray, target: float, spread_y: bool = True) -> _Scores:
        """Rewrite slot ``s[C]`` to expert ``y[C]``: every GPU holding either expert changes load.

        ``spread_y=False`` lets ``y``'s new copy land on a node it is already on (a later swap spreads it).
        """
        lay = self.layout
        x, h = self.p2l[s], self.gos[s]
        cx, cy = self.cnt[x], self.cnt[y]
        ok = (y != x) & (cx > self.floor) & (cy < self.cap)
        if not lay.allow_dup:
            ok &= self.hold[h, y] == 0
        if lay.spread:
            nh = self.nog[h]
            after_x = self.distinct[x] - (self.nodecnt[x, nh] == 1)
            ok &= (after_x >= np.minimum(lay.need(cx - 1), self.distinct[x])) | self.waived[x]
            after_y = self.distinct[y] + (self.nodecnt[y, nh] == 0)
            if spread_y:
                ok &= (after_y >= np.minimum(lay.need(cy + 1), self.distinct[y] + 1)) | self.waived[y]
        lx, ly = self.load[x], self.load[y]
        wx_new = lx / np.maximum(cx - 1, 1)
        wy_new = ly / (cy + 1)
        new = (
            gl[None, :]
            + self.hold[:, x].T * (wx_new - lx / cx)[:, None]
            + self.hold[:, y].T * (wy_new - ly / cy)[:, None]
        )
        new[np.arange(len(s)), h] += wy_new - wx_new
        gain = np.maximum(gl - target, 0.0).sum() - np.maximum(new - target, 0.0).sum(axis=1)
        cost = self._changed(s, y) - self._changed(s, x)
        return ok, new.max(axis=1), gain, cost

    def swaps(
        self, gs: IntArray, gl: FloatArray, target: float, partners: IntArray | None = None
    ) -> tuple[IntArray, IntArray, _Scores]:
        """Swap each slot of GPUs ``gs[k]`` with each slot of ``partners[P]`` (default all): ``[k, S * P]``.

        Valid swaps lower GPU ``g`` and leave the partner below ``g``'s old load.
        """
        lay = self.layout
        per = lay.per_gpu
        t = np.arange(lay.slots) if partners is None else partners
        sg = gs[:, None] * per + np.arange(per)[None, :]  # [k, S]
        eg, et = self.p2l[sg], self.p2l[t]
        w = self.load / self.cnt
        d = w[eg][:, :, None] - w[et][None, None, :]  # [k, S, P]
        h = self.gos[t]
        lg = gl[gs][:, None, None]
        new_g = lg - d
        new_h = gl[h][None, None, :] + d
        ok = (h[None, None, :] != gs[:, None, None]) & (eg[:, :, None] != et[None, None, :])
        if not lay.allow_dup:
            ok &= self.hold.T[eg][:, :, h] == 0  # g's expert not on the partner GPU
            ok &= (self.hold[gs][:, et] == 0)[:, None, :]  # partner's expert not on g
        if lay.spread:
            ng, nh = self.nog[gs], self.nog[h]
            need = lay.need(self.cnt)
            de, dt = self.distinct[eg], self.distinct[et]
            after_e = (de - (self.nodecnt[eg, ng[:, None]] == 1))[:, :, None] + (self.nodecnt[eg][:, :, nh] == 0)
            ok_e = after_e >= np.minimum(need[eg], de)[:, :, None]
            after_t = (dt - (self.nodecnt[et, nh] == 1))[None, :] + (self.nodecnt[et][:, ng].T == 0)
            ok_t = after_t >= np.minimum(need[et], dt)[None, :]
            ok &= (nh[None, None, :] == ng[:, None, None]) | (ok_e & ok_t[:, None, :])
        pair = np.maximum(new_g, new_h)
        ok &= pair < lg * (1 - 1e-12)
        gain = (
            np.maximum(lg - target, 0.0)
            + np.maximum(gl[h] - target, 0.0)[None, None, :]
            - np.maximum(new_g - target, 0.0)
            - np.maximum(new_h - target, 0.0)
        )
        k, shape = len(gs), (len(gs), per, len(t))
        if self.prev is None:
            cost = np.zeros(shape, dtype=np.int64)
        else:
            was_g, was_t = self.prev[sg], self.prev[t]
            cost = (
                (et[None, None, :] != was_g[:, :, None]).astype(np.int64)
                + (eg[:, :, None] != was_t[None, None, :])
                - (eg != was_g)[:, :, None]
                - (et != was_t)[None, None, :]
            )
        s_idx = np.broadcast_to(sg[:, :, None], shape).reshape(k, -1)
        t_idx = np.broadcast_to(t, shape).reshape(k, -1)
        return s_idx, t_idx, (ok.reshape(k, -1), pair.reshape(k, -1), gain.reshape(k, -1), cost.reshape(k, -1))

    def _score(self, scores: _Scores, top: float, per_slot: bool) -> FloatArray:
        ok, newmax, gain, cost = scores
        ok = ok & (gain > _REL_EPS * top) & (newmax <= top * (1 + 1e-12))
        # per changed slot; steps that change no slot (or undo a change) come first
        raw = np.where(cost > 0, gain / np.maximum(cost, 1), gain * 1e9) if per_slot else gain
        result: FloatArray = np.where(ok, raw, -np.inf)
        return result

    # steps ------------------------------------------------------------------------------------------
    def improve(self, target: float, per_slot: bool) -> list[_Step]:
        """One round of steps cutting the excess above ``target``; empty when none helps."""
        lay = self.layout
        gl = self.loads()
        g = int(gl.argmax())
        top = float(gl[g])
        if lay.per_gpu < 2:
            rewrite = self._best_rewrite(g, gl, target, top, per_slot)
            return [rewrite[1]] if rewrite else []
        over = np.flatnonzero(gl > target)
        focus = over[np.argsort(-gl[over], kind="stable")][:_FOCUS]
        # partners: slots on the lighter half of the GPUs (where the load can go)
        light = np.argsort(gl, kind="stable")[: max(_PARTNERS, lay.gpus // 2)]
        partners = (light[:, None] * lay.per_gpu + np.arange(lay.per_gpu)[None, :]).ravel()
        s_idx, t_idx, scores = self.swaps(focus, gl, target, partners)
        score = self._score(scores, top, per_slot)
        steps: list[_Step] = []
        used = np.zeros(lay.gpus, dtype=bool)
        used_e = np.zeros(lay.experts, dtype=bool)
        if not np.isfinite(score[0].max()):  # the busiest GPU needs its replica counts changed
            rewrite = self._best_rewrite(g, gl, target, top, per_slot)
            if rewrite:
                step = rewrite[1]
                x = int(self.p2l[step.a])
                used |= (self.hold[:, x] > 0) | (self.hold[:, step.b] > 0)
                used_e[[x, step.b]] = True
                steps.append(step)
        # swaps on disjoint GPUs (and experts): each keeps its exact score when applied together
        k = min(_PARTNER_TRIES, score.shape[1])
        top_k = np.argpartition(-score, k - 1, axis=1)[:, :k]
        top_k = np.take_along_axis(top_k, np.argsort(-np.take_along_axis(score, top_k, axis=1), axis=1), axis=1)
        for i in np.argsort(-score.max(axis=1), kind="stable"):
            for j in top_k[i]:
                if not np.isfinite(score[i, j]):
                    break
                s, t = int(s_idx[i, j]), int(t_idx[i, j])
                gpus = [int(self.gos[s]), int(self.gos[t])]
                experts = [int(self.p2l[s]), int(self.p2l[t])]
                if used[gpus].any() or used_e[experts].any():
                    continue
                used[gpus] = True
                if lay.spread:
                    used_e[experts] = True
                steps.append(_Step(True, s, t, int(scores[3][i, j])))
                break
        return steps

    def _best_rewrite(
        self, g: int, gl: FloatArray, target: float, top: float, per_slot: bool
    ) -> tuple[float, _Step] | None:
        """Best rewrite for GPU ``g``: one more replica of an expert on ``g`` in a slot elsewhere (donor:
        light GPU, cheap expert), or a slot of ``g`` given to an expert that is light or whose GPUs are busy.
        """
        lay = self.layout
        w = self.load / self.cnt
        per = lay.per_gpu
        sg = g * per + np.arange(per)
        eg = np.unique(self.p2l[sg])
        x = self.p2l
        proxy = gl[self.gos] - w[x] + self.load[x] / np.maximum(self.cnt[x] - 1, 1) - w[x]
        proxy = np.where((self.cnt[x] > self.floor) & (self.gos != g), proxy, np.inf)
        k = min(_CANDIDATES, lay.slots)
        donors = np.argpartition(proxy, k - 1)[:k]
        free = (self.hold[g] == 0) & (self.cnt < self.cap)
        k_e = min(_CANDIDATES, lay.experts)
        light = np.argpartition(np.where(free, self.load / (self.cnt + 1), np.inf), k_e - 1)[:k_e]
        relief = np.where(free, w - self.load / (self.cnt + 1), -np.inf)
        busy = np.argpartition(-relief, k_e // 2)[: k_e // 2 + 1]
        ys = np.unique(np.concatenate([light, busy]))
        s = np.concatenate([np.repeat(donors, len(eg)), np.repeat(sg, len(ys))])
        y = np.concatenate([np.tile(eg, len(donors)), np.tile(ys, per)])
        scores = self.rewrites(s, y, gl, target)
        score = self._score(scores, top, per_slot)
        i = int(np.argmax(score))
        if not np.isfinite(score[i]):
            return None
        return float(score[i]), _Step(False, int(s[i]), int(y[i]), int(scores[3][i]))

    def split_heaviest(self, weight_cap: float) -> _Step | None:
        """One more replica for the heaviest expert on the busiest GPU, if it weighs over ``weight_cap``.

        The slot comes from an expert whose replicas stay under the cap. This may raise the busiest GPU
        for a while; callers keep the best prefix of a search.
        """
        gl = self.loads()
        g = int(gl.argmax())
        w = self.load / self.cnt
        eg = self.p2l[g * self.layout.per_gpu : (g + 1) * self.layout.per_gpu]
        e = int(eg[np.argmax(w[eg])])
        if w[e] <= weight_cap or self.cnt[e] >= self.cap:
            return None
        x = self.p2l
        grown = self.load[x] / np.maximum(self.cnt[x] - 1, 1)
        # donor slots: light GPU, expert that stays under the cap; scored exactly for the best few
        proxy = np.where((grown <= weight_cap) & (self.cnt[x] > self.floor), gl[self.gos] - w[x] + grown, np.inf)
        k = min(_CANDIDATES, len(proxy))
        s = np.argpartition(proxy, k - 1)[:k]
        s = s[np.isfinite(proxy[s])]
        ok, newmax, _, cost = self.rewrites(s, np.full(len(s), e), gl, np.inf)
        if not ok.any():
            return None
        best = int(np.argmin(np.where(ok, newmax, np.inf)))
        return _Step(False, int(s[best]), e, int(cost[best]))

    def _count_excess(self, weights: FloatArray, target: float) -> float:
        """Excess over ``target`` of the ideal packing of replica ``weights[R]``: the i-th heaviest
        replica with the i-th block of ``S - 1`` lightest (exact for ``S <= 2``, a guide beyond)."""
        lay = self.layout
        ordered = np.sort(weights)
        heavy = ordered[::-1][: lay.gpus]
        rest = ordered[: lay.slots - lay.gpus].reshape(lay.gpus, lay.per_gpu - 1).sum(axis=1)
        return float(np.maximum(heavy + rest - target, 0.0).sum())

    def align_counts(self, target: float) -> _Step | None:
        """Move one replica to the heaviest expert when the counts alone keep the layer above ``target``.

        The donor is the light expert (among a few) that lowers the ideal packing's excess most; the
        slot is the donor's copy whose GPU ends lowest.
        """
        if self.layout.per_gpu > 2:
            return None
        w = self.load / self.cnt
        per_slot = w[self.p2l]
        excess = self._count_excess(per_slot, target)
        if excess <= _REL_EPS * target:
            return None
        e = int(np.argmax(np.where(self.cnt < self.cap, w, -np.inf)))
        grown = np.where((self.cnt > self.floor) & (np.arange(len(w)) != e),
                         self.load / np.maximum(self.cnt - 1, 1), np.inf)
        k = min(8, len(w))
        donors = np.argpartition(grown, k - 1)[:k]
        donors = donors[np.isfinite(grown[donors])]
        best: tuple[float, int] | None = None
        for d in donors:
            trial = per_slot.copy()
            trial[self.p2l == e] = self.load[e] / (self.cnt[e] + 1)
            trial[self.p2l == d] = grown[d]
            trial[np.flatnonzero(self.p2l == d)[0]] = self.load[e] / (self.cnt[e] + 1)
            after = self._count_excess(trial, target)
            if after < excess * (1 - 1e-9) and (best is None or after < best[0]):
                best = (after, int(d))
        if best is None:
            return None
        s = np.flatnonzero(self.p2l == best[1])
        ok, newmax, _, cost = self.rewrites(s, np.full(len(s), e), self.loads(), np.inf)
        if not ok.any():
            return None
        i = int(np.argmin(np.where(ok, newmax, np.inf)))
        return _Step(False, int(s[i]), e, int(cost[i]))

    def violation(self) -> tuple[str, int]:
        """The first broken constraint: ('dup', slot), ('floor', expert), ('spread', expert) or ('', -1)."""
        lay = self.layout
        if not lay.allow_dup:
            dup = np.flatnonzero(self.hold[self.gos, self.p2l] > 1)
            if len(dup):
                return "dup", int(dup[0])
        low = np.flatnonzero((self.cnt < self.floor) & ~self.waived)
        if len(low):
            return "floor", int(low[0])
        short = np.flatnonzero((self.distinct < lay.need(self.cnt)) & ~self.waived)
        if len(short):
            return "spread", int(short[0])
        return "", -1

    def repair(self, kind: str, which: int, rewrite: bool = True) -> _Step | None:
        """The cheapest step that repairs a violation; among those, the lowest busiest GPU.

        A rewrite (one slot, counts change) if ``rewrite`` and one exists, else a swap.
        """
        lay = self.layout
        gl = self.loads()
        if rewrite:
            if kind == "dup":
                s = np.full(lay.experts, which)
                y = np.arange(lay.experts)
            else:
                s = np.arange(lay.slots)
                if kind == "spread":
                    s = s[self.nodecnt[which, self.nos] == 0]
                y = np.full(len(s), which)
            ok, newmax, _, cost = self.rewrites(s, y, gl, np.inf)
            if not ok.any() and kind == "floor":
                ok, newmax, _, cost = self.rewrites(s, y, gl, np.inf, spread_y=False)
            if ok.any():
                best = int(np.lexsort((newmax, np.where(ok, cost, 1 << 30)))[0])
                return _Step(False, int(s[best]), int(y[best]), int(cost[best]), forced=True)
        if kind == "floor":
            return None
        if kind == "dup":
            slot = which
        else:  # move the copy on the most crowded node, busiest GPU first
            copies = np.flatnonzero(self.p2l == which)
            crowd = self.nodecnt[which, self.nos[copies]]
            slot = int(copies[np.lexsort((-gl[self.gos[copies]], -crowd))[0]])
        t = np.arange(lay.slots)
        ok_s = self._swap_valid(np.full(lay.slots, slot), t)
        if kind == "dup" and not ok_s.any():  # a duplicate is worse than a crowded node: spread it later
            ok_s = self._swap_valid(np.full(lay.slots, slot), t, spread=False)
        if kind == "spread":
            ok_s &= self.nodecnt[which, self.nos] == 0
        if not ok_s.any():
            return None
        w = self.load / self.cnt
        d = w[self.p2l[slot]] - w[self.p2l]
        worse = np.maximum(gl[self.gos[slot]] - d, gl[self.gos] + d)
        cost = (
            self._changed(np.full(lay.slots, slot), self.p2l)
            - self._changed(np.array([slot]), self.p2l[[slot]])
            + self._changed(t, np.full(lay.slots, self.p2l[slot]))
            - self._changed(t, self.p2l)
        )
        best = int(np.lexsort((worse, np.where(ok_s, cost, 1 << 30)))[0])
        return _Step(True, slot, best, int(cost[best]), forced=True)

    def _swap_valid(self, s: IntArray, t: IntArray, spread: bool = True) -> BoolArray:
        """Constraint-only validity of swapping slots ``s[C]`` and ``t[C]`` (``spread``: keep node spread)."""
        lay = self.layout
        es, et = self.p2l[s], self.p2l[t]
        gs, gt = self.gos[s], self.gos[t]
        ok = (gs != gt) & (es != et)
        if not lay.allow_dup:
            ok &= (self.hold[gt, es] == 0) & (self.hold[gs, et] == 0)
        if lay.spread and spread:
            ns, nt = self.nog[gs], self.nog[gt]
            need = lay.need(self.cnt)
            after_s = self.distinct[es] - (self.nodecnt[es, ns] == 1) + (self.nodecnt[es, nt] == 0)
            after_t = self.distinct[et] - (self.nodecnt[et, nt] == 1) + (self.nodecnt[et, ns] == 0)
            ok &= (ns == nt) | (after_t >= np.minimum(need[et], self.distinct[et]))
            ok &= (ns == nt) | (after_s >= np.minimum(need[es], self.distinct[es])) | (self.distinct[es] < need[es])
        result: BoolArray = ok
        return result

    def run(self, target: float, per_slot: bool, limit: int, weight_cap: float = np.inf) -> list[_Step]:
        """Repair violations, then improve until the busiest GPU is at most ``target`` (or stuck).

        When stuck, :meth:`split_heaviest` may take a step that raises the busiest GPU for a while.
        """
        steps: list[_Step] = []
        while len(steps) < limit:
            kind, which = self.violation()
            if kind:
                step = self.repair(kind, which)
                if step is None:
                    expert = int(self.p2l[which]) if kind == "dup" else which
                    if self.waived[expert]:
                        break
                    self.waived[expert] = True
                    continue
                batch = [step]
            else:
                if self.loads().max() <= target:
                    break
                split = self.align_counts(target)
                batch = [split] if split else self.improve(target, per_slot)
                if not batch:
                    split = self.split_heaviest(weight_cap)
                    if split is None:
                        break
                    batch = [split]
            for step in batch:
                self.apply(step)
                steps.append(replace(step, top=float(self.loads().max())))
        return steps


# --------------------------------------------------------------------------------------------------
# Incremental placement


def _incremental(
    load: FloatArray,
    previous: IntArray,
    layout: _Layout,
    fresh_top: FloatArray,
    max_moves: int | None,
    tolerance: float = KEEP_TOLERANCE,
) -> IntArray:
    """Walk from ``previous[L, R]`` towards the fresh busiest-GPU loads ``fresh_top[L]``.

    Each layer's search aims close to its fresh result; then the cheapest stretches of those walks
    (balance gained per slot changed, over all layers) are kept until the mean balance is within
    ``KEEP_TOLERANCE`` of the fresh one, or ``max_moves`` is spent.
    """
    layers = load.shape[0]
    floor, cap = layout.limits()
    weight_cap = (load / _replica_counts(load, layout.slots, floor, cap)).max(axis=1)
    aim = fresh_top * (1.0 + tolerance)
    paths = []
    for layer in range(layers):
        search = _Search(load[layer], previous[layer], previous[layer], layout)
        path = search.run(float(aim[layer]), True, 4 * layout.slots, float(weight_cap[layer]))
        paths.append(_best_prefix(path))
    mean = np.maximum(load.sum(axis=1) / layout.gpus, 1e-300)
    start = _gpu_loads(load / _logcnt(previous, layout.experts), previous, layout.gpus).max(axis=1)
    goal = float((fresh_top / mean).sum() * (1.0 + tolerance))
    taken = _allocate(paths, start / mean, mean, goal, max_moves)
    result = previous.copy()
    for layer, path in enumerate(paths):
        row = result[layer]
        for step in path[: taken[layer]]:
            if step.swap:
                row[[step.a, step.b]] = row[[step.b, step.a]]
            else:
                row[step.a] = step.b
    return result


def _best_prefix(path: list[_Step]) -> list[_Step]:
    """Drop the tail after the lowest busiest GPU (keeping every repair)."""
    if not path:
        return path
    tops = np.array([step.top for step in path])
    forced = [i for i, step in enumerate(path) if step.forced]
    first_best = int(np.argmax(tops <= tops.min() * (1 + 1e-12)))
    return path[: max(first_best, forced[-1] if forced else -1) + 1]


def _allocate(
    paths: list[list[_Step]], start: FloatArray, mean: FloatArray, goal: float, budget: int | None
) -> list[int]:
    """How many steps of each layer's path to keep.

    A path is cut into segments ending where its busiest GPU drops, merged so that balance gained per
    slot changed never rises along a layer; segments are then bought best ratio first (repairs before
    anything) until the summed max/mean ratio reaches ``goal`` or the next segment exceeds ``budget``.
    """
    segments: list[list[tuple[int, int, float]]] = []  # per layer: (end index, cost, gain)
    for layer, path in enumerate(paths):
        segs: list[tuple[int, int, float]] = []
        cost, level = 0, float(start[layer])
        for i, step in enumerate(path):
            cost += step.cost
            ratio = step.top / mean[layer]
            if step.forced or ratio < level * (1 - 1e-12) or i == len(path) - 1:
                gain = np.inf if step.forced else max(level - ratio, 0.0)
                segs.append((i + 1, cost, gain))
                cost, level = 0, min(level, ratio)
                while len(segs) > 1 and _ratio(segs[-2]) < _ratio(segs[-1]):
                    last, prev = segs.pop(), segs.pop()
                    segs.append((last[0], prev[1] + last[1], prev[2] + last[2]))
        segments.append(segs)
    taken = [0] * len(paths)
    heap: list[tuple[float, int, int]] = []

    def push(layer: int, k: int) -> None:
        if k < len(segments[layer]):
            heapq.heappush(heap, (-_ratio(segments[layer][k]), layer, k))

    for layer in range(len(paths)):
        push(layer, 0)
    left = np.inf if budget is None else budget
    total = float(start.sum())
    while heap:
        _, layer, k = heapq.heappop(heap)
        end, cost, gain = segments[layer][k]
        if cost > left or (total <= goal and not np.isinf(gain)):
            continue
        left -= cost
        total -= gain if np.isfinite(gain) else 0.0
        taken[layer] = end
        push(layer, k + 1)
    return taken


def _ratio(segment: tuple[int, int, float]) -> float:
    _, cost, gain = segment
    return float(gain / cost) if cost > 0 else np.inf
