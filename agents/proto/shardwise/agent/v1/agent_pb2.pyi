from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RankState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RANK_STATE_UNSPECIFIED: _ClassVar[RankState]
    RANK_STATE_STARTING: _ClassVar[RankState]
    RANK_STATE_READY: _ClassVar[RankState]
    RANK_STATE_SERVING: _ClassVar[RankState]
    RANK_STATE_PAUSED: _ClassVar[RankState]
    RANK_STATE_CRASHED: _ClassVar[RankState]
    RANK_STATE_EXITED: _ClassVar[RankState]

class AgentStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AGENT_STATUS_UNSPECIFIED: _ClassVar[AgentStatus]
    AGENT_STATUS_UNCONFIGURED: _ClassVar[AgentStatus]
    AGENT_STATUS_STARTING: _ClassVar[AgentStatus]
    AGENT_STATUS_SERVING: _ClassVar[AgentStatus]
    AGENT_STATUS_PAUSED: _ClassVar[AgentStatus]
    AGENT_STATUS_DEGRADED: _ClassVar[AgentStatus]
RANK_STATE_UNSPECIFIED: RankState
RANK_STATE_STARTING: RankState
RANK_STATE_READY: RankState
RANK_STATE_SERVING: RankState
RANK_STATE_PAUSED: RankState
RANK_STATE_CRASHED: RankState
RANK_STATE_EXITED: RankState
AGENT_STATUS_UNSPECIFIED: AgentStatus
AGENT_STATUS_UNCONFIGURED: AgentStatus
AGENT_STATUS_STARTING: AgentStatus
AGENT_STATUS_SERVING: AgentStatus
AGENT_STATUS_PAUSED: AgentStatus
AGENT_STATUS_DEGRADED: AgentStatus

class RankEntry(_message.Message):
    __slots__ = ("rank", "pod", "local_gpu", "tp_rank", "cp_rank", "dpa_group", "pp_stage", "ep_rank")
    RANK_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    LOCAL_GPU_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    CP_RANK_FIELD_NUMBER: _ClassVar[int]
    DPA_GROUP_FIELD_NUMBER: _ClassVar[int]
    PP_STAGE_FIELD_NUMBER: _ClassVar[int]
    EP_RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pod: int
    local_gpu: int
    tp_rank: int
    cp_rank: int
    dpa_group: int
    pp_stage: int
    ep_rank: int
    def __init__(self, rank: _Optional[int] = ..., pod: _Optional[int] = ..., local_gpu: _Optional[int] = ..., tp_rank: _Optional[int] = ..., cp_rank: _Optional[int] = ..., dpa_group: _Optional[int] = ..., pp_stage: _Optional[int] = ..., ep_rank: _Optional[int] = ...) -> None: ...

class LayerMap(_message.Message):
    __slots__ = ("layer", "phy2log")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    layer: int
    phy2log: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., phy2log: _Optional[_Iterable[int]] = ...) -> None: ...

class ParallelSizes(_message.Message):
    __slots__ = ("tp", "dpa", "pp", "cp", "ep", "moe_tp")
    TP_FIELD_NUMBER: _ClassVar[int]
    DPA_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    CP_FIELD_NUMBER: _ClassVar[int]
    EP_FIELD_NUMBER: _ClassVar[int]
    MOE_TP_FIELD_NUMBER: _ClassVar[int]
    tp: int
    dpa: int
    pp: int
    cp: int
    ep: int
    moe_tp: int
    def __init__(self, tp: _Optional[int] = ..., dpa: _Optional[int] = ..., pp: _Optional[int] = ..., cp: _Optional[int] = ..., ep: _Optional[int] = ..., moe_tp: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("deployment", "pod_index", "ranks", "generation", "map_generation", "serving_url", "agent_version", "world_size", "rendezvous_address")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    POD_INDEX_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MAP_GENERATION_FIELD_NUMBER: _ClassVar[int]
    SERVING_URL_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    pod_index: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankEntry]
    generation: int
    map_generation: int
    serving_url: str
    agent_version: str
    world_size: int
    rendezvous_address: str
    def __init__(self, deployment: _Optional[str] = ..., pod_index: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankEntry, _Mapping]]] = ..., generation: _Optional[int] = ..., map_generation: _Optional[int] = ..., serving_url: _Optional[str] = ..., agent_version: _Optional[str] = ..., world_size: _Optional[int] = ..., rendezvous_address: _Optional[str] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankHealth(_message.Message):
    __slots__ = ("rank", "state", "exit_code", "restarts", "last_error", "pid")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    rank: int
    state: RankState
    exit_code: int
    restarts: int
    last_error: str
    pid: int
    def __init__(self, rank: _Optional[int] = ..., state: _Optional[_Union[RankState, str]] = ..., exit_code: _Optional[int] = ..., restarts: _Optional[int] = ..., last_error: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "ranks", "generation", "warm")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    status: AgentStatus
    ranks: _containers.RepeatedCompositeFieldContainer[RankHealth]
    generation: int
    warm: bool
    def __init__(self, status: _Optional[_Union[AgentStatus, str]] = ..., ranks: _Optional[_Iterable[_Union[RankHealth, _Mapping]]] = ..., generation: _Optional[int] = ..., warm: _Optional[bool] = ...) -> None: ...

