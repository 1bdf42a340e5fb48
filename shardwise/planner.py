"""The planner: `plan(spec) -> Plan`, pure and frozen.

It resolves the presets, checks the layout against the model and the GPUs (every violation at once, each
with its field path and the numbers), slices every group from one rank grid (`shardwise.grid`), lays the
ranks out on pods (one pod per node slice of `gpusPerNode` GPUs; a TP group never spans pods), fills the
per-rank memory ledger (`shardwise.ledger`) and estimates traffic and step time for a workload
(`shardwise.cost`). An invalid spec still gets as much of a plan as can be computed, so a user sees the
ledger that does not fit.

Field paths in messages are the YAML paths a user writes (`spec.parallelism.tp`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardwise import cp as cplayout
from shardwise import promql
from shardwise.api import (
    AttentionType,
    CpLayout,
    CpMode,
    DType,
    Engine,
    InferenceDeploymentSpec,
    ModelArchitecture,
    ParallelismSpec,
)
from shardwise.cost import Estimate, Links, Phase, Traffic, Workload, estimate, traffic
from shardwise.grid import RankGrid
from shardwise.ledger import LedgerEntry, Sharding, ledger_entry
from shardwise.presets import GpuSpec, UnknownPreset, gpu_preset, model_preset

GiB = 1024**3
MiB = 1024**2
#: maxModelLen where neither the spec nor the model gives one (a config.json without max_position_embeddings)
DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class Violation:
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass(frozen=True)
class RankInfo:
    rank: int
    pod: int
    gpu: int
    tp_rank: int
    cp_rank: int
    dpa_group: int
    pp_stage: int
    ep_rank: int
    moe_tp_rank: int


@dataclass(frozen=True)
class Plan:
    """Everything the operator and the runtime need to know about one layout."""

    spec: InferenceDeploymentSpec
    model_name: str
    errors: tuple[Violation, ...]
    warnings: tuple[Violation, ...]
    arch: ModelArchitecture | None = None
    gpu: GpuSpec | None = None
    grid: RankGrid | None = None
    gpus_per_pod: int = 0
    stage_layers: tuple[range, ...] = ()
    stage_ledger: tuple[LedgerEntry, ...] = ()
    workload: Workload = field(default_factory=Workload)
    stage_traffic: tuple[Traffic, ...] = ()
    stage_estimates: tuple[Estimate, ...] = ()
    stage_shards: tuple[Sharding, ...] = ()
    links: Links | None = None
    max_model_len: int = DEFAULT_MAX_MODEL_LEN  # spec.serving.maxModelLen, or its default (`max_model_len`)

    @property
    def valid(self) -> bool:
        return not self.errors

    @property
    def world_size(self) -> int:
        return self.spec.parallelism.world_size

    @property
    def pod_count(self) -> int:
        return math.ceil(self.world_size / self.gpus_per_pod) if self.gpus_per_pod else 0

    @property
    def bottleneck_stage(self) -> int:
        if not self.stage_estimates:
            return 0
        steps = [e.step_seconds for e in self.stage_estimates]
        return steps.index(max(steps))

    def rank_table(self) -> list[RankInfo]:
        if self.grid is None:
            return []
        c = self.grid.coordinates()
        return [
            RankInfo(
                rank=r, pod=r // self.gpus_per_pod, gpu=r % self.gpus_per_pod,
                tp_rank=int(c["tp"][r]), cp_rank=int(c["cp"][r]), dpa_group=int(c["dpa"][r]),
                pp_stage=int(c["pp"][r]), ep_rank=int(c["ep"][r]), moe_tp_rank=int(c["moe_tp"][r]),
            )
            for r in range(self.world_size)
        ]

    def ledger_for_rank(self, rank: int) -> LedgerEntry:
        assert self.grid is not None
        return self.stage_ledger[rank // self.grid.stage_size]

    def groups(self) -> dict[str, list[list[int]]]:
        if self.grid is None:
            return {}
        g = self.grid
        return {
            "tp": g.tp_groups().tolist(),
            "cp": g.cp_groups().tolist(),
            "dpa": g.dpa_groups().tolist(),
            "pp": g.pp_groups().tolist(),
            "ep": g.ep_groups().tolist(),
            "moeTp": g.moe_tp_groups().tolist(),
        }

    def pods(self) -> list[list[int]]:
        per = self.gpus_per_pod
        return [list(range(p * per, min((p + 1) * per, self.world_size))) for p in range(self.pod_count)]

    def capacity(self) -> dict[str, int]:
        """KV capacity: requests at maxModelLen per attention group (its tightest rank) and in all."""
        if not self.stage_ledger:
            return {"kvTokensPerRank": 0, "requestsPerDpaGroup": 0, "requests": 0}
        per_group = min(e.kv_capacity_requests for e in self.stage_ledger)
        return {
            "kvTokensPerRank": min(e.kv_capacity_tokens for e in self.stage_ledger),
            "requestsPerDpaGroup": per_group,
            "requests": per_group * self.spec.parallelism.dpa,
        }

    def throughput(self) -> dict[str, float]:
        """Tokens/s from the bottleneck stage's step estimate (decode: one token per request per
        pipeline round; prefill: B*S tokens per group)."""
        if not self.stage_estimates:
            return {"tokensPerSecond": 0.0, "tokensPerSecondPerGpu": 0.0, "tokensPerSecondPerUser": 0.0}
        step = self.stage_estimates[self.bottleneck_stage].step_seconds
        par, w = self.spec.parallelism, self.workload
        total = w.tokens_per_group * par.dpa / step
        per_user = (1 if w.phase is Phase.DECODE else w.context) / (par.pp * step)
        return {
            "tokensPerSecond": total,
            "tokensPerSecondPerGpu": total / self.world_size,
            "tokensPerSecondPerUser": per_user,
        }

    def step_seconds(self, workload: Workload) -> float:
        """The bottleneck stage's step estimate for another workload, reusing this plan's shards."""
        assert self.arch is not None and self.gpu is not None and self.links is not None
        b, kv_b = self.spec.model.dtype.nbytes, self.spec.model.kv_dtype.nbytes
        return max(
            estimate(self.arch, sh, workload, b=b, kv_b=kv_b, peak_flops=self.gpu.peak_flops,
                     hbm_bandwidth=self.gpu.hbm_bandwidth, links=self.links,
                     cp_keys_busiest=_busiest_cp_work(self.spec.parallelism, workload)).step_seconds
            for sh in self.stage_shards
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract of `shardwise plan --output json`."""
        par = self.spec.parallelism
        out: dict[str, Any] = {
            "valid": self.valid,
            "errors": [{"field": v.field, "message": v.message} for v in self.errors],
            "warnings": [{"field": v.field, "message": v.message} for v in self.warnings],
            "model": self.model_name,
            "gpu": self.gpu.name if self.gpu else self.spec.hardware.gpu,
            "worldSize": self.world_size,
            "maxModelLen": self.max_model_len,
            "podCount": self.pod_count,
            "gpusPerPod": self.gpus_per_pod,
            "parallelism": {
                "tp": par.tp, "dpa": par.dpa, "pp": par.pp, "cp": par.cp, "ep": par.ep_size,
                "moeTp": par.moe_tp, "cpMode": par.cp_mode.value, "cpLayout": par.cp_layout.value,
                "epReplicas": self.grid.ep_replicas if self.grid else 0,
            },
            "stages": [{"stage": i, "layers": [r.start, r.stop]} for i, r in enumerate(self.stage_layers)],
            "groups": self.groups(),
            "pods": [{"index": i, "ranks": rs} for i, rs in enumerate(self.pods())] if self.grid else [],
            "ranks": [
                {
                    "rank": i.rank, "pod": i.pod, "gpu": i.gpu, "tpRank": i.tp_rank, "cpRank": i.cp_rank,
                    "dpaGroup": i.dpa_group, "ppStage": i.pp_stage, "epRank": i.ep_rank,
                    "moeTpRank": i.moe_tp_rank,
                }
                for i in self.rank_table()
            ],
            "ledger": [],
            "capacity": self.capacity(),
            "workload": {
                "phase": self.workload.phase.value,
                "batch": self.workload.batch,
                "context": self.workload.context,
            },
            "traffic": {},
            "estimates": {},
        }
        if self.grid is not None and self.stage_ledger:
            rows = []
            for r in range(self.world_size):
                e = self.ledger_for_rank(r)
                rows.append({
                    "rank": r, "weightsBytes": e.weights_bytes, "kvCacheBytes": e.kv_cache_bytes,
                    "kvBytesPerToken": e.kv_bytes_per_token, "activationBytes": e.activation_bytes,
                    "workspaceBytes": e.workspace_bytes, "totalBytes": e.total_bytes,
                    "freeBytes": e.free_bytes, "kvCapacityTokens": e.kv_capacity_tokens,
                    "kvCapacityRequests": e.kv_capacity_requests, "budgetBytes": e.budget_bytes,
                })
            out["ledger"] = rows
        if self.stage_traffic:
            t = self.stage_traffic[self.bottleneck_stage]
            out["traffic"] = {
                "tpAllReduceBytesPerRank": t.tp_all_reduce_bytes_per_rank,
                "tpAllReducesPerStep": t.tp_all_reduces_per_step,
                "tpMessageBytes": t.tp_message_bytes,
                "epAllToAllBytesPerRank": t.ep_all_to_all_bytes_per_rank,
                "epAllToAllsPerStep": t.ep_all_to_alls_per_step,
                "cpBytesPerRank": t.cp_bytes_per_rank,
                "cpA2aBytesPerRank": t.cp_a2a_bytes_per_rank,
                "cpOpsPerStep": t.cp_ops_per_step,
                "ppSendBytesPerRank": max(x.pp_send_bytes_per_rank for x in self.stage_traffic),
            }
            est = self.stage_estimates[self.bottleneck_stage]
            out["estimates"] = {
                "stepSeconds": est.step_seconds, "computeSeconds": est.compute_seconds,
                "memorySeconds": est.memory_seconds, "commSeconds": est.comm_seconds,
                "bottleneckStage": self.bottleneck_stage, **self.throughput(),
            }
        return out


