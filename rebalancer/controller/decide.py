"""Decision policy: is a new placement worth moving weights for, right now?

Refitting on every window would chase noise and keep the links busy; never refitting lets
the placement go stale as the traffic mix drifts. `decide` predicts, on the load
estimate, the balance of the current placement and of a migration-aware candidate, puts
the serving time the candidate saves over a horizon against the serving time its weight
transfers cost, and rebalances only when the gain wins by a margin (hysteresis), the last
rebalance is old enough and enough windows were seen. Every field of the `Decision` is
filled whatever the outcome, so an operator can ask why it did or did not rebalance.

It is a pure function of its arguments (time included), so the live controller and the
simulator's virtual clock take the same decisions on the same input.

The numbers come from the one migration-cost model, rebalancer/controller/cost.py (the
simulator charges plans with the same functions): the candidate saves
`gain_seconds(horizon_seconds, r_current, r_candidate)`, with r the load-weighted
imbalance ratio (sum over layers of max GPU load / sum of mean GPU load: step time over
step time at perfect balance), and its transfer list costs `plan_cost(...).seconds` =
busiest receiver's transfer time (intra- and inter-node bandwidths) x overlap_penalty +
commit pause + map swap. PolicyConfig's cost fields and timing defaults come from that
module too (`DEFAULT_COST`, `derived_timing`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from rebalancer.controller.cost import (
    DEEPSEEK_V3_EXPERT_BYTES,
    DEFAULT_COST,
    CostParams,
    ReferenceDeployment,
    derived_timing,
    gain_seconds,
    imbalance_ratio,
    plan_cost,
)
from rebalancer.controller.estimate import EstimatorConfig
from rebalancer.errors import InputError
from rebalancer.placement import (
    balancedness,
    compute_placement,
    lower_bound_balancedness,
    transfers,
)
from rebalancer.placement.metrics import (
    balancedness_of_gpu_loads,
    expected_gpu_loads,
    mean_balancedness,
)
from rebalancer.wire.dispatch import DEFAULT_DISPATCH_MODE, check_dispatch_mode
from rebalancer.wire.layout import check_layout

__all__ = [
    "DEEPSEEK_V3_EXPERT_BYTES",
    "ClusterShape",
    "Decision",
    "PolicyConfig",
    "decide",
    "sampling_noise",
]

TAKEN = ("rebalance", "forced")

# Defaults the timing defaults are derived from (rebalancer/controller/cost.py).
_DECAY = EstimatorConfig.decay
_GAIN_THRESHOLD = 0.02
_MAX_MOVED_FRACTION = 0.25
_TIMING = derived_timing(_DECAY, _GAIN_THRESHOLD, _MAX_MOVED_FRACTION)


@dataclass
class PolicyConfig:
    """When to rebalance; mirrors the proto message rebalancer.v1.Policy (plus a few knobs).

    Every field but `paused` (set by pause/resume) and `intra_node_gbps` (not on the v1
    wire yet) is a field of the Policy message. The cost fields (`step_seconds`,
    `link_bandwidth_gbps`, `intra_node_gbps`, `overlap_penalty`, `commit_gbps`,
    `swap_seconds`) are the deployment's `CostParams` (`cost_params()`), with the cost
    model's defaults; `min_interval_seconds` and `decision_period_seconds` default to what
    the cost model derives from them (rebalancer/controller/cost.py, `derived_timing`).
    """

    # No two rebalances closer than this (seconds of the controller's clock). Default:
    # the time the smallest accepted gain needs to repay the largest plan, at least one
    # window plus the estimate's half-life (2.2 s for ~1 s windows; `for_windows`).
    min_interval_seconds: float = _TIMING.min_interval_seconds
    # Hysteresis: minimum predicted balancedness gain (candidate - current, layer mean).
    gain_threshold: float = _GAIN_THRESHOLD
    # The predicted step-time saving is credited over this horizon.
    horizon_seconds: float = 300.0
    # Migration budget per plan: at most this fraction of the slots change.
    max_moved_fraction: float = _MAX_MOVED_FRACTION
    # Load estimate: weight of the old estimate per window (see EstimatorConfig.decay).
    decay: float = _DECAY
    # Windows folded into the estimate before the first decision.
    min_windows: int = 2
    # How often the controller runs a decision (it decides only on a folded window).
    # Default: the estimate's half-life, at least one window (1.0 s for ~1 s windows).
    decision_period_seconds: float = _TIMING.decision_period_seconds
    # A rank that has not prepared within this time aborts the plan.
    prepare_timeout_seconds: float = 30.0
    # GB/s one rank receives expert weights at from another node (CostParams.inter_node_gbps).
    link_bandwidth_gbps: float = DEFAULT_COST.inter_node_gbps
    # Serving step time at perfect balance (CostParams.step_seconds).
    step_seconds: float = DEFAULT_COST.step_seconds
    # No policy rebalances while paused (forced ones still run).
    paused: bool = False
    # Fraction of serving throughput lost while weight transfers run beside serving.
    overlap_penalty: float = DEFAULT_COST.overlap_penalty
    # The stall a plan causes at commit: staged experts copied into their live slots at
    # `commit_gbps` (GB/s), then the map swap between two graph replays.
    commit_gbps: float = DEFAULT_COST.commit_gbps
    swap_seconds: float = DEFAULT_COST.swap_seconds
    # > 0: the estimate is the mean of the last `estimate_window` windows instead of decay.
    estimate_window: int = EstimatorConfig.window
    # Sampling-noise margin added to the hysteresis, in standard errors of a GPU's load:
    # a candidate fitted on a noisy estimate looks better on it than it will serve.
    noise_z: float = 2.0
    # Decide on the empirical-Bayes estimate (LoadEstimator.shrunk): short-run shares that
    # differ from the long-run prior by no more than sampling noise are replaced by it, so
    # sparse counts neither trigger a refit on noise nor keep a placement fitted on noise.
    shrink: bool = EstimatorConfig.shrink
    # Weight of the old long-run prior per window (EstimatorConfig.prior_decay).
    prior_decay: float = EstimatorConfig.prior_decay
    # GB/s one rank receives expert weights at from a rank of its own node
    # (CostParams.intra_node_gbps). Not in the v1 Policy message: TOML and `simulate --set`.
    intra_node_gbps: float = DEFAULT_COST.intra_node_gbps

    def cost_params(self) -> CostParams:
        """The migration-cost parameters this policy charges plans with."""
        return CostParams(
            step_seconds=self.step_seconds,
            intra_node_gbps=self.intra_node_gbps,
            inter_node_gbps=self.link_bandwidth_gbps,
            overlap_penalty=self.overlap_penalty,
            commit_gbps=self.commit_gbps,
            swap_seconds=self.swap_seconds,
        )

    def for_windows(self, shape: ClusterShape, window_seconds: float) -> PolicyConfig:
        """A copy with `min_interval_seconds` and `decision_period_seconds` derived for
        this deployment and window length (`cost.derived_timing`) from this policy's
        decay (or estimate_window), gain_threshold, max_moved_fraction and cost parameters. The defaults are
        this for `cost.REFERENCE`: DeepSeek-V3 at EP32 on 4 nodes, ~1 s windows."""
        self.validate()
        shape.validate()
        if not (math.isfinite(window_seconds) and window_seconds > 0):
            raise InputError(f"window_seconds must be > 0, got {window_seconds}")
        deployment = ReferenceDeployment(
            num_layers=shape.num_layers,
            num_slots=shape.num_slots,
            num_gpus=shape.num_gpus,
            num_nodes=shape.num_nodes,
            expert_bytes=shape.expert_bytes,
            window_seconds=window_seconds,
        )
        timing = derived_timing(
            self.decay,
            self.gain_threshold,
            self.max_moved_fraction,
            self.cost_params(),
            deployment,
            self.estimate_window,
        )
        return replace(
            self,
            min_interval_seconds=timing.min_interval_seconds,
            decision_period_seconds=timing.decision_period_seconds,
        )

    def validate(self) -> None:
        """Raise InputError naming the first field that is out of range."""

        def number(name: str, lo: float, hi: float, lo_open: bool = False) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputError(f"policy {name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise InputError(f"policy {name} must be finite, got {value}")
            if value < lo or (lo_open and value == lo) or value > hi:
                left = "(" if lo_open else "["
                raise InputError(f"policy {name} must be in {left}{lo}, {hi}], got {value}")

        inf = math.inf
        number("min_interval_seconds", 0.0, inf)
        number("gain_threshold", 0.0, 1.0)
        number("horizon_seconds", 0.0, inf, lo_open=True)
        number("max_moved_fraction", 0.0, 1.0, lo_open=True)
        number("decay", 0.0, 1.0)
        number("decision_period_seconds", 0.0, inf, lo_open=True)
        number("prepare_timeout_seconds", 0.0, inf, lo_open=True)
        number("link_bandwidth_gbps", 0.0, inf, lo_open=True)
        number("intra_node_gbps", 0.0, inf, lo_open=True)
        number("step_seconds", 0.0, inf, lo_open=True)
        number("overlap_penalty", 0.0, 1.0)
        number("swap_seconds", 0.0, inf)
        number("commit_gbps", 0.0, inf, lo_open=True)
        number("noise_z", 0.0, inf)
        number("prior_decay", 0.0, 1.0)
        for name in ("min_windows", "estimate_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InputError(f"policy {name} must be an integer >= 0, got {value!r}")
        for name in ("paused", "shrink"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"policy {name} must be a boolean, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PolicyConfig:
        """Build from a mapping; unknown keys are an InputError, missing ones keep defaults."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InputError(f"unknown policy field(s): {', '.join(unknown)}")
        config = cls(**values)
        config.validate()
        return config