class ConfigureRequest(_message.Message):
    __slots__ = ("generation", "world_size", "rendezvous_address", "ranks", "sizes", "expert_map", "map_generation", "model_preset", "seed", "weights_dir", "planned_architecture", "dtype", "cp_mode", "cp_layout", "cp_comm", "max_model_len", "joins_running_world")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_MAP_FIELD_NUMBER: _ClassVar[int]
    MAP_GENERATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_PRESET_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIR_FIELD_NUMBER: _ClassVar[int]
    PLANNED_ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CP_MODE_FIELD_NUMBER: _ClassVar[int]
    CP_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CP_COMM_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    JOINS_RUNNING_WORLD_FIELD_NUMBER: _ClassVar[int]
    generation: int
    world_size: int
    rendezvous_address: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankEntry]
    sizes: ParallelSizes
    expert_map: _containers.RepeatedCompositeFieldContainer[LayerMap]
    map_generation: int
    model_preset: str
    seed: int
    weights_dir: str
    planned_architecture: str
    dtype: str
    cp_mode: str
    cp_layout: str
    cp_comm: str
    max_model_len: int
    joins_running_world: bool
    def __init__(self, generation: _Optional[int] = ..., world_size: _Optional[int] = ..., rendezvous_address: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankEntry, _Mapping]]] = ..., sizes: _Optional[_Union[ParallelSizes, _Mapping]] = ..., expert_map: _Optional[_Iterable[_Union[LayerMap, _Mapping]]] = ..., map_generation: _Optional[int] = ..., model_preset: _Optional[str] = ..., seed: _Optional[int] = ..., weights_dir: _Optional[str] = ..., planned_architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., cp_mode: _Optional[str] = ..., cp_layout: _Optional[str] = ..., cp_comm: _Optional[str] = ..., max_model_len: _Optional[int] = ..., joins_running_world: _Optional[bool] = ...) -> None: ...

class ConfigureResponse(_message.Message):
    __slots__ = ("generation", "local_ranks")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANKS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    local_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, generation: _Optional[int] = ..., local_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class PrepareResponse(_message.Message):
    __slots__ = ("generation", "seconds")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    seconds: float
    def __init__(self, generation: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("generation", "deadline_ms")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    deadline_ms: int
    def __init__(self, generation: _Optional[int] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("generation", "step")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class SwitchRequest(_message.Message):
    __slots__ = ("generation", "recover")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RECOVER_FIELD_NUMBER: _ClassVar[int]
    generation: int
    recover: bool
    def __init__(self, generation: _Optional[int] = ..., recover: _Optional[bool] = ...) -> None: ...

class SwitchResponse(_message.Message):
    __slots__ = ("generation", "previous_generation")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    previous_generation: int
    def __init__(self, generation: _Optional[int] = ..., previous_generation: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("generation", "paused_seconds")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    paused_seconds: float
    def __init__(self, generation: _Optional[int] = ..., paused_seconds: _Optional[float] = ...) -> None: ...

class ExpertMove(_message.Message):
    __slots__ = ("layer", "logical_expert", "src_rank", "dst_rank", "dst_slot")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_EXPERT_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_RANK_FIELD_NUMBER: _ClassVar[int]
    DST_SLOT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    logical_expert: int
    src_rank: int
    dst_rank: int
    dst_slot: int
    def __init__(self, layer: _Optional[int] = ..., logical_expert: _Optional[int] = ..., src_rank: _Optional[int] = ..., dst_rank: _Optional[int] = ..., dst_slot: _Optional[int] = ...) -> None: ...

class MigrateExpertsRequest(_message.Message):
    __slots__ = ("generation", "map_generation", "moves", "deadline_ms")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MAP_GENERATION_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    map_generation: int
    moves: _containers.RepeatedCompositeFieldContainer[ExpertMove]
    deadline_ms: int
    def __init__(self, generation: _Optional[int] = ..., map_generation: _Optional[int] = ..., moves: _Optional[_Iterable[_Union[ExpertMove, _Mapping]]] = ..., deadline_ms: _Optional[int] = ...) -> None: ...

class MigrateExpertsResponse(_message.Message):
    __slots__ = ("generation", "map_generation", "experts_moved", "bytes_moved", "seconds")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MAP_GENERATION_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    map_generation: int
    experts_moved: int
    bytes_moved: int
    seconds: float
    def __init__(self, generation: _Optional[int] = ..., map_generation: _Optional[int] = ..., experts_moved: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class UpdateExpertMapRequest(_message.Message):
    __slots__ = ("generation", "map_generation", "layers")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MAP_GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    map_generation: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerMap]
    def __init__(self, generation: _Optional[int] = ..., map_generation: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerMap, _Mapping]]] = ...) -> None: ...

