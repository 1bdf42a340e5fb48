"""One rank of the reference runtime: a process that loads its shards and steps with the others.

Layout (`shardwise.grid.RankGrid`, CP = 1 here): ranks of one pipeline stage form the EP group; inside it,
DPA groups of TP consecutive ranks each serve their own requests with their own KV cache.

Every step, all ranks of the world meet once to agree on what to run (`all_gather_object` of a small
control record): each DPA group leader (stage 0, TP rank 0) contributes its group's batch from its
scheduler, and any rank may ask to pause or stop. Then every rank runs its group's batch through its
stage's layers:

- attention: each TP rank computes its heads (KV heads replicated when TP > KV heads), partial outputs
  are summed with an all-reduce over the TP group; MLA (deepseek_v3): q_b (or q_proj), kv_b and o split by
  heads, q_a, kv_a and the latent cache the same on every TP rank; prompts run the plain form, decode tokens
  the absorbed one (`WorldSpec.mla_absorb`: decode, always or never); under decode CP (MLA supports dcp, not
  pcp) the latent cache is split by position and every query runs absorbed;
- dense FFN and shared experts: split by the TP group, summed with the same all-reduce;
- routed experts: each TP rank dispatches its share of the group's tokens to the EP ranks holding the
  chosen replicas (`all_to_all_single` with split sizes), the owners run their experts, results come back
  by the reverse all-to-all and are weighted and summed at the source; an idle group takes part with no
  tokens;
- pipeline stages hand hidden states to the next stage by send/recv; the last stage samples greedily
  and sends the tokens to the group leader.

Computation is in the world's dtype: float64 on the CPU by default, so that summation orders (TP all-reduce,
batched expert GEMMs, batch composition) cannot flip a greedy token or a router's top-k and every layout
yields the oracle's tokens; float32, bfloat16 or float16 otherwise. On the CPU with gloo, or on the rank's GPU
with NCCL when CUDA is present (`select_device`; one rank on one GPU measured by `make bench-gpu`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import faulthandler
import gc
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from shardwise.agents.runtime import context as cpctx
from shardwise.agents.runtime.batching import Feed, Request, Scheduler
from shardwise.agents.runtime.experts import ExpertMap, round_robin
from shardwise.agents.runtime.model import (
    LayerCache,
    SequenceCache,
    attention,
    mla_attention,
    mla_project,
    rms_norm,
    rope,
    route,
    route_grouped,
    softmax_scale,
    swiglu,
)
from shardwise.agents.runtime.sources import WeightSource, open_source

from shardwise.api import AttentionType, ModelArchitecture
from shardwise.grid import RankGrid
from shardwise.planner import stage_layers

# An idle world waits for commands between control rounds, backing off from IDLE_MIN_S to IDLE_MAX_S so
# idle ranks cost little CPU; the first request after a quiet spell waits at most IDLE_MAX_S to start.
BACKEND = "gloo"  # set per process by select_device()
IDLE_MIN_S = 0.002
IDLE_MAX_S = 0.05
# Fault injection for tests of a migration cut short: the rank process exits (code 137, as if killed) right
# after it has moved this many layers of a migration. Unset in production.
FAULT_EXIT_AFTER_LAYERS_ENV = "SHARDWISE_FAULT_EXIT_AFTER_MIGRATED_LAYERS"
# How long a rank that is told to form a world waits for the others to reach its rendezvous, and then for the
# process group to connect; past it the rank fails (a peer is gone). A rank that starts for a world a running
# one switches into (a new rank of a scale-up) is not told when that switch comes: it waits without this limit
# (the operator's operation deadline bounds it). The variable shortens the wait for arrivals, for tests only.
RENDEZVOUS_TIMEOUT_S = 120.0
RENDEZVOUS_TIMEOUT_ENV = "SHARDWISE_RENDEZVOUS_TIMEOUT_S"
ARRIVED_KEY, ALL_ARRIVED_KEY = "arrived", "all-arrived"  # under the generation's prefix in the store
ARRIVAL_WAIT_S = 30.0  # one stretch of a rank's wait at the rendezvous (the store wakes it at once when all came)


def arrival_timeout() -> float:
    """How long a rank that is not patient waits for the others to reach the rendezvous (the variable shortens
    only this wait; the process group's exchange, once all have come, keeps RENDEZVOUS_TIMEOUT_S)."""
    return float(os.environ.get(RENDEZVOUS_TIMEOUT_ENV) or RENDEZVOUS_TIMEOUT_S)


MLA_ABSORB = ("decode", "always", "never")  # when MLA runs its absorbed form (the module docstring of model.py)


@dataclass(frozen=True)
class WorldSpec:
    """What every rank of one world generation must agree on."""

    generation: int
    tp: int
    dpa: int
    pp: int
    store_host: str
    store_port: int
    model: str
    seed: int = 0
    weights_dir: str | None = None
    redundant_experts: int = 0  # extra expert slots per MoE layer across the EP group
    phy2log: dict[int, list[int]] = field(default_factory=dict)  # MoE layer -> slots; default round robin
    max_batch_tokens: int = 512
    max_running: int = 64
    max_waiting: int = 256
    load_window_steps: int = 1000
    kv_capacity_tokens: int = 65536  # per rank, from the plan's ledger; the denominator of KV usage
    dtype: str = "float64"  # what the ranks compute in (float64 on the CPU makes every layout equal the oracle)
    moe_tp: int = 1  # ranks that split each routed expert (column then row split of its projections)
    cp: int = 1  # ranks that split each request's sequence (context parallelism)
    cp_mode: str = "dcp"  # pcp: ring attention for prompts; dcp: KV shards, the query reaches every shard
    cp_layout: str = "striped"  # contiguous | zigzag | striped (shardwise.agents.runtime.context)
    cp_comm: str = "ag_rs"  # DCP's merge: ag_rs (all-gather Q and LSE, reduce-scatter O) or a2a (one all-to-all)
    max_model_len: int = 4096  # the length a contiguous DCP layout cuts into CP ranges
    mla_absorb: str = "decode"  # MLA's absorbed form: for decode tokens (one per request), always, or never

    def __post_init__(self) -> None:
        if self.mla_absorb not in MLA_ABSORB:
            raise ValueError(f"mla_absorb must be one of {', '.join(MLA_ABSORB)}, got {self.mla_absorb!r}")

    @property
    def grid(self) -> RankGrid:
        return RankGrid(pp=self.pp, dpa=self.dpa, cp=self.cp, tp=self.tp,
                        ep=self.dpa * self.cp * self.tp // self.moe_tp, moe_tp=self.moe_tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dpa * self.cp * self.tp

    def leader(self, group: int) -> int:
        return int(self.grid.grid[0, group, 0, 0])


COMPUTE_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
                  "float16": torch.float16}


def compute_dtype(spec: WorldSpec) -> torch.dtype:
    return COMPUTE_DTYPES[spec.dtype]


def runs_mla(arch: ModelArchitecture) -> bool:
    """MLA as the checkpoint defines it (deepseek_v3, kimi_k2). A seeded preset that declares MLA for the
    planner's numbers (DeepSeek-V3) has seeded Q/K/V/O weights of the same heads and runs as MHA."""
    return arch.attention_type is AttentionType.MLA and bool(arch.family)


def _split(n: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of share `index` when n items are cut into `parts` contiguous, nearly equal shares."""
    return index * n // parts, (index + 1) * n // parts


class Shards:
    """The weight slices one rank holds, in float64, read from `source` slice by slice: head-aligned Q/K/V/O
    rows and columns, a vocabulary share of the embedding and LM head, a TP share of each dense FFN, and the
    routed experts the expert map puts on this EP rank."""

    def __init__(self, source: WeightSource, spec: WorldSpec, tp_rank: int, ep_rank: int, layers: range,
                 moe_part: tuple[int, int] = (0, 1), attn_index: int | None = None) -> None:
        arch = source.arch
        self.arch, self.layers, self.source = arch, layers, source
        self.tp, self.tp_rank = spec.tp, tp_rank
        hq, hkv, dh = arch.num_heads, arch.kv_heads, arch.dim_head
        mla = runs_mla(arch)
        if mla and hq % spec.tp:
            raise ValueError(f"MLA splits whole heads over TP: numHeads={hq} is not divisible by tp={spec.tp}")
        if mla and spec.cp > 1 and spec.cp_mode != "dcp":
            raise ValueError(f"prefill context parallelism (cpMode {spec.cp_mode}) is not implemented for MLA "
                             "attention: use cpMode dcp")
        q_lo, q_hi = tp_rank * hq // spec.tp, (tp_rank + 1) * hq // spec.tp
        group = hq // hkv
        kv_lo, kv_hi = q_lo // group, (q_hi - 1) // group + 1
        self.vocab = _split(arch.vocab_size, spec.tp, tp_rank)
        get = source.tensor
        w: dict[str, torch.Tensor] = {"embed": get("embed", rows=self.vocab),
                                      "lm_head": get("lm_head", rows=self.vocab), "norm": get("norm")}
        for i in layers:
            p = f"layers.{i}."
            for name in ("attn_norm", "ffn_norm") + (("q_norm", "k_norm") if arch.qk_norm else ()):
                w[p + name] = get(p + name)
            if mla:
                w |= self.mla_weights(p, q_lo, q_hi)
            else:
                w[p + "wq"] = get(p + "wq", rows=(q_lo * dh, q_hi * dh))
                w[p + "wk"] = get(p + "wk", rows=(kv_lo * dh, kv_hi * dh))
                w[p + "wv"] = get(p + "wv", rows=(kv_lo * dh, kv_hi * dh))
                w[p + "wo"] = get(p + "wo", cols=(q_lo * dh, q_hi * dh))
            if arch.is_moe_layer(i):
                ffns = [(f"shared.{s}.", arch.shared_width) for s in range(arch.num_shared_experts)]
                w[p + "router"] = get(p + "router")
                if arch.router_scoring == "sigmoid":
                    w[p + "router_bias"] = get(p + "router_bias")
            else:
                ffns = [("ffn.", arch.intermediate_size)]
            for f, width in ffns:  # split over the attention group: its cp * tp ranks share one hidden state
                lo, hi = _split(width, spec.tp * spec.cp, tp_rank if attn_index is None else attn_index)
                w[p + f + "w1"] = get(p + f + "w1", rows=(lo, hi))
                w[p + f + "w3"] = get(p + f + "w3", rows=(lo, hi))
                w[p + f + "w2"] = get(p + f + "w2", cols=(lo, hi))
        device = torch.get_default_device()
        self.dtype = compute_dtype(spec)
        self.w = {k: v.to(device=device, dtype=self.dtype).contiguous() for k, v in w.items()}
        self.expert_maps: dict[int, ExpertMap] = {}
        self.experts: dict[int, dict[str, torch.Tensor]] = {}
        self.moe_part, self.ep_rank = moe_part, ep_rank
        self.bind_experts(spec, ep_rank, moe_part)

    def mla_weights(self, p: str, lo: int, hi: int) -> dict[str, torch.Tensor]:
        """One MLA layer's attention for query heads lo..hi: q_b (or q_proj) and kv_b rows and o columns of
        those heads; q_a, kv_a and their norms whole (every TP rank computes the same latents)."""
        a, get = self.arch, self.source.tensor
        qk, kv = a.nope_head_dim + a.rope_head_dim, a.nope_head_dim + a.v_head_dim
        w = {p + n: get(p + n) for n in ("wkv_a", "kv_a_norm")}
        if a.q_lora_rank:
            w |= {p + "wq_a": get(p + "wq_a"), p + "q_a_norm": get(p + "q_a_norm"),
                  p + "wq_b": get(p + "wq_b", rows=(lo * qk, hi * qk))}
        else:
            w[p + "wq"] = get(p + "wq", rows=(lo * qk, hi * qk))
        w[p + "wkv_b"] = get(p + "wkv_b", rows=(lo * kv, hi * kv))
        w[p + "wo"] = get(p + "wo", cols=(lo * a.v_head_dim, hi * a.v_head_dim))
        return w

    def bind_experts(self, spec: WorldSpec, ep_rank: int, moe_part: tuple[int, int] = (0, 1)) -> int:
        """Hold the experts `spec`'s map puts on EP rank `ep_rank` (shard `moe_part` = (index, moeTp) of each),
        reusing local copies and loading the rest from the weight files (or the seed). Returns how many experts
        were loaded."""
        if moe_part != self.moe_part:  # another shard of every expert: nothing held can be reused
            self.expert_maps, self.experts, self.moe_part = {}, {}, moe_part
        loaded = 0
        for i in self.layers:
            if not self.arch.is_moe_layer(i):
                continue
            e_total = self.arch.num_experts
            phy = spec.phy2log.get(i) or round_robin(e_total, e_total + spec.redundant_experts)
            emap = ExpertMap(np.asarray(phy, dtype=np.int64), e_total, spec.grid.ep)
            wanted = [int(emap.phy2log[slot]) for slot in emap.local_slots(ep_rank)]
            have: dict[int, int] = {}
            if i in self.expert_maps:
                old = self.expert_maps[i]
                have = {int(old.phy2log[slot]): j for j, slot in enumerate(old.local_slots(self.ep_rank))}
            missing = [e for e in wanted if e not in have]
            fresh = self.load_experts(i, missing) if missing else {}
            rows: dict[str, list[torch.Tensor]] = {"w1": [], "w3": [], "w2": []}
            for e in wanted:
                for w in rows:
                    rows[w].append(self.experts[i][w][have[e]] if e in have else fresh[w][missing.index(e)])
            self.experts[i] = {w: torch.stack(v).contiguous() for w, v in rows.items()}
            self.expert_maps[i] = emap
            loaded += len(missing)
        self.ep_rank = ep_rank
        return loaded

    def load_experts(self, layer: int, logical: list[int]) -> dict[str, torch.Tensor]:
        """Routed experts of one layer, stacked in the order given (w1/w3 [n, I, D], w2 [n, D, I])."""
        got = self.source.experts(layer, logical, self.moe_part)
        return {k: v.to(device=torch.get_default_device(), dtype=self.dtype).contiguous() for k, v in got.items()}


@dataclass
class Migration:
    """Moving experts to a new map, one layer per step boundary, through one reusable buffer."""

    map_generation: int
    targets: dict[int, np.ndarray]  # layer -> new phy2log (this rank's stage only)
    pending: list[int]
    moved: int = 0
    bytes: int = 0
    started: float = 0.0
    buffer: dict[str, torch.Tensor] | None = None


class Rank:
    """The step loop of one rank. Commands arrive on `commands`, events leave on `events`.

    Everything that changes the world happens between steps and is agreed through the control records:
    a pause holds every rank once any asks; a migration moves one layer per round once every rank has it;
    a switch to a new world generation happens once every rank of the old world is paused and has it.
    """

    def __init__(self, rank: int, spec: WorldSpec, commands: Any, events: Any, patient: bool = False) -> None:
        self.commands, self.events = commands, events
        # started for a world that a running one switches into (a scale-up's new rank): its first rendezvous
        # waits for the old world's ranks for as long as the operator takes to switch them
        self.patient = patient
        self.source = open_source(spec.model, spec.seed, spec.weights_dir)
        self.arch = self.source.arch
        self.hf = bool(self.arch.family)  # the Hugging Face families' float32 islands (norms, router softmax)
        self.caches: dict[str, SequenceCache] = {}
        self.scheduler: Scheduler | None = None
        self.shards: Shards | None = None
        self.pause_requested = False
        self.stop_requested = False
        self.paused = False
        self.to_free: list[str] = []
        self.expert_load: dict[int, list[np.ndarray]] = {}
        self.steps = 0
        self.world_steps = 0  # steps completed in the current world generation
        self.running_feeds: list[Feed] | None = None  # the step in progress, to undo if the world breaks
        self.carry: tuple[int, ...] | None = None  # last world: generation, group, stage, TP rank, steps, CP rank
        self.generated_tokens = 0
        self.prompt_lens: dict[str, int] = {}  # request -> prompt length (where a pcp layout put its positions)
        self.cp_work = 0  # query-key pairs this rank's attention computed (context parallelism)
        self.cp_bytes: dict[str, int] = {"q": 0, "o": 0, "lse": 0, "kv": 0}  # what its CP collectives sent
        self.map_generation = 0
        self.migration: Migration | None = None
        self.switch_to: tuple[WorldSpec, int | None] | None = None
        self.idle_wait = IDLE_MIN_S
        self.adopt(rank, spec)

    def adopt(self, rank: int, spec: WorldSpec) -> None:
        """Take rank `rank` of `spec`; the role (stage, group, TP rank) of a surviving rank never changes."""
        self.rank, self.spec = rank, spec
        c = spec.grid.coordinates()
        self.stage, self.group, self.tp_rank = int(c["pp"][rank]), int(c["dpa"][rank]), int(c["tp"][rank])
        self.ep_rank, self.moe_tp_rank = int(c["ep"][rank]), int(c["moe_tp"][rank])
        self.cp_rank = int(c["cp"][rank])
        self.attn_index = self.cp_rank * spec.tp + self.tp_rank  # place in the group's cp * tp ranks
        self.layers = stage_layers(self.arch.num_layers, spec.pp)[self.stage]
        self.is_leader = rank == spec.leader(self.group)
        if self.is_leader and self.scheduler is None:
            self.scheduler = Scheduler(max_batch_tokens=spec.max_batch_tokens, max_running=spec.max_running,
                                       max_waiting=spec.max_waiting)

    @property
    def loaded(self) -> Shards:
        """This rank's weights: loaded by `load`, before the first step."""
        assert self.shards is not None, "the rank has no weights loaded"
        return self.shards

    # ------------------------------------------------------------------------------------------ setup
    def drop_groups(self) -> None:
        """Forget every process group this rank holds (one list, so that a group added later is not left holding
        a broken world's sockets open)."""
        self.tp_group = self.ep_group = self.moe_group = self.attn_group = self.cp_group = None

    def join(self) -> None:
        spec = self.spec
        timeout = dt.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(f"generation/{spec.generation}/", store)
        self.await_arrivals(prefixed, arrival_timeout())
        self.patient = False  # a later world is formed by a switch this rank is told of, with its peers
        dist.init_process_group(BACKEND, store=prefixed, rank=self.rank, world_size=spec.world_size,
                                timeout=timeout)
        grid = spec.grid
        self.drop_groups()
        for ranks in grid.tp_groups().tolist():  # every rank creates every group, in the same order
            pg = dist.new_group(ranks)
            if self.rank in ranks:
                self.tp_group = pg
        self.attn_group = self.tp_group  # what sums the partial outputs of attention and FFNs
        if spec.cp > 1:
            for ranks in grid.cp_groups().tolist():
                pg = dist.new_group(ranks)
                if self.rank in ranks:
                    self.cp_group, self.cp_ranks = pg, ranks
            for ranks in grid.grid.reshape(grid.pp * grid.dpa, -1).tolist():  # the cp * tp ranks of a group
                pg = dist.new_group(ranks)
                if self.rank in ranks:
                    self.attn_group = pg
        for ranks in grid.ep_groups().tolist():
            pg = dist.new_group(ranks)
            if self.rank in ranks:
                self.ep_group, self.ep_ranks = pg, ranks
        # routed tokens go to every shard of an expert: with MoE-TP the dispatch spans the stage's ranks, in
        # (EP, moeTP) order; without it that is the EP group itself
        self.moe_group = self.ep_group
        if spec.moe_tp > 1:
            for ranks in grid.stage_groups().tolist():
                pg = dist.new_group(ranks)
                if self.rank in ranks:
                    self.moe_group = pg

    def await_arrivals(self, store: Any, timeout_s: float) -> None:
        """Wait until every rank of the world has reached its rendezvous, before any of them starts the process
        group's exchange of addresses: that exchange has a deadline, and a rank that had started it alone and
        given up would leave its address under the generation's keys for the others to read, with no listener
        behind it. A patient rank waits without a deadline; the others fail after `timeout_s` with the count."""
        size = self.spec.world_size
        if store.add(ARRIVED_KEY, 1) == size:
            store.set(ALL_ARRIVED_KEY, "1")
        deadline = None if self.patient else time.monotonic() + timeout_s
        while True:
            # the store answers the moment the last rank counts itself in; a wait that runs out logs a warning,
            # so a patient rank waits in long stretches. A store that is gone raises DistNetworkError: no wait.
            left = ARRIVAL_WAIT_S if deadline is None else max(0.001, min(ARRIVAL_WAIT_S, deadline - time.monotonic()))
            try:
                store.wait([ALL_ARRIVED_KEY], dt.timedelta(seconds=left))
                return
            except dist.DistStoreError as e:
                if deadline is not None and time.monotonic() >= deadline:
                    raise RuntimeError(f"generation {self.spec.generation}: only {store.add(ARRIVED_KEY, 0)} of "
                                       f"{size} ranks reached the rendezvous within {timeout_s:g} s") from e

    def load(self) -> None:
        """Weights for the current spec: everything on first start (before the rendezvous, so a new rank
        prepares while the old world still serves); after a switch only the experts the new map adds."""
        if self.shards is None:
            self.shards = Shards(self.source, self.spec, self.tp_rank, self.ep_rank, self.layers,
                                 (self.moe_tp_rank, self.spec.moe_tp), self.attn_index)
            self.events.put(("loaded", self.rank, self.spec.generation))
        else:
            loaded = self.shards.bind_experts(self.spec, self.ep_rank, (self.moe_tp_rank, self.spec.moe_tp))
            self.events.put(("experts_loaded", self.rank, loaded))

    # ------------------------------------------------------------------------------------ step loop
    def run(self, standby: bool = False) -> None:
        """Load, then serve world generations until stopped. A standby rank (restarted after a crash) loads
        its weights and waits for a `switch` into a new generation instead of joining the broken one.

        A collective that fails because a peer died breaks the world for every rank in it: the rank reports
        it, drops the broken world's requests and caches, and stands by in the same process with its weights
        loaded, so the survivors re-form a world without restarting (recovery)."""
        self.load()
        if standby:
            self.events.put(("standby", self.rank, self.spec.generation))
            if not self.await_switch():
                return
        while True:
            started = time.monotonic()
            self.join()
            self.events.put(("ready", self.rank, self.spec.generation, time.monotonic() - started))
            broken = None
            try:
                outcome = self.serve()
            except RuntimeError as e:  # gloo/NCCL: a peer of this world is gone
                broken = (f"{type(e).__name__}: {e}", traceback.format_exc())
            if broken is not None:
                # outside the handler, so that the traceback's frames are gone too: drop every reference to
                # the broken groups so their sockets close now, and peers blocked in a collective with this
                # rank fail at once instead of waiting out the timeout
                self.drop_groups()
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()
                # standing by is reported before the collection of what is left (0.1-0.25 s on 2 busy cores):
                # the operator plans the next world meanwhile, and its switch is read only after it
                self.events.put(("broken", self.rank, self.spec.generation, *broken))
                gc.collect()
                self.hold_requests()
                if not self.await_switch():
                    return
                continue
            dist.destroy_process_group()
            if outcome is None:
                return
            self.carry = self.origin()
            spec, rank = outcome
            if rank is None:  # this rank is not part of the new world: hold state until told to stop
                self.events.put(("left", self.rank, spec.generation))
                while not self.stop_requested:
                    self.drain_commands(block=True)
                return
            self.adopt(rank, spec)
            self.load()

    def await_switch(self) -> bool:
        """Stand by until switched into a new world (True, adopted and loaded) or stopped/left (False)."""
        while self.switch_to is None and not self.stop_requested:
            self.drain_commands(block=True)
        if self.switch_to is None:
            return False
        (spec, rank), self.switch_to = self.switch_to, None
        if rank is None:
            self.events.put(("left", self.rank, spec.generation))
            return False
        self.adopt(rank, spec)
        self.load()
        return True

    def hold_requests(self) -> None:
        """Keep the requests of a broken world for the next one: the step that failed is undone (KV caches cut
        back to where it started; the scheduler records a step only once it completed), so a group whose ranks
        all survive carries on where it stopped. `settle_carried` decides that in the new world."""
        for f in self.running_feeds or []:
            cache = self.caches.get(f.rid)
            if cache is not None:
                if f.start == 0:
                    del self.caches[f.rid]
                else:
                    cache.truncate(f.start)
        self.running_feeds = None
        if self.world_steps >= 0:  # else the world broke before it settled: what was carried stays unsettled
            self.carry = self.origin()
        self.pause_requested = self.paused = False
        self.migration = None

    def origin(self) -> tuple[int, int, int, int, int, int]:
        """Where this rank's requests and caches come from: generation, group, stage, TP rank, steps done, CP
        rank."""
        return self.spec.generation, self.group, self.stage, self.tp_rank, self.world_steps, self.cp_rank

    def settle_carried(self, records: list[Any]) -> None:
        """First round of a new world: a group keeps its requests and KV caches only when every one of its ranks
        comes from the same group of the same world, after the same number of steps (a restarted rank, or one
        that finished a step its group-mates undid, breaks that). Otherwise every rank of the group drops its
        caches, and the leader's running requests are recomputed (prompt and generated tokens as one prefill) and
        go on; one too long to recompute in a step ends with an explicit error."""
        grid = self.spec.grid.grid
        members = {(p, c, t): int(grid[p, self.group, c, t]) for p in range(grid.shape[0])
                   for c in range(grid.shape[2]) for t in range(grid.shape[3])}
        carried = [records[m]["carry"] for m in members.values()]
        first = carried[0]
        if first is not None and all(
                c is not None and (c[0], c[1], c[4]) == (first[0], first[1], first[4]) and (c[2], c[5], c[3]) == role
                for role, c in zip(members, carried, strict=True)):
            return
        self.caches.clear()
        self.prompt_lens.clear()
        if self.scheduler is not None:  # the leader came through: its requests are recomputed, not lost
            generation = first[0] if first is not None else "?"
            for rid in self.scheduler.recompute():
                self.events.put(("lost", rid, f"lost: its KV cache did not survive the end of generation {generation} "
                                              f"and its prompt and tokens exceed maxBatchTokens="
                                              f"{self.scheduler.max_batch_tokens} to recompute; retry the request"))

    def serve(self) -> tuple[WorldSpec, int | None] | None:
        """Step until stopped (None) or until the world switches generation (the new spec and rank)."""
        self.world_steps = -1
        while True:
            self.drain_commands(block=False)
            records: list[Any] = [None] * self.spec.world_size
            dist.all_gather_object(records, self.control())
            if self.world_steps < 0:
                self.settle_carried(records)
                self.world_steps, self.carry = 0, None
                continue
            if any(r["stop"] for r in records):
                return None
            for rid in records[self.spec.leader(self.group)]["free"]:
                self.caches.pop(rid, None)
                self.prompt_lens.pop(rid, None)
            paused = any(r["pause"] for r in records)
            if paused != self.paused:
                self.paused = paused  # every rank sees the same records, so all switch on the same step
                self.events.put(("paused" if paused else "resumed", self.rank, self.spec.generation))
            target = records[0]["switch"]
            if paused and target is not None and all(r["switch"] == target for r in records):
                assert self.switch_to is not None
                outcome, self.switch_to = self.switch_to, None
                return outcome
            mig = records[0]["migrate"]
            if mig is not None and all(r["migrate"] == mig for r in records):
                self.migrate_step(records)
            batches = {g: records[self.spec.leader(g)]["batch"] for g in range(self.spec.dpa)}
            if self.paused or not any(batches.values()):
                if self.migration is None:
                    self.drain_commands(block=True)
                    self.idle_wait = min(IDLE_MAX_S, self.idle_wait * 2)
                continue
            self.idle_wait = IDLE_MIN_S
            self.step([Feed(*f) for f in batches[self.group]])

    def control(self) -> dict[str, Any]:
        if self.world_steps < 0:  # the first round of a world only settles carried requests (serve reads no more)
            return {"carry": self.carry}
        batch: list[tuple[Any, ...]] = []
        if self.scheduler is not None and not self.pause_requested:
            batch = [(f.rid, f.tokens, f.start, f.sampling) for f in self.scheduler.next_batch()]
        free, self.to_free = self.to_free, []
        m = self.migration
        return {
            "batch": batch, "free": free, "pause": self.pause_requested, "stop": self.stop_requested,
            "switch": self.switch_to[0].generation if self.switch_to else None,
            "migrate": m.map_generation if m else None,
            "migrated": (m.moved, m.bytes, not m.pending) if m else None,
        }

    def drain_commands(self, *, block: bool) -> None:
        try:
            cmd = self.commands.get(timeout=self.idle_wait) if block else self.commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self.handle(cmd)
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return

    def handle(self, cmd: tuple[Any, ...]) -> None:
        kind, s = cmd[0], self.scheduler
        if kind == "submit":
            _, rid, prompt, max_tokens, stop_ids, sampling = cmd
            refused = s.submit(Request(rid, list(prompt), int(max_tokens), frozenset(stop_ids), tuple(sampling))
                               ) if s else "not a DPA group leader"
            if refused:
                self.events.put(("refused", rid, refused))
        elif kind in ("abort", "abort_all"):
            finished = ([f] if (f := s.abort(cmd[1])) else []) if kind == "abort" and s else (
                s.abort_all() if s else [])
            for f in finished:
                self.to_free.append(f.rid)
                self.events.put(("done", f.rid, f.reason))
        elif kind == "drain" and s:
            s.admitting = False
        elif kind == "admit" and s:
            s.admitting = True
        elif kind == "pause":
            self.pause_requested = True
        elif kind == "resume":
            self.pause_requested = False
        elif kind == "stop":
            self.stop_requested = True
        elif kind == "stats":
            self.events.put(("stats", cmd[1], self.stats()))
        elif kind == "migrate":
            self.start_migration(cmd[1], cmd[2])
        elif kind == "cancel_migration" and self.migration and self.migration.map_generation == cmd[1]:
            # Layers already moved stay moved: each was swapped whole, with its map, on every rank together.
            self.migration = None
            self.events.put(("migration_cancelled", self.rank, cmd[1]))
        elif kind == "switch":
            self.switch_to = (cmd[1], cmd[2])

    def stats(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "rank": self.rank, "group": self.group, "generation": self.spec.generation, "steps": self.steps,
            "paused": self.paused, "queueDepth": s.queue_depth if s else 0,
            "running": len(s.running) if s else 0, "generatedTokens": self.generated_tokens,
            "admitting": s.admitting if s else False, "mapGeneration": self.map_generation,
            "cachedTokens": sum(c.length for c in self.caches.values()),
            "cpWork": self.cp_work, "cpBytes": dict(self.cp_bytes),
            "kvCapacityTokens": self.spec.kv_capacity_tokens,
            "device": str(torch.get_default_device()), "backend": BACKEND, "dtype": self.spec.dtype,
            "expertLoad": {layer: np.sum(w, axis=0).tolist() for layer, w in self.expert_load.items() if w},
            "phy2log": {layer: m.phy2log.tolist() for layer, m in self.shards.expert_maps.items()}
            if self.shards else {},
        }

    # ----------------------------------------------------------------------------------- migration
    def start_migration(self, map_generation: int, phy2log: dict[int, list[int]]) -> None:
        if map_generation <= self.map_generation or self.migration is not None:
            self.events.put(("migration_refused", self.rank, map_generation,
                             f"map generation {map_generation} is not newer than {self.map_generation}"
                             if self.migration is None else "a migration is already running"))
            return
        assert self.shards is not None
        targets = {i: np.asarray(phy2log[i], dtype=np.int64) for i in self.shards.expert_maps if i in phy2log}
        self.migration = Migration(map_generation, targets, sorted(targets), started=time.monotonic())

    def migrate_step(self, records: list[Any]) -> None:
        """Move the next layer (every rank of the stage in lockstep), or finish when all ranks are done."""
        m, sh = self.migration, self.shards
        assert m is not None and sh is not None
        if m.pending:
            layer = m.pending.pop(0)
            moved, nbytes = self.migrate_layer(layer, m)
            m.moved += moved
            m.bytes += nbytes
            fault = os.environ.get(FAULT_EXIT_AFTER_LAYERS_ENV)
            if fault and len(m.targets) - len(m.pending) >= int(fault):
                os._exit(137)
            return
        if all(r["migrated"] is not None and r["migrated"][2] for r in records):
            self.map_generation = m.map_generation
            moved = sum(r["migrated"][0] for r in records)  # every rank sees the same totals
            nbytes = sum(r["migrated"][1] for r in records)
            self.events.put(("migrated", self.rank, m.map_generation, moved, nbytes, time.monotonic() - m.started))
            self.migration = None

    def migrate_layer(self, layer: int, m: Migration) -> tuple[int, int]:
        """Fill the staging buffer with this rank's new experts (local copies and transfers from the ranks
        that hold them), then swap it in with the layer's new map; the old tensors become the buffer."""
        sh = self.shards
        assert sh is not None
        old = sh.expert_maps[layer]
        new = ExpertMap(m.targets[layer], self.arch.num_experts, old.ep)
        if new.slots_per_rank != old.slots_per_rank:
            raise ValueError(f"layer {layer}: a migration keeps {old.slots_per_rank} slots per rank, "
                             f"got {new.slots_per_rank}")
        spr = old.slots_per_rank
        held = [[int(e) for e in old.phy2log[j * spr:(j + 1) * spr]] for j in range(old.ep)]
        current = sh.experts[layer]
        if m.buffer is None or m.buffer["w1"].shape != current["w1"].shape:
            m.buffer = {w: torch.empty_like(t) for w, t in current.items()}
        buf = m.buffer
        ops: list[Any] = []
        moved = 0
        tag = 0
        for j in range(old.ep):  # the same plan on every rank of the stage
            for s_new in range(spr):
                e = int(new.phy2log[j * spr + s_new])
                if e in held[j]:
                    if j == self.ep_rank:
                        src_slot = held[j].index(e)
                        for w in buf:
                            buf[w][s_new].copy_(current[w][src_slot])
                    continue
                src = next(i for i in range(old.ep) if e in held[i])
                tag += 1
                if j == self.ep_rank:
                    moved += 1
                    for k, w in enumerate(buf):
                        ops.append(dist.irecv(buf[w][s_new], self.ep_ranks[src], tag=tag * 3 + k))
                if src == self.ep_rank:
                    for k, w in enumerate(buf):
                        ops.append(dist.isend(current[w][held[src].index(e)].contiguous(), self.ep_ranks[j],
                                              tag=tag * 3 + k))
        for req in ops:
            req.wait()
        sh.experts[layer], m.buffer = buf, current
        sh.expert_maps[layer] = new
        per_expert = sum(t[0].numel() * t.element_size() for t in buf.values())
        return moved, moved * per_expert

    # ------------------------------------------------------------------------------------- forward
    def step(self, feeds: list[Feed]) -> None:
        self.steps += 1
        self.running_feeds = feeds
        spec, d = self.spec, self.arch.hidden_size
        for f in feeds:
            if f.start == 0:
                self.caches[f.rid] = SequenceCache.empty(len(self.layers))
                self.prompt_lens[f.rid] = len(f.tokens)
        total = sum(len(f.tokens) for f in feeds)
        grid = spec.grid.grid
        if self.stage == 0:
            x = self.embed(torch.tensor([t for f in feeds for t in f.tokens], dtype=torch.long))
        else:
            x = torch.empty(total, d, dtype=self.loaded.dtype)
            if total:
                dist.recv(x, src=int(grid[self.stage - 1, self.group, self.cp_rank, self.tp_rank]))
        for local, layer in enumerate(self.layers):
            x = self.block(x, feeds, layer, local)
        if self.stage < spec.pp - 1:
            if total:
                dist.send(x, dst=int(grid[self.stage + 1, self.group, self.cp_rank, self.tp_rank]))
            sampled = None
        else:
            sampled = self.sample(x, feeds)
        leader = spec.leader(self.group)
        if spec.pp > 1 and feeds:
            last_tp0 = int(grid[spec.pp - 1, self.group, 0, 0])
            if self.rank == last_tp0:
                dist.send(sampled if sampled is not None else torch.empty(0, dtype=torch.long), dst=leader)
            elif self.rank == leader:
                sampled = torch.empty(len(feeds), dtype=torch.long)
                dist.recv(sampled, src=last_tp0)
        if self.rank == leader and self.scheduler is not None and sampled is not None:
            emitted, finished = self.scheduler.record({f.rid: int(t) for f, t in zip(feeds, sampled, strict=True)})
            self.generated_tokens += len(emitted)
            for rid, token in emitted:
                self.events.put(("token", rid, token))
            for fin in finished:
                self.to_free.append(fin.rid)
                self.events.put(("done", fin.rid, fin.reason))
        self.running_feeds = None
        self.world_steps += 1

    def all_reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.tp > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def reduce_group(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial outputs over the attention group's cp * tp ranks (the TP group without CP)."""
        if self.spec.tp * self.spec.cp > 1:
            dist.all_reduce(x, group=self.attn_group)
        return x

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        v0, v1 = self.loaded.vocab
        mine = (ids >= v0) & (ids < v1)
        x = self.loaded.w["embed"][(ids - v0).clamp(0, v1 - v0 - 1)] * mine[:, None]
        return self.all_reduce_tp(x)

    def block(self, x: torch.Tensor, feeds: list[Feed], layer: int, local: int) -> torch.Tensor:
        a, w, p, f32 = self.arch, self.loaded.w, f"layers.{layer}.", self.hf
        h = rms_norm(x, w[p + "attn_norm"], a.rms_norm_eps, f32)
        if self.spec.cp > 1:
            x = x + self.reduce_group(self.attention_cp(h, feeds, layer, local))
            return self.ffn(x, layer)
        parts, offset = [], 0
        mla = runs_mla(a)
        for f in feeds:
            n = len(f.tokens)
            positions = torch.arange(f.start, f.start + n)
            if mla:  # the absorbed form for decode (one new token of a request) unless told otherwise
                absorbed = self.spec.mla_absorb == "always" or (self.spec.mla_absorb == "decode" and n == 1)
                parts.append(mla_attention(h[offset:offset + n], positions, self.caches[f.rid].layers[local], w, p,
                                           a, absorbed=absorbed))
                offset += n
                continue
            parts.append(attention(h[offset:offset + n], positions, self.caches[f.rid].layers[local],
                                   wq=w[p + "wq"], wk=w[p + "wk"], wv=w[p + "wv"], wo=w[p + "wo"],
                                   head_dim=a.dim_head, theta=a.rope_theta, q_norm=w.get(p + "q_norm"),
                                   k_norm=w.get(p + "k_norm"), eps=a.rms_norm_eps))
            offset += n
        attn = torch.cat(parts) if parts else torch.zeros_like(x)
        x = x + self.all_reduce_tp(attn)
        return self.ffn(x, layer)

    def ffn(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        a, w, p = self.arch, self.loaded.w, f"layers.{layer}."
        h = rms_norm(x, w[p + "ffn_norm"], a.rms_norm_eps, self.hf)
        if not a.is_moe_layer(layer):
            return x + self.reduce_group(swiglu(h, w[p + "ffn.w1"], w[p + "ffn.w3"], w[p + "ffn.w2"]))
        out = self.routed(h, layer)
        for s in range(a.num_shared_experts):
            q = p + f"shared.{s}."
            out = out + swiglu(h, w[q + "w1"], w[q + "w3"], w[q + "w2"])
        return x + self.reduce_group(out)

    # ------------------------------------------------------------------------------ context parallel
    def attention_cp(self, h: torch.Tensor, feeds: list[Feed], layer: int, local: int) -> torch.Tensor:
        """This rank's partial attention output [T, D] with the sequence split over the CP group: each rank
        keeps the K/V of its own positions; a prompt under pcp runs ring attention over the rank's own queries,
        everything else (dcp, and decode under pcp) brings the queries to every shard and merges by LSE into
        the head slice this rank projects. The sum over the attention group is the full output."""
        a, w, p, spec = self.arch, self.loaded.w, f"layers.{layer}.", self.spec
        if runs_mla(a):
            return self.attention_mla_dcp(h, feeds, layer, local)
        dh = a.dim_head
        out = torch.zeros_like(h)
        offset = 0
        for f in feeds:
            n = len(f.tokens)
            hx = h[offset:offset + n]
            pos = torch.arange(f.start, f.start + n)
            q = (hx @ w[p + "wq"].T).view(n, -1, dh)
            k = (hx @ w[p + "wk"].T).view(n, -1, dh)
            v = (hx @ w[p + "wv"].T).view(n, -1, dh)
            if p + "q_norm" in w:
                q = rms_norm(q, w[p + "q_norm"], a.rms_norm_eps, f32=True)
                k = rms_norm(k, w[p + "k_norm"], a.rms_norm_eps, f32=True)
            q, k = rope(q, pos, a.rope_theta), rope(k, pos, a.rope_theta)
            prompt_len = self.prompt_lens.get(f.rid, f.start + n)
            owner = cpctx.owners(pos, spec.cp, spec.cp_mode, spec.cp_layout, prompt_len, spec.max_model_len)
            mine = owner == self.cp_rank
            cache = self.caches[f.rid].layers[local]
            if spec.cp_mode == "pcp" and f.start == 0:
                o = self.ring(q[mine], pos[mine], k[mine], v[mine], owner)
                cache.append_at(k[mine], v[mine], pos[mine])
                rows = mine.nonzero(as_tuple=True)[0] + offset
                out[rows] = o.reshape(len(rows), -1) @ w[p + "wo"].T
            else:
                cache.append_at(k[mine], v[mine], pos[mine])
                lo, hi, o = self.dcp(q, pos, cache)
                out[offset:offset + n] = o.reshape(n, -1) @ w[p + "wo"][:, lo * dh:hi * dh].T
            offset += n
        return out

    def attention_mla_dcp(self, h: torch.Tensor, feeds: list[Feed], layer: int, local: int) -> torch.Tensor:
        """Decode CP for MLA: each CP rank keeps the latents and RoPE keys of its own positions; queries (every
        token, prompts included) run in the absorbed form, so a query reaches every shard as one latent-space
        vector per head (q_nope W_UK and q_rope: kv_lora + rope values) and each shard's output is an average of
        its latents; `dcp` merges them by LSE into this rank's head slice, which W_UV and o project. The sum
        over the attention group is the full output."""
        a, w, p, spec = self.arch, self.loaded.w, f"layers.{layer}.", self.spec
        nope, vd, c = a.nope_head_dim, a.v_head_dim, a.kv_lora_rank
        # partial_attention divides the scores by sqrt(query width): fold MLA's softmax scale in instead
        scale = softmax_scale(a) * (c + a.rope_head_dim) ** 0.5
        out = torch.zeros_like(h)
        offset = 0
        for f in feeds:
            n = len(f.tokens)
            pos = torch.arange(f.start, f.start + n)
            q_nope, q_rope, latent, k_rope = mla_project(h[offset:offset + n], pos, w, p, a)
            wkv_b = w[p + "wkv_b"].view(q_nope.shape[1], nope + vd, c)
            q = torch.cat([torch.einsum("thn,hnc->thc", q_nope, wkv_b[:, :nope]), q_rope], dim=-1) * scale
            prompt_len = self.prompt_lens.get(f.rid, f.start + n)
            owner = cpctx.owners(pos, spec.cp, spec.cp_mode, spec.cp_layout, prompt_len, spec.max_model_len)
            mine = owner == self.cp_rank
            cache = self.caches[f.rid].layers[local]
            cache.append_at(latent[mine][:, None], k_rope[mine][:, None], pos[mine])
            keys = LayerCache()  # the shard as keys [S, 1, kv_lora + rope] and values (the latents) [S, 1, kv_lora]
            if cache.k is not None and cache.v is not None:
                keys = LayerCache(torch.cat([cache.k, cache.v], dim=-1), cache.k, cache.pos)
            lo, hi, o = self.dcp(q, pos, keys, dv=c)
            o = torch.einsum("thc,hvc->thv", o, wkv_b[lo:hi, nope:])  # W_UV
            out[offset:offset + n] = o.reshape(n, -1) @ w[p + "wo"][:, lo * vd:hi * vd].T
            offset += n
        return out

    def _expand(self, kv: torch.Tensor, heads: int) -> torch.Tensor:
        return kv.repeat_interleave(heads // kv.shape[1], dim=1) if kv.shape[0] else kv.new_zeros(0, heads,
                                                                                                  kv.shape[2])

    def ring(self, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             owner: torch.Tensor) -> torch.Tensor:
        """Ring attention over the CP group for one prompt: this rank's queries [m, H, d] against every rank's
        K/V block, received from the previous rank while the current block is computed."""
        cp, c, heads = self.spec.cp, self.cp_rank, q.shape[1]
        positions = torch.arange(len(owner))
        blocks = [positions[owner == r] for r in range(cp)]
        nxt, prev = self.cp_ranks[(c + 1) % cp], self.cp_ranks[(c - 1) % cp]
        cur_k, cur_v, cur_pos = k.contiguous(), v.contiguous(), blocks[c]
        outs, lses = [], []
        for step in range(cp):
            pending: list[dist.Work | None] = []  # None only for a rank outside the group: never here
            if step < cp - 1:
                src = (c - step - 1) % cp
                buf_k = torch.empty(len(blocks[src]), *k.shape[1:], dtype=k.dtype)
                buf_v = torch.empty_like(buf_k)
                if cur_k.shape[0]:
                    pending += [dist.isend(cur_k, nxt, tag=2 * step), dist.isend(cur_v, nxt, tag=2 * step + 1)]
                    self.cp_bytes["kv"] += 2 * cur_k.numel() * cur_k.element_size()
                if buf_k.shape[0]:
                    pending += [dist.irecv(buf_k, prev, tag=2 * step), dist.irecv(buf_v, prev, tag=2 * step + 1)]
            o, lse, pairs = cpctx.partial_attention(q, q_pos, self._expand(cur_k, heads), self._expand(cur_v, heads),
                                                    cur_pos)
            self.cp_work += pairs
            outs.append(o)
            lses.append(lse)
            for req in pending:
                if req is not None:
                    req.wait()
            if step < cp - 1:
                cur_k, cur_v, cur_pos = buf_k, buf_v, blocks[src]
        return cpctx.merge(torch.stack(outs), torch.stack(lses))

    def dcp(self, q: torch.Tensor, q_pos: torch.Tensor, cache: LayerCache,
            dv: int | None = None) -> tuple[int, int, torch.Tensor]:
        """Decode CP for T queries [T, H, d] against this rank's KV shard: (lo, hi, the merged output of query
        heads lo..hi [T, hi-lo, dv]) by ag_rs or a2a; values are dv wide (default d; MLA: the latent)."""
        cp, c, (t, heads, d) = self.spec.cp, self.cp_rank, q.shape
        dv = dv or d
        slices = cpctx.head_slices(heads, cp)
        lo, hi = slices[c]
        keys, values, kpos = cache.k, cache.v, cache.pos
        if keys is None or values is None or kpos is None:  # no position of this request is here yet
            keys, values = q.new_zeros(0, 1, d), q.new_zeros(0, 1, dv)
            kpos = torch.empty(0, dtype=torch.long)
        if self.spec.cp_comm == "ag_rs":
            # all-gather Q: each rank brings the query heads it will project
            width = max(b - a for a, b in slices)
            mine = q.new_zeros(t, width, d)
            mine[:, :hi - lo] = q[:, lo:hi]
            pieces = [torch.empty_like(mine) for _ in range(cp)]
            dist.all_gather(pieces, mine.contiguous(), group=self.cp_group)
            self.cp_bytes["q"] += (cp - 1) * t * (hi - lo) * d * q.element_size()
            q = torch.cat([pc[:, :b - a] for pc, (a, b) in zip(pieces, slices, strict=True)], dim=1)
            o, lse, pairs = cpctx.partial_attention(q, q_pos, self._expand(keys, heads), self._expand(values, heads),
                                                    kpos)
            lses = [torch.empty_like(lse) for _ in range(cp)]
            dist.all_gather(lses, lse.contiguous(), group=self.cp_group)
            self.cp_bytes["lse"] += (cp - 1) * lse.numel() * lse.element_size()
            total = torch.logsumexp(torch.stack(lses), dim=0)
            scale = torch.where(torch.isfinite(lse), torch.exp(lse - torch.where(torch.isfinite(total), total, 0.0)),
                                0.0)
            scaled = o * scale[..., None]
            # reduce-scatter the corrected outputs by head slice (an all-to-all of the slices, then the sum)
            send = torch.cat([scaled[:, a:b].reshape(-1) for a, b in slices])
            counts = [t * (b - a) * dv for a, b in slices]
            recv = torch.empty(cp * counts[c], dtype=q.dtype)
            dist.all_to_all_single(recv, send, [counts[c]] * cp, counts, group=self.cp_group)
            self.cp_bytes["o"] += sum(n for r, n in enumerate(counts) if r != c) * q.element_size()
            merged = recv.view(cp, t, hi - lo, dv).sum(0)
        else:
            o, lse, pairs = cpctx.partial_attention(q, q_pos, self._expand(keys, heads), self._expand(values, heads),
                                                    kpos)
            send = torch.cat([torch.cat([o[:, a:b].reshape(-1), lse[:, a:b].reshape(-1)]) for a, b in slices])
            counts = [t * (b - a) * (dv + 1) for a, b in slices]
            recv = torch.empty(cp * counts[c], dtype=q.dtype)
            dist.all_to_all_single(recv, send, [counts[c]] * cp, counts, group=self.cp_group)
            sent = sum(n for r, n in enumerate(counts) if r != c) * q.element_size()
            self.cp_bytes["o"] += sent * dv // (dv + 1)
            self.cp_bytes["lse"] += sent // (dv + 1)
            parts = recv.view(cp, -1)
            size = t * (hi - lo) * dv
            merged = cpctx.merge(parts[:, :size].reshape(cp, t, hi - lo, dv),
                                 parts[:, size:].reshape(cp, t, hi - lo))
        self.cp_work += pairs
        return lo, hi, merged

    def routed(self, h: torch.Tensor, layer: int) -> torch.Tensor:
        """Routed experts for this TP rank's share of the tokens; zero rows for the other shares.

        Each (token, chosen expert) pair goes to the EP rank holding its replica; with MoE-TP to each of the
        moeTp ranks holding a shard of it (gate/up rows, down columns), whose partial outputs are summed where
        the token came from: the combine is the MoE-TP reduction."""
        a, emap, mt = self.arch, self.loaded.expert_maps[layer], self.spec.moe_tp
        t = h.shape[0]
        lo, hi = _split(t, self.spec.tp * self.spec.cp, self.attn_index)  # the group's hidden states are shared
        out = torch.zeros_like(h)
        ids = torch.empty(0, a.top_k, dtype=torch.long)
        wts = torch.empty(0, a.top_k, dtype=h.dtype)
        if hi > lo and a.router_scoring == "sigmoid":
            wts, ids = route_grouped(h[lo:hi], self.loaded.w[f"layers.{layer}.router"],
                                     self.loaded.w[f"layers.{layer}.router_bias"], a)
        elif hi > lo:
            wts, ids = route(h[lo:hi], self.loaded.w[f"layers.{layer}.router"], a.top_k,
                             renormalise=a.norm_topk_prob, f32=self.hf)
        self.count_load(layer, ids)
        tok = torch.arange(lo, hi).repeat_interleave(a.top_k)
        slot = emap.slot_of(ids.reshape(-1), tok)
        weight = wts.reshape(-1)
        dest = torch.div(slot, emap.slots_per_rank, rounding_mode="floor")  # EP rank
        if mt > 1:  # every shard of the expert: stage position EP rank * moeTp + shard
            tok, slot, weight = (v.repeat_interleave(mt) for v in (tok, slot, weight))
            dest = dest.repeat_interleave(mt) * mt + torch.arange(mt).repeat(len(dest))
        order = torch.argsort(dest, stable=True)
        tok, slot, weight, dest = tok[order], slot[order], weight[order], dest[order]
        size = emap.ep * mt
        send_counts = torch.bincount(dest, minlength=size).to(torch.long)
        recv_counts = torch.empty(size, dtype=torch.long)
        group = self.moe_group
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        recv_x = torch.empty(sum(rc), h.shape[1], dtype=h.dtype)
        dist.all_to_all_single(recv_x, h[tok].contiguous(), rc, sc, group=group)
        recv_slot = torch.empty(sum(rc), dtype=torch.long)
        dist.all_to_all_single(recv_slot, (slot % emap.slots_per_rank).contiguous(), rc, sc, group=group)
        y = torch.empty_like(recv_x)
        ex = self.loaded.experts[layer]
        for j in range(emap.slots_per_rank):
            rows = (recv_slot == j).nonzero(as_tuple=True)[0]
            if rows.numel():
                y[rows] = swiglu(recv_x[rows], ex["w1"][j], ex["w3"][j], ex["w2"][j])
        back = torch.empty(len(tok), h.shape[1], dtype=h.dtype)
        dist.all_to_all_single(back, y, sc, rc, group=group)
        out.index_add_(0, tok, back * weight[:, None])
        return out

    def count_load(self, layer: int, ids: torch.Tensor) -> None:
        counts = np.bincount(ids.reshape(-1).cpu().numpy(), minlength=self.arch.num_experts)
        window = self.expert_load.setdefault(layer, [])
        window.append(counts)
        if len(window) > self.spec.load_window_steps:
            del window[0]

    def sample(self, x: torch.Tensor, feeds: list[Feed]) -> torch.Tensor:
        ends = torch.tensor(np.cumsum([len(f.tokens) for f in feeds]) - 1, dtype=torch.long)
        last = rms_norm(x[ends], self.loaded.w["norm"], self.arch.rms_norm_eps, self.hf)
        local = last @ self.loaded.w["lm_head"].T  # [n, my vocab slice]
        if self.spec.tp > 1:
            width = -(-self.arch.vocab_size // self.spec.tp)
            padded = torch.full((len(feeds), width), float("-inf"), dtype=local.dtype)
            padded[:, :local.shape[1]] = local
            pieces = [torch.empty_like(padded) for _ in range(self.spec.tp)]
            dist.all_gather(pieces, padded, group=self.tp_group)
            sizes = [_split(self.arch.vocab_size, self.spec.tp, i) for i in range(self.spec.tp)]
            local = torch.cat([pc[:, : hi - lo] for pc, (lo, hi) in zip(pieces, sizes, strict=True)], dim=1)
        return torch.tensor([pick(local[i], f) for i, f in enumerate(feeds)], dtype=torch.long)


def pick(logits: torch.Tensor, feed: Feed) -> int:
    """The next token from one request's logits [V]: the argmax when greedy, else a draw from the softmax at
    its temperature, cut to top_k and top_p. The draw uses a generator seeded by (seed, position), so a
    seeded request gets the same tokens whatever the layout, the batch or the step it lands in."""
    temperature, top_p, top_k, seed = feed.sampling
    if temperature <= 0:
        return int(logits.argmax())
    scaled = logits.double() / temperature
    if 0 < top_k < scaled.shape[0]:
        kth = scaled.topk(top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if top_p < 1.0:
        order = probs.argsort(descending=True)
        cumulative = probs[order].cumsum(0)
        drop = order[(cumulative - probs[order]) >= top_p]  # keep the smallest prefix reaching top_p
        probs[drop] = 0.0
        probs = probs / probs.sum()
    position = feed.start + len(feed.tokens) - 1
    g = torch.Generator(device="cpu").manual_seed((seed * 1_000_003 + position) % (1 << 63))
    return int(torch.multinomial(probs.cpu(), 1, generator=g))


def select_device(rank: int) -> str:
    """NCCL on the rank's GPU when CUDA is present (ranks of a pod are consecutive, so the local GPU is
    rank mod the GPU count), else gloo on the CPU. Returns the process-group backend."""
    if torch.cuda.is_available():
        local = rank % torch.cuda.device_count()
        torch.cuda.set_device(local)
        torch.set_default_device(f"cuda:{local}")
        return "nccl"
    return "gloo"


def die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent (the agent) dies, however it dies, so a rank never
    outlives its agent holding ports or GPU memory."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux: the agent's process-group kill still applies
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)


def rank_main(rank: int, spec: WorldSpec, commands: Any, events: Any, standby: bool = False,
              patient: bool = False) -> None:
    """Process entry point: run one rank until told to stop; report a crash as an event. `patient`: its first
    world is one a running world switches into (it waits at the rendezvous until that world comes)."""
    die_with_parent()
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to stderr
    try:
        global BACKEND
        BACKEND = select_device(rank)
        Rank(rank, spec, commands, events, patient).run(standby)
    except Exception as e:  # reported to the supervisor, then the process exits non-zero
        events.put(("crashed", rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise
