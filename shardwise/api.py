"""The `InferenceDeployment` API (`shardwise.io/v1alpha1`) as pydantic v2 models.

These models are the one source of the CRD schema (`shardwise crd`, `make crds`): every field carries a
description and a default, and the YAML a user writes uses the camelCase aliases (`gpusPerNode`, not
`gpus_per_node`). Python code reads the snake_case attribute names.

Parallelism glossary (the planner in `shardwise.planner` turns these into a rank grid):

- `tp`   attention tensor parallelism inside one attention group (heads split over `tp` GPUs of one pod);
- `dpa`  attention data parallelism: the number of attention groups per pipeline stage, each serving its
         own requests with its own KV cache (the elastic dimension, also the scale subresource);
- `cp`   context parallelism: the sequence of one request split over `cp` ranks (`pcp` for prefill,
         `dcp` for decode), laid out `contiguous`, `zigzag` or `striped`;
- `pp`   pipeline stages (contiguous layers);
- `ep`   expert parallelism of the MoE layers; by default every rank of a stage (`dpa * cp * tp`);
- `moeTp` tensor parallelism inside one expert (`ep * moeTp` ranks hold one copy of the experts).

World size = `pp * dpa * cp * tp`.
"""

from __future__ import annotations

import re
from enum import StrEnum
from fractions import Fraction
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

GROUP = "shardwise.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ("idep",)


_NUMBERS = (int, float, int | None, float | None)
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
RFC1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # namespaces, volumes: may start with a digit
MAX_NAME = 52  # pod, Service and ConfigMap names add suffixes such as "-router" and "-pod-12" to it


def dns_label_error(name: str) -> str:
    """Why `name` cannot name a deployment (its objects' names and Services derive from it), or ""."""
    if len(name) > MAX_NAME:
        return f"{len(name)} characters; at most {MAX_NAME}"
    if not _DNS_LABEL.match(name):
        return "lowercase letters, digits and '-', starting with a letter and ending with a letter or digit"
    return ""


class _Model(BaseModel):
    """Base: camelCase aliases, population by either name, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_not_booleans(cls, data: Any) -> Any:
        """YAML's `true` is not the number 1: a boolean given for a number field is refused by name."""
        if isinstance(data, dict):
            for name, f in cls.model_fields.items():
                key = f.alias or name
                value = data.get(key, data.get(name))
                if isinstance(value, bool) and f.annotation in _NUMBERS:
                    raise ValueError(f"{key} must be a number, got {str(value).lower()}")
        return data


class AttentionType(StrEnum):
    GQA = "gqa"
    MHA = "mha"
    MLA = "mla"


class DType(StrEnum):
    FLOAT32 = "float32"
    FLOAT64 = "float64"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FP8 = "fp8"

    @property
    def nbytes(self) -> int:
        return {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "fp8": 1}[self.value]


#: a field's JSON schema key saying the CRD carries no default for it: the default depends on other fields, so the
#: API server must not store one (the model's validators fill it in)
NO_CRD_DEFAULT = "x-shardwise-no-crd-default"

#: the longest string a spec field takes unless the field says otherwise (the CRD carries it as maxLength)
MAX_STRING = 4096


class _Spec(_Model):
    """Base of what users write: every string bounded (status, written by the operator, is not)."""

    model_config = ConfigDict(str_max_length=MAX_STRING)


class YarnScaling(_Spec):
    """YaRN RoPE scaling (`rope_scaling`/`rope_parameters` with rope_type yarn), as the DeepSeek-V3 family uses it:
    per-frequency interpolation between the original and the `factor`-stretched wavelengths, cos/sin scaled by
    an attention factor, and (MLA) the softmax scale multiplied by mscale(factor, mscaleAllDim)^2."""

    factor: float = Field(gt=0, description="Context extension factor (positions / original positions).")
    original_max_position_embeddings: int = Field(ge=1, description="Positions the model was pretrained for.")
    beta_fast: float = Field(default=32.0, gt=0, description="Rotations above which a frequency is kept as is.")
    beta_slow: float = Field(default=1.0, gt=0, description="Rotations below which a frequency is interpolated.")
    mscale: float = Field(default=0.0, ge=0, description="mscale of the cos/sin attention factor (0: not set).")
    mscale_all_dim: float = Field(
        default=0.0, ge=0, description="mscale of the softmax scale and of the attention factor's denominator "
        "(0: not set)."
    )
    attention_factor: float = Field(default=0.0, ge=0, description="cos/sin scale given outright (0: derived).")
    truncate: bool = Field(default=True, description="Round the correction range to whole dimensions.")


