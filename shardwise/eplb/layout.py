"""What every EPLB algorithm shares: the array types, the argument checks, the layout of slots on GPUs
and nodes, :class:`Placement`, and the per-layer arithmetic (replica counts of a ``phy2log``, GPU loads,
balance). Shapes: ``load[L, E]``, ``phy2log[L, R]``, ``logcnt[L, E]``, GPU loads ``[L, G]``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

IntArray = NDArray[np.int64]
FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]

REL_EPS = 1e-9  # relative slack below which a change of load counts as none


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
        logcnt = counts_of(p2l, num_experts)
        return cls(phy2log=p2l, logcnt=logcnt, log2phy=slots_of(p2l, logcnt), num_gpus=num_gpus)

    def gpu_loads(self, load: FloatArray) -> FloatArray:
        """Load carried by each GPU, ``[L, G]``, for expert loads ``load[L, E]``."""
        return gpu_loads(np.asarray(load, dtype=np.float64) / np.maximum(self.logcnt, 1), self.phy2log,
                          self.num_gpus)

    def balance(self, load: FloatArray) -> float:
        """Mean over layers of max GPU load / mean GPU load (1.0 is perfect)."""
        return balance(load, self.phy2log, self.num_gpus)

    def slots_changed(self, previous: IntArray) -> int:
        """Number of slots whose logical expert differs from ``previous[L, R]``."""
        return int(np.count_nonzero(self.phy2log != previous))



def balance(load: FloatArray, phy2log: IntArray, num_gpus: int) -> float:
    """Mean over layers of (max GPU load / mean GPU load); each replica carries ``load / logcnt``.

    ``load[L, E]``, ``phy2log[L, R]``. A layer with no load counts as perfectly balanced.
    """
    return float(layer_ratio(np.asarray(load, dtype=np.float64), np.asarray(phy2log), num_gpus).mean())



# --------------------------------------------------------------------------------------------------
# Argument checks


def check_load(load: FloatArray) -> FloatArray:
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


def check_layout(
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


def check_previous(
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
    missing = counts_of(prev.astype(np.int64), experts) == 0
    if missing.any():
        layer, expert = (int(i) for i in np.argwhere(missing)[0])
        raise ValueError(
            f"previous has no slot for {int(missing.sum())} experts, first layer {layer}, expert {expert}"
        )
    return np.array(prev, dtype=np.int64)


# --------------------------------------------------------------------------------------------------
# Layout and shared arithmetic


@dataclass(frozen=True)
class Layout:
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
        return count_limits(self.experts, self.slots, self.gpus, self.min_distinct)

    def need(self, counts: IntArray) -> IntArray:
        """Distinct domains each expert must span given its replica count (0 when not tracked)."""
        if not self.spread:
            return np.zeros_like(counts)
        return np.minimum(np.minimum(counts, self.min_distinct), self.domains)


def count_limits(experts: int, num_slots: int, num_gpus: int, min_distinct: int) -> tuple[int, int]:
    """(floor, cap) on replicas per expert: ``min_distinct`` if the budget allows, at most ``G``."""
    floor = min_distinct if num_slots >= min_distinct * experts else 1
    cap = num_gpus if num_slots // num_gpus <= experts else num_slots
    return floor, cap


def counts_of(phy2log: IntArray, experts: int) -> IntArray:
    """``phy2log[L, R]`` -> ``logcnt[L, E]``."""
    layers = phy2log.shape[0]
    flat = (np.arange(layers, dtype=np.int64)[:, None] * experts + phy2log).ravel()
    return np.bincount(flat, minlength=layers * experts).reshape(layers, experts).astype(np.int64)


def slots_of(phy2log: IntArray, logcnt: IntArray) -> IntArray:
    """``phy2log[L, R]`` -> ``log2phy[L, E, max_replicas]``, slots ascending, padded with -1."""
    layers, slots = phy2log.shape
    order = np.argsort(phy2log, axis=1, kind="stable")
    experts_sorted = np.take_along_axis(phy2log, order, axis=1)
    first = np.cumsum(logcnt, axis=1) - logcnt
    rank = np.arange(slots)[None, :] - np.take_along_axis(first, experts_sorted, axis=1)
    out = np.full((layers, logcnt.shape[1], max(int(logcnt.max()), 1)), -1, dtype=np.int64)
    out[np.arange(layers)[:, None], experts_sorted, rank] = order
    return out


def gpu_loads(weight: FloatArray, phy2log: IntArray, num_gpus: int) -> FloatArray:
    """Per-replica load ``weight[L, E]`` and ``phy2log[L, R]`` -> GPU loads ``[L, G]``."""
    per_slot = np.take_along_axis(weight, phy2log, axis=1)
    result: FloatArray = per_slot.reshape(phy2log.shape[0], num_gpus, phy2log.shape[1] // num_gpus).sum(axis=2)
    return result


def layer_ratio(load: FloatArray, phy2log: IntArray, num_gpus: int) -> FloatArray:
    """Max / mean GPU load per layer, ``[L]``."""
    counts = np.maximum(counts_of(phy2log.astype(np.int64), load.shape[1]), 1)
    gpu = gpu_loads(load / counts, phy2log.astype(np.int64), num_gpus)
    mean = gpu.mean(axis=1)
    return np.where(mean > 0, gpu.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)


def layer_lower_bound(load: FloatArray, counts: IntArray, num_gpus: int) -> FloatArray:
    mean = load.sum(axis=1) / num_gpus
    heaviest = (load / counts).max(axis=1)
    return np.where(mean > 0, np.maximum(mean, heaviest) / np.where(mean > 0, mean, 1.0), 1.0)
