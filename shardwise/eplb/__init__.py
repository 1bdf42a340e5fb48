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
at once. It ignores how replicas pack, so it is loose when a GPU holds few replicas of few experts (the
8-expert example of ``make bench-eplb``, two slots per GPU: at best 196.7 against a bound of 181.25); with
256 experts and two slots per GPU the best placements measured (``make bench-eplb-optimum``) lie within 1%
of it.

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
   With two slots per GPU, counts searched under the sorted pairing that places them (``pairs``: a ballot
   condition per target busiest GPU, the target bisected per layer) are placed first, D'Hondt's where better.
2. Placement by the balanced largest-differencing method (Karmarkar-Karp with equal-size bins): rounds of
   ``G`` replicas are merged lightest-with-heaviest, re-pairing where a GPU would get an expert twice;
   then count-preserving swaps repair the spread rule and move load off the busiest GPU. Small problems
   also try the reference's greedy loop (without duplicates) and keep the better.
3. With ``previous``: each layer walks from the current placement. Broken rules are repaired first; then
   rounds of steps, each a swap of two slots or a rewrite of one slot (counts change), are taken by load
   cut above the target per changed slot. Over all layers, the cheapest stretches of those walks (balance
   gained per changed slot) are kept until the mean balance is within ``KEEP_TOLERANCE`` of a fresh
   placement's, or ``max_moves`` is spent. With two slots per GPU a layer may instead take a repair of the
   current placement to a target busiest GPU (``churn``: GPUs that fit stay, the others and as few more as
   the sorted pairing's ballot needs change one slot each), for several targets and replica counts.
4. With ``num_groups``: the hierarchical placement (groups packed onto nodes, replicas kept in the node)
   is the start of such a walk towards the global placement's balance, so replicas leave their group's
   node only as far as balance needs (``GROUP_TOLERANCE``).

Modules
-------
``layout`` (array types, checks, :class:`Placement`, shared arithmetic), ``counts`` and ``pairs`` (step 1),
``packing`` (step 2), ``local_search`` (one layer's local search: its steps, their scores, repairs), ``walk`` and
``churn`` (step 3),
``groups`` (step 4), ``carry`` (:func:`carry_over`, a resized world). This module holds the entry points.

Hazards
-------
The reference ignores the current placement, so a rerun after a small drift moves most experts; its
hierarchical variant caps balance at the heaviest node's share of the load (max/mean 1.17-1.77 on 8 nodes
where the global one gets 1.00-1.03); it can put two copies of one expert on a GPU (a wasted slot); its
placement loop is slow in Python. Moving an expert costs migration bytes and a redundant slot costs
KV-cache memory, so rebalance on drift with a move budget rather than chase 1.00.
"""

from __future__ import annotations

import numpy as np

from .carry import carry_over
from .counts import replica_counts
from .groups import GROUP_TOLERANCE, group_aware
from .layout import (
    FloatArray,
    IntArray,
    Layout,
    Placement,
    balance,
    check_layout,
    check_load,
    check_previous,
    count_limits,
    counts_of,
    gpu_loads,
    layer_lower_bound,
)
from .packing import fresh_placement
from .walk import KEEP_TOLERANCE, incremental

__all__ = [
    "GROUP_TOLERANCE",
    "KEEP_TOLERANCE",
    "Placement",
    "balance",
    "carry_over",
    "lower_bound",
    "rebalance",
]


def lower_bound(load: FloatArray, num_slots: int, num_gpus: int, min_distinct: int = 1) -> float:
    """A balance no placement of ``num_slots`` slots on ``num_gpus`` GPUs can beat (module docstring).

    ``load[L, E]``. Per layer: ``max(total / G, t*) / (total / G)``, averaged over layers.
    """
    arr = check_load(load)
    check_layout(arr.shape[1], num_slots, num_gpus, 1, None, min_distinct)
    floor, cap = count_limits(arr.shape[1], num_slots, num_gpus, min_distinct)
    return float(layer_lower_bound(arr, replica_counts(arr, num_slots, floor, cap), num_gpus).mean())


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
    arr = check_load(load)
    peak = arr.max(axis=1, keepdims=True)
    arr = arr / np.where(peak > 0, peak, 1.0)  # placements are scale-free per layer; this keeps bisection tame
    layers, experts = arr.shape
    check_layout(experts, num_slots, num_gpus, num_nodes, num_groups, min_distinct)
    prev = check_previous(previous, max_moves, layers, num_slots, experts)
    layout = Layout(experts, num_slots, num_gpus, num_nodes, min_distinct)

    if prev is not None and max_moves == 0:
        return Placement.from_phy2log(prev, experts, num_gpus)
    if num_groups is not None and num_nodes >= 2 and min_distinct < 2:
        fresh = group_aware(arr, layout, num_groups)
    else:
        fresh = fresh_placement(arr, layout)
    if prev is None:
        return Placement.from_phy2log(fresh, experts, num_gpus)

    fresh_top = gpu_loads(arr / counts_of(fresh, experts), fresh, num_gpus).max(axis=1)
    result = incremental(arr, prev, layout, fresh_top, max_moves, fresh_counts=counts_of(fresh, experts))
    return Placement.from_phy2log(result, experts, num_gpus)