class ModelArchitecture(_Spec):
    """The shape of a transformer, enough to shard it and to count its bytes and FLOPs."""

    num_layers: int = Field(ge=1, description="Transformer blocks.")
    hidden_size: int = Field(ge=1, description="Model width D.")
    vocab_size: int = Field(ge=1, description="Vocabulary size (embedding and LM head rows).")
    attention_type: AttentionType = Field(
        default=AttentionType.GQA, description="gqa, mha (KV heads = Q heads) or mla (latent KV cache)."
    )
    num_heads: int = Field(ge=1, description="Query heads.")
    num_kv_heads: int = Field(
        default=0, ge=0, description="KV heads for gqa/mha (0 means equal to numHeads); ignored for mla."
    )
    head_dim: int = Field(default=0, ge=0, description="Dimension of one head (0 means hiddenSize / numHeads).")
    q_lora_rank: int = Field(default=0, ge=0, description="MLA: rank of the query down-projection (0: none).")
    kv_lora_rank: int = Field(default=0, ge=0, description="MLA: rank of the compressed KV latent.")
    rope_head_dim: int = Field(default=0, ge=0, description="MLA: decoupled RoPE key dimension.")
    nope_head_dim: int = Field(default=0, ge=0, description="MLA: non-RoPE query/key dimension per head.")
    v_head_dim: int = Field(default=0, ge=0, description="MLA: value dimension per head.")
    intermediate_size: int = Field(default=0, ge=0, description="Dense FFN width (SwiGLU) of dense layers.")
    num_experts: int = Field(default=0, ge=0, description="Routed experts per MoE layer (0: dense model).")
    top_k: int = Field(default=0, ge=0, description="Experts chosen per token.")
    moe_intermediate_size: int = Field(default=0, ge=0, description="Width of one routed expert.")
    num_shared_experts: int = Field(default=0, ge=0, description="Shared experts every token passes through.")
    shared_intermediate_size: int = Field(
        default=0, ge=0, description="Width of one shared expert (0 means moeIntermediateSize)."
    )
    first_dense_layers: int = Field(
        default=0, ge=0, description="Leading layers that use the dense FFN instead of experts."
    )
    num_expert_groups: int = Field(default=1, ge=1, description="Expert groups for group-limited routing.")
    topk_groups: int = Field(default=1, ge=1, description="Groups a token may route to.")
    tie_word_embeddings: bool = Field(default=False, description="LM head shares the embedding weights.")
    family: str = Field(
        default="", max_length=64,
        description="Hugging Face model_type the runtime computes (llama, mistral, qwen3, qwen3_moe, mixtral, "
        "deepseek_v3, kimi_k2); "
        "empty for shardwise's seeded reference model.",
    )
    qk_norm: bool = Field(default=False, description="RMSNorm on each query and key head before RoPE (Qwen3).")
    norm_topk_prob: bool = Field(
        default=True, description="Renormalise the chosen experts' router probabilities to sum to 1."
    )
    rope_theta: float = Field(default=10000.0, gt=0, description="RoPE base frequency.")
    rope_interleave: bool = Field(
        default=False, description="RoPE rotates interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek-V3) instead of "
        "the two halves of a head."
    )
    rope_scaling: YarnScaling | None = Field(default=None, description="YaRN RoPE scaling (none: plain RoPE).")
    router_scoring: Literal["softmax", "sigmoid"] = Field(
        default="softmax", description="softmax: top-k of a softmax router; sigmoid (DeepSeek-V3): sigmoid scores, "
        "a per-expert correction bias that only chooses, group-limited top-k (numExpertGroups, topkGroups)."
    )
    routed_scaling_factor: float = Field(
        default=1.0, gt=0, description="Multiplies the routed experts' weights (DeepSeek-V3's routed_scaling_factor)."
    )
    max_position_embeddings: int = Field(
        default=0, ge=0,
        description="Positions the model was trained for (config.json's max_position_embeddings; 0: not known): "
        "serving.maxModelLen defaults to it and may not exceed it.",
    )
    rms_norm_eps: float = Field(default=1e-6, gt=0, description="RMSNorm epsilon.")

    @model_validator(mode="after")
    def _check_shape(self) -> ModelArchitecture:
        if self.head_dim == 0 and self.attention_type is not AttentionType.MLA and self.hidden_size < self.num_heads:
            raise ValueError(f"hiddenSize {self.hidden_size} is smaller than numHeads {self.num_heads}: each head "
                             f"would have 0 dimensions (set headDim, or a hiddenSize of at least numHeads)")
        if self.attention_type is not AttentionType.MLA and self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise ValueError(f"numHeads {self.num_heads} is not a multiple of numKvHeads {self.num_kv_heads}")
        if self.is_moe and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"topK must be within 1..numExperts={self.num_experts}, got {self.top_k}")
        if self.is_moe and self.moe_intermediate_size < 1:
            raise ValueError("moeIntermediateSize must be set for an MoE model (numExperts > 0)")
        if self.attention_type is AttentionType.MLA and (self.kv_lora_rank < 1 or self.v_head_dim < 1):
            raise ValueError("mla attention needs kvLoraRank and vHeadDim")
        if not self.is_moe and self.intermediate_size < 1:
            raise ValueError("a dense model (numExperts = 0) needs intermediateSize")
        if self.first_dense_layers > 0 and self.intermediate_size < 1:
            raise ValueError("firstDenseLayers > 0 needs intermediateSize")
        return self

    # Derived shape, in one place so the ledger, the cost model and the runtime agree.
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_heads(self) -> int:
        if self.attention_type is AttentionType.MHA or self.num_kv_heads == 0:
            return self.num_heads
        return self.num_kv_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head (MLA: nope + rope)."""
        if self.attention_type is AttentionType.MLA:
            return self.nope_head_dim + self.rope_head_dim
        return self.dim_head

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.attention_type is AttentionType.MLA else self.dim_head

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers if self.is_moe else 0

    @property
    def shared_width(self) -> int:
        return self.shared_intermediate_size or self.moe_intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.first_dense_layers


class PvcSource(_Spec):
    claim_name: str = Field(min_length=1, max_length=253, description="PersistentVolumeClaim holding the model.")
    sub_path: str = Field(default="", max_length=1024, description="Folder of the checkpoint within the volume.")


class ModelSource(_Spec):
    """Where worker pods find a Hugging Face checkpoint (config.json, *.safetensors, tokenizer.json)."""

    path: str | None = Field(
        default=None, max_length=4096,
        description="A host path, mounted read-only at the same path in worker pods (local cluster: pods see the "
        "host's files; the operator reads config.json there when it can).",
    )
    pvc: PvcSource | None = Field(default=None, description="A PVC mounted read-only into worker pods.")

    @model_validator(mode="after")
    def _one_place(self) -> ModelSource:
        if (self.path is None) == (self.pvc is None):
            raise ValueError("give exactly one of source.path and source.pvc")
        if self.path is not None and not self.path.startswith("/"):
            raise ValueError(f"source.path must be absolute, got {self.path!r}")
        return self

    @property
    def mount_path(self) -> str:
        """Where the checkpoint is seen inside a worker pod."""
        if self.path is not None:
            return self.path
        assert self.pvc is not None
        return "/models/" + self.pvc.claim_name + ("/" + self.pvc.sub_path.strip("/") if self.pvc.sub_path else "")


class ModelSpec(_Spec):
    source: ModelSource | None = Field(
        default=None,
        description="A Hugging Face checkpoint to serve. Its architecture is read from config.json where the "
        "operator can read the path; otherwise give `architecture` (`shardwise model inspect DIR` prints it) "
        "and the pods check the checkpoint against it before loading.",
    )
    served_name: str | None = Field(
        default=None, max_length=256,
        description="The model name of the OpenAI API (`model` in requests); default: the deployment's name.",
    )
    preset: str | None = Field(
        default=None,
        description="A model preset name (see `shardwise presets`), e.g. Qwen3-235B-A22B or tiny-moe.",
    )
    architecture: ModelArchitecture | None = Field(
        default=None, description="An inline architecture, used instead of a preset."
    )
    dtype: DType = Field(
        default=DType.BFLOAT16, json_schema_extra={NO_CRD_DEFAULT: True},
        description="Weight and activation dtype. Default: bfloat16 on a GPU; on gpu cpu float64 for the reference "
        "engine (its answers then equal transformers' float64 greedy decode) and float32 for vLLM (whose CPU build "
        "has no float64).")
    kv_cache_dtype: DType | None = Field(default=None, description="KV cache dtype (default: dtype).")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        if self.source is not None:
            if self.preset is not None:
                raise ValueError("give model.source or model.preset, not both")
        elif (self.preset is None) == (self.architecture is None):
            raise ValueError("give exactly one of model.preset, model.architecture and model.source")
        return self

    @property
    def kv_dtype(self) -> DType:
        return self.kv_cache_dtype or self.dtype


class Toleration(_Spec):
    key: str | None = Field(default=None, description="Taint key the toleration applies to.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, description="Taint value to match with Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match (empty matches all)."
    )
    toleration_seconds: int | None = Field(default=None, description="For NoExecute: how long to stay.")


class HardwareSpec(_Spec):
    gpu: str = Field(default="H200", description="A GPU preset name: H200, H100, B200, A100-80GB or cpu.")
    gpus_per_node: int = Field(
        default=8, ge=1, description="GPUs of one node slice; one worker pod holds this many."
    )
    resource_name: str = Field(
        default="nvidia.com/gpu", description="Extended resource a worker pod requests, gpusPerNode of it."
    )
    node_selector: dict[str, str] = Field(default_factory=dict, description="Node selector of worker pods.")
    tolerations: list[Toleration] = Field(default_factory=list, description="Tolerations of worker pods.")


class CpMode(StrEnum):
    PCP = "pcp"
    DCP = "dcp"


class CpLayout(StrEnum):
    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"
    STRIPED = "striped"


class CpComm(StrEnum):
    AG_RS = "ag_rs"
    A2A = "a2a"


class ParallelismSpec(_Spec):
    tp: int = Field(default=1, ge=1, description="Attention tensor parallelism within one attention group.")
    dpa: int = Field(
        default=1, ge=1, description="Attention data-parallel groups per stage (the elastic, scalable size)."
    )
    pp: int = Field(default=1, ge=1, description="Pipeline stages (contiguous layers each).")
    cp: int = Field(default=1, ge=1, description="Context parallelism: ranks that split one sequence.")
    cp_mode: CpMode = Field(default=CpMode.DCP, description="pcp (prefill, ring) or dcp (decode, KV shards).")
    cp_layout: CpLayout = Field(
        default=CpLayout.STRIPED, description="How positions map to CP ranks: contiguous, zigzag or striped."
    )
    cp_comm: CpComm = Field(
        default=CpComm.AG_RS, description="How decode CP merges its shards: ag_rs (all-gather Q and LSE, "
        "reduce-scatter O) or a2a (one all-to-all of partial O and LSE).",
    )
    ep: int | None = Field(
        default=None, ge=1, description="Expert parallelism; default all ranks of a stage divided by moeTp."
    )
    moe_tp: int = Field(default=1, ge=1, description="Tensor parallelism inside one routed expert.")

    @property
    def world_size(self) -> int:
        return self.pp * self.dpa * self.cp * self.tp

    @property
    def stage_size(self) -> int:
        return self.dpa * self.cp * self.tp

    @property
    def ep_size(self) -> int:
        return self.ep if self.ep is not None else max(1, self.stage_size // self.moe_tp)


class ServingSpec(_Spec):
    max_model_len: int | None = Field(
        default=None, ge=1,
        description="Longest request (prompt + output) in tokens, at most the model's maxPositionEmbeddings. "
        "Default: the model's maxPositionEmbeddings (4096 where the model does not say).",
    )
    max_batch_tokens: int = Field(
        default=8192, ge=1, description="Tokens one attention group runs in one forward step (sizes activations)."
    )
    memory_fraction: float = Field(
        default=0.9, gt=0, le=1, description="Share of each GPU's memory the runtime may use."
    )
    workspace_mib: int = Field(
        default=1024, ge=0, description="Reserve per GPU for communication buffers and graphs, MiB."
    )
    max_running: int | None = Field(
        default=None, ge=1, le=65536,
        description="Requests one attention group decodes at once; more wait in its queue (vLLM --max-num-seqs). "
        "Default: the engine's (64 reference, 256 vLLM).",
    )


class EplbSpec(_Spec):
    enabled: bool = Field(default=False, description="Rebalance experts from measured load.")
    redundant_experts: int = Field(
        default=0, ge=0, description="Extra expert slots per MoE layer across the EP group (replicas)."
    )
    balance_threshold: float = Field(
        default=1.2, ge=1, description="Rebalance when max/mean GPU load exceeds this."
    )
    interval_seconds: int = Field(default=300, ge=1, description="Rebalance at least this often while skewed.")
    window_steps: int = Field(default=1000, ge=1, description="Steps in the sliding expert-load window.")
    max_moves_per_rebalance: int | None = Field(
        default=None, ge=1, description="Cap on expert slots changed by one rebalance (all layers)."
    )
    min_distinct: int = Field(
        default=1, ge=1, le=2, description="2 keeps every expert on two GPUs so one lost rank loses none."
    )


class ScaleDownMode(StrEnum):
    DRAIN = "drain"
    ABORT = "abort"


class ScaleDownSpec(_Spec):
    mode: ScaleDownMode = Field(
        default=ScaleDownMode.DRAIN,
        description="drain: finish in-flight requests (cancel on timeout); abort: end them with an error.",
    )
    drain_timeout_seconds: int = Field(default=120, ge=1, description="How long a drain may wait.")


class ElasticSpec(_Spec):
    min_dpa: int = Field(default=1, ge=1, description="Fewest attention groups.")
    max_dpa: int = Field(default=64, ge=1, description="Most attention groups.")
    scale_down: ScaleDownSpec = Field(default_factory=ScaleDownSpec, description="How groups are removed.")
    operation_timeout_seconds: int = Field(
        default=600, ge=1, description="Deadline of one scale operation before it is rolled back."
    )
    max_unavailable_groups: int = Field(
        default=1, ge=1, le=4096,
        description="A pod template change that leaves the world's shape alone (image, env, resources, pod shape, "
        "scheduling) replaces this many DPA groups at a time, each drained first while the others serve (never "
        "every group of a world of more than one). Changes that reshape the world (model, layout, serving limits) "
        "replace every pod at once.",
    )
    standby_pods: int = Field(
        default=0, ge=0, le=16,
        description="Pods kept started beside the serving world, without ranks (their agents up and their rank "
        "processes' interpreter warm), each holding a pod's GPUs: the scale-up that replaces a lost pod, or any "
        "other, takes them before it creates a pod, which saves a pod's start. The reference engine with pp=1 "
        "only (where the world changes in place).",
    )


class AutoscalingSpec(_Spec):
    enabled: bool = Field(default=False, description="Let the autoscaler set parallelism.dpa.")
    prometheus_url: str = Field(
        default="http://prometheus:9090", max_length=2048, pattern=r"^https?://[^\s]+$",
        description="Prometheus HTTP API base URL (http:// or https:// only).",
    )
    query: str | None = Field(
        default=None, max_length=4096,
        description="PromQL giving the load; default: queue depth plus running requests. Every selector is "
        "limited to the deployment's own series (matchers on deployment and namespace are added, and refused "
        "in the query).",
    )
    target_per_dpa: float = Field(default=8.0, gt=0, description="Load one attention group should carry.")
    stabilization_window_seconds: int = Field(
        default=60, ge=0, description="A scale-down waits for the highest desire over this window."
    )
    cooldown_seconds: int = Field(default=120, ge=0, description="Minimum time between two scale decisions.")
    interval_seconds: int = Field(default=15, ge=1, description="How often the query runs.")


class Engine(StrEnum):
    REFERENCE = "reference"
    VLLM = "vllm"


class EnvVar(_Spec):
    name: str = Field(min_length=1, max_length=256, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$",
                      description="Variable name.")
    value: str = Field(default="", max_length=32768, description="Its value.")


class SecretKey(_Spec):
    name: str = Field(min_length=1, max_length=253, description="Secret in the deployment's namespace.")
    key: str = Field(default="api-key", min_length=1, max_length=253, description="Key within the Secret.")


WORKER_RESOURCES = ("cpu", "memory", "ephemeral-storage")
_QUANTITY = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))(?:[eE]([+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E))?")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(value: str | int | float) -> Fraction:
    """A Kubernetes quantity (`500m`, `2`, `16Gi`, `1e3`) as an exact number; ValueError names what is not one."""
    if isinstance(value, bool):
        raise ValueError(f"invalid quantity {value!r}")
    if isinstance(value, int | float):
        return Fraction(str(value))
    match = _QUANTITY.fullmatch(value.strip())
    if match is None:
        raise ValueError(f"invalid quantity {value!r} (a Kubernetes quantity is such as 500m, 4, 16Gi or 1e9)")
    number, exponent, suffix = match.groups()
    if suffix in _BINARY:
        return Fraction(number) * (1 << (10 * _BINARY[suffix]))
    power = int(exponent) if exponent is not None else _DECIMAL.get(suffix or "", 0)
    scale = Fraction(10 ** power) if power >= 0 else Fraction(1, 10 ** -power)
    return Fraction(number) * scale


class WorkerResources(_Spec):
    requests: dict[str, str] = Field(
        default_factory=dict, max_length=len(WORKER_RESOURCES),
        description="CPU, memory and ephemeral-storage each worker container requests (Kubernetes quantities, "
        "such as 8 or 64Gi); the GPUs are requested from hardware.gpusPerNode and resourceName.",
    )
    limits: dict[str, str] = Field(
        default_factory=dict, max_length=len(WORKER_RESOURCES),
        description="Their limits; each at least its request.",
    )

    @model_validator(mode="after")
    def _quantities(self) -> WorkerResources:
        errors: list[str] = []
        for what, values in (("requests", self.requests), ("limits", self.limits)):
            for key, value in values.items():
                if key not in WORKER_RESOURCES:
                    errors.append(f"{what}.{key}: only {', '.join(WORKER_RESOURCES)} can be set here (the GPUs "
                                  "come from hardware.gpusPerNode and hardware.resourceName)")
                    continue
                try:
                    if parse_quantity(value) < 0:
                        errors.append(f"{what}.{key}={value} is negative")
                except ValueError as e:
                    errors.append(f"{what}.{key}: {e}")
        if not errors:
            for key in sorted(set(self.requests) & set(self.limits)):
                if parse_quantity(self.requests[key]) > parse_quantity(self.limits[key]):
                    errors.append(f"requests.{key}={self.requests[key]} exceeds limits.{key}={self.limits[key]}")
        if errors:
            raise ValueError("; ".join(errors))
        return self


_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
RESERVED_PREFIXES = ("shardwise.io/", "app.kubernetes.io/")  # keys the operator sets on its pods
RESERVED_VOLUMES = ("model", "dshm", "agent-token", "api-key")  # volume names the operator uses
RESERVED_MOUNT = "/var/run/secrets/shardwise"  # where the operator mounts the pods' credentials
VOLUME_SOURCES = ("emptyDir", "hostPath", "configMap", "secret", "persistentVolumeClaim", "projected", "csi",
                  "ephemeral", "nfs", "downwardAPI", "image")


def _key_error(key: str) -> str:
    prefix, _, name = key.rpartition("/")
    if prefix and not _DNS_SUBDOMAIN.match(prefix):
        return f"{key!r}: the prefix {prefix!r} is not a DNS subdomain"
    if not _LABEL_NAME.match(name):
        return f"{key!r}: the name part must be 1-63 letters, digits, '-', '_' or '.', starting and ending with a " \
               "letter or digit"
    if key.startswith(RESERVED_PREFIXES):
        return f"{key!r}: keys under {' and '.join(RESERVED_PREFIXES)} are the operator's"
    return ""


class WorkerPodShape(_Spec):
    """What a workload needs on its worker pods beyond what the operator sets: merged into every generated pod
    (the operator's own labels, annotations, volumes and probes are never overridden)."""

    labels: dict[str, str] = Field(default_factory=dict, max_length=64, description="Extra pod labels.")
    annotations: dict[str, str] = Field(
        default_factory=dict, max_length=64, description="Extra pod annotations (e.g. for a service mesh or a "
        "log shipper).")
    shm_size: str | None = Field(
        default=None, description="Size of /dev/shm (a Kubernetes quantity such as 16Gi): an in-memory emptyDir "
        "mounted there, which NCCL and vLLM need beyond the container runtime's 64 MiB. None: the runtime's default.")
    volumes: list[dict[str, Any]] = Field(
        default_factory=list, max_length=32, description="Extra pod volumes (Kubernetes Volume objects), each "
        "with a name and one source.")
    volume_mounts: list[dict[str, Any]] = Field(
        default_factory=list, max_length=32, description="Mounts of those volumes in the worker container "
        "(name, mountPath, readOnly, subPath).")
    image_pull_secrets: list[str] = Field(
        default_factory=list, max_length=16, description="Secrets in the deployment's namespace to pull the image "
        "with.")
    affinity: dict[str, Any] = Field(
        default_factory=dict, description="Pod affinity (a Kubernetes Affinity: nodeAffinity, podAffinity, "
        "podAntiAffinity).")
    topology_spread_constraints: list[dict[str, Any]] = Field(
        default_factory=list, max_length=16, description="Topology spread constraints (Kubernetes "
        "TopologySpreadConstraint objects).")
    priority_class_name: str | None = Field(
        default=None, max_length=253, description="PriorityClass of the worker pods.")

    @model_validator(mode="after")
    def _checked(self) -> WorkerPodShape:
        errors = [f"labels.{e}" for e in map(_key_error, self.labels) if e]
        errors += [f"labels[{k!r}]: {v!r} is not a label value (at most 63 letters, digits, '-', '_' or '.', "
                   "starting and ending with a letter or digit)" for k, v in self.labels.items()
                   if not _LABEL_VALUE.match(v)]
        errors += [f"annotations.{e}" for e in map(_key_error, self.annotations) if e]
        if self.shm_size is not None:
            try:
                if parse_quantity(self.shm_size) <= 0:
                    errors.append(f"shmSize={self.shm_size} must be positive")
            except ValueError as e:
                errors.append(f"shmSize: {e}")
        names: list[str] = []
        for i, v in enumerate(self.volumes):
            name = v.get("name")
            sources = [k for k in v if k != "name"]
            if not isinstance(name, str) or not RFC1123_LABEL.match(name):
                errors.append(f"volumes[{i}].name: a DNS label is required, got {name!r}")
            elif name in RESERVED_VOLUMES or name in names:
                errors.append(f"volumes[{i}].name: {name!r} is " + ("the operator's" if name in RESERVED_VOLUMES
                                                                     else "used twice"))
            if len(sources) != 1 or sources[0] not in VOLUME_SOURCES:
                errors.append(f"volumes[{i}]: exactly one source ({', '.join(VOLUME_SOURCES)}), got "
                              f"{sources or 'none'}")
            names.append(str(name))
        paths: list[str] = []
        for i, m in enumerate(self.volume_mounts):
            path = m.get("mountPath")
            if m.get("name") not in names:
                errors.append(f"volumeMounts[{i}].name: {m.get('name')!r} names no volume of this spec")
            if not isinstance(path, str) or not path.startswith("/"):
                errors.append(f"volumeMounts[{i}].mountPath: an absolute path is required, got {path!r}")
            elif path.rstrip("/") == "/dev/shm" or path in paths:
                errors.append(f"volumeMounts[{i}].mountPath: {path} is " + ("set by shmSize" if path.rstrip("/") ==
                                                                             "/dev/shm" else "mounted twice"))
            elif (path.rstrip("/") + "/").startswith(RESERVED_MOUNT + "/") or \
                    RESERVED_MOUNT.startswith(path.rstrip("/") + "/"):
                errors.append(f"volumeMounts[{i}].mountPath: {path} would cover {RESERVED_MOUNT}, where the "
                              "operator mounts the agent token and the API key")
            paths.append(str(path))
        errors += [f"imagePullSecrets: {n!r} is not a Secret name" for n in self.image_pull_secrets
                   if not _DNS_SUBDOMAIN.match(n)]
        if self.priority_class_name is not None and not _DNS_SUBDOMAIN.match(self.priority_class_name):
            errors.append(f"priorityClassName: {self.priority_class_name!r} is not a PriorityClass name")
        if errors:
            raise ValueError("; ".join(errors))
        return self


DEFAULT_IMAGE = "shardwise:0.1.0"  # `make image`: the reference runtime and the agent (CPU torch)
DEFAULT_VLLM_IMAGE = "shardwise-vllm:0.1.0"  # `make image-vllm`: vLLM's image with the shardwise agent added


class RuntimeSpec(_Spec):
    image: str = Field(
        default="", max_length=512,
        description=f"Image of the worker pods. Empty: the operator's --agent-image (the chart's agentImage), "
        f"else {DEFAULT_IMAGE}; engine vllm: {DEFAULT_VLLM_IMAGE} (vLLM's image with the shardwise agent).",
    )
    engine: Engine = Field(
        default=Engine.REFERENCE,
        description="Runtime engine: reference (shardwise's PyTorch runtime) or vllm (vLLM's OpenAI server, "
        "supervised by the shardwise agent, flags derived from the plan).",
    )
    seed: int = Field(default=0, ge=0, description="Reference engine: seed of the generated weights.")
    args: list[str] = Field(
        default_factory=list, max_length=256,
        description="engine vllm: extra arguments after the derived ones (flags the plan sets are refused).",
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=256, description="Extra environment variables of the worker container.",
    )
    resources: WorkerResources = Field(
        default_factory=WorkerResources,
        description="CPU and memory requests and limits of each worker container. Requests default to the plan's: "
        "a CPU and the staged weights plus 1 GiB of memory per rank (vLLM: 1 GiB more, and its CPU KV cache on gpu "
        "cpu); a request given here replaces that default key by key. Limits are only those given (equal to the "
        "requests: QoS Guaranteed).",
    )
    api_key_secret: SecretKey | None = Field(
        default=None,
        description="The Secret key holding the API key clients send as a bearer token (checked by the router; "
        "engine vllm: also VLLM_API_KEY).",
    )
    pod: WorkerPodShape = Field(
        default_factory=WorkerPodShape,
        description="Labels, annotations, /dev/shm, volumes, pull secrets, affinity, topology spread and priority "
        "of the worker pods.",
    )


class RouterPolicy(StrEnum):
    LOAD = "load"
    ROUND_ROBIN = "round-robin"


class RouterSpec(_Spec):
    enabled: bool = Field(default=True, description="Serve the deployment through its router (status.url).")
    policy: RouterPolicy = Field(
        default=RouterPolicy.LOAD,
        description="load: the DPA group that can start a request soonest (outstanding work, queue, KV cache); "
        "round-robin: each admitting group in turn.",
    )
    prefix_affinity: bool = Field(
        default=False, description="Keep prompts with the same first characters on one group while it has headroom "
        "(for engines with a prefix cache).",
    )
    retry_seconds: float = Field(
        default=30.0, ge=0, le=600,
        description="How long a request no group has accepted yet is retried on other groups.",
    )
    replicas: int = Field(default=1, ge=1, le=16, description="Router replicas (pods behind the Service NAME).")


class InferenceDeploymentSpec(_Spec):
    model: ModelSpec = Field(description="The model: a preset or an inline architecture.")
    hardware: HardwareSpec = Field(default_factory=HardwareSpec, description="GPUs and node placement.")
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec, description="The parallel layout.")
    serving: ServingSpec = Field(default_factory=ServingSpec, description="Serving limits and memory.")
    eplb: EplbSpec = Field(default_factory=EplbSpec, description="Expert-parallel load balancing.")
    elastic: ElasticSpec = Field(default_factory=ElasticSpec, description="Elastic scaling of dpa.")
    autoscaling: AutoscalingSpec = Field(
        default_factory=AutoscalingSpec, description="Autoscaling of dpa on Prometheus metrics."
    )
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec, description="Worker image and engine.")
    router: RouterSpec = Field(default_factory=RouterSpec, description="The deployment's OpenAI entry point.")

    @model_validator(mode="after")
    def _dtype_for_the_hardware(self) -> InferenceDeploymentSpec:
        """model.dtype, where the spec does not give it, is what the hardware computes in (see its description)."""
        if "dtype" not in self.model.model_fields_set and self.hardware.gpu == "cpu":
            # (the models are frozen: the validator sets the field as pydantic's own construction does; the field
            # stays out of model_fields_set, so a spec dumped with exclude_unset still leaves it to the hardware)
            dtype = DType.FLOAT32 if self.runtime.engine is Engine.VLLM else DType.FLOAT64
            object.__setattr__(self.model, "dtype", dtype)
        return self


