"""Replica counts for two slots per GPU, searched under the sorted pairing that places them.

With two slots per GPU the best placement of given counts pairs the heaviest replica with the lightest,
the second heaviest with the second lightest, and so on; D'Hondt's counts (the flattest replicas) are not
the best counts for that pairing. Here the counts are searched under it, per layer:

- Feasibility of a target ``T`` (busiest GPU, in units of the mean GPU load) is a matching condition. A
  replica heavier than ``T / 2`` needs a partner of at most ``T - w``; mirror it to position ``T - w`` as a
  "close", and put every lighter replica at its own weight as an "open". The pairing stays under ``T``
  exactly when, sweeping positions upwards, the opens seen never fall behind the closes seen (a ballot
  condition): every heavy replica then has its own lighter partner, and the opens left over pair up.
- For a target, start from the counts that keep every replica under ``_START_SHARE * T`` and sweep: at the
  first close that finds no open left, give one more copy to the expert that adds the most opens (or takes
  away the most closes) up to that position, extra opens overall breaking ties, then heavier pieces. A copy
  more for a light expert only adds opens, so the counts it reaches with slots to spare are topped up with
  copies of the heaviest light replicas. Each sweep changes one count per step, for all candidate layers at
  once (NumPy, rows of ``[B, E]``).
- The target's excess over the mean is bisected per layer (geometrically, ``_STAGES`` times, between the
  shares ``_BRACKET`` of the D'Hondt pairing's excess; on the benchmark loads the best lay at 0.2-0.7 of
  it); each layer keeps the counts with the lightest busiest GPU of the sorted pairing, D'Hondt's
  included, so a layer never gets counts worse than D'Hondt's under that pairing.
- Tiny problems add the spare-slot search (:func:`_spare_search`), exact but slow (scores every expert for
  every spare slot), which also avoids pairings of an expert with itself, costly when experts are few.

Shapes: ``load[L, E]``, ``counts[L, E]``; a sweep's rows ``[B, E]`` are layers (one target each, a few
starting shares each on small problems).
"""

from __future__ import annotations

import numpy as np

from .counts import replica_counts
from .layout import BoolArray, FloatArray, IntArray

_STAGES = 3  # bisection steps on the target, each one sweep over all layers
_BRACKET = (1 / 6, 0.8)  # the target's gap over the mean is searched between these shares of D'Hondt's
_START_SHARE = 0.7  # a sweep starts with every replica at most this share of its target
_SMALL_SHARES = (0.7, 0.8, 0.9, 1.0)  # tried side by side when layers * experts <= _SMALL_WORK
_SMALL_WORK = 4096
_TINY_WORK = 4096  # layers * experts * slots up to which the spare-slot search (exact, slow) runs too
_SPARE_MAX = 32  # spare slots it tries at most
_QUANT = float(1 << 30)  # positions are compared as integers: this many steps per target
_PREFER = 1e5  # rank bonus of a preferred copy: below one unit of relief (1e6), above the other tie-breaks


def pair_busiest(load: FloatArray, counts: IntArray) -> FloatArray:
    """Busiest GPU of the sorted pairing (two slots per GPU), ``[L]``: ``counts[L, E]`` sums to the slots.

    No placement of these counts has a lighter busiest GPU.
    """
    layers = load.shape[0]
    if not layers:
        return np.zeros(0)
    slots = int(counts[0].sum())
    pieces = np.repeat((load / np.maximum(counts, 1)).ravel(), counts.ravel()).reshape(layers, slots)
    pieces.sort(axis=1)
    half = slots // 2
    result: FloatArray = (pieces[:, :half] + pieces[:, ::-1][:, :half]).max(axis=1)
    return result


