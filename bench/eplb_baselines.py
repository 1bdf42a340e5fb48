"""The EPLB baselines shardwise is measured against (`make bench-eplb`, tests/unit/test_eplb.py): no EPLB at
all, and the reference's two-step greedy written plainly. Not used by the operator."""

from __future__ import annotations

import heapq

import numpy as np
from numpy.typing import NDArray

from shardwise.eplb import Placement

FloatArray = NDArray[np.float64]


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
