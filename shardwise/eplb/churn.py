"""With two slots per GPU and ``previous``: placements that keep most GPUs as they are, for several targets.

Fresh two-slot placements take counts searched under the sorted pairing (:mod:`.pairs`), shaped unlike the
previous ones, which the walk's one-slot steps seldom reach. Here each layer is instead repaired to a
target busiest GPU ``T`` with given counts, changing few slots:

- GPUs whose pair still fits under ``T`` are kept. Every other GPU is opened: one of its slots (the lighter
  replica's) is freed and the other stays, an anchor. Copies an expert loses (its count fell) are taken
  from the busiest GPUs holding it, whose slot is freed; copies it gains join the freed replicas in a pool.
- The anchors take the pool, heaviest anchor with lightest replica. That fits under ``T`` exactly when,
  for each anchor's room ``T - w``, at least as many pool replicas weigh at most that room as anchors have
  at most that room (the ballot condition of :mod:`.pairs`). At the first room that fails, one more kept
  GPUs are opened, as many as that room lacks: those whose pair straddles it (the lighter replica, or the
  heavier one, within it and the anchor's room above it) reaching highest; this repeats until the ballot holds.
- Counts tried: the previous ones, the fresh placement's, and counts searched under the sorted pairing
  close to the previous ones (:func:`.pairs.counts_near`); targets are the fresh busiest GPU times
  ``1 + d`` for ``d`` in ``_DELTAS``.

Each layer's candidates, ``(slots changed, busiest GPU, phy2log row)``, go to the walk's allocation beside
its own steps. Applies when GPUs hold two slots, no expert may sit twice on a GPU, spread over nodes is not
asked for and ``previous`` breaks no rule (otherwise the walk's repairs come first).
"""

from __future__ import annotations

import heapq

import numpy as np

from .layout import BoolArray, FloatArray, IntArray, Layout, counts_of
from .pairs import counts_near

_DELTAS = (0.0, 0.006, 0.012, 0.02, 0.035)  # targets: the fresh busiest GPU times 1 + these
_EPS = 1e-12

Candidate = tuple[int, float, IntArray]  # slots changed, busiest GPU (load units), phy2log row


def applicable(layout: Layout, previous: IntArray) -> bool:
    """Two slots per GPU, no duplicates allowed or present, no node spread, every count at its floor."""
    if layout.per_gpu != 2 or layout.allow_dup or layout.spread:
        return False
    floor, cap = layout.limits()
    counts = counts_of(previous, layout.experts)
    if (counts < floor).any() or (counts > cap).any():
        return False
    return not (previous[:, 0::2] == previous[:, 1::2]).any()


def candidates(
    load: FloatArray, previous: IntArray, layout: Layout, fresh_top: FloatArray, fresh_counts: IntArray
) -> list[list[Candidate]]:
    """Per layer, repaired placements for each target and set of counts tried (module docstring)."""
    layers = load.shape[0]
    floor, cap = layout.limits()
    mean = np.maximum(load.sum(axis=1) / layout.gpus, 1e-300)
    x = load / mean[:, None]
    top = fresh_top / mean
    prev_counts = counts_of(previous, layout.experts)
    result: list[list[Candidate]] = [[] for _ in range(layers)]
    for delta in _DELTAS:
        target = top * (1.0 + delta)
        near, ok = counts_near(x, target, prev_counts, layout.slots, floor, cap)
        for layer in range(layers):
            tried: list[IntArray] = [prev_counts[layer], fresh_counts[layer]]
            if ok[layer]:
                tried.append(near[layer])
            seen: set[bytes] = set()
            for counts in tried:
                key = counts.tobytes()
                if key in seen:
                    continue
                seen.add(key)
                row = repair(x[layer], previous[layer], counts, float(target[layer]))
                if row is None:
                    continue
                busiest = _busiest(x[layer], row) * mean[layer]
                result[layer].append((int(np.count_nonzero(row != previous[layer])), busiest, row))
    return result


def _busiest(x: FloatArray, row: IntArray) -> float:
    w = x / np.bincount(row, minlength=len(x))
    return float(w[row].reshape(-1, 2).sum(axis=1).max())