def _pairing(load: FloatArray, counts: IntArray) -> tuple[FloatArray, BoolArray]:
    """The sorted pairing's busiest GPU ``[L]``, and whether it pairs an expert with itself ``[L]``."""
    layers, experts = load.shape
    if not layers:
        return np.zeros(0), np.zeros(0, dtype=bool)
    slots = int(counts[0].sum())
    labels = np.repeat(np.tile(np.arange(experts), layers), counts.ravel()).reshape(layers, slots)
    pieces = np.take_along_axis(load / np.maximum(counts, 1), labels, axis=1)
    order = np.argsort(pieces, axis=1, kind="stable")
    pieces = np.take_along_axis(pieces, order, axis=1)
    labels = np.take_along_axis(labels, order, axis=1)
    half = slots // 2
    top: FloatArray = (pieces[:, :half] + pieces[:, ::-1][:, :half]).max(axis=1)
    clash: BoolArray = (labels[:, :half] == labels[:, ::-1][:, :half]).any(axis=1)
    return top, clash


def pairing_counts(load: FloatArray, counts: IntArray, num_gpus: int, floor: int, cap: int) -> IntArray:
    """Counts at least as good as ``counts[L, E]`` (D'Hondt's) under the sorted pairing, ``[L, E]``.

    ``load[L, E]``; every count stays within ``[floor, cap]`` and each layer's counts keep their sum (two
    slots per GPU: ``2 * num_gpus``). Small problems (``layers * experts <= _SMALL_WORK``) also try other
    starting shares; tiny ones (``layers * experts * slots <= _TINY_WORK``) the spare-slot search too,
    which passes over counts whose sorted pairing puts two copies of one expert on a GPU (with many experts
    the placement's repair swaps such a pair with a neighbour of nearly the same weight; with few it may
    cost much more).
    """
    slots = 2 * num_gpus
    total = load.sum(axis=1)
    layers = np.flatnonzero(total > 0)
    best = counts.copy()
    if not len(layers):
        return best
    small = len(layers) * load.shape[1] <= _SMALL_WORK
    shares = _SMALL_SHARES if small else (_START_SHARE,)
    x = np.repeat(load[layers] / (total[layers] / num_gpus)[:, None], len(shares), axis=0)  # mean GPU load 1
    share = np.tile(np.asarray(shares), len(layers))
    kept = np.repeat(counts[layers], len(shares), axis=0)
    kept_top = pair_busiest(x, kept)
    gap = np.maximum(kept_top - 1.0, 1e-9)
    lo, hi = np.log(gap * _BRACKET[0]), np.log(gap * _BRACKET[1])
    for _ in range(_STAGES):
        mid = 0.5 * (lo + hi)
        target = 1.0 + np.exp(mid)
        cand = np.clip(np.ceil(x / (share * target)[:, None] - 1e-12), floor, cap).astype(np.int64)
        ok = _sweep(x, target, cand, slots, cap)
        _top_up(x, target, cand, slots, cap)
        ok &= cand.sum(axis=1) == slots
        top = np.full(len(x), np.inf)
        if ok.any():
            top[ok] = pair_busiest(x[ok], cand[ok])
        better = top < kept_top * (1 - 1e-12)
        kept[better] = cand[better]
        kept_top[better] = top[better]
        hi = np.where(ok, mid, hi)
        lo = np.where(ok, lo, mid)
    pick = kept_top.reshape(len(layers), len(shares)).argmin(axis=1)
    best[layers] = kept.reshape(len(layers), len(shares), -1)[np.arange(len(layers)), pick]
    if len(layers) * load.shape[1] * slots <= _TINY_WORK:
        for layer in layers:
            best[layer] = _spare_search(load[layer], best[layer], slots, floor, cap)
    return best