class Condition(_Model):
    type: str = Field(description="Available, Progressing or Degraded.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable details.")
    observed_generation: int | None = Field(default=None, description="Spec generation it describes.")
    last_transition_time: str | None = Field(default=None, description="When status last changed.")


class PodStatus(_Model):
    name: str = Field(description="Pod name.")
    index: int = Field(description="Pod index in the world.")
    ranks: list[int] = Field(default_factory=list, description="Global ranks on the pod.")
    ready: bool = Field(default=False, description="Every rank on the pod serves.")


class InferenceDeploymentStatus(_Model):
    """Status. Written by the operator; `x-kubernetes-preserve-unknown-fields` keeps later additions."""

    model_config = ConfigDict(extra="allow")

    phase: str | None = Field(default=None, description="Pending, Provisioning, Running, Scaling, ...")
    observed_generation: int | None = Field(default=None, description="Last spec generation acted on.")
    conditions: list[Condition] = Field(
        default_factory=list, description="Available/Progressing/Degraded, one of each type.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    dpa: int | None = Field(default=None, description="Attention groups currently serving.")
    selector: str | None = Field(default=None, description="Label selector of the worker pods (scale).")
    world_size: int | None = Field(default=None, description="Ranks in the current world.")
    world_generation: int | None = Field(default=None, description="Current world generation.")
    ready: str | None = Field(default=None, description="Ready pods over desired pods, e.g. 2/2.")
    pods: list[PodStatus] = Field(default_factory=list, description="Worker pods.")
    endpoints: list[str] = Field(default_factory=list, description="Serving URLs of DPA group leaders.")
    url: str | None = Field(default=None, description="The deployment's OpenAI endpoint: its router.")
    model: str | None = Field(default=None, description="The model name the OpenAI API serves.")
    world_dpa: int | None = Field(default=None, description="DPA groups of the configured world.")
    configured_world: int | None = Field(
        default=None, description="The world generation every agent was configured with (absent while forming).")
    served_world: int | None = Field(default=None, description="The last world generation seen serving.")
    last_world: int | None = Field(
        default=None, description="The highest world generation an elastic operation chose, completed or not: the "
                                  "next one is above it (a generation is never formed twice in one rendezvous store).")
    world_hash: str | None = Field(
        default=None, description="Hash of what shapes the world (image, env, resources, pod shape); a pod "
                                  "template change that leaves it alone rolls group by group.")
    pending_reason: str | None = Field(
        default=None, description="Why a world is being formed: Recovering, Rolling, Provisioning.")
    engine: dict[str, Any] | None = Field(
        default=None, description="The engine's name and the operations the operator does for it.")
    engine_crashes: int | None = Field(default=None, description="vLLM exits in a row (the backoff counts them).")
    engine_failure: str | None = Field(default=None, description="vLLM's exit and last error line, while it restarts.")
    checkpoint_refused: dict[str, Any] | None = Field(
        default=None, description="generation and message of a checkpoint the agents refused.")
    gang: dict[str, Any] | None = Field(
        default=None, description="Gang creation of a world: since, attempts, retryAt.")
    crash_loop: dict[str, Any] | None = Field(
        default=None, description="Worlds in a row that lost a pod exiting while they formed (crashes) and when the "
                                  "last did (lastAt): the next world waits 10 s doubling to 5 minutes.")
    elastic: dict[str, Any] | None = Field(
        default=None, description="The elastic operation in progress (operation, phase, fromDpa, toDpa, target, "
                                  "deadline, ...) or, with phase Done, the last one and its lastResult.")
    spares: list[int] = Field(
        default_factory=list, description="Pods a recovery kept out of the world (a crashed rank restarting in "
                                          "place), taken back by the scale-up that follows.")
    standby: list[int] = Field(
        default_factory=list, description="Standby pods running beside the world (spec.elastic.standbyPods), "
                                          "taken first by a scale-up.")
    eplb: dict[str, Any] | None = Field(
        default=None, description="Expert rebalancing: last rebalance, slots and bytes moved, balance, "
                                  "inProgress with its deadline, lastError.")
    autoscaling: dict[str, Any] | None = Field(
        default=None, description="The autoscaler's last value, desired dpa, check and scale times, lastError.")


class ObjectMeta(_Model):
    model_config = ConfigDict(extra="allow")
    name: str | None = None
    namespace: str | None = None


class InferenceDeployment(_Model):
    """The custom resource as a whole, for validating manifests read from files."""

    api_version: Literal["shardwise.io/v1alpha1"] = Field(default="shardwise.io/v1alpha1", alias="apiVersion")
    kind: Literal["InferenceDeployment"] = Field(default="InferenceDeployment")
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: InferenceDeploymentSpec
    status: InferenceDeploymentStatus | None = None


def parse_deployment(obj: dict[str, Any]) -> InferenceDeployment:
    """Validate a manifest dict; raises pydantic.ValidationError with field paths."""
    return InferenceDeployment.model_validate(obj)