def repair(x: FloatArray, previous: IntArray, counts: IntArray, target: float) -> IntArray | None:
    """``previous[R]`` (two slots per GPU) changed in few slots so that with ``counts[E]`` every GPU is at most
    ``target`` (``x[E]``, same units); None when this finds no such placement."""
    gpus = len(previous) // 2
    w = x / counts
    ws = w[previous]
    sums = ws.reshape(gpus, 2).sum(axis=1)
    free = np.zeros(2 * gpus, dtype=bool)  # slots whose replica leaves
    dropped = np.zeros(2 * gpus, dtype=bool)  # freed slots whose replica is gone (its expert lost a copy)
    had = np.bincount(previous, minlength=len(x))
    for e in np.flatnonzero(had > counts):
        slots = np.flatnonzero(previous == e)
        slots = slots[np.argsort(-sums[slots // 2], kind="stable")]
        taken = 0
        for s in slots:
            if taken == had[e] - counts[e]:
                break
            if not free[s ^ 1]:
                free[s] = dropped[s] = True
                taken += 1
        if taken < had[e] - counts[e]:
            return None
    opened = free.reshape(gpus, 2).any(axis=1)
    for g in np.flatnonzero((sums > target * (1 + _EPS)) & ~opened):
        light = 2 * g + int(ws[2 * g + 1] <= ws[2 * g])
        free[light] = True
    gained = np.repeat(np.arange(len(x)), np.maximum(counts - had, 0))
    while True:
        anchors = np.flatnonzero(free.reshape(gpus, 2).any(axis=1))
        anchor_slot = 2 * anchors + free[2 * anchors].astype(np.int64)
        pool = np.concatenate([previous[free & ~dropped], gained])
        rooms = np.sort(target - ws[anchor_slot])
        weights = np.sort(w[pool])
        short = np.flatnonzero(weights > rooms * (1 + _EPS) + _EPS)
        if not len(short):
            break
        room = float(rooms[short[0]])
        needed = int(short[0]) + 1 - int(np.searchsorted(weights, room * (1 + _EPS) + _EPS, side="right"))
        if not _open(ws, free, room, target, max(needed, 1)):
            return None
    return _pair(w, previous, free, dropped, gained, target)


def _open(ws: FloatArray, free: BoolArray, room: float, target: float, needed: int) -> bool:
    """Open the ``needed`` kept GPUs that cover ``room`` reaching highest: each adds a pool replica at most
    ``room`` and an anchor whose room is above it. False when too few do."""
    kept = np.flatnonzero(~free.reshape(-1, 2).any(axis=1))
    first, second = ws[2 * kept], ws[2 * kept + 1]
    # freeing the second slot: pool replica `second`, anchor room target - first (and the other way round)
    reach = np.stack([target - first, target - second])  # [2, K]
    start = np.stack([second, first])
    reach = np.where((start <= room * (1 + _EPS)) & (reach > room * (1 + _EPS)), reach, -np.inf)
    best = reach.max(axis=0, initial=-np.inf)
    if np.isfinite(best).sum() < needed:
        return False
    k = np.argpartition(-best, needed - 1)[:needed]
    side = reach[:, k].argmax(axis=0)
    free[2 * kept[k] + (1 - side)] = True
    return True


def _pair(
    w: FloatArray, previous: IntArray, free: BoolArray, dropped: BoolArray, gained: IntArray, target: float
) -> IntArray | None:
    """Heaviest anchor with lightest pool replica; an expert met twice on a GPU trades partners with the nearest
    pair where both still fit."""
    gpus = len(previous) // 2
    anchors = np.flatnonzero(free.reshape(gpus, 2).any(axis=1))
    anchor_slot = 2 * anchors + free[2 * anchors].astype(np.int64)
    pool = np.concatenate([previous[free & ~dropped], gained])
    anchor_slot = anchor_slot[np.argsort(-w[previous[anchor_slot]], kind="stable")]
    pool = pool[np.argsort(w[pool], kind="stable")]
    held = previous[anchor_slot]
    rooms = (target - w[held]) * (1 + _EPS) + _EPS
    n = len(pool)
    for clash in np.flatnonzero(held == pool):
        i = int(clash)
        if held[i] != pool[i]:
            continue
        for j in sorted(range(n), key=lambda k: abs(k - i)):
            if pool[j] != held[i] and pool[i] != held[j] and w[pool[j]] <= rooms[i] and w[pool[i]] <= rooms[j]:
                pool[i], pool[j] = pool[j], pool[i]
                break
        else:
            return None
    row = previous.copy()
    row[anchor_slot ^ 1] = pool
    return row


def allocate(options: list[list[tuple[int, float]]], mean: FloatArray, goal: float, budget: int | None) -> list[int]:
    """Which option of each layer to take: ``options[L]`` lists ``(slots changed, busiest GPU)``, the first
    the starting point (cost 0). Per layer the options on the lower convex hull of (cost, max / mean) are bought
    a segment at a time, best balance gained per slot first, until the summed max / mean reaches ``goal``
    or the next segment exceeds ``budget``. Returns an index into each layer's options."""
    hulls: list[list[int]] = []
    for layer, opts in enumerate(options):
        order = sorted(range(len(opts)), key=lambda i: (opts[i][0], opts[i][1]))
        hull = [order[0]]
        for i in order[1:]:
            cost, ratio = opts[i][0], opts[i][1] / mean[layer]
            last_cost, last_ratio = opts[hull[-1]][0], opts[hull[-1]][1] / mean[layer]
            if ratio >= last_ratio * (1 - _EPS) or cost <= last_cost:
                continue
            while len(hull) >= 2:
                c0, r0 = opts[hull[-2]][0], opts[hull[-2]][1] / mean[layer]
                if (r0 - last_ratio) / (last_cost - c0) > (r0 - ratio) / (cost - c0):
                    break
                hull.pop()
                last_cost, last_ratio = opts[hull[-1]][0], opts[hull[-1]][1] / mean[layer]
            hull.append(i)
        hulls.append(hull)
    heap: list[tuple[float, int, int]] = []

    def push(layer: int, k: int) -> None:
        hull = hulls[layer]
        if k + 1 < len(hull):
            (c0, t0), (c1, t1) = options[layer][hull[k]], options[layer][hull[k + 1]]
            heapq.heappush(heap, (-(t0 - t1) / mean[layer] / (c1 - c0), layer, k))

    for layer in range(len(options)):
        push(layer, 0)
    total = float(sum(options[layer][hull[0]][1] / mean[layer] for layer, hull in enumerate(hulls)))
    left = np.inf if budget is None else budget
    at = [0] * len(options)
    while heap and total > goal:
        _, layer, k = heapq.heappop(heap)
        (c0, t0), (c1, t1) = options[layer][hulls[layer][k]], options[layer][hulls[layer][k + 1]]
        if c1 - c0 > left:
            continue
        left -= c1 - c0
        total -= (t0 - t1) / mean[layer]
        at[layer] = k + 1
        push(layer, k + 1)
    return [hulls[layer][k] for layer, k in enumerate(at)]
