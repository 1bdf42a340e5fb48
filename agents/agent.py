"""The node agent: the main process of a worker pod (`shardwise agent`).

It runs the pod's rank processes (a `RankPool`), serves the gRPC API `shardwise.agent.v1.Agent` that the
operator and `shardwise agentctl` drive, the completions endpoint of the DPA groups it leads (HTTP, port
8000) and Prometheus metrics (`/metrics`, port 9090). Every mutating call names a world generation and is
idempotent for it; an older generation is refused with FAILED_PRECONDITION, an unknown expert, layer or a
rank not on this pod, or expert moves that would leave an expert without a copy, with INVALID_ARGUMENT, and
nothing changes. A shared token guards every call.

A rank process that dies is detected (process exit or its crash report) and reported by Health, the
metrics and the log, then restarted with backoff (0.25 s, then 1 s doubling to 60 s) as a standby: it loads its weights
and waits. It cannot rejoin the old world (its peers' collectives with the dead process failed); the world
is re-formed as a new generation, with or without it, by the elastic controller's recovery.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
import numpy as np
from shardwise.agents.proto import agent_pb2 as pb
from shardwise.agents.proto import agent_pb2_grpc as pb_grpc
from shardwise.agents.runtime.engine import WorldSpec
from shardwise.agents.runtime.pool import RankPool, WorldError

from shardwise import __version__

log = logging.getLogger("shardwise.agent")
T = TypeVar("T")

STALL_S = 120.0  # a poller silent this long reports the agent dead (/livez 503); its calls are bounded by 5 s
STATES = {
    "starting": pb.RANK_STATE_STARTING, "ready": pb.RANK_STATE_READY, "serving": pb.RANK_STATE_SERVING,
    "paused": pb.RANK_STATE_PAUSED, "crashed": pb.RANK_STATE_CRASHED, "exited": pb.RANK_STATE_EXITED,
}


class CallError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class Configured:
    spec: WorldSpec
    local: list[int]
    table: list[pb.RankEntry]
    map_generation: int


@dataclass
class AgentConfig:
    deployment: str = "local"
    pod_index: int = 0
    host: str = "127.0.0.1"
    http_port: int = 8000
    max_model_len: int = 4096
    max_running: int = 64  # requests a DPA group decodes at once (its scheduler queues the rest)
    served_model_name: str = ""  # the OpenAI API's model name (default: the preset's)
    serving_url: str = ""
    rendezvous_address: str = ""
    rank_start: str = "spawn"  # how rank processes start: "forkserver" once `warm_rank_starts` ran (main.run)


@dataclass
class Snapshot:
    """The latest statistics of the local ranks, refreshed by the poller (scrapes never wait on ranks)."""

    stats: list[dict[str, Any]] = field(default_factory=list)
    tokens_per_second: dict[int, float] = field(default_factory=dict)
    at: float = 0.0


class Agent:
    """The state behind the gRPC servicer, the HTTP handler and the metrics collector."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.pool: RankPool | None = None
        self.configured: dict[int, Configured] = {}
        self.active = 0
        self.map_generation = 0
        self.paused_since: float | None = None
        self.pause_step = 0
        self.lock = threading.RLock()
        self.snapshot = Snapshot()
        self.crashes_total = 0
        self.stopping = threading.Event()
        self.warm = threading.Event()  # rank processes start warm (set by the forkserver's probe: `main.run`)
        self.polled_at: float | None = None  # the poller's last run (None before its first)

    # -------------------------------------------------------------------------------------- helpers
    def _require_pool(self) -> RankPool:
        if self.pool is None:
            raise CallError(grpc.StatusCode.FAILED_PRECONDITION, "not configured: call Configure first")
        return self.pool

    def _require_active(self, generation: int) -> RankPool:
        pool = self._require_pool()
        if generation < self.active:
            raise CallError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"generation {generation} is older than the active generation {self.active}")
        if generation != self.active:
            raise CallError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"generation {generation} is not active (active: {self.active})")
        return pool

    @staticmethod
    def _timeout(deadline_ms: int, default: float = 600.0) -> float:
        return deadline_ms / 1000 if deadline_ms else default

    # ------------------------------------------------------------------------------------ configure
    def configure(self, req: pb.ConfigureRequest) -> pb.ConfigureResponse:
        with self.lock:
            if req.generation in self.configured:
                done = self.configured[req.generation]
                return pb.ConfigureResponse(generation=req.generation, local_ranks=done.local)
            if req.generation <= self.active:
                raise CallError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"generation {req.generation} is not newer than the active generation {self.active}")
            conf = self._validate(req)
            self.configured[req.generation] = conf
            if self.pool is None:  # the first world of this pod: start its ranks now
                pool = RankPool(conf.spec, conf.local, start_method=self.config.rank_start,
                                joins_running_world=req.joins_running_world)
                pool.start()
                self.active = req.generation
                self.map_generation = req.map_generation
                # published last: Health (which takes no lock) must never see a pool without its ranks (an empty
                # rank set reads SERVING) or with generation 0 active
                self.pool = pool
            return pb.ConfigureResponse(generation=req.generation, local_ranks=conf.local)

    def _validate(self, req: pb.ConfigureRequest) -> Configured:
        bad = grpc.StatusCode.INVALID_ARGUMENT
        s = req.sizes
        tp, dpa, pp, moe_tp, cp = s.tp or 1, s.dpa or 1, s.pp or 1, s.moe_tp or 1, s.cp or 1
        if (dpa * cp * tp) % moe_tp:
            raise CallError(bad, f"moeTp={moe_tp} does not divide the {dpa * cp * tp} ranks of a stage (dpa*cp*tp)")
        modes = (req.cp_mode or "dcp", req.cp_layout or "striped", req.cp_comm or "ag_rs")
        if modes[0] not in ("pcp", "dcp") or modes[1] not in ("contiguous", "zigzag", "striped") or \
                modes[2] not in ("ag_rs", "a2a") or (modes[0] == "dcp" and modes[1] == "zigzag"):
            raise CallError(bad, f"cp mode, layout and comm {modes} are not pcp|dcp, contiguous|zigzag|striped "
                                 "(zigzag with pcp only), ag_rs|a2a")
        if req.world_size != tp * dpa * cp * pp:
            raise CallError(bad, f"world_size {req.world_size} != tp*dpa*cp*pp = {tp}*{dpa}*{cp}*{pp}")
        if sorted(e.rank for e in req.ranks) != list(range(req.world_size)):
            raise CallError(bad, f"the rank table must list ranks 0..{req.world_size - 1} once each")
        host, _, port = req.rendezvous_address.rpartition(":")
        if not host or not port.isdigit():
            raise CallError(bad, f"rendezvous_address must be host:port, got {req.rendezvous_address!r}")
        phy2log = {m.layer: list(m.phy2log) for m in req.expert_map}
        dtype = req.dtype or "float64"
        if dtype not in ("float64", "float32", "bfloat16", "float16"):
            raise CallError(bad, f"the reference runtime computes in float64, float32, bfloat16 or float16, not {dtype}"
                            " (fp8 is not supported yet)")
        spec = WorldSpec(generation=req.generation, tp=tp, dpa=dpa, pp=pp, store_host=host, store_port=int(port),
                         model=req.model_preset, seed=req.seed, weights_dir=req.weights_dir or None,
                         phy2log=phy2log, max_batch_tokens=max(512, self.config.max_model_len), dtype=dtype,
                         max_running=self.config.max_running,
                         moe_tp=moe_tp, cp=cp, cp_mode=modes[0], cp_layout=modes[1], cp_comm=modes[2],
                         max_model_len=req.max_model_len or self.config.max_model_len)
        coords = spec.grid.coordinates()
        for e in req.ranks:
            want = (int(coords["tp"][e.rank]), int(coords["dpa"][e.rank]), int(coords["pp"][e.rank]),
                    int(coords["cp"][e.rank]))
            if (e.tp_rank, e.dpa_group, e.pp_stage, e.cp_rank) != want:
                raise CallError(bad, f"rank {e.rank}: (tp, dpa, pp, cp) = "
                                     f"{(e.tp_rank, e.dpa_group, e.pp_stage, e.cp_rank)} disagrees with the rank grid "
                                     f"{want}")
        arch = self._architecture(req)
        for layer, phy in phy2log.items():
            if not arch.is_moe_layer(layer):
                raise CallError(bad, f"layer {layer} is not an MoE layer of {req.model_preset}")
            if len(phy) % spec.grid.ep or any(not 0 <= x < arch.num_experts for x in phy) or \
                    set(phy) != set(range(arch.num_experts)):
                raise CallError(bad, f"layer {layer}: phy2log must cover experts 0..{arch.num_experts - 1} in a "
                                     f"multiple of ep={spec.grid.ep} slots")
        if moe_tp > 1 and arch.is_moe and arch.moe_intermediate_size < moe_tp:
            raise CallError(bad, f"moeTp={moe_tp} exceeds the experts' width {arch.moe_intermediate_size}")
        if arch.is_moe and not phy2log:
            spec = dataclasses.replace(spec, redundant_experts=0)
        local = sorted(e.rank for e in req.ranks if e.pod == self.config.pod_index)
        if not local and self.pool is None:
            raise CallError(bad, f"no rank of the table runs on pod {self.config.pod_index}")
        # with a world running, no rank here means this pod leaves at the switch to this generation
        return Configured(spec, local, list(req.ranks), req.map_generation)

    @staticmethod
    def _architecture(req: pb.ConfigureRequest) -> Any:
        """The architecture the ranks will compute, after checking a checkpoint whole (config, every tensor's
        presence, shape and dtype) and against the plan's architecture, before any rank loads a byte: a wrong
        checkpoint is refused with "checkpoint: ..." and the numbers, instead of crashing every rank."""
        from shardwise import checkpoint
        from shardwise.api import ModelArchitecture

        bad = grpc.StatusCode.INVALID_ARGUMENT
        try:
            if req.weights_dir and checkpoint.is_checkpoint(Path(req.weights_dir)):
                arch = checkpoint.inspect(Path(req.weights_dir)).architecture
                if req.planned_architecture:
                    planned = ModelArchitecture.model_validate_json(req.planned_architecture)
                    wrong = checkpoint.mismatches(planned, arch)
                    if wrong:
                        raise CallError(bad, f"checkpoint: {req.weights_dir} is not the model the plan was made for: "
                                             + "; ".join(wrong))
                return arch
            return checkpoint.model_architecture(req.model_preset, req.weights_dir or None)
        except checkpoint.CheckpointError as e:
            raise CallError(bad, f"checkpoint: {e}") from e
        except (KeyError, ValueError) as e:
            raise CallError(bad, str(e)) from e

    # --------------------------------------------------------------------------------- world change
    def prepare(self, req: pb.PrepareRequest) -> pb.PrepareResponse:
        with self.lock:
            pool = self._require_pool()
            conf = self._configured(req.generation)
            if req.generation == self.active:
                return pb.PrepareResponse(generation=req.generation, seconds=0.0)
            started = time.monotonic()
            pool.prepare(conf.spec, conf.local)
            return pb.PrepareResponse(generation=req.generation, seconds=time.monotonic() - started)

    def _configured(self, generation: int) -> Configured:
        if generation < self.active:
            raise CallError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"generation {generation} is older than the active generation {self.active}")
        if generation not in self.configured:
            raise CallError(grpc.StatusCode.FAILED_PRECONDITION, f"generation {generation} is not configured")
        return self.configured[generation]

    def pause(self, req: pb.PauseRequest) -> pb.PauseResponse:
        pool = self._require_active(req.generation)
        try:
            pool.pause(self._timeout(req.deadline_ms))
        except WorldError as e:
            pool.broadcast("resume")
            raise CallError(grpc.StatusCode.DEADLINE_EXCEEDED, str(e)) from e
        with self.lock:
            if self.paused_since is None:
                self.paused_since = time.monotonic()
        steps = [s["steps"] for s in pool.stats()]
        return pb.PauseResponse(generation=req.generation, step=max(steps, default=0))

    def switch(self, req: pb.SwitchRequest) -> pb.SwitchResponse:
        with self.lock:
            pool = self._require_pool()
            if req.generation == self.active:
                return pb.SwitchResponse(generation=self.active, previous_generation=self.active)
            conf = self._configured(req.generation)
            previous = self.active
            # A Switch asked again while its world forms (an operator restarted mid-switch, a retried call) waits
            # for that same world: sent through again, it would take every rank to a second rendezvous under this
            # generation's keys, where they would meet the first one's addresses.
            if pool.spec.generation != req.generation:
                if req.recover:
                    waiting = pool.not_standing_by()
                    if waiting:
                        raise CallError(grpc.StatusCode.UNAVAILABLE,
                                        f"ranks {waiting} are not standing by yet (restarting after the crash)")
                elif self.paused_since is None:
                    raise CallError(grpc.StatusCode.FAILED_PRECONDITION, "pause the active generation before Switch")
                pool.switch(conf.spec, conf.local)
        try:
            pool.wait_ready(600)
        except WorldError as e:
            raise CallError(grpc.StatusCode.UNAVAILABLE, str(e)) from e
        with self.lock:
            self.active = req.generation
            self.map_generation = max(self.map_generation, conf.map_generation)
        # the ranks that left stop in the background: their exit is no part of the pause
        threading.Thread(target=pool.release_retired, name="release-retired", daemon=True).start()
        return pb.SwitchResponse(generation=req.generation, previous_generation=previous)

    def resume(self, req: pb.ResumeRequest) -> pb.ResumeResponse:
        pool = self._require_active(req.generation)
        pool.resume()
        with self.lock:
            since, self.paused_since = self.paused_since, None
            if since is not None:
                pool.last_pause_seconds = time.monotonic() - since
        return pb.ResumeResponse(generation=req.generation, paused_seconds=pool.last_pause_seconds if since else 0.0)

    # -------------------------------------------------------------------------------------- experts
    def current_maps(self) -> dict[int, list[int]]:
        maps: dict[int, list[int]] = {}
        for s in self._require_pool().stats():
            for layer, phy in s["phy2log"].items():
                maps[int(layer)] = phy
        return maps

    def migrate(self, req: pb.MigrateExpertsRequest) -> pb.MigrateExpertsResponse:
        pool = self._require_active(req.generation)
        if req.map_generation == self.map_generation:
            return pb.MigrateExpertsResponse(generation=self.active, map_generation=self.map_generation)
        self._require_newer_map(req.map_generation)
        maps = {k: np.asarray(v) for k, v in self.current_maps().items()}
        spec = pool.spec
        ep = spec.grid.ep
        for m in req.moves:
            if m.layer not in maps:
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"layer {m.layer} is not an MoE layer held here")
            phy = maps[m.layer]
            spr = len(phy) // ep
            if m.logical_expert >= int(phy.max()) + 1 or m.dst_slot >= spr or max(m.src_rank, m.dst_rank) >= ep:
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"move {m.layer}/{m.logical_expert}: expert, slot or rank out of range "
                                f"(experts {int(phy.max()) + 1}, slots per rank {spr}, ep {ep})")
            src_slots = phy[m.src_rank * spr:(m.src_rank + 1) * spr]
            if m.logical_expert not in src_slots:
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"rank {m.src_rank} holds no copy of expert {m.logical_expert} in layer {m.layer}")
        experts = {layer: len(set(phy.tolist())) for layer, phy in maps.items()}
        for m in req.moves:
            maps[m.layer] = maps[m.layer].copy()
            maps[m.layer][m.dst_rank * len(maps[m.layer]) // ep + m.dst_slot] = m.logical_expert
        for layer in sorted({m.layer for m in req.moves}):  # a map without some expert would stop every rank
            missing = sorted(set(range(experts[layer])) - set(maps[layer].tolist()))
            if missing:
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the moves leave expert(s) {missing} of layer {layer} without a copy")
        return self._apply_maps(req.generation, req.map_generation, {k: v.tolist() for k, v in maps.items()},
                                req.deadline_ms)

    def update_map(self, req: pb.UpdateExpertMapRequest) -> pb.UpdateExpertMapResponse:
        self._require_active(req.generation)
        if req.map_generation == self.map_generation:
            return pb.UpdateExpertMapResponse(generation=self.active, map_generation=self.map_generation)
        self._require_newer_map(req.map_generation)
        maps = self.current_maps()
        for m in req.layers:
            if m.layer not in maps:
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"layer {m.layer} is not an MoE layer held here")
            if len(m.phy2log) != len(maps[m.layer]) or set(m.phy2log) != set(range(max(maps[m.layer]) + 1)):
                raise CallError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"layer {m.layer}: phy2log needs {len(maps[m.layer])} slots covering every expert")
            maps[m.layer] = list(m.phy2log)
        r = self._apply_maps(req.generation, req.map_generation, maps, 0)
        return pb.UpdateExpertMapResponse(generation=r.generation, map_generation=r.map_generation,
                                          experts_moved=r.experts_moved, bytes_moved=r.bytes_moved, seconds=r.seconds)

    def _require_newer_map(self, map_generation: int) -> None:
        if map_generation < self.map_generation:
            raise CallError(grpc.StatusCode.FAILED_PRECONDITION,
                            f"map generation {map_generation} is older than {self.map_generation}")

    def _apply_maps(self, generation: int, map_generation: int, maps: dict[int, list[int]],
                    deadline_ms: int) -> pb.MigrateExpertsResponse:
        pool = self._require_pool()
        try:
            moved, nbytes, seconds = pool.migrate(map_generation, maps, self._timeout(deadline_ms))
        except WorldError as e:
            raise CallError(grpc.StatusCode.ABORTED, str(e)) from e
        with self.lock:
            self.map_generation = map_generation
        return pb.MigrateExpertsResponse(generation=generation, map_generation=map_generation,
                                         experts_moved=moved, bytes_moved=nbytes, seconds=seconds)

    # ------------------------------------------------------------------------------ drain and abort
    def _groups(self, pool: RankPool, asked: list[int]) -> list[int]:
        """The DPA groups a Drain or Abort names (every group the pod leads when none); INVALID_ARGUMENT for a
        group the world does not have."""
        wrong = sorted(g for g in asked if not 0 <= g < pool.spec.dpa)
        if wrong:
            raise CallError(grpc.StatusCode.INVALID_ARGUMENT, f"dpa_groups {wrong} do not exist: generation "
                            f"{pool.spec.generation} has {pool.spec.dpa} DPA groups (0..{pool.spec.dpa - 1})")
        return list(asked) or pool.leader_groups()

    def drain(self, req: pb.DrainRequest) -> pb.DrainResponse:
        pool = self._require_active(req.generation)
        groups = self._groups(pool, list(req.dpa_groups))
        before = len(pool.in_flight(groups))
        ok = pool.drain(groups, self._timeout(req.deadline_ms))
        remaining = len(pool.in_flight(groups))
        return pb.DrainResponse(generation=req.generation, finished=max(0, before - remaining),
                                remaining=remaining, timed_out=not ok)

    def restart_stuck(self, req: pb.RestartStuckRequest) -> pb.RestartStuckResponse:
        pool = self._require_pool()
        if req.generation != self.active:  # the world moved on (or this pod never served it): nothing is stuck in it
            return pb.RestartStuckResponse(generation=req.generation)
        why = req.reason or f"restarted: still in broken world {req.generation}"
        restarted = pool.restart_stuck(why)
        if restarted:
            log.warning("ranks %s still in broken world %d: restarted (%s)", restarted, req.generation, why)
        return pb.RestartStuckResponse(generation=req.generation, restarted=restarted)

    def abort(self, req: pb.AbortRequest) -> pb.AbortResponse:
        pool = self._require_active(req.generation)
        groups = self._groups(pool, list(req.dpa_groups))
        by_id = req.request_ids
        count = sum(pool.abort(rid) for rid in by_id) if by_id else pool.abort_groups(groups)
        return pb.AbortResponse(generation=req.generation, aborted=count)

    # --------------------------------------------------------------------------------- observation
    def describe(self) -> pb.DescribeResponse:
        conf = self.configured.get(self.active)
        ranks = [e for e in conf.table if e.pod == self.config.pod_index] if conf else []
        leads = bool(self.pool and self.pool.leader_groups())
        return pb.DescribeResponse(deployment=self.config.deployment, pod_index=self.config.pod_index, ranks=ranks,
                                   generation=self.active, map_generation=self.map_generation,
                                   serving_url=self.config.serving_url if leads else "", agent_version=__version__,
                                   world_size=conf.spec.world_size if conf else 0,
                                   rendezvous_address=self.config.rendezvous_address)

    def health(self) -> pb.HealthResponse:
        if self.pool is None:
            return pb.HealthResponse(status=pb.AGENT_STATUS_UNCONFIGURED, warm=self.warm.is_set())
        self.pool.poll_processes()
        out = []
        for r in sorted(self.pool.ranks):
            st, proc = self.pool.ranks[r], self.pool.procs.get(r)
            h = pb.RankHealth(rank=r, state=STATES.get(st.state, pb.RANK_STATE_UNSPECIFIED), last_error=st.error,
                              pid=st.pid or 0, restarts=st.restarts)
            code = proc.exitcode if proc is not None and proc.exitcode is not None else st.exit_code
            if code is not None:
                h.exit_code = code
            out.append(h)
        states = {h.state for h in out}
        # a restarted rank degrades the pod until it serves again in a new generation
        standing_by = any((h.restarts or h.last_error) and h.state not in (pb.RANK_STATE_SERVING,
                                                                           pb.RANK_STATE_PAUSED) for h in out)
        if states & {pb.RANK_STATE_CRASHED, pb.RANK_STATE_EXITED} or standing_by:
            status = pb.AGENT_STATUS_DEGRADED
        elif states == {pb.RANK_STATE_PAUSED}:
            status = pb.AGENT_STATUS_PAUSED
        elif states <= {pb.RANK_STATE_SERVING, pb.RANK_STATE_PAUSED}:
            status = pb.AGENT_STATUS_SERVING
        else:
            status = pb.AGENT_STATUS_STARTING
        return pb.HealthResponse(status=status, ranks=out, generation=self.active, warm=self.warm.is_set())

    def alive(self) -> tuple[bool, str]:
        """Whether the agent's poller still runs (what the liveness probe asks): False once it has not for
        STALL_S (a deadlock); a stopped or hung process answers nothing at all."""
        beat = self.polled_at
        if beat is not None and time.monotonic() - beat > STALL_S:
            return False, f"the agent's poller has not run for {time.monotonic() - beat:.0f} s"
        return True, "alive"

    def refresh(self) -> None:
        """Poll the ranks (the poller thread calls this about once a second)."""
        self.polled_at = time.monotonic()
        pool = self.pool
        if pool is None:
            return
        for rank, code in pool.poll_processes():
            self.crashes_total += 1
            log.error("rank %d exited unexpectedly with code %d", rank, code)
        if pool.crashes or set(pool.local) - pool.ready.get(pool.spec.generation, set()):
            return
        try:
            stats = pool.stats(timeout=5)
        except WorldError:
            return
        now = time.monotonic()
        old = {s["rank"]: s["generatedTokens"] for s in self.snapshot.stats}
        dt = now - self.snapshot.at if self.snapshot.at else 0.0
        rates = {s["rank"]: (s["generatedTokens"] - old.get(s["rank"], 0)) / dt if dt else 0.0 for s in stats}
        self.snapshot = Snapshot(stats, rates, now)

    def stats(self) -> pb.StatsResponse:
        snap, spec = self.snapshot, self.pool.spec if self.pool else None
        # (a snapshot taken before a switch can name a group the new world no longer has: it is refreshed within
        # a second, and until then such a group is not reported)
        leaders = [s for s in snap.stats
                   if spec is not None and s["group"] < spec.dpa and s["rank"] == spec.leader(s["group"])]
        groups = [pb.DpaGroupStats(
            dpa_group=s["group"], queue_depth=s["queueDepth"], running_requests=s["running"],
            kv_cache_usage=min(1.0, s["cachedTokens"] / max(1, s["kvCapacityTokens"])),
            generated_tokens_total=s["generatedTokens"], tokens_per_second=snap.tokens_per_second.get(s["rank"], 0.0),
            draining=not s["admitting"]) for s in leaders]
        return pb.StatsResponse(
            queue_depth=sum(g.queue_depth for g in groups), running_requests=sum(g.running_requests for g in groups),
            kv_cache_usage=max((g.kv_cache_usage for g in groups), default=0.0),
            generated_tokens_total=sum(g.generated_tokens_total for g in groups),
            tokens_per_second=sum(g.tokens_per_second for g in groups), groups=groups, generation=self.active,
            last_pause_seconds=self.pool.last_pause_seconds if self.pool else 0.0)

    def expert_load(self, stats: list[dict[str, Any]] | None = None) -> pb.ExpertLoad:
        """This pod's ranks' expert load, summed, from their statistics (asked now unless given)."""
        total: dict[int, np.ndarray] = {}
        maps: dict[int, list[int]] = {}
        step = 0
        for s in self._require_pool().stats() if stats is None else stats:
            step = max(step, s["steps"])
            for layer, counts in s["expertLoad"].items():
                total[int(layer)] = total.get(int(layer), 0) + np.asarray(counts, dtype=np.int64)
            for layer, phy in s["phy2log"].items():
                maps[int(layer)] = phy
        for layer in maps:
            total.setdefault(layer, np.zeros(max(maps[layer]) + 1, dtype=np.int64))
        return pb.ExpertLoad(step=step, map_generation=self.map_generation, generation=self.active,
                             layers=[pb.LayerLoad(layer=k, tokens_per_logical_expert=v.tolist(),
                                                  phy2log=maps.get(k, []))
                                     for k, v in sorted(total.items())])

    def close(self) -> None:
        self.stopping.set()
        if self.pool is not None:
            self.pool.close()