# --------------------------------------------------------------------------------------------- checks


def _check_attention(arch: ModelArchitecture, par: ParallelismSpec) -> tuple[list[Violation], list[Violation]]:
    errors: list[Violation] = []
    warnings: list[Violation] = []
    f = "spec.parallelism.tp"
    if arch.num_heads % par.tp:
        errors.append(Violation(f, f"numHeads={arch.num_heads} is not divisible by tp={par.tp}"))
    if arch.attention_type is AttentionType.MLA:
        if par.tp > 1:
            warnings.append(Violation(
                f, f"MLA keeps one latent KV cache per token on each of the tp={par.tp} ranks "
                "(replicated); dpa or cp divide it",
            ))
        return errors, warnings
    kv = arch.kv_heads
    if par.tp > kv:
        if par.tp % kv:
            errors.append(Violation(
                f, f"tp={par.tp} > numKvHeads={kv} needs tp % numKvHeads == 0 (remainder {par.tp % kv})"
            ))
        else:
            warnings.append(Violation(
                f, f"tp={par.tp} > numKvHeads={kv}: K/V weights and the KV cache are replicated "
                f"{par.tp // kv}x; consider tp={kv} with dpa={par.dpa * par.tp // kv}",
            ))
    elif kv % par.tp:
        errors.append(Violation(f, f"numKvHeads={kv} is not divisible by tp={par.tp}"))
    return errors, warnings


