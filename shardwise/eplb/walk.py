"""The incremental walk: from the current placement towards a fresh one's balance, a layer at a time, then
the cheapest stretches of those walks over all layers (balance gained per slot changed) until the mean
balance is within ``KEEP_TOLERANCE`` of the fresh placement's or the move budget is spent. Besides the
search's swaps and rewrites, a walk may change replica counts when they alone keep a layer above its aim
(:func:`align_counts`) or split the heaviest replica (:func:`split_heaviest`)."""

from __future__ import annotations

import heapq
from dataclasses import replace

import numpy as np

from . import churn
from .counts import replica_counts
from .layout import REL_EPS, FloatArray, IntArray, Layout, counts_of, gpu_loads
from .local_search import CANDIDATES, Search, Step

KEEP_TOLERANCE = 0.008
"""With ``previous``: moving stops once the mean balance is within this share of a fresh placement's."""


def split_heaviest(search: Search, weight_cap: float) -> Step | None:
    """One more replica for the heaviest expert on the busiest GPU, if it weighs over ``weight_cap``.

    The slot comes from an expert whose replicas stay under the cap. This may raise the busiest GPU
    for a while; callers keep the best prefix of a search.
    """
    gl = search.loads()
    g = int(gl.argmax())
    w = search.load / search.cnt
    eg = search.p2l[g * search.layout.per_gpu : (g + 1) * search.layout.per_gpu]
    e = int(eg[np.argmax(w[eg])])
    if w[e] <= weight_cap or search.cnt[e] >= search.cap:
        return None
    x = search.p2l
    grown = search.load[x] / np.maximum(search.cnt[x] - 1, 1)
    # donor slots: light GPU, expert that stays under the cap; scored exactly for the best few
    proxy = np.where((grown <= weight_cap) & (search.cnt[x] > search.floor), gl[search.gos] - w[x] + grown, np.inf)
    k = min(CANDIDATES, len(proxy))
    s = np.argpartition(proxy, k - 1)[:k]
    s = s[np.isfinite(proxy[s])]
    ok, newmax, _, cost = search.rewrites(s, np.full(len(s), e), gl, np.inf)
    if not ok.any():
        return None
    best = int(np.argmin(np.where(ok, newmax, np.inf)))
    return Step(False, int(s[best]), e, int(cost[best]))

def _count_excess(layout: Layout, weights: FloatArray, target: float) -> float:
    """Excess over ``target`` of the ideal packing of replica ``weights[R]``: the i-th heaviest
    replica with the i-th block of ``S - 1`` lightest (exact for ``S <= 2``, a guide beyond)."""
    lay = layout
    ordered = np.sort(weights)
    heavy = ordered[::-1][: lay.gpus]
    rest = ordered[: lay.slots - lay.gpus].reshape(lay.gpus, lay.per_gpu - 1).sum(axis=1)
    return float(np.maximum(heavy + rest - target, 0.0).sum())

def align_counts(search: Search, target: float) -> Step | None:
    """Move one replica to the heaviest expert when the counts alone keep the layer above ``target``.

    The donor is the light expert (among a few) that lowers the ideal packing's excess most; the
    slot is the donor's copy whose GPU ends lowest.
    """
    if search.layout.per_gpu > 2:
        return None
    w = search.load / search.cnt
    per_slot = w[search.p2l]
    excess = _count_excess(search.layout, per_slot, target)
    if excess <= REL_EPS * target:
        return None
    e = int(np.argmax(np.where(search.cnt < search.cap, w, -np.inf)))
    grown = np.where((search.cnt > search.floor) & (np.arange(len(w)) != e),
                     search.load / np.maximum(search.cnt - 1, 1), np.inf)
    k = min(8, len(w))
    donors = np.argpartition(grown, k - 1)[:k]
    donors = donors[np.isfinite(grown[donors])]
    best: tuple[float, int] | None = None
    for d in donors:
        trial = per_slot.copy()
        trial[search.p2l == e] = search.load[e] / (search.cnt[e] + 1)
        trial[search.p2l == d] = grown[d]
        trial[np.flatnonzero(search.p2l == d)[0]] = search.load[e] / (search.cnt[e] + 1)
        after = _count_excess(search.layout, trial, target)
        if after < excess * (1 - 1e-9) and (best is None or after < best[0]):
            best = (after, int(d))
    if best is None:
        return None
    s = np.flatnonzero(search.p2l == best[1])
    ok, newmax, _, cost = search.rewrites(s, np.full(len(s), e), search.loads(), np.inf)
    if not ok.any():
        return None
    i = int(np.argmin(np.where(ok, newmax, np.inf)))
    return Step(False, int(s[i]), e, int(cost[i]))

def walk(search: Search, target: float, per_slot: bool, limit: int, weight_cap: float = np.inf) -> list[Step]:
    """Repair violations, then improve until the busiest GPU is at most ``target`` (or stuck).

    When stuck, :func:`split_heaviest` may take a step that raises the busiest GPU for a while.
    """
    steps: list[Step] = []
    while len(steps) < limit:
        kind, which = search.violation()
        if kind:
            step = search.repair(kind, which)
            if step is None:
                if not search.waive(kind, which):
                    break
                continue
            batch = [step]
        else:
            if search.loads().max() <= target:
                break
            split = align_counts(search, target)
            batch = [split] if split else search.improve(target, per_slot)
            if not batch:
                split = split_heaviest(search, weight_cap)
                if split is None:
                    break
                batch = [split]
        for step in batch:
            search.apply(step)
            steps.append(replace(step, top=float(search.loads().max())))
    return steps


def incremental(
    load: FloatArray,
    previous: IntArray,
    layout: Layout,
    fresh_top: FloatArray,
    max_moves: int | None,
    tolerance: float = KEEP_TOLERANCE,
    fresh_counts: IntArray | None = None,
) -> IntArray:
    """Walk from ``previous[L, R]`` towards the fresh busiest-GPU loads ``fresh_top[L]``.

    Each layer's search aims close to its fresh result; then the cheapest stretches of those walks
    (balance gained per slot changed, over all layers) are kept until the mean balance is within
    ``KEEP_TOLERANCE`` of the fresh one, or ``max_moves`` is spent. With two slots per GPU and the fresh
    placement's ``fresh_counts[L, E]``, each layer may instead take a repaired placement of
    :func:`.churn.candidates` (:func:`.churn.allocate` weighs them against the walk's prefixes).
    """
    layers = load.shape[0]
    floor, cap = layout.limits()
    weight_cap = (load / replica_counts(load, layout.slots, floor, cap)).max(axis=1)
    aim = fresh_top * (1.0 + tolerance)
    paths = []
    for layer in range(layers):
        search = Search(load[layer], previous[layer], previous[layer], layout)
        path = walk(search, float(aim[layer]), True, 4 * layout.slots, float(weight_cap[layer]))
        paths.append(_best_prefix(path))
    mean = np.maximum(load.sum(axis=1) / layout.gpus, 1e-300)
    start = gpu_loads(load / counts_of(previous, layout.experts), previous, layout.gpus).max(axis=1)
    goal = float((fresh_top / mean).sum() * (1.0 + tolerance))
    if fresh_counts is not None and churn.applicable(layout, previous):
        return _with_candidates(load, previous, layout, fresh_top, fresh_counts, paths, start, goal, max_moves)
    taken = _allocate(paths, start / mean, mean, goal, max_moves)
    return _replay(previous, paths, taken)


def _replay(previous: IntArray, paths: list[list[Step]], taken: list[int]) -> IntArray:
    result = previous.copy()
    for layer, path in enumerate(paths):
        row = result[layer]
        for step in path[: taken[layer]]:
            if step.swap:
                row[[step.a, step.b]] = row[[step.b, step.a]]
            else:
                row[step.a] = step.b
    return result


def _with_candidates(
    load: FloatArray,
    previous: IntArray,
    layout: Layout,
    fresh_top: FloatArray,
    fresh_counts: IntArray,
    paths: list[list[Step]],
    start: FloatArray,
    goal: float,
    max_moves: int | None,
) -> IntArray:
    """Each layer's walk prefixes and :func:`.churn.candidates` as options of one allocation."""
    mean = np.maximum(load.sum(axis=1) / layout.gpus, 1e-300)
    extra = churn.candidates(load, previous, layout, fresh_top, fresh_counts)
    options: list[list[tuple[int, float]]] = []
    for layer, path in enumerate(paths):
        costs = np.cumsum([0] + [step.cost for step in path])
        tops = [float(start[layer])] + [step.top for step in path]
        options.append([(int(c), t) for c, t in zip(costs, tops, strict=True)] + [(c, t) for c, t, _ in extra[layer]])
    chosen = churn.allocate(options, mean, goal, max_moves)
    taken = [min(i, len(path)) for i, path in zip(chosen, paths, strict=True)]
    result = _replay(previous, paths, taken)
    for layer, (i, path) in enumerate(zip(chosen, paths, strict=True)):
        if i > len(path):
            result[layer] = extra[layer][i - len(path) - 1][2]
    return result


def _best_prefix(path: list[Step]) -> list[Step]:
    """Drop the tail after the lowest busiest GPU (keeping every repair)."""
    if not path:
        return path
    tops = np.array([step.top for step in path])
    forced = [i for i, step in enumerate(path) if step.forced]
    first_best = int(np.argmax(tops <= tops.min() * (1 + 1e-12)))
    return path[: max(first_best, forced[-1] if forced else -1) + 1]


def _allocate(
    paths: list[list[Step]], start: FloatArray, mean: FloatArray, goal: float, budget: int | None
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