class Engine(Protocol):
    """What the gRPC face drives: `Agent` (the runtime's ranks) and `VllmAgent` (a supervised vLLM server)."""

    stopping: threading.Event

    def describe(self) -> pb.DescribeResponse: ...
    def health(self) -> pb.HealthResponse: ...
    def configure(self, req: pb.ConfigureRequest) -> pb.ConfigureResponse: ...
    def prepare(self, req: pb.PrepareRequest) -> pb.PrepareResponse: ...
    def pause(self, req: pb.PauseRequest) -> pb.PauseResponse: ...
    def switch(self, req: pb.SwitchRequest) -> pb.SwitchResponse: ...
    def resume(self, req: pb.ResumeRequest) -> pb.ResumeResponse: ...
    def migrate(self, req: pb.MigrateExpertsRequest) -> pb.MigrateExpertsResponse: ...
    def update_map(self, req: pb.UpdateExpertMapRequest) -> pb.UpdateExpertMapResponse: ...
    def drain(self, req: pb.DrainRequest) -> pb.DrainResponse: ...
    def abort(self, req: pb.AbortRequest) -> pb.AbortResponse: ...
    def restart_stuck(self, req: pb.RestartStuckRequest) -> pb.RestartStuckResponse: ...
    def stats(self) -> pb.StatsResponse: ...
    def expert_load(self) -> pb.ExpertLoad: ...


class Servicer(pb_grpc.AgentServicer):
    """gRPC face of an engine: each method delegates and turns CallError into a status."""

    def __init__(self, agent: Engine) -> None:
        self.agent = agent

    def _call(self, context: grpc.ServicerContext, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except CallError as e:
            context.abort(e.code, e.message)

    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.DescribeResponse:
        return self._call(context, self.agent.describe)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        return self._call(context, self.agent.health)

    def Configure(self, request: pb.ConfigureRequest, context: grpc.ServicerContext) -> pb.ConfigureResponse:
        return self._call(context, self.agent.configure, request)

    def Prepare(self, request: pb.PrepareRequest, context: grpc.ServicerContext) -> pb.PrepareResponse:
        return self._call(context, self.agent.prepare, request)

    def Pause(self, request: pb.PauseRequest, context: grpc.ServicerContext) -> pb.PauseResponse:
        return self._call(context, self.agent.pause, request)

    def Switch(self, request: pb.SwitchRequest, context: grpc.ServicerContext) -> pb.SwitchResponse:
        return self._call(context, self.agent.switch, request)

    def Resume(self, request: pb.ResumeRequest, context: grpc.ServicerContext) -> pb.ResumeResponse:
        return self._call(context, self.agent.resume, request)

    def MigrateExperts(self, request: pb.MigrateExpertsRequest,
                       context: grpc.ServicerContext) -> pb.MigrateExpertsResponse:
        return self._call(context, self.agent.migrate, request)

    def UpdateExpertMap(self, request: pb.UpdateExpertMapRequest,
                        context: grpc.ServicerContext) -> pb.UpdateExpertMapResponse:
        return self._call(context, self.agent.update_map, request)

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainResponse:
        return self._call(context, self.agent.drain, request)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:
        return self._call(context, self.agent.abort, request)

    def RestartStuck(self, request: pb.RestartStuckRequest, context: grpc.ServicerContext) -> pb.RestartStuckResponse:
        return self._call(context, self.agent.restart_stuck, request)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        return self._call(context, self.agent.stats)

    def WatchHealth(self, request: pb.WatchHealthRequest,
                    context: grpc.ServicerContext) -> Iterator[pb.HealthResponse]:
        interval = max(0.01, (request.interval_ms or 50) / 1000)
        heartbeat = max(interval, (request.heartbeat_ms or 5000) / 1000)
        sent, sent_at = None, 0.0
        while context.is_active() and not self.agent.stopping.is_set():
            health = self._call(context, self.agent.health)
            shape = (health.status, health.generation,
                     tuple((r.rank, r.state, r.restarts, r.last_error) for r in health.ranks))
            if shape != sent or time.monotonic() - sent_at >= heartbeat:
                sent, sent_at = shape, time.monotonic()
                yield health
            self.agent.stopping.wait(interval)

    def StreamExpertLoad(self, request: pb.StreamExpertLoadRequest,
                         context: grpc.ServicerContext) -> Iterator[pb.ExpertLoad]:
        interval = max(0.05, (request.interval_ms or 1000) / 1000)
        while context.is_active() and not self.agent.stopping.is_set():
            msg = self._call(context, self.agent.expert_load)
            yield msg
            self.agent.stopping.wait(interval)
