"""`make bench-eplb-optimum`: how far the 2-slot placements of `make bench-eplb` are from the best that exists.

With two slots per GPU the lower bound that `make bench-eplb` prints (the mean GPU load, or the heaviest replica)
ignores that replicas pair up, so a gap to it may be the bound's or the placement's. This benchmark settles it
for sampled layers of the same loads (the same seeds): a mixed-integer program (HiGHS, through SciPy) looks for
replica counts whose sorted pairing keeps every GPU under a target, and the target is bisected. A count vector it
finds is turned into a placement (the sorted pairing, with any GPU that would hold one expert twice repaired by
swapping partners with a neighbouring GPU) and measured like any other; so "found" is a placement that exists,
an upper bound on the best one, and the gap between it and ours is ours.

The program, for one layer and a target ``T`` (loads scaled to a mean GPU load of 1): a binary ``y[e, c]`` per
expert and candidate count, one count per expert, the counts summing to the slots. A replica of weight
``w = x[e] / c`` at most ``T / 2`` is an "open" at position ``w``; a heavier one a "close" at ``T - w`` (its
partner must weigh at most that). The sorted pairing stays under ``T`` exactly when, sweeping positions upwards,
the opens seen never fall behind the closes seen; those running sums are the program's continuous variables,
one per candidate, chained. Candidates: from the fewest copies that keep a replica under ``T`` to two more than
the fewest that make it light, so a target it cannot meet may still be met by counts outside that range: the
program finds placements, it proves no bound. Each solve is limited to ``TIME_LIMIT`` seconds.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench_eplb import CONFIGS, SEED, make_load  # bench/bench_eplb.py: the same loads from the same seeds
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from shardwise.eplb import balance, rebalance

OUT = Path(__file__).parent / "results" / "eplb_optimum.json"
ROWS = [  # load kind, seed of bench-eplb's row; the 256-GPU configuration, 2 slots per GPU
    ("lognormal", SEED + 10 * 2 + 0),
    ("zipf", SEED + 10 * 2 + 1),
    ("lognormal-0.7", SEED + 50),
]
SAMPLE = (0, 30, 60)  # layers measured (3 of 61: each takes a minute or two)
STEPS = 5  # bisection steps on the target between the mean and ours
TIME_LIMIT = 15.0  # seconds per solve; a solve that runs out counts as "not found"
EXTRA = 2  # candidate counts reach this many past the fewest that make a replica light


def find_counts(x: np.ndarray, target: float, slots: int, cap: int) -> np.ndarray | None:
    """Counts ``[E]`` summing to ``slots`` whose sorted pairing keeps every GPU at most ``target``, or None."""
    fewest = np.floor(x / target).astype(np.int64) + 1  # a replica under the target
    light = np.maximum(fewest, np.ceil(2 * x / target - 1e-12).astype(np.int64))
    expert = np.concatenate([np.full(max(0, min(cap, light[e] + EXTRA) - fewest[e] + 1), e)
                             for e in range(len(x))])
    count = np.concatenate([np.arange(fewest[e], min(cap, light[e] + EXTRA) + 1) for e in range(len(x))])
    if fewest.sum() > slots or count.size == 0:
        return None
    weight = x[expert] / count
    is_open = weight <= target / 2
    position = np.where(is_open, weight, target - weight)
    step = np.where(is_open, count, -count).astype(float)
    n, experts = len(expert), len(x)
    rank = np.empty(n, dtype=np.int64)
    rank[np.lexsort((~is_open, position))] = np.arange(n)  # opens before closes at a tie (w + w' = T fits)
    # rows: one count per expert; the slots; chain s[k] - s[k-1] - step(candidate ranked k) = 0
    chain = experts + 1 + np.arange(n)
    rows = np.concatenate([expert, np.full(n, experts), chain, chain[1:], experts + 1 + rank])
    cols = np.concatenate([np.arange(n), np.arange(n), n + np.arange(n), n + np.arange(n - 1), np.arange(n)])
    vals = np.concatenate([np.ones(n), count.astype(float), np.ones(n), -np.ones(n - 1), -step])
    matrix = coo_matrix((vals, (rows, cols)), shape=(experts + 1 + n, 2 * n)).tocsr()
    bound = np.concatenate([np.ones(experts), [slots], np.zeros(n)])
    result = milp(
        np.zeros(2 * n), constraints=LinearConstraint(matrix, bound, bound),
        integrality=np.concatenate([np.ones(n), np.zeros(n)]),
        bounds=Bounds(np.zeros(2 * n), np.concatenate([np.ones(n), np.full(n, np.inf)])),
        options={"time_limit": TIME_LIMIT},
    )
    if result.status != 0 or result.x is None:
        return None
    chosen = np.round(result.x[:n]).astype(bool)
    counts = np.zeros(experts, dtype=np.int64)
    counts[expert[chosen]] = count[chosen]
    return counts if counts.sum() == slots else None


def sorted_pairing(x: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``phy2log[2G]`` of the sorted pairing of ``counts`` (GPU g holds slots 2g, 2g + 1), no expert twice on
    a GPU where swapping partners with the nearest GPU that allows it fixes that (measured after, by `busiest`)."""
    labels = np.repeat(np.arange(len(x)), counts)
    order = np.argsort(x[labels] / counts[labels], kind="stable")
    light, heavy = labels[order][: len(labels) // 2], labels[order][::-1][: len(labels) // 2].copy()
    for g in np.flatnonzero(light == heavy):
        for h in sorted(range(len(light)), key=lambda k: abs(k - g)):
            if h != g and heavy[h] != light[g] and heavy[g] != light[h]:
                heavy[g], heavy[h] = heavy[h], heavy[g]
                break
    return np.stack([light, heavy], axis=1).ravel()


def busiest(x: np.ndarray, phy2log: np.ndarray) -> float:
    """Busiest GPU over the mean of ``phy2log`` (two slots per GPU); infinite when a GPU holds one expert twice."""
    pairs = phy2log.reshape(-1, 2)
    if (pairs[:, 0] == pairs[:, 1]).any():
        return float("inf")
    return balance(x[None, :], phy2log[None, :], len(pairs))


def main() -> None:
    name, layers, experts, slots, gpus, nodes = CONFIGS[2]
    rows: list[dict[str, Any]] = []
    for kind, seed in ROWS:
        load = make_load(kind, layers, experts, np.random.default_rng(seed))
        ours = rebalance(load, num_slots=slots, num_gpus=gpus, num_nodes=nodes)
        ours_top = ours.gpu_loads(load).max(axis=1) / (load.sum(axis=1) / gpus)
        for layer in SAMPLE:
            x = load[layer] / (load[layer].sum() / gpus)
            lo, hi, found, t0 = 1.0, float(ours_top[layer]), float(ours_top[layer]), time.perf_counter()
            for _ in range(STEPS):
                mid = 0.5 * (lo + hi)
                counts = find_counts(x, mid, slots, gpus)
                top = busiest(x, sorted_pairing(x, counts)) if counts is not None else float("inf")
                if top <= mid * (1 + 1e-9):
                    hi, found = mid, min(found, top)
                else:
                    lo = mid
            rows.append({"config": name, "load": kind, "layer": layer, "ours": float(ours_top[layer]),
                         "found": found, "seconds": time.perf_counter() - t0})
            print(f"{kind:14s} layer {layer:2d}: ours {ours_top[layer]:.4f}, found {found:.4f} "
                  f"({rows[-1]['seconds']:.0f} s)", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": f"{platform.machine()} {platform.python_version()}",
                               "timeLimit": TIME_LIMIT, "rows": rows}, indent=2) + "\n")
    print(f"\n| {name}, layers {list(SAMPLE)} | busiest GPU / mean: ours | found (a placement that exists) |")
    print("|---|---|---|")
    for kind, _ in ROWS:
        mine = [r for r in rows if r["load"] == kind]
        print(f"| {kind} | {np.mean([r['ours'] for r in mine]):.4f} | {np.mean([r['found'] for r in mine]):.4f} |")
    print(f"\nwritten to {OUT}")


if __name__ == "__main__":
    main()