@dataclass(frozen=True)
class ClusterShape:
    """What the decision needs to know about a deployment's EP group."""

    num_layers: int
    num_logical: int
    num_slots: int
    num_gpus: int
    num_nodes: int = 1
    num_groups: int = 0  # expert groups for hierarchical placement, 0 = none
    expert_bytes: int = DEEPSEEK_V3_EXPERT_BYTES
    # How the ranks divide an expert's tokens among its replicas (rebalancer.wire.dispatch):
    # a placement's balance is predicted under it. top_k (0: unknown) sizes the shared
    # expert's load under "load+shared" (one shared pick per token).
    dispatch_mode: str = DEFAULT_DISPATCH_MODE
    top_k: int = 0

    def validate(self) -> None:
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, (int, np.integer)) or self.num_layers <= 0:
            raise InputError(f"num_layers must be a positive integer, got {self.num_layers!r}")
        check_layout(self.num_logical, self.num_slots, self.num_gpus, self.num_nodes)
        if self.num_groups < 0 or (self.num_groups and self.num_logical % self.num_groups):
            raise InputError(
                f"num_groups ({self.num_groups}) must be 0 or divide num_logical "
                f"({self.num_logical})"
            )
        if self.expert_bytes < 0:
            raise InputError(f"expert_bytes must be >= 0, got {self.expert_bytes}")
        check_dispatch_mode(self.dispatch_mode)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or not 0 <= self.top_k <= self.num_logical:
            raise InputError(f"top_k must be an integer in [0, num_logical], got {self.top_k!r}")


def predicted_balance(phy2log: np.ndarray, estimate: np.ndarray, shape: ClusterShape) -> tuple[float, float]:
    """(balancedness, imbalance ratio) of a placement on a load estimate, under the
    deployment's dispatch mode.

    1. split: each replica carries its expert's load / replicas (`balancedness`,
       `imbalance_ratio`), as before dispatch modes existed.
    2. load, load+shared: each expert's load water-filled over its GPUs
       (`expected_gpu_loads`), with the shared expert's load (routed picks / top_k)
       fixed per GPU or movable; without top_k the shared load is left out.

    phy2log: [L, P]; estimate: [L, E]. Returns: (mean over layers of mean/max GPU load,
    sum over layers of max / sum of mean GPU load).
    """
    shared = estimate.sum(axis=1) / shape.top_k if shape.top_k else None
    return balance_under_dispatch(phy2log, estimate, shape.num_gpus, shape.dispatch_mode, shared)


def balance_under_dispatch(
    phy2log: np.ndarray, load: np.ndarray, num_gpus: int, mode: str, shared: np.ndarray | None
) -> tuple[float, float]:
    """`predicted_balance` with the shared expert's load given (`rebalancer plan` passes
    the one a count file measured). shared: [L] or None; split leaves it out."""
    G = num_gpus
    if mode == "split":
        return float(balancedness(phy2log, load, G)), imbalance_ratio(phy2log, load, G)
    loads = expected_gpu_loads(phy2log, load, G, mode, shared)
    mean = float(loads.sum()) / G
    ratio = float(loads.max(axis=1).sum()) / mean if mean > 0 else 1.0
    return mean_balancedness(balancedness_of_gpu_loads(loads)), ratio