def _check_layers(arch: ModelArchitecture, par: ParallelismSpec) -> tuple[list[Violation], list[Violation]]:
    f = "spec.parallelism.pp"
    if par.pp > arch.num_layers:
        return [Violation(f, f"pp={par.pp} exceeds numLayers={arch.num_layers}: a stage would be empty")], []
    if arch.num_layers % par.pp:
        sizes = sorted({len(r) for r in stage_layers(arch.num_layers, par.pp)})
        return [], [Violation(
            f, f"numLayers={arch.num_layers} is not divisible by pp={par.pp}: stages hold "
            f"{' or '.join(map(str, sizes))} layers, the largest sets the pace",
        )]
    return [], []


def _check_experts(
    arch: ModelArchitecture, spec: InferenceDeploymentSpec
) -> tuple[list[Violation], list[Violation]]:
    par, eplb = spec.parallelism, spec.eplb
    errors: list[Violation] = []
    warnings: list[Violation] = []
    if not arch.is_moe:
        if par.ep not in (None, 1):
            errors.append(Violation("spec.parallelism.ep", f"ep={par.ep} but the model has no experts"))
        if par.moe_tp > 1:
            errors.append(Violation("spec.parallelism.moeTp", f"moeTp={par.moe_tp} but the model has no experts"))
        if eplb.redundant_experts:
            errors.append(Violation(
                "spec.eplb.redundantExperts",
                f"redundantExperts={eplb.redundant_experts} but the model has no experts",
            ))
        return errors, warnings
    stage = par.stage_size
    ep, mtp = par.ep_size, par.moe_tp
    if stage % (ep * mtp):
        errors.append(Violation(
            "spec.parallelism.ep",
            f"ep * moeTp = {ep} * {mtp} = {ep * mtp} must divide the {stage} ranks of a stage "
            f"(dpa * cp * tp = {par.dpa} * {par.cp} * {par.tp})",
        ))
    slots = arch.num_experts + eplb.redundant_experts
    if slots % ep:
        errors.append(Violation(
            "spec.eplb.redundantExperts" if eplb.redundant_experts else "spec.parallelism.ep",
            f"numExperts + redundantExperts = {arch.num_experts} + {eplb.redundant_experts} = {slots} "
            f"expert slots are not divisible by ep={ep}",
        ))
    el = spec.elastic
    if par.ep is None and el.max_dpa - el.min_dpa <= 64:
        per_group = par.cp * par.tp // max(1, mtp)
        stuck = [d for d in range(el.min_dpa, el.max_dpa + 1) if d != par.dpa and slots % max(1, d * per_group)]
        if stuck:
            warnings.append(Violation(
                "spec.elastic",
                f"{slots} expert slots do not divide over ep = dpa * {per_group} for dpa in {stuck[:8]}: "
                f"elastic scaling to {'those sizes' if len(stuck) > 1 else 'that size'} will be refused "
                "(choose redundantExperts so that every size in minDpa..maxDpa divides the slots)",
            ))
    if arch.moe_intermediate_size % mtp:
        errors.append(Violation(
            "spec.parallelism.moeTp",
            f"moeIntermediateSize={arch.moe_intermediate_size} is not divisible by moeTp={mtp}",
        ))
    if arch.num_experts % arch.num_expert_groups:
        errors.append(Violation(
            "spec.model.architecture.numExpertGroups",
            f"numExperts={arch.num_experts} is not divisible by numExpertGroups={arch.num_expert_groups}",
        ))
    if eplb.min_distinct > 1 and not (ep >= 2 and eplb.redundant_experts >= arch.num_experts):
        warnings.append(Violation(
            "spec.eplb.minDistinct",
            f"minDistinct=2 needs ep >= 2 and redundantExperts >= numExperts={arch.num_experts} "
            f"(ep={ep}, redundantExperts={eplb.redundant_experts}): some experts will have one copy",
        ))
    return errors, warnings