def _spare_search(load: FloatArray, counts: IntArray, slots: int, floor: int, cap: int) -> IntArray:
    """Tiny problems: D'Hondt on all slots but ``f``, then each spare slot to the expert that lowers the sorted
    pairing's busiest GPU most, ``f`` from 1 to ``_SPARE_MAX``; counts whose pairing puts one expert's copies
    together are passed over. ``load[E]``, ``counts[E]`` (kept unless beaten)."""
    experts = len(load)
    top, clash = _pairing(load[None, :], counts[None, :])
    best, best_top = counts, float(top[0]) if not clash[0] else np.inf
    for spare in range(1, min(slots - floor * experts, _SPARE_MAX) + 1):
        cand = replica_counts(load[None, :], slots - spare, floor, cap)[0]
        for _ in range(spare):
            trials = np.repeat(cand[None, :], experts, axis=0) + np.eye(experts, dtype=np.int64)
            tops, clashes = _pairing(np.repeat(load[None, :], experts, axis=0), trials)
            tops = np.where(trials.max(axis=1) <= cap, tops, np.inf)
            score = np.where(clashes, np.inf, tops)
            score = score if np.isfinite(score).any() else tops
            if not np.isfinite(score).any():
                break
            cand = trials[int(np.argmin(score))]
        if cand.sum() != slots:
            continue
        top, clash = _pairing(load[None, :], cand[None, :])
        if not clash[0] and top[0] < best_top * (1 - 1e-12):
            best, best_top = cand, float(top[0])
    return best


def _events(x: FloatArray, counts: IntArray, half: FloatArray, quant: float) -> tuple[IntArray, IntArray]:
    """Sweep keys and ballot steps of each expert's replicas, ``[B, E]`` each.

    Key: ``2 * position + (1 if a close)``, position quantised (opens before closes at a tie); step:
    ``+counts`` for opens, ``-counts`` for closes.
    """
    w = x / counts
    light = w <= half
    pos = np.where(light, w, 2 * half - w)
    key: IntArray = (np.floor(pos * quant).astype(np.int64) << 1) + (~light).astype(np.int64)
    step: IntArray = np.where(light, counts, -counts).astype(np.int64)
    return key, step