@dataclass(frozen=True)
class Decision:
    """One decision with every number behind it, taken or not."""

    outcome: str
    reason: str
    balancedness_current: float
    balancedness_candidate: float
    bound_balancedness: float
    moved_fraction: float
    slots_moved: int
    bytes_to_move: int
    predicted_gain_seconds: float
    migration_cost_seconds: float
    candidate: np.ndarray | None = field(default=None, repr=False, compare=False)
    # Seconds the busiest receiving rank needs for the candidate's transfers.
    transfer_seconds: float = 0.0
    # The gate's verdict had it been asked (for forced and dry-run decisions).
    gate: str = ""
    # Balancedness gain needed on top of gain_threshold because the estimate is noisy.
    noise_margin: float = 0.0
    # When it was taken: the `now` it was decided at, on the caller's clock.
    time: float = 0.0

    @property
    def take(self) -> bool:
        """Whether a plan should start from this decision."""
        return self.outcome in TAKEN

    def to_dict(self) -> dict[str, Any]:
        """Plain values for logs, JSON and the store (the candidate array is left out)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "candidate"}
        out["take"] = self.take
        return out


def sampling_noise(
    estimate: np.ndarray, num_gpus: int, effective_windows: float | np.ndarray
) -> float:
    """Relative standard error of a GPU's load on the estimate, averaged over layers.

    A GPU with mean load m tokens per window, seen over n effective windows, carries
    about m * n routed tokens: Poisson noise of 1 / sqrt(m * n) relative to its load.
    `effective_windows` is one number or one per layer (a shrunk estimate's, where a
    layer equal to its noise-free prior is worth infinitely many).
    """
    mean_gpu = estimate.sum(axis=1) / num_gpus
    n = np.broadcast_to(np.asarray(effective_windows, dtype=np.float64), mean_gpu.shape)
    live = mean_gpu > 0
    if not live.any() or np.any(n[live] <= 0):
        return math.inf
    return float(np.mean(1.0 / np.sqrt(mean_gpu[live] * n[live])))


def _check_inputs(estimate: np.ndarray, current: np.ndarray, shape: ClusterShape) -> None:
    shape.validate()
    if estimate.shape != (shape.num_layers, shape.num_logical):
        raise InputError(
            f"estimate has shape {list(estimate.shape)}, expected "
            f"[{shape.num_layers}, {shape.num_logical}]"
        )
    if current.shape != (shape.num_layers, shape.num_slots):
        raise InputError(
            f"current placement has shape {list(current.shape)}, expected "
            f"[{shape.num_layers}, {shape.num_slots}]"
        )
    if not np.all(np.isfinite(estimate)) or np.any(estimate < 0):
        raise InputError("estimate must be finite and non-negative")


def decide(
    estimate: np.ndarray,
    current: np.ndarray,
    shape: ClusterShape,
    policy: PolicyConfig,
    now: float,
    last_rebalance: float | None,
    windows: int,
    forced: bool = False,
    dry_run: bool = False,
    effective_windows: float | np.ndarray | None = None,
) -> Decision:
    """Decide whether to move from `current` (phy2log [L, P]) toward a candidate now.

    `estimate` is the load estimate [L, E] in tokens per window; `now` and
    `last_rebalance` are seconds on the caller's clock (`None`: never rebalanced);
    `windows` is how many windows the estimate holds and `effective_windows` how many
    independent windows they are worth (`LoadEstimator.effective_windows`, or per layer
    with `LoadEstimator.shrunk`; default `windows`). `forced` skips the gate (outcome "forced"); `dry_run` computes everything
    and returns the candidate with outcome "dry_run", starting nothing.
    """
    estimate = np.asarray(estimate, dtype=np.float64)
    current = np.asarray(current)
    _check_inputs(estimate, current, shape)
    policy.validate()
    G = shape.num_gpus

    if float(estimate.sum()) <= 0.0:
        return Decision(
            outcome="skip_no_load",
            reason=f"the estimate holds no load yet ({windows} window(s) folded)",
            balancedness_current=0.0,
            balancedness_candidate=0.0,
            bound_balancedness=0.0,
            moved_fraction=0.0,
            slots_moved=0,
            bytes_to_move=0,
            predicted_gain_seconds=0.0,
            migration_cost_seconds=0.0,
            time=now,
        )

    b_current, r_current = predicted_balance(current, estimate, shape)
    bound = float(lower_bound_balancedness(estimate, shape.num_slots, G, shape.num_nodes))
    result = compute_placement(
        estimate,
        shape.num_slots,
        G,
        num_nodes=shape.num_nodes,
        num_groups=shape.num_groups or None,
        previous=current,
        max_moved_fraction=policy.max_moved_fraction,
    )
    candidate = np.asarray(result.phy2log)
    b_candidate, r_candidate = predicted_balance(candidate, estimate, shape)

    moves = np.asarray(transfers(current, candidate, G, shape.num_nodes))
    slots_moved = int(moves.shape[0])
    moved_fraction = slots_moved / float(current.size)
    cost = plan_cost(moves, G, shape.num_nodes, shape.expert_bytes, policy.cost_params())
    migration_cost = cost.seconds

    gain = gain_seconds(policy.horizon_seconds, r_current, r_candidate)
    delta_b = b_candidate - b_current
    n_eff = windows if effective_windows is None else effective_windows
    noise_margin = policy.noise_z * sampling_noise(estimate, G, n_eff) if policy.noise_z else 0.0
    needed = policy.gain_threshold + noise_margin

    numbers = (
        f"balancedness {b_current:.3f} -> {b_candidate:.3f} (bound {bound:.3f}), "
        f"{slots_moved} slots ({moved_fraction:.1%}) to move, predicted gain "
        f"{gain:.2f} s over {policy.horizon_seconds:g} s vs migration cost "
        f"{migration_cost:.3f} s"
    )

    # What the gate would say; forced and dry-run decisions record it too.
    if policy.paused:
        gate, why = "skip_paused", "the deployment is paused"
    elif windows < policy.min_windows:
        gate, why = "skip_min_windows", f"only {windows} of {policy.min_windows} windows seen"
    elif last_rebalance is not None and now - last_rebalance < policy.min_interval_seconds:
        gate, why = (
            "skip_min_interval",
            f"last rebalance {now - last_rebalance:.1f} s ago "
            f"(< {policy.min_interval_seconds:g} s)",
        )
    elif slots_moved == 0:
        gate, why = "skip_gain", "the candidate equals the current placement"
    elif delta_b < needed:
        gate, why = (
            "skip_gain",
            f"balancedness gain {delta_b:+.3f} below threshold {policy.gain_threshold:g}"
            + (f" + noise margin {noise_margin:.3f}" if noise_margin else ""),
        )
    elif gain <= migration_cost:
        gate, why = "skip_gain", "predicted gain does not beat the migration cost"
    else:
        gate, why = "rebalance", "predicted gain beats the migration cost"

    if dry_run:
        outcome, reason = "dry_run", f"dry run (gate: {gate}): {numbers}"
    elif forced and slots_moved == 0:
        # A plan that moves nothing would only bump the version: not even forced.
        outcome, reason = "skip_gain", f"forced, but the candidate equals the current placement: {numbers}"
    elif forced:
        outcome, reason = "forced", f"forced (gate: {gate}): {numbers}"
    else:
        outcome, reason = gate, f"{why}: {numbers}"

    return Decision(
        outcome=outcome,
        reason=reason,
        balancedness_current=b_current,
        balancedness_candidate=b_candidate,
        bound_balancedness=bound,
        moved_fraction=moved_fraction,
        slots_moved=slots_moved,
        bytes_to_move=cost.bytes_between_gpus,
        predicted_gain_seconds=gain,
        migration_cost_seconds=migration_cost,
        candidate=candidate if outcome in ("rebalance", "forced", "dry_run") else None,
        transfer_seconds=cost.transfer_seconds,
        gate=gate,
        noise_margin=noise_margin if math.isfinite(noise_margin) else 1.0,
        time=now,
    )