def _check_pods(spec: InferenceDeploymentSpec) -> list[Violation]:
    par, gpn = spec.parallelism, spec.hardware.gpus_per_node
    errors: list[Violation] = []
    if par.tp > gpn:
        errors.append(Violation(
            "spec.parallelism.tp", f"tp={par.tp} exceeds gpusPerNode={gpn}: a TP group must sit in one node"
        ))
    world = par.world_size
    if world > gpn:
        if world % gpn:
            errors.append(Violation(
                "spec.hardware.gpusPerNode",
                f"world size {world} (pp*dpa*cp*tp) is larger than gpusPerNode={gpn} and not a multiple of it",
            ))
        if par.tp <= gpn and gpn % par.tp:
            errors.append(Violation(
                "spec.hardware.gpusPerNode",
                f"gpusPerNode={gpn} is not divisible by tp={par.tp}: a TP group would span two pods",
            ))
    return errors


def _check_positions(spec: InferenceDeploymentSpec, arch: ModelArchitecture) -> list[Violation]:
    """A maxModelLen beyond the positions the model was trained for: vLLM refuses it, and the reference runtime
    would serve positions the model never saw."""
    asked, positions = spec.serving.max_model_len, arch.max_position_embeddings
    if asked is None or not positions or asked <= positions:
        return []
    return [Violation("spec.serving.maxModelLen", f"{asked} exceeds the model's max_position_embeddings {positions} "
                      f"(set at most {positions}, or leave it out to get {positions})")]


def _check_mla_runtime(spec: InferenceDeploymentSpec, arch: ModelArchitecture) -> list[Violation]:
    """What the reference runtime does not run yet for an MLA checkpoint (deepseek_v3, kimi_k2): prefill context
    parallelism (its decode CP splits the latent cache). Refused at admission rather than by a crashed rank."""
    par = spec.parallelism
    if (arch.attention_type is not AttentionType.MLA or not arch.family or par.cp == 1
            or par.cp_mode is not CpMode.PCP or spec.runtime.engine is not Engine.REFERENCE):
        return []
    return [Violation("spec.parallelism.cpMode", f"the reference runtime does not run prefill context parallelism "
                      f"(cpMode pcp) for MLA checkpoints ({arch.family}) yet: use cpMode dcp, which splits the "
                      "latent KV cache by position")]


def _check_cp(spec: InferenceDeploymentSpec, s: int) -> tuple[list[Violation], list[Violation]]:
    par = spec.parallelism
    errors: list[Violation] = []
    warnings: list[Violation] = []
    if par.cp == 1:
        return errors, warnings
    f = "spec.parallelism.cpLayout"
    if par.cp_layout is CpLayout.ZIGZAG:
        if par.cp_mode is CpMode.DCP:
            errors.append(Violation(
                f, "zigzag needs a fixed sequence length, but decode CP (cpMode dcp) grows the sequence; "
                "use striped",
            ))
        if s % (2 * par.cp):
            errors.append(Violation(
                f, f"zigzag needs maxModelLen % (2*cp) == 0: maxModelLen={s}, 2*cp={2 * par.cp}"
            ))
    elif par.cp_layout is CpLayout.CONTIGUOUS:
        if s % par.cp:
            errors.append(Violation(f, f"contiguous needs maxModelLen % cp == 0: maxModelLen={s}, cp={par.cp}"))
        else:
            ratio = cplayout.imbalance(s, par.cp, CpLayout.CONTIGUOUS)
            warnings.append(Violation(
                f, f"contiguous layout is unbalanced under causal attention: the busiest of cp={par.cp} "
                f"ranks does {ratio:.2f}x the mean work at maxModelLen={s}; zigzag or striped balance it",
            ))
    if par.cp * par.tp > spec.hardware.gpus_per_node:
        warnings.append(Violation(
            "spec.parallelism.cp",
            f"cp*tp = {par.cp * par.tp} > gpusPerNode={spec.hardware.gpus_per_node}: CP traffic crosses pods",
        ))
    return errors, warnings


#: the most ranks the operator plans in one world: its plan ConfigMap (about 420 bytes a rank) stays under the
#: API server's 1 MiB object limit, and 2,048 GPUs is 256 nodes of 8
MAX_WORLD_SIZE = 2048


def _check_size(spec: InferenceDeploymentSpec) -> tuple[list[Violation], list[Violation]]:
    """(errors, warnings): a world beyond MAX_WORLD_SIZE is refused; a maxDpa that would pass it is a warning
    (a scale that far is refused when it is asked for, with this message)."""
    par, el = spec.parallelism, spec.elastic
    per_group = par.pp * par.cp * par.tp
    if per_group * par.dpa > MAX_WORLD_SIZE:
        return [Violation("spec.parallelism", f"pp*dpa*cp*tp = {par.pp}*{par.dpa}*{par.cp}*{par.tp} = "
                          f"{per_group * par.dpa:,} ranks; the operator plans at most {MAX_WORLD_SIZE:,}")], []
    if per_group * el.max_dpa > MAX_WORLD_SIZE:
        return [], [Violation("spec.elastic.maxDpa", f"maxDpa={el.max_dpa} would grow the world to "
                              f"pp*maxDpa*cp*tp = {per_group * el.max_dpa:,} ranks; the operator plans at most "
                              f"{MAX_WORLD_SIZE:,}, so dpa stops at {max(1, MAX_WORLD_SIZE // per_group)}")]
    return [], []


def _check_autoscaling(spec: InferenceDeploymentSpec) -> list[Violation]:
    """A user's load query must be one the autoscaler can scope to the deployment's own series."""
    query = spec.autoscaling.query
    if not query:
        return []
    try:
        promql.selectors(query)
    except promql.PromQLError as e:
        return [Violation("spec.autoscaling.query", str(e))]
    return []


def _check_elastic(spec: InferenceDeploymentSpec) -> list[Violation]:
    el, dpa = spec.elastic, spec.parallelism.dpa
    if el.min_dpa > el.max_dpa:
        return [Violation("spec.elastic.minDpa", f"minDpa={el.min_dpa} > maxDpa={el.max_dpa}")]
    if not el.min_dpa <= dpa <= el.max_dpa:
        return [Violation(
            "spec.parallelism.dpa", f"dpa={dpa} is outside elastic.minDpa..maxDpa = {el.min_dpa}..{el.max_dpa}"
        )]
    return []