class UpdateExpertMapResponse(_message.Message):
    __slots__ = ("generation", "map_generation", "experts_moved", "bytes_moved", "seconds")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MAP_GENERATION_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    map_generation: int
    experts_moved: int
    bytes_moved: int
    seconds: float
    def __init__(self, generation: _Optional[int] = ..., map_generation: _Optional[int] = ..., experts_moved: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("generation", "deadline_ms", "dpa_groups")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    DPA_GROUPS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    deadline_ms: int
    dpa_groups: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, generation: _Optional[int] = ..., deadline_ms: _Optional[int] = ..., dpa_groups: _Optional[_Iterable[int]] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("generation", "finished", "remaining", "timed_out")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    finished: int
    remaining: int
    timed_out: bool
    def __init__(self, generation: _Optional[int] = ..., finished: _Optional[int] = ..., remaining: _Optional[int] = ..., timed_out: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("generation", "dpa_groups", "request_ids")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    DPA_GROUPS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    dpa_groups: _containers.RepeatedScalarFieldContainer[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, generation: _Optional[int] = ..., dpa_groups: _Optional[_Iterable[int]] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("generation", "aborted")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    generation: int
    aborted: int
    def __init__(self, generation: _Optional[int] = ..., aborted: _Optional[int] = ...) -> None: ...

class RestartStuckRequest(_message.Message):
    __slots__ = ("generation", "reason")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    generation: int
    reason: str
    def __init__(self, generation: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class RestartStuckResponse(_message.Message):
    __slots__ = ("generation", "restarted")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RESTARTED_FIELD_NUMBER: _ClassVar[int]
    generation: int
    restarted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, generation: _Optional[int] = ..., restarted: _Optional[_Iterable[int]] = ...) -> None: ...

class WatchHealthRequest(_message.Message):
    __slots__ = ("interval_ms", "heartbeat_ms")
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    heartbeat_ms: int
    def __init__(self, interval_ms: _Optional[int] = ..., heartbeat_ms: _Optional[int] = ...) -> None: ...

class StreamExpertLoadRequest(_message.Message):
    __slots__ = ("window_steps", "interval_ms")
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    window_steps: int
    interval_ms: int
    def __init__(self, window_steps: _Optional[int] = ..., interval_ms: _Optional[int] = ...) -> None: ...

class LayerLoad(_message.Message):
    __slots__ = ("layer", "tokens_per_logical_expert", "phy2log")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_LOGICAL_EXPERT_FIELD_NUMBER: _ClassVar[int]
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    layer: int
    tokens_per_logical_expert: _containers.RepeatedScalarFieldContainer[int]
    phy2log: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., tokens_per_logical_expert: _Optional[_Iterable[int]] = ..., phy2log: _Optional[_Iterable[int]] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("step", "map_generation", "layers", "generation")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MAP_GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    step: int
    map_generation: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerLoad]
    generation: int
    def __init__(self, step: _Optional[int] = ..., map_generation: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerLoad, _Mapping]]] = ..., generation: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DpaGroupStats(_message.Message):
    __slots__ = ("dpa_group", "queue_depth", "running_requests", "kv_cache_usage", "generated_tokens_total", "tokens_per_second", "draining")
    DPA_GROUP_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    dpa_group: int
    queue_depth: int
    running_requests: int
    kv_cache_usage: float
    generated_tokens_total: int
    tokens_per_second: float
    draining: bool
    def __init__(self, dpa_group: _Optional[int] = ..., queue_depth: _Optional[int] = ..., running_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., generated_tokens_total: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., draining: _Optional[bool] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("queue_depth", "running_requests", "kv_cache_usage", "generated_tokens_total", "tokens_per_second", "groups", "generation", "last_pause_seconds")
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAST_PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_depth: int
    running_requests: int
    kv_cache_usage: float
    generated_tokens_total: int
    tokens_per_second: float
    groups: _containers.RepeatedCompositeFieldContainer[DpaGroupStats]
    generation: int
    last_pause_seconds: float
    def __init__(self, queue_depth: _Optional[int] = ..., running_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., generated_tokens_total: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., groups: _Optional[_Iterable[_Union[DpaGroupStats, _Mapping]]] = ..., generation: _Optional[int] = ..., last_pause_seconds: _Optional[float] = ...) -> None: ...
