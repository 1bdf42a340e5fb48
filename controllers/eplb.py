"""The EPLB controller: measured expert load -> a better placement -> experts moved live, layer by layer.

One `check()` of a deployment:

1. **observe**: each agent's expert-load window and current map (`StreamExpertLoad`, first message), summed
   over pods into `load[moe_layers, experts]`; the map is the same on every pod.
2. **decide**: the current balance (mean over layers of max GPU load / mean GPU load, replicas sharing their
   expert's load) against `spec.eplb.balanceThreshold`, or `intervalSeconds` since the last rebalance.
3. **place**: `shardwise.eplb.rebalance` with the current map as `previous`, `maxMovesPerRebalance` and
   `minDistinct`; nothing happens unless the new placement is better on the measured load.
4. **execute**: `UpdateExpertMap` with the next map generation, on every agent at once (it is collective).
   Each rank moves the layers one after another through one reusable buffer, and a layer's new experts and
   its map are swapped together only when all of that layer's transfers are complete; if any rank cannot
   finish before the deadline, the migration is cancelled at a layer boundary and every rank keeps routing by
   a consistent map (the old one for the unfinished layers). The outcome is returned for status, events and
   metrics; a failure carries its message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
import numpy as np
from shardwise.agents.client import AgentClient, Credential, call_all, pb

from shardwise.api import EplbSpec
from shardwise.eplb import balance, carry_over, rebalance

from .world import CALL_TIMEOUT_S, WorldPod

MIGRATION_TIMEOUT_S = 120.0


@dataclass
class Observation:
    generation: int
    map_generation: int
    layers: list[int]
    load: np.ndarray  # [len(layers), experts] tokens
    phy2log: np.ndarray  # [len(layers), slots]

    @property
    def tokens(self) -> int:
        return int(self.load.sum())


@dataclass
class Outcome:
    """What one check did: `action` is skipped, rebalanced or failed."""

    action: str
    reason: str
    balance_before: float = 0.0
    balance_after: float = 0.0
    map_generation: int = 0
    slots_moved: int = 0
    bytes_moved: int = 0
    seconds: float = 0.0
    phy2log: list[list[int]] = field(default_factory=list)


def observe(pods: list[WorldPod], token: Credential) -> Observation:
    loads: dict[int, np.ndarray] = {}
    maps: dict[int, list[int]] = {}
    generation = map_generation = 0
    for p in pods:
        with AgentClient(p.address, token, timeout=CALL_TIMEOUT_S) as c:
            msg = c.expert_load()
        generation, map_generation = int(msg.generation), max(map_generation, int(msg.map_generation))
        for layer in msg.layers:
            counts = np.asarray(layer.tokens_per_logical_expert, dtype=np.float64)
            loads[layer.layer] = loads.get(layer.layer, 0) + counts
            if layer.phy2log:
                maps[layer.layer] = list(layer.phy2log)
    layers = sorted(maps)
    experts = max((len(loads[k]) for k in layers), default=0)
    load = np.zeros((len(layers), experts))
    for i, k in enumerate(layers):
        load[i, :len(loads[k])] = loads[k]
    return Observation(generation, map_generation, layers, load, np.asarray([maps[k] for k in layers], dtype=np.int64))


def decide(obs: Observation, spec: EplbSpec, *, ep: int, nodes: int, seconds_since_last: float | None,
           min_tokens: int = 1) -> Outcome:
    """Pure: whether and where to move experts for the observed load (no calls)."""
    if not obs.layers:
        return Outcome("skipped", "the model has no MoE layer held by the agents")
    if obs.tokens < min_tokens:
        return Outcome("skipped", f"no routed tokens in the window yet ({obs.tokens})")
    before = balance(obs.load, obs.phy2log, ep)
    due = seconds_since_last is None or seconds_since_last >= spec.interval_seconds
    if before <= spec.balance_threshold and not due:
        return Outcome("skipped", f"balance {before:.3f} within the threshold {spec.balance_threshold}",
                       balance_before=before)
    placement = rebalance(obs.load, num_slots=obs.phy2log.shape[1], num_gpus=ep,
                          num_nodes=nodes if nodes > 0 and ep % nodes == 0 else 1, previous=obs.phy2log,
                          max_moves=spec.max_moves_per_rebalance, min_distinct=spec.min_distinct)
    after = balance(obs.load, placement.phy2log, ep)
    moved = int((placement.phy2log != obs.phy2log).sum())
    if moved == 0 or after >= before - 1e-9:
        return Outcome("skipped", f"no better placement for the measured load (balance {before:.3f})",
                       balance_before=before, balance_after=min(before, after))
    return Outcome("planned", f"balance {before:.3f} -> {after:.3f} moving {moved} slots", before, after,
                   obs.map_generation + 1, moved, phy2log=placement.phy2log.tolist())


def execute(pods: list[WorldPod], token: Credential, obs: Observation, plan: Outcome,
            timeout: float = MIGRATION_TIMEOUT_S) -> Outcome:
    """Move the experts to `plan.phy2log` on every agent at once; the outcome as `rebalanced` or `failed`."""
    request = pb.UpdateExpertMapRequest(
        generation=obs.generation, map_generation=plan.map_generation,
        layers=[pb.LayerMap(layer=layer, phy2log=row) for layer, row in zip(obs.layers, plan.phy2log, strict=True)])
    clients = [AgentClient(p.address, token, timeout=timeout) for p in sorted(pods, key=lambda p: p.index)]
    started = time.monotonic()
    try:
        answers = call_all(clients, "UpdateExpertMap", request, timeout)
    except grpc.RpcError as e:
        return Outcome("failed", f"UpdateExpertMap to map generation {plan.map_generation} failed: "
                                 f"{e.code().name}: {e.details()}", plan.balance_before, plan.balance_before,
                       obs.map_generation, seconds=time.monotonic() - started)
    finally:
        for c in clients:
            c.close()
    return Outcome("rebalanced", plan.reason, plan.balance_before, plan.balance_after, plan.map_generation,
                   plan.slots_moved, sum(int(a.bytes_moved) for a in answers), time.monotonic() - started,
                   plan.phy2log)


# ------------------------------------------------------------------------------ a world of another size


def maps_by_pod(pods: list[WorldPod], token: Credential) -> tuple[dict[int, dict[int, list[int]]], int]:
    """Pod index -> (MoE layer -> the slots of its ranks' map), and the newest map generation among them."""
    out: dict[int, dict[int, list[int]]] = {}
    newest = 0
    for p in pods:
        with AgentClient(p.address, token, timeout=CALL_TIMEOUT_S) as c:
            msg = c.expert_load()
        newest = max(newest, int(msg.map_generation))
        out[p.index] = {int(layer.layer): list(layer.phy2log) for layer in msg.layers if layer.phy2log}
    return out, newest


def carried_map(maps: dict[int, dict[int, list[int]]], old: dict[int, list[int]], new: dict[int, list[int]],
                num_experts: int, moe_tp: int = 1) -> tuple[dict[int, list[int]], int]:
    """Pure: the expert map of a world with the ranks `new` (pod -> ranks) that keeps every expert where a rank
    of the old world (`old`, pod -> ranks) already holds it. A pod's k-th rank in the new world is its k-th
    rank of the old one; what that rank holds is read from the pod's own map (`maps`, pod -> layer -> slots),
    which is right even after a migration cut short by a lost rank left pods on different maps. Returns
    (layer -> slots, how many (layer, expert) pairs no staying rank holds: those load from the weight files).
    With pipeline parallelism 1, a rank's EP rank is its index // moe_tp (slots EP rank * slots_per_rank onwards);
    the moe_tp ranks of one EP rank hold shards of the same experts."""
    layers = sorted({layer for m in maps.values() for layer in m})
    if not layers:
        return {}, 0
    num_slots = len(next(m[layers[0]] for m in maps.values() if layers[0] in m))
    old_ep = sum(len(r) for r in old.values()) // moe_tp
    new_ep = sum(len(r) for r in new.values()) // moe_tp
    per_old = num_slots // old_ep
    holds: list[list[list[int]]] = [[[] for _ in range(new_ep)] for _ in layers]
    for pod, ranks in new.items():
        for k, rank in enumerate(ranks):
            if pod not in maps or k >= len(old.get(pod, [])):
                continue  # a new rank: it holds nothing yet
            was = old[pod][k] // moe_tp
            if old[pod][k] % moe_tp != rank % moe_tp:
                continue  # another shard of its experts than the one it holds: nothing carries over
            for li, layer in enumerate(layers):
                holds[li][rank // moe_tp] = maps[pod][layer][was * per_old:(was + 1) * per_old]
    placement, lost = carry_over(holds, num_experts=num_experts, num_slots=num_slots, num_gpus=new_ep)
    return {layer: placement.phy2log[li].tolist() for li, layer in enumerate(layers)}, lost