def _check_memory(spec: InferenceDeploymentSpec, gpu: GpuSpec, ledgers: tuple[LedgerEntry, ...],
                  s: int) -> list[Violation]:
    errors: list[Violation] = []
    frac, cp = spec.serving.memory_fraction, spec.parallelism.cp
    for stage, e in enumerate(ledgers):
        where = f"a rank of stage {stage}" if len(ledgers) > 1 else "each rank"
        if e.fixed_bytes > e.budget_bytes:
            errors.append(Violation(
                "spec.parallelism",
                f"{where} needs {_gib(e.weights_bytes)} weights + {_gib(e.activation_bytes)} activations + "
                f"{_gib(e.workspace_bytes)} workspace = {_gib(e.fixed_bytes)}, more than its budget "
                f"{_gib(e.budget_bytes)} ({gpu.name} {_gib(gpu.memory_bytes)} x memoryFraction {frac})",
            ))
        elif e.kv_capacity_requests < 1:
            need = math.ceil(s / cp)
            errors.append(Violation(
                "spec.serving.maxModelLen",
                f"{where} has room for {e.kv_capacity_tokens} KV tokens ({_gib(e.kv_cache_bytes)}) but one "
                f"request of maxModelLen={s} needs {need} on it ({_gib(need * e.kv_bytes_per_token)})",
            ))
    return errors


def _fits(p: Plan) -> bool:
    """Every stage's weights, activations and workspace fit its budget with room for one request."""
    return bool(p.stage_ledger) and all(e.fixed_bytes <= e.budget_bytes and e.kv_capacity_requests >= 1
                                        for e in p.stage_ledger)


def _candidates(spec: InferenceDeploymentSpec, arch: ModelArchitecture) -> list[tuple[str, InferenceDeploymentSpec]]:
    """Single changes that shrink what one rank holds: a smaller dtype, more tp (within a node, dividing the
    heads), more pp (up to one layer per stage), and for a MoE model more dpa (ep grows with it)."""
    par, out = spec.parallelism, []
    if spec.model.dtype.nbytes > 1:
        model = spec.model.model_copy(update={"dtype": DType.FP8})
        out.append(("dtype fp8", spec.model_copy(update={"model": model})))
    tp = par.tp * 2
    while tp <= spec.hardware.gpus_per_node and arch.num_heads % tp == 0:
        out.append((f"tp={tp}", spec.model_copy(update={"parallelism": par.model_copy(update={"tp": tp})})))
        tp *= 2
    for pp in range(par.pp + 1, min(arch.num_layers, 64 * par.pp) + 1):
        out.append((f"pp={pp}", spec.model_copy(update={"parallelism": par.model_copy(update={"pp": pp})})))
    if arch.is_moe and par.ep is None:
        dpa = par.dpa * 2
        while dpa <= 64 * par.dpa:
            grown = spec.model_copy(update={
                "parallelism": par.model_copy(update={"dpa": dpa}),
                "elastic": spec.elastic.model_copy(update={"max_dpa": max(dpa, spec.elastic.max_dpa)})})
            out.append((f"dpa={dpa}", grown))
            dpa *= 2
    return out


def _what_fits(spec: InferenceDeploymentSpec, arch: ModelArchitecture, gpu: GpuSpec) -> str:
    """The smallest single changes (fewest GPUs, then the order tried) after which a rank fits, with the
    numbers; at most one per kind of change and three in all."""
    found: list[tuple[int, int, str]] = []
    kinds: set[str] = set()
    for order, (label, candidate) in enumerate(_candidates(spec, arch)):
        kind = label.split("=")[0].split()[0]
        if kind in kinds:
            continue
        p = plan(candidate, suggest=False)
        if _fits(p):
            kinds.add(kind)
            busiest = max(e.fixed_bytes for e in p.stage_ledger)
            ep = f"ep {candidate.parallelism.ep_size}, " if kind == "dpa" else ""
            found.append((p.world_size, order, f"{label} ({ep}{p.world_size} GPUs, {_gib(busiest)} fixed per rank)"))
    if not found:
        knobs = ["a smaller dtype" if spec.model.dtype.nbytes > 1 else "", "more tp" if
                 spec.parallelism.tp * 2 <= spec.hardware.gpus_per_node else "", "more pp",
                 "more dpa" if arch.is_moe else ""]
        return f"no single change ({', '.join(k for k in knobs if k)}) fits on {gpu.name}: use a larger GPU"
    return "it fits with " + " or ".join(text for _, _, text in sorted(found)[:3])


