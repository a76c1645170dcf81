from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_UINT32: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]

class PlanPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PLAN_PHASE_UNSPECIFIED: _ClassVar[PlanPhase]
    PLAN_PHASE_PREPARED: _ClassVar[PlanPhase]
    PLAN_PHASE_FAILED: _ClassVar[PlanPhase]
    PLAN_PHASE_COMMITTED: _ClassVar[PlanPhase]
    PLAN_PHASE_ABORTED: _ClassVar[PlanPhase]
DTYPE_UNSPECIFIED: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_UINT32: DType
DTYPE_FLOAT32: DType
PLAN_PHASE_UNSPECIFIED: PlanPhase
PLAN_PHASE_PREPARED: PlanPhase
PLAN_PHASE_FAILED: PlanPhase
PLAN_PHASE_COMMITTED: PlanPhase
PLAN_PHASE_ABORTED: PlanPhase

class Array(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ModelShape(_message.Message):
    __slots__ = ("num_layers", "num_logical_experts", "num_physical_slots", "num_gpus", "num_nodes", "expert_bytes", "num_groups")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PHYSICAL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_GPUS_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_logical_experts: int
    num_physical_slots: int
    num_gpus: int
    num_nodes: int
    expert_bytes: int
    num_groups: int
    def __init__(self, num_layers: _Optional[int] = ..., num_logical_experts: _Optional[int] = ..., num_physical_slots: _Optional[int] = ..., num_gpus: _Optional[int] = ..., num_nodes: _Optional[int] = ..., expert_bytes: _Optional[int] = ..., num_groups: _Optional[int] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("version", "phy2log")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    version: int
    phy2log: Array
    def __init__(self, version: _Optional[int] = ..., phy2log: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("deployment", "rank", "shape", "placement_version", "initial_placement", "worker_id", "ranks", "pod", "dispatch_mode", "top_k", "pool", "resized_from")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    INITIAL_PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_MODE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    RESIZED_FROM_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    rank: int
    shape: ModelShape
    placement_version: int
    initial_placement: Placement
    worker_id: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    pod: str
    dispatch_mode: str
    top_k: int
    pool: str
    resized_from: Resize
    def __init__(self, deployment: _Optional[str] = ..., rank: _Optional[int] = ..., shape: _Optional[_Union[ModelShape, _Mapping]] = ..., placement_version: _Optional[int] = ..., initial_placement: _Optional[_Union[Placement, _Mapping]] = ..., worker_id: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., pod: _Optional[str] = ..., dispatch_mode: _Optional[str] = ..., top_k: _Optional[int] = ..., pool: _Optional[str] = ..., resized_from: _Optional[_Union[Resize, _Mapping]] = ...) -> None: ...

class Resize(_message.Message):
    __slots__ = ("version", "num_gpus")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_GPUS_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_gpus: int
    def __init__(self, version: _Optional[int] = ..., num_gpus: _Optional[int] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("session_id", "committed", "next_window_seq", "warm_start")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_WINDOW_SEQ_FIELD_NUMBER: _ClassVar[int]
    WARM_START_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    committed: Placement
    next_window_seq: int
    warm_start: Placement
    def __init__(self, session_id: _Optional[str] = ..., committed: _Optional[_Union[Placement, _Mapping]] = ..., next_window_seq: _Optional[int] = ..., warm_start: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class Window(_message.Message):
    __slots__ = ("seq", "first_step", "num_steps", "placement_version", "logical_count", "physical_count", "serving_version", "serving_hash")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_COUNT_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_COUNT_FIELD_NUMBER: _ClassVar[int]
    SERVING_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVING_HASH_FIELD_NUMBER: _ClassVar[int]
    seq: int
    first_step: int
    num_steps: int
    placement_version: int
    logical_count: Array
    physical_count: Array
    serving_version: int
    serving_hash: int
    def __init__(self, seq: _Optional[int] = ..., first_step: _Optional[int] = ..., num_steps: _Optional[int] = ..., placement_version: _Optional[int] = ..., logical_count: _Optional[_Union[Array, _Mapping]] = ..., physical_count: _Optional[_Union[Array, _Mapping]] = ..., serving_version: _Optional[int] = ..., serving_hash: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "window")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    window: Window
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., window: _Optional[_Union[Window, _Mapping]] = ...) -> None: ...

class WindowAck(_message.Message):
    __slots__ = ("seq", "held_seconds")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HELD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    held_seconds: float
    def __init__(self, seq: _Optional[int] = ..., held_seconds: _Optional[float] = ...) -> None: ...

class Prepare(_message.Message):
    __slots__ = ("version", "base_version", "placement", "transfers", "layers_per_chunk", "timeout_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    base_version: int
    placement: Placement
    transfers: Array
    layers_per_chunk: int
    timeout_seconds: float
    def __init__(self, version: _Optional[int] = ..., base_version: _Optional[int] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., transfers: _Optional[_Union[Array, _Mapping]] = ..., layers_per_chunk: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("version", "reason")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    version: int
    reason: str
    def __init__(self, version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ControllerMessage(_message.Message):
    __slots__ = ("window_ack", "prepare", "commit", "abort", "warm_start", "planned_loss")
    WINDOW_ACK_FIELD_NUMBER: _ClassVar[int]
    PREPARE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    WARM_START_FIELD_NUMBER: _ClassVar[int]
    PLANNED_LOSS_FIELD_NUMBER: _ClassVar[int]
    window_ack: WindowAck
    prepare: Prepare
    commit: Commit
    abort: Abort
    warm_start: Placement
    planned_loss: PlannedLoss
    def __init__(self, window_ack: _Optional[_Union[WindowAck, _Mapping]] = ..., prepare: _Optional[_Union[Prepare, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., warm_start: _Optional[_Union[Placement, _Mapping]] = ..., planned_loss: _Optional[_Union[PlannedLoss, _Mapping]] = ...) -> None: ...

class PlanReport(_message.Message):
    __slots__ = ("session_id", "version", "phase", "step", "error", "bytes_received", "seconds", "serving")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    version: int
    phase: PlanPhase
    step: int
    error: str
    bytes_received: int
    seconds: float
    serving: Placement
    def __init__(self, session_id: _Optional[str] = ..., version: _Optional[int] = ..., phase: _Optional[_Union[PlanPhase, str]] = ..., step: _Optional[int] = ..., error: _Optional[str] = ..., bytes_received: _Optional[int] = ..., seconds: _Optional[float] = ..., serving: _Optional[_Union[Placement, _Mapping]] = ...) -> None: ...

class PlanReportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankPresence(_message.Message):
    __slots__ = ("session_id", "connected_ranks")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_RANKS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    connected_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., connected_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class RankPresenceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Policy(_message.Message):
    __slots__ = ("min_interval_seconds", "gain_threshold", "horizon_seconds", "max_moved_fraction", "decay", "min_windows", "decision_period_seconds", "prepare_timeout_seconds", "link_bandwidth_gbps", "step_seconds", "overlap_penalty", "commit_gbps", "swap_seconds", "estimate_window", "noise_z", "shrink", "prior_decay", "scale_down_nodes", "regimes")
    MIN_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GAIN_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    HORIZON_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MOVED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    DECAY_FIELD_NUMBER: _ClassVar[int]
    MIN_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    DECISION_PERIOD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LINK_BANDWIDTH_GBPS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_PENALTY_FIELD_NUMBER: _ClassVar[int]
    COMMIT_GBPS_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    NOISE_Z_FIELD_NUMBER: _ClassVar[int]
    SHRINK_FIELD_NUMBER: _ClassVar[int]
    PRIOR_DECAY_FIELD_NUMBER: _ClassVar[int]
    SCALE_DOWN_NODES_FIELD_NUMBER: _ClassVar[int]
    REGIMES_FIELD_NUMBER: _ClassVar[int]
    min_interval_seconds: float
    gain_threshold: float
    horizon_seconds: float
    max_moved_fraction: float
    decay: float
    min_windows: int
    decision_period_seconds: float
    prepare_timeout_seconds: float
    link_bandwidth_gbps: float
    step_seconds: float
    overlap_penalty: float
    commit_gbps: float
    swap_seconds: float
    estimate_window: int
    noise_z: float
    shrink: bool
    prior_decay: float
    scale_down_nodes: NodeCounts
    regimes: bool
    def __init__(self, min_interval_seconds: _Optional[float] = ..., gain_threshold: _Optional[float] = ..., horizon_seconds: _Optional[float] = ..., max_moved_fraction: _Optional[float] = ..., decay: _Optional[float] = ..., min_windows: _Optional[int] = ..., decision_period_seconds: _Optional[float] = ..., prepare_timeout_seconds: _Optional[float] = ..., link_bandwidth_gbps: _Optional[float] = ..., step_seconds: _Optional[float] = ..., overlap_penalty: _Optional[float] = ..., commit_gbps: _Optional[float] = ..., swap_seconds: _Optional[float] = ..., estimate_window: _Optional[int] = ..., noise_z: _Optional[float] = ..., shrink: _Optional[bool] = ..., prior_decay: _Optional[float] = ..., scale_down_nodes: _Optional[_Union[NodeCounts, _Mapping]] = ..., regimes: _Optional[bool] = ...) -> None: ...

class NodeCounts(_message.Message):
    __slots__ = ("counts",)
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, counts: _Optional[_Iterable[int]] = ...) -> None: ...

class DeploymentRef(_message.Message):
    __slots__ = ("deployment",)
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    def __init__(self, deployment: _Optional[str] = ...) -> None: ...

class ForceRebalanceRequest(_message.Message):
    __slots__ = ("deployment", "dry_run", "max_moved_fraction", "pool")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    MAX_MOVED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    dry_run: bool
    max_moved_fraction: float
    pool: str
    def __init__(self, deployment: _Optional[str] = ..., dry_run: _Optional[bool] = ..., max_moved_fraction: _Optional[float] = ..., pool: _Optional[str] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("time", "outcome", "reason", "balancedness_current", "balancedness_candidate", "bound_balancedness", "moved_fraction", "bytes_to_move", "predicted_gain_seconds", "migration_cost_seconds", "plan_version", "pool", "load")
    TIME_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_CURRENT_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    BOUND_BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    MOVED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    BYTES_TO_MOVE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_GAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIGRATION_COST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    time: float
    outcome: str
    reason: str
    balancedness_current: float
    balancedness_candidate: float
    bound_balancedness: float
    moved_fraction: float
    bytes_to_move: int
    predicted_gain_seconds: float
    migration_cost_seconds: float
    plan_version: int
    pool: str
    load: str
    def __init__(self, time: _Optional[float] = ..., outcome: _Optional[str] = ..., reason: _Optional[str] = ..., balancedness_current: _Optional[float] = ..., balancedness_candidate: _Optional[float] = ..., bound_balancedness: _Optional[float] = ..., moved_fraction: _Optional[float] = ..., bytes_to_move: _Optional[int] = ..., predicted_gain_seconds: _Optional[float] = ..., migration_cost_seconds: _Optional[float] = ..., plan_version: _Optional[int] = ..., pool: _Optional[str] = ..., load: _Optional[str] = ...) -> None: ...

class ForceRebalanceResponse(_message.Message):
    __slots__ = ("decision", "placement", "transfers", "members")
    DECISION_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    decision: Decision
    placement: Placement
    transfers: Array
    members: _containers.RepeatedCompositeFieldContainer[PoolMemberMove]
    def __init__(self, decision: _Optional[_Union[Decision, _Mapping]] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., transfers: _Optional[_Union[Array, _Mapping]] = ..., members: _Optional[_Iterable[_Union[PoolMemberMove, _Mapping]]] = ...) -> None: ...

class PoolMemberMove(_message.Message):
    __slots__ = ("deployment", "placement_version", "slots_moved", "bytes_to_move", "moved_fraction", "diverged")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_TO_MOVE_FIELD_NUMBER: _ClassVar[int]
    MOVED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    placement_version: int
    slots_moved: int
    bytes_to_move: int
    moved_fraction: float
    diverged: bool
    def __init__(self, deployment: _Optional[str] = ..., placement_version: _Optional[int] = ..., slots_moved: _Optional[int] = ..., bytes_to_move: _Optional[int] = ..., moved_fraction: _Optional[float] = ..., diverged: _Optional[bool] = ...) -> None: ...

class DeploymentStatus(_message.Message):
    __slots__ = ("deployment", "shape", "placement_version", "balancedness_actual", "balancedness_estimated", "connected_ranks", "windows_ingested", "paused", "plan_in_flight", "plan_phase", "last_decision", "plans_committed", "plans_aborted", "slots_moved", "bytes_moved", "windows_folded", "mixed", "pool", "diverged")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_ACTUAL_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_RANKS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_INGESTED_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    PLAN_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PLAN_PHASE_FIELD_NUMBER: _ClassVar[int]
    LAST_DECISION_FIELD_NUMBER: _ClassVar[int]
    PLANS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    PLANS_ABORTED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FOLDED_FIELD_NUMBER: _ClassVar[int]
    MIXED_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    shape: ModelShape
    placement_version: int
    balancedness_actual: float
    balancedness_estimated: float
    connected_ranks: int
    windows_ingested: int
    paused: bool
    plan_in_flight: int
    plan_phase: str
    last_decision: Decision
    plans_committed: int
    plans_aborted: int
    slots_moved: int
    bytes_moved: int
    windows_folded: int
    mixed: str
    pool: str
    diverged: bool
    def __init__(self, deployment: _Optional[str] = ..., shape: _Optional[_Union[ModelShape, _Mapping]] = ..., placement_version: _Optional[int] = ..., balancedness_actual: _Optional[float] = ..., balancedness_estimated: _Optional[float] = ..., connected_ranks: _Optional[int] = ..., windows_ingested: _Optional[int] = ..., paused: _Optional[bool] = ..., plan_in_flight: _Optional[int] = ..., plan_phase: _Optional[str] = ..., last_decision: _Optional[_Union[Decision, _Mapping]] = ..., plans_committed: _Optional[int] = ..., plans_aborted: _Optional[int] = ..., slots_moved: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., windows_folded: _Optional[int] = ..., mixed: _Optional[str] = ..., pool: _Optional[str] = ..., diverged: _Optional[bool] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("pool", "members", "diverged", "pool_version", "balancedness_estimated", "members_at_target", "members_moving", "max_moving", "last_decision")
    POOL_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    DIVERGED_FIELD_NUMBER: _ClassVar[int]
    POOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_AT_TARGET_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_MOVING_FIELD_NUMBER: _ClassVar[int]
    MAX_MOVING_FIELD_NUMBER: _ClassVar[int]
    LAST_DECISION_FIELD_NUMBER: _ClassVar[int]
    pool: str
    members: _containers.RepeatedScalarFieldContainer[str]
    diverged: _containers.RepeatedScalarFieldContainer[str]
    pool_version: int
    balancedness_estimated: float
    members_at_target: int
    members_moving: int
    max_moving: int
    last_decision: Decision
    def __init__(self, pool: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., diverged: _Optional[_Iterable[str]] = ..., pool_version: _Optional[int] = ..., balancedness_estimated: _Optional[float] = ..., members_at_target: _Optional[int] = ..., members_moving: _Optional[int] = ..., max_moving: _Optional[int] = ..., last_decision: _Optional[_Union[Decision, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("deployment",)
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    def __init__(self, deployment: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("deployments", "pools")
    DEPLOYMENTS_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    deployments: _containers.RepeatedCompositeFieldContainer[DeploymentStatus]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    def __init__(self, deployments: _Optional[_Iterable[_Union[DeploymentStatus, _Mapping]]] = ..., pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ...) -> None: ...

class PlanRecord(_message.Message):
    __slots__ = ("version", "base_version", "state", "trigger", "created", "finished", "slots_moved", "bytes_moved", "reason")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    version: int
    base_version: int
    state: str
    trigger: str
    created: float
    finished: float
    slots_moved: int
    bytes_moved: int
    reason: str
    def __init__(self, version: _Optional[int] = ..., base_version: _Optional[int] = ..., state: _Optional[str] = ..., trigger: _Optional[str] = ..., created: _Optional[float] = ..., finished: _Optional[float] = ..., slots_moved: _Optional[int] = ..., bytes_moved: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class HistoryRequest(_message.Message):
    __slots__ = ("deployment", "limit")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    limit: int
    def __init__(self, deployment: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class HistoryResponse(_message.Message):
    __slots__ = ("plans", "decisions", "contingency_sets")
    PLANS_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    CONTINGENCY_SETS_FIELD_NUMBER: _ClassVar[int]
    plans: _containers.RepeatedCompositeFieldContainer[PlanRecord]
    decisions: _containers.RepeatedCompositeFieldContainer[Decision]
    contingency_sets: _containers.RepeatedCompositeFieldContainer[ContingencySummary]
    def __init__(self, plans: _Optional[_Iterable[_Union[PlanRecord, _Mapping]]] = ..., decisions: _Optional[_Iterable[_Union[Decision, _Mapping]]] = ..., contingency_sets: _Optional[_Iterable[_Union[ContingencySummary, _Mapping]]] = ...) -> None: ...

class ContingencySummary(_message.Message):
    __slots__ = ("time", "base_version", "balancedness_now", "rank_loss_worst", "rank_loss_mean", "node_loss_worst", "node_loss_mean", "node_loss_unserved")
    TIME_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_NOW_FIELD_NUMBER: _ClassVar[int]
    RANK_LOSS_WORST_FIELD_NUMBER: _ClassVar[int]
    RANK_LOSS_MEAN_FIELD_NUMBER: _ClassVar[int]
    NODE_LOSS_WORST_FIELD_NUMBER: _ClassVar[int]
    NODE_LOSS_MEAN_FIELD_NUMBER: _ClassVar[int]
    NODE_LOSS_UNSERVED_FIELD_NUMBER: _ClassVar[int]
    time: float
    base_version: int
    balancedness_now: float
    rank_loss_worst: float
    rank_loss_mean: float
    node_loss_worst: float
    node_loss_mean: float
    node_loss_unserved: int
    def __init__(self, time: _Optional[float] = ..., base_version: _Optional[int] = ..., balancedness_now: _Optional[float] = ..., rank_loss_worst: _Optional[float] = ..., rank_loss_mean: _Optional[float] = ..., node_loss_worst: _Optional[float] = ..., node_loss_mean: _Optional[float] = ..., node_loss_unserved: _Optional[int] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("deployment", "policy")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    policy: Policy
    def __init__(self, deployment: _Optional[str] = ..., policy: _Optional[_Union[Policy, _Mapping]] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PlannedLoss(_message.Message):
    __slots__ = ("kind", "lost_ranks", "balancedness", "slots_moved", "from_storage", "unserved", "phy2log", "base_version", "set_size")
    KIND_FIELD_NUMBER: _ClassVar[int]
    LOST_RANKS_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    FROM_STORAGE_FIELD_NUMBER: _ClassVar[int]
    UNSERVED_FIELD_NUMBER: _ClassVar[int]
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    SET_SIZE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    lost_ranks: _containers.RepeatedScalarFieldContainer[int]
    balancedness: float
    slots_moved: int
    from_storage: int
    unserved: int
    phy2log: Array
    base_version: int
    set_size: int
    def __init__(self, kind: _Optional[str] = ..., lost_ranks: _Optional[_Iterable[int]] = ..., balancedness: _Optional[float] = ..., slots_moved: _Optional[int] = ..., from_storage: _Optional[int] = ..., unserved: _Optional[int] = ..., phy2log: _Optional[_Union[Array, _Mapping]] = ..., base_version: _Optional[int] = ..., set_size: _Optional[int] = ...) -> None: ...

class ContingencyResponse(_message.Message):
    __slots__ = ("planned", "base_version", "computed_at", "balancedness_now", "losses")
    PLANNED_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_AT_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_NOW_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    planned: bool
    base_version: int
    computed_at: float
    balancedness_now: float
    losses: _containers.RepeatedCompositeFieldContainer[PlannedLoss]
    def __init__(self, planned: _Optional[bool] = ..., base_version: _Optional[int] = ..., computed_at: _Optional[float] = ..., balancedness_now: _Optional[float] = ..., losses: _Optional[_Iterable[_Union[PlannedLoss, _Mapping]]] = ...) -> None: ...

class RegimeSummary(_message.Message):
    __slots__ = ("id", "windows", "visits", "mean_stay_windows", "first_seen", "last_seen", "fit_balancedness", "ready")
    ID_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    VISITS_FIELD_NUMBER: _ClassVar[int]
    MEAN_STAY_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEEN_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    FIT_BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    id: int
    windows: int
    visits: int
    mean_stay_windows: float
    first_seen: float
    last_seen: float
    fit_balancedness: float
    ready: bool
    def __init__(self, id: _Optional[int] = ..., windows: _Optional[int] = ..., visits: _Optional[int] = ..., mean_stay_windows: _Optional[float] = ..., first_seen: _Optional[float] = ..., last_seen: _Optional[float] = ..., fit_balancedness: _Optional[float] = ..., ready: _Optional[bool] = ...) -> None: ...

class RegimesResponse(_message.Message):
    __slots__ = ("enabled", "current", "windows", "regimes", "predictor_errors", "recent", "last_load")
    class PredictorErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    REGIMES_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_ERRORS_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    LAST_LOAD_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    current: int
    windows: int
    regimes: _containers.RepeatedCompositeFieldContainer[RegimeSummary]
    predictor_errors: _containers.ScalarMap[str, float]
    recent: _containers.RepeatedScalarFieldContainer[int]
    last_load: str
    def __init__(self, enabled: _Optional[bool] = ..., current: _Optional[int] = ..., windows: _Optional[int] = ..., regimes: _Optional[_Iterable[_Union[RegimeSummary, _Mapping]]] = ..., predictor_errors: _Optional[_Mapping[str, float]] = ..., recent: _Optional[_Iterable[int]] = ..., last_load: _Optional[str] = ...) -> None: ...