def _sweep(
    x: FloatArray, target: FloatArray, counts: IntArray, slots: int, cap: int, prefer: IntArray | None = None
) -> BoolArray:
    """Add copies until each row's ballot holds (True) or its slots run out (False); ``counts`` in place.

    ``x[B, E]`` (mean GPU load 1), ``target[B]``, ``counts[B, E]``. Rows still sweeping are packed
    together whenever a third of them have finished. ``prefer[B, E]``: among copies of equal relief, those
    of experts still below these counts come first.
    """
    ok = np.zeros(x.shape[0], dtype=bool)
    quant = _QUANT / float(target.max())
    offset = cap + 1
    bits = (2 * offset + 1).bit_length()
    ids = np.flatnonzero(counts.sum(axis=1) <= slots)
    while len(ids):
        state = _State(x[ids], target[ids] / 2, counts[ids], quant, offset, bits, cap,
                       None if prefer is None else prefer[ids])
        live, fine = state.run(slots, len(ids) * 2 // 3)
        counts[ids] = state.counts
        ok[ids[fine]] = True
        ids = ids[live]
    return ok


class _State:
    """One sweep's rows: ``x[B, E]``, ``half[B]`` (half the target), ``counts[B, E]`` and their events."""

    def __init__(
        self, x: FloatArray, half: FloatArray, counts: IntArray, quant: float, offset: int, bits: int, cap: int,
        prefer: IntArray | None = None,
    ) -> None:
        self.x, self.half, self.counts = x, half[:, None], counts
        self.quant, self.offset, self.bits, self.cap = quant, offset, bits, cap
        self.key, self.step = _events(x, counts, self.half, quant)
        self.key_up, self.step_up = _events(x, counts + 1, self.half, quant)  # one copy more
        self.packed = (self.key << bits) | (self.step + offset)
        # ties: more opens overall, then the heavier piece (a later position)
        self.rank = (self.step_up - self.step) * 1e3 + self.key / (2 * quant) - (counts >= cap) * 1e18
        self.prefer = prefer
        if prefer is not None:
            self.rank += (counts < prefer) * _PREFER

    def run(self, slots: int, keep: int) -> tuple[BoolArray, BoolArray]:
        """Sweep until at most ``keep`` rows still need copies: (still sweeping, ballot holds), ``[B]`` each."""
        rows = self.x.shape[0]
        every = np.arange(rows)
        low = (1 << self.bits) - 1
        used = self.counts.sum(axis=1)
        live = np.ones(rows, dtype=bool)
        fine = np.zeros(rows, dtype=bool)
        while live.sum() > keep:
            ordered = np.sort(self.packed, axis=1)
            short = np.cumsum((ordered & low) - self.offset, axis=1) < 0
            done = ~short.any(axis=1)
            fine |= live & done
            live &= ~done
            if not live.any():
                break
            at = (ordered[every, short.argmax(axis=1)] >> self.bits)[:, None]
            relief = np.where(self.key_up <= at, self.step_up, 0) - np.where(self.key <= at, self.step, 0)
            pick = (relief * 1e6 + self.rank).argmax(axis=1)
            live &= relief[every, pick] > 0
            self.grow(every[live], pick[live])
            used[live] += 1
            live &= used <= slots
        return live, fine

    def grow(self, r: IntArray, e: IntArray) -> None:
        """One copy more of expert ``e[k]`` in row ``r[k]``."""
        self.counts[r, e] += 1
        grown = self.counts[r, e]
        both = np.stack([grown, grown + 1], axis=1)  # [k, 2]: now, and with one copy more
        key, step = _events(self.x[r, e][:, None], both, self.half[r], self.quant)
        self.key[r, e], self.step[r, e] = key[:, 0], step[:, 0]
        self.key_up[r, e], self.step_up[r, e] = key[:, 1], step[:, 1]
        self.packed[r, e] = (key[:, 0] << self.bits) | (step[:, 0] + self.offset)
        self.rank[r, e] = (step[:, 1] - step[:, 0]) * 1e3 + key[:, 0] / (2 * self.quant) - (grown >= self.cap) * 1e18
        if self.prefer is not None:
            self.rank[r, e] += (grown < self.prefer[r, e]) * _PREFER


def _top_up(x: FloatArray, target: FloatArray, counts: IntArray, slots: int, cap: int) -> None:
    """Give each row's spare slots to its heaviest light replicas (each a copy more), ``counts`` in place.

    A copy more for a replica at most ``target / 2`` only adds opens, so the ballot still holds.
    """
    experts = x.shape[1]
    for _ in range(slots):
        left = slots - counts.sum(axis=1)
        if left.max() <= 0:
            return
        w = x / counts
        priority = np.where((w <= target[:, None] / 2) & (counts < cap), w, -np.inf)
        order = np.argsort(-priority, axis=1, kind="stable")
        give = (np.arange(experts)[None, :] < left[:, None]) & np.isfinite(
            np.take_along_axis(priority, order, axis=1)
        )
        if not give.any():
            return
        np.put_along_axis(counts, order, np.take_along_axis(counts, order, axis=1) + give, axis=1)


def counts_near(
    x: FloatArray, target: FloatArray, prefer: IntArray, slots: int, floor: int, cap: int
) -> tuple[IntArray, BoolArray]:
    """Counts whose sorted pairing keeps each row under ``target[B]``, close to ``prefer[B, E]``.

    ``x[B, E]`` (mean GPU load 1). The sweep starts from the lower of ``prefer`` and the usual start and,
    among copies of equal relief, gives them back to experts below ``prefer`` first; spare slots go to the
    heaviest light replicas, those below ``prefer`` first. Returns (counts ``[B, E]``, ballot held ``[B]``).
    """
    start = np.clip(np.ceil(x / (_START_SHARE * target)[:, None] - 1e-12), floor, cap).astype(np.int64)
    counts = np.maximum(np.minimum(start, prefer), floor)
    ok = _sweep(x, target, counts, slots, cap, prefer)
    for _ in range(slots):
        left = slots - counts.sum(axis=1)
        if left.max() <= 0:
            break
        w = x / counts
        priority = np.where((w <= target[:, None] / 2) & (counts < cap), w + 2.0 * (counts < prefer), -np.inf)
        pick = priority.argmax(axis=1)
        give = (left > 0) & np.isfinite(priority[np.arange(len(x)), pick])
        if not give.any():
            break
        counts[np.flatnonzero(give), pick[give]] += 1
    return counts, ok & (counts.sum(axis=1) == slots)