def _gib(n: int | float) -> str:
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB"


# ----------------------------------------------------------------------------------------------- plan


def stage_layers(num_layers: int, pp: int) -> tuple[range, ...]:
    """Contiguous layers per stage; the first `num_layers % pp` stages hold one more."""
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return tuple(out)


def _links(gpu: GpuSpec, grid: RankGrid, gpus_per_pod: int) -> Links:
    def bw(group: list[int]) -> float:
        same_pod = len({r // gpus_per_pod for r in group}) == 1
        return gpu.link_bandwidth_one_way if same_pod else gpu.network_bandwidth

    return Links(
        tp=bw(grid.tp_groups()[0].tolist()),
        cp=bw(grid.cp_groups()[0].tolist()),
        ep=bw(grid.ep_groups()[0].tolist()),
        pp=bw(grid.pp_groups()[0].tolist()) if grid.pp > 1 else gpu.link_bandwidth_one_way,
    )


def _checkpoint_architecture(spec: InferenceDeploymentSpec) -> ModelArchitecture | Violation:
    """The architecture of `spec.model.source` read from its config.json, where this process can read it."""
    from shardwise import checkpoint

    source = spec.model.source
    assert source is not None
    if source.path is None:
        return Violation("spec.model.architecture", "the operator cannot read a PVC: give the architecture "
                         "(`shardwise model inspect DIR` prints the block to paste)")
    directory = Path(source.path)
    if not (directory / checkpoint.CONFIG).is_file():
        return Violation("spec.model.architecture", f"{source.path}/config.json cannot be read here: give the "
                         "architecture (`shardwise model inspect DIR` prints the block to paste)")
    try:
        return checkpoint.architecture_from_config(checkpoint.read_config(directory))
    except checkpoint.CheckpointError as e:
        return Violation("spec.model.source.path", str(e))


def resolve(spec: InferenceDeploymentSpec) -> tuple[str, ModelArchitecture | None, GpuSpec | None, list[Violation]]:
    """The model architecture and GPU of a spec, or violations naming the unknown presets."""
    errors: list[Violation] = []
    arch: ModelArchitecture | None
    if spec.model.architecture is not None:
        name, arch = "inline", spec.model.architecture
    elif spec.model.source is not None:
        name, arch = "checkpoint", None
        violation = _checkpoint_architecture(spec)
        if isinstance(violation, Violation):
            errors.append(violation)
        else:
            arch = violation
    else:
        name = spec.model.preset or ""
        try:
            arch = model_preset(name)
        except UnknownPreset as e:
            arch = None
            errors.append(Violation("spec.model.preset", e.message))
    try:
        gpu: GpuSpec | None = gpu_preset(spec.hardware.gpu)
    except UnknownPreset as e:
        gpu = None
        errors.append(Violation("spec.hardware.gpu", e.message))
    return name, arch, gpu, errors


def max_model_len(spec: InferenceDeploymentSpec, arch: ModelArchitecture | None) -> int:
    """The longest request a deployment serves: spec.serving.maxModelLen, else the model's maxPositionEmbeddings
    (a checkpoint's config.json, a preset's), else DEFAULT_MAX_MODEL_LEN."""
    if spec.serving.max_model_len is not None:
        return spec.serving.max_model_len
    if arch is not None and arch.max_position_embeddings:
        return arch.max_position_embeddings
    return DEFAULT_MAX_MODEL_LEN


def plan(spec: InferenceDeploymentSpec, workload: Workload | None = None, *, suggest: bool = True) -> Plan:
    """Validate and lay out a spec. Never raises for a bad layout: the Plan carries the violations. Where the
    weights do not fit, `suggest` names the smallest changes that do (it plans each candidate)."""
    name, arch, gpu, errors = resolve(spec)
    s = max_model_len(spec, arch)
    workload = workload or Workload(context=min(4096, s))
    warnings: list[Violation] = []
    too_big, warnings = _check_size(spec)
    if too_big:  # no rank table is built for a world this large
        return Plan(spec, name, tuple(errors + too_big), tuple(warnings), arch, gpu, workload=workload,
                    max_model_len=s)
    errors += _check_pods(spec) + _check_elastic(spec) + _check_autoscaling(spec)
    cp_err, cp_warn = _check_cp(spec, s)
    errors += cp_err
    warnings += cp_warn
    if arch is None or gpu is None:
        return Plan(spec, name, tuple(errors), tuple(warnings), arch, gpu, workload=workload, max_model_len=s)
    errors += _check_positions(spec, arch) + _check_mla_runtime(spec, arch)
    structural: list[Violation] = []
    for check in (_check_attention(arch, spec.parallelism), _check_layers(arch, spec.parallelism),
                  _check_experts(arch, spec)):
        structural += check[0]
        warnings += check[1]
    if structural:
        # Shards are not well defined (heads, layers or experts do not divide): no ledger to show.
        return Plan(spec, name, tuple(errors + structural), tuple(warnings), arch, gpu, workload=workload,
                    max_model_len=s)
    return _layout(spec, name, arch, gpu, workload, errors, warnings, suggest, s)


def _layout(
    spec: InferenceDeploymentSpec, name: str, arch: ModelArchitecture, gpu: GpuSpec, workload: Workload,
    errors: list[Violation], warnings: list[Violation], suggest: bool, s: int,
) -> Plan:
    par = spec.parallelism
    grid = RankGrid(pp=par.pp, dpa=par.dpa, cp=par.cp, tp=par.tp, ep=par.ep_size, moe_tp=par.moe_tp)
    gpus_per_pod = min(spec.hardware.gpus_per_node, grid.world_size)
    stages = stage_layers(arch.num_layers, par.pp)
    slots = arch.num_experts + spec.eplb.redundant_experts if arch.is_moe else 0
    b, kv_b = spec.model.dtype.nbytes, spec.model.kv_dtype.nbytes
    shards = tuple(
        Sharding(
            tp=par.tp, cp=par.cp, dpa=par.dpa, pp=par.pp, ep=par.ep_size, moe_tp=par.moe_tp,
            ep_replicas=grid.ep_replicas, expert_slots=slots, layers=len(layers),
            moe_layers=sum(1 for i in layers if arch.is_moe_layer(i)),
            first_stage=i == 0, last_stage=i == par.pp - 1,
        )
        for i, layers in enumerate(stages)
    )
    ledgers = tuple(
        ledger_entry(
            arch, sh, memory_bytes=gpu.memory_bytes, memory_fraction=spec.serving.memory_fraction,
            max_batch_tokens=spec.serving.max_batch_tokens, max_model_len=s,
            workspace_bytes=spec.serving.workspace_mib * MiB, weight_dtype_bytes=b, kv_dtype_bytes=kv_b,
        )
        for sh in shards
    )
    memory = _check_memory(spec, gpu, ledgers, s)
    if suggest and any(e.fixed_bytes > e.budget_bytes for e in ledgers):
        hint = _what_fits(spec, arch, gpu)
        memory = [Violation(v.field, f"{v.message}; {hint}") if v.field == "spec.parallelism" else v
                  for v in memory]
    errors = errors + memory
    links = _links(gpu, grid, gpus_per_pod)
    busiest = _busiest_cp_work(par, workload)
    traffics = tuple(traffic(arch, sh, workload, b, kv_b) for sh in shards)
    estimates = tuple(
        estimate(arch, sh, workload, b=b, kv_b=kv_b, peak_flops=gpu.peak_flops,
                 hbm_bandwidth=gpu.hbm_bandwidth, links=links, cp_keys_busiest=busiest)
        for sh in shards
    )
    return Plan(
        spec=spec, model_name=name, errors=tuple(errors), warnings=tuple(warnings), arch=arch, gpu=gpu,
        grid=grid, gpus_per_pod=gpus_per_pod, stage_layers=stages, stage_ledger=ledgers,
        workload=workload, stage_traffic=traffics, stage_estimates=estimates, stage_shards=shards,
        links=links, max_model_len=s,
    )


def _busiest_cp_work(par: ParallelismSpec, workload: Workload) -> float:
    """Causal K/V positions the busiest CP rank processes for one prefill sequence (0 for decode)."""
    if workload.phase is not Phase.PREFILL:
        return 0.0
    layout = par.cp_layout if par.cp > 1 else CpLayout.STRIPED
    try:
        return float(max(cplayout.causal_work(workload.context, par.cp, layout)))
    except ValueError:  # the workload's length does not suit the layout: assume a balanced split
        return workload.context * (workload.context + 1) / 2 / par.cp
