"""Layout search: every valid layout of a model on N GPUs, ranked by a Pareto front.

For each layout (tp, pp, cp, dpa, moeTp with `tp * pp * cp * dpa = N`) the planner validates it and
sizes its KV cache; then decode batches `B = 1, 2, 4, ...` up to the KV capacity at the given context
give points (tokens/s per GPU, tokens/s per user) from the roofline step estimate. A point is on the
front when no other point is at least as good on both axes and better on one. Throughput per GPU is what
a fleet pays for; speed per user is what a user feels; the front is the menu between them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.api import (
    API_VERSION,
    KIND,
    MAX_NAME,
    DType,
    ElasticSpec,
    HardwareSpec,
    InferenceDeploymentSpec,
    ModelSource,
    ModelSpec,
    ParallelismSpec,
    ServingSpec,
)
from shardwise.cost import Phase, Workload
from shardwise.planner import Plan, plan
from shardwise.presets import gpu_preset, model_preset


@dataclass(frozen=True)
class Point:
    tp: int
    pp: int
    cp: int
    dpa: int
    moe_tp: int
    batch: int
    step_seconds: float
    tokens_per_second_per_gpu: float
    tokens_per_second_per_user: float
    kv_capacity_requests: int

    def layout(self) -> str:
        s = f"tp={self.tp} dpa={self.dpa} pp={self.pp} cp={self.cp}"
        return s + (f" moeTp={self.moe_tp}" if self.moe_tp > 1 else "")


@dataclass(frozen=True)
class SearchResult:
    layouts_tried: int
    layouts_valid: int
    points: tuple[Point, ...]
    front: tuple[Point, ...]  # sorted by tokens/s per user, ascending
    model: ModelSpec | None = None  # what every layout was planned with
    hardware: HardwareSpec | None = None
    serving: ServingSpec | None = None
    context: int = 4096  # tokens in the KV cache of the decode workload every layout was measured at


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(num_layers: int, gpus: int, gpus_per_node: int, moe: bool) -> list[ParallelismSpec]:
    out = []
    for tp in _divisors(gpus):
        if tp > gpus_per_node or (gpus > gpus_per_node and gpus_per_node % tp):
            continue
        for pp in _divisors(gpus // tp):
            if pp > num_layers:
                continue
            for cp in _divisors(gpus // (tp * pp)):
                dpa = gpus // (tp * pp * cp)
                stage = dpa * cp * tp
                for moe_tp in _divisors(stage) if moe else [1]:
                    if moe_tp > gpus_per_node:
                        continue
                    out.append(ParallelismSpec(tp=tp, pp=pp, cp=cp, dpa=dpa, moe_tp=moe_tp))
    return out


def pareto(points: list[Point]) -> list[Point]:
    ordered = sorted(points, key=lambda p: (-p.tokens_per_second_per_user, -p.tokens_per_second_per_gpu))
    front: list[Point] = []
    best_gpu = -1.0
    for p in ordered:
        if p.tokens_per_second_per_gpu > best_gpu:
            front.append(p)
            best_gpu = p.tokens_per_second_per_gpu
    return sorted(front, key=lambda p: p.tokens_per_second_per_user)


def search(
    model: str,
    gpu: str,
    gpus: int,
    *,
    gpus_per_node: int | None = None,
    context: int | None = None,
    max_model_len: int | None = None,
    dtype: DType = DType.BFLOAT16,
    max_batch: int = 4096,
) -> SearchResult:
    """`model` is a preset name or a Hugging Face checkpoint directory (its config.json). `context` defaults to
    min(4096, the model's maxPositionEmbeddings) and `max_model_len` to `context`. Raises UnknownPreset for unknown
    names, CheckpointError for an unreadable checkpoint and ValueError for a GPU count below 1 or a length beyond
    the model's positions."""
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    from shardwise import checkpoint

    directory = Path(model)
    if directory.is_dir():
        arch = checkpoint.architecture_from_config(checkpoint.read_config(directory))
        model_spec = ModelSpec(source=ModelSource(path=str(directory.resolve())), architecture=arch, dtype=dtype)
    else:
        arch = model_preset(model)
        model_spec = ModelSpec(preset=model, dtype=dtype)
    gpn = gpus_per_node or gpu_preset(gpu).default_gpus_per_node
    gpn = min(gpn, gpus)
    positions = arch.max_position_embeddings
    context = context or min(4096, positions or 4096)
    for flag, length in (("--context", context), ("maxModelLen", max_model_len)):
        if positions and length is not None and length > positions:
            raise ValueError(f"{flag} {length} exceeds the model's max_position_embeddings {positions}")
    serving = ServingSpec(max_model_len=max_model_len or context)
    tried = valid = 0
    points: list[Point] = []
    for par in layouts(arch.num_layers, gpus, gpn, arch.is_moe):
        tried += 1
        spec = InferenceDeploymentSpec(
            model=model_spec,
            hardware=HardwareSpec(gpu=gpu, gpus_per_node=gpn),
            parallelism=par,
            serving=serving,
            elastic=ElasticSpec(min_dpa=1, max_dpa=max(par.dpa, 1)),
        )
        p: Plan = plan(spec, Workload(Phase.DECODE, 1, context), suggest=False)
        if not p.valid:
            continue
        valid += 1
        cap = p.capacity()["requestsPerDpaGroup"]
        batch = 1
        while batch <= min(cap, max_batch):
            step = p.step_seconds(Workload(Phase.DECODE, batch, context))
            points.append(Point(
                tp=par.tp, pp=par.pp, cp=par.cp, dpa=par.dpa, moe_tp=par.moe_tp, batch=batch,
                step_seconds=step,
                tokens_per_second_per_gpu=batch * par.dpa / step / gpus,
                tokens_per_second_per_user=1.0 / (par.pp * step),
                kv_capacity_requests=cap * par.dpa,
            ))
            batch *= 2
    return SearchResult(tried, valid, tuple(points), tuple(pareto(points)), model_spec,
                        HardwareSpec(gpu=gpu, gpus_per_node=gpn), serving, context)


_NAME = re.compile(r"[^a-z0-9-]+")


def deployment_name(model: str) -> str:
    """A DNS-1123 name from a preset name or a checkpoint directory: `Qwen3-30B-A3B` -> `qwen3-30b-a3b`."""
    base = _NAME.sub("-", Path(model).name.lower().replace(".", "-")).strip("-")
    return base[:MAX_NAME].rstrip("-") or "model"


def manifest(result: SearchResult, point: Point, name: str) -> dict[str, Any]:
    """An InferenceDeployment serving `point` of the front: the model, GPUs and serving limits the search
    planned it with, its layout, `maxRunning` = the point's batch per group, and elastic room from one group
    to its dpa."""
    assert result.model is not None and result.hardware is not None and result.serving is not None
    parallelism: dict[str, Any] = {"tp": point.tp, "dpa": point.dpa, "pp": point.pp}
    if point.cp > 1:
        parallelism["cp"] = point.cp
    if point.moe_tp > 1:
        parallelism["moeTp"] = point.moe_tp
    return {
        "apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name},
        "spec": {
            "model": result.model.model_dump(mode="json", by_alias=True, exclude_defaults=True,
                                             exclude_none=True) | {"dtype": result.model.dtype.value},
            "hardware": result.hardware.model_dump(mode="json", by_alias=True, include={"gpu", "gpus_per_node"}),
            "parallelism": parallelism,
            "serving": {"maxModelLen": result.serving.max_model_len, "maxRunning": min(point.batch, 65536)},
            "elastic": {"minDpa": 1, "maxDpa": point.dpa},
        },
    }
