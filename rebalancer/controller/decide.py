"""Decision policy: is a new placement worth moving weights for, right now?

Refitting on every window would chase noise and keep the links busy; never refitting lets
the placement go stale as the traffic mix drifts. `decide` predicts, on the load
estimate, the balance of the current placement and of a migration-aware candidate, puts
the serving time the candidate saves over a horizon against the serving time its weight
transfers cost, and rebalances only when the gain wins by a margin (hysteresis), the last
rebalance is old enough and enough windows were seen. Every field of the `Decision` is
filled whatever the outcome, so an operator can ask why it did or did not rebalance. When
the best reachable balancedness (the bound) is already within the gate's margin of the
current placement's, no candidate is fitted: the gate refuses any, and the record's
candidate is the current placement (reason: "no candidate fitted").

It is a pure function of its arguments (time included), so the live controller and the
simulator's virtual clock take the same decisions on the same input.

The numbers come from the one migration-cost model, rebalancer/controller/cost.py (the
simulator charges plans with the same functions): the candidate saves
`gain_seconds(horizon_seconds, r_current, r_candidate)`, with r the load-weighted
imbalance ratio (sum over layers of max GPU load / sum of mean GPU load: step time over
step time at perfect balance), and its transfer list costs `plan_cost(...).seconds` =
busiest receiver's transfer time (intra- and inter-node bandwidths) x overlap_penalty +
commit pause + map swap, under the policy's `cost` section (`PolicyConfig`,
rebalancer/controller/policy_config.py, whose timing defaults come from that module too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from rebalancer.controller.cost import PlanCost, gain_seconds, plan_cost
from rebalancer.controller.policy_config import PolicyConfig
from rebalancer.errors import InputError
from rebalancer.placement import (
    compute_placement,
    gpu_load,
    lower_bound_balancedness,
    transfers,
)
from rebalancer.placement.metrics import (
    balancedness_of_gpu_loads,
    expected_gpu_loads,
    mean_balancedness,
)
from rebalancer.wire.shape import ClusterShape

__all__ = [
    "Decision",
    "PolicyConfig",
    "decide",
    "sampling_noise",
]

TAKEN = ("rebalance", "forced")


def predicted_balance(
    phy2log: np.ndarray, estimate: np.ndarray, shape: ClusterShape
) -> tuple[float, float]:
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
        # Both figures from one GPU load (it is most of a settled decision's cost): the
        # numbers of `balancedness` and `cost.imbalance_ratio`, each of which packs it.
        loads = gpu_load(phy2log, load, G)
        mean = float(np.asarray(load, dtype=np.float64).sum()) / G
    else:
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
    # The regimes policy (rebalancer/controller/regimes.py): which load it decided on (a
    # recognised regime, the drift forecast, the estimate) and why; "" for the others.
    load: str = ""
    # The regimes policy: the deployment's regime library after this decision's windows
    # (a RegimeLibrary), for the caller to keep; never stored with the record.
    state: Any = field(default=None, repr=False, compare=False)

    @property
    def take(self) -> bool:
        """Whether a plan should start from this decision."""
        return self.outcome in TAKEN

    def to_dict(self) -> dict[str, Any]:
        """Plain values for logs, JSON and the store (the candidate array is left out)."""
        out = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("candidate", "state")
        }
        out["take"] = self.take
        if not out["load"]:  # the policies other than regimes record what they always did
            del out["load"]
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


@dataclass(frozen=True)
class _Evaluation:
    """The current placement and the candidate measured on one estimate: what the gate
    and the record read."""

    b_current: float
    r_current: float
    bound: float
    candidate: np.ndarray
    b_candidate: float
    r_candidate: float
    slots_moved: int
    moved_fraction: float
    cost: PlanCost
    gain: float
    noise_margin: float
    # False: no candidate was fitted, since none could pass the gate (`_evaluate`).
    fitted: bool = True

    def summary(self, horizon_seconds: float) -> str:
        """The numbers every reason ends with."""
        if not self.fitted:
            return f"balancedness {self.b_current:.3f} (bound {self.bound:.3f})"
        return (
            f"balancedness {self.b_current:.3f} -> {self.b_candidate:.3f} "
            f"(bound {self.bound:.3f}), "
            f"{self.slots_moved} slots ({self.moved_fraction:.1%}) to move, predicted gain "
            f"{self.gain:.2f} s over {horizon_seconds:g} s vs migration cost "
            f"{self.cost.seconds:.3f} s"
        )


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
    with `LoadEstimator.shrunk`; default `windows`). `forced` skips the gate (outcome "forced");
    `dry_run` computes everything and returns the candidate with outcome "dry_run", starting
    nothing.
    """
    estimate = np.asarray(estimate, dtype=np.float64)
    current = np.asarray(current)
    _check_inputs(estimate, current, shape)
    policy.validate()
    if float(estimate.sum()) <= 0.0:
        return no_load_decision(windows, now)
    ev = _evaluate(
        estimate,
        current,
        shape,
        policy,
        windows if effective_windows is None else effective_windows,
        always_fit=forced or dry_run,
    )
    return gate_decision(ev, policy, now, last_rebalance, windows, forced, dry_run)


def gate_decision(
    ev: _Evaluation,
    policy: PolicyConfig,
    now: float,
    last_rebalance: float | None,
    windows: int,
    forced: bool = False,
    dry_run: bool = False,
    load: str = "",
) -> Decision:
    """`decide`'s gate, outcome and record on an evaluation already made
    (`evaluate_candidate`); `load` says which load it was decided on (Decision.load)."""
    gate, why = _gate(ev, policy, now, last_rebalance, windows)
    outcome, reason = _outcome(gate, why, ev, policy, forced, dry_run)
    decision = _record(outcome, reason, gate, ev, now)
    return replace(decision, load=load) if load else decision


def no_load_decision(windows: int, now: float) -> Decision:
    """The decision when the estimate holds no load yet: nothing to fit, every figure 0."""
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


def _fit_candidate(
    estimate: np.ndarray, current: np.ndarray, shape: ClusterShape, policy: PolicyConfig
) -> np.ndarray:
    """The migration-aware candidate within the policy's move budget: phy2log [L, P]."""
    result = compute_placement(
        estimate,
        shape.num_slots,
        shape.num_gpus,
        num_nodes=shape.num_nodes,
        num_groups=shape.num_groups or None,
        previous=current,
        max_moved_fraction=policy.max_moved_fraction,
    )
    return np.asarray(result.phy2log)


def _evaluate(
    estimate: np.ndarray,
    current: np.ndarray,
    shape: ClusterShape,
    policy: PolicyConfig,
    effective_windows: float | np.ndarray,
    always_fit: bool = True,
) -> _Evaluation:
    """Balance of current and candidate, the candidate's moves, their cost, the gain over
    the horizon and the noise margin, on the estimate.

    `always_fit` False: no candidate is fitted when the best reachable balancedness (`bound`) is
    less than the gate's margin above the current placement's, since the gate would then
    refuse whatever the fit gave (split dispatch, where every placement's balancedness is
    at most the bound); the evaluation says so (`_Evaluation.fitted`). The fit is most of
    a decision's cost, and a placement that already sits near the bound is the usual
    state of a deployment between shifts."""
    G = shape.num_gpus
    b_current, r_current = predicted_balance(current, estimate, shape)
    bound = float(lower_bound_balancedness(estimate, shape.num_slots, G, shape.num_nodes))
    noise = _noise_margin(estimate, G, policy, effective_windows)
    settled = bound - b_current < policy.gain_threshold + noise
    if settled and shape.dispatch_mode == "split" and not always_fit:
        return _unfitted(current, b_current, r_current, bound, noise, shape, policy)
    candidate = _fit_candidate(estimate, current, shape, policy)
    return evaluate_candidate(
        estimate,
        current,
        candidate,
        shape,
        policy,
        effective_windows,
        current_balance=(b_current, r_current),
        bound=bound,
        noise_margin=noise,
    )


def evaluate_candidate(
    estimate: np.ndarray,
    current: np.ndarray,
    candidate: np.ndarray,
    shape: ClusterShape,
    policy: PolicyConfig,
    effective_windows: float | np.ndarray,
    current_balance: tuple[float, float] | None = None,
    bound: float | None = None,
    noise_margin: float | None = None,
) -> _Evaluation:
    """A given candidate (phy2log [L, P]) against `current` on the load `estimate` [L, E]:
    what `decide`'s gate reads (balance of both, moves, their cost, the gain over the
    horizon, the noise margin for `effective_windows`). `current_balance`, `bound` and
    `noise_margin` save recomputing them when several candidates are measured on one load."""
    G = shape.num_gpus
    b_current, r_current = (
        predicted_balance(current, estimate, shape) if current_balance is None else current_balance
    )
    if bound is None:
        bound = float(lower_bound_balancedness(estimate, shape.num_slots, G, shape.num_nodes))
    b_candidate, r_candidate = predicted_balance(candidate, estimate, shape)
    moves = np.asarray(transfers(current, candidate, G, shape.num_nodes))
    slots_moved = int(moves.shape[0])
    noise = (
        _noise_margin(estimate, G, policy, effective_windows)
        if noise_margin is None
        else noise_margin
    )
    return _Evaluation(
        b_current=b_current,
        r_current=r_current,
        bound=bound,
        candidate=candidate,
        b_candidate=b_candidate,
        r_candidate=r_candidate,
        slots_moved=slots_moved,
        moved_fraction=slots_moved / float(current.size),
        cost=plan_cost(moves, G, shape.num_nodes, shape.expert_bytes, policy.cost),
        gain=gain_seconds(policy.horizon_seconds, r_current, r_candidate),
        noise_margin=noise,
    )


def _noise_margin(
    estimate: np.ndarray,
    num_gpus: int,
    policy: PolicyConfig,
    effective_windows: float | np.ndarray,
) -> float:
    """The balancedness gain the gate asks on top of gain_threshold for a noisy estimate."""
    if not policy.noise_z:
        return 0.0
    return policy.noise_z * sampling_noise(estimate, num_gpus, effective_windows)


def _unfitted(
    current: np.ndarray,
    b_current: float,
    r_current: float,
    bound: float,
    noise: float,
    shape: ClusterShape,
    policy: PolicyConfig,
) -> _Evaluation:
    """The evaluation without a fitted candidate (`_evaluate`): the candidate is the current
    placement, nothing moves, nothing is gained."""
    return _Evaluation(
        b_current=b_current,
        r_current=r_current,
        bound=bound,
        candidate=current,
        b_candidate=b_current,
        r_candidate=r_current,
        slots_moved=0,
        moved_fraction=0.0,
        cost=plan_cost(_NO_MOVES, shape.num_gpus, shape.num_nodes, shape.expert_bytes, policy.cost),
        gain=0.0,
        noise_margin=noise,
        fitted=False,
    )


_NO_MOVES = np.zeros((0, 5), dtype=np.int64)


def _gate(
    ev: _Evaluation, policy: PolicyConfig, now: float, last_rebalance: float | None, windows: int
) -> tuple[str, str]:
    """What the gate says, and why: the first of paused, too few windows, too soon, no
    gain, and the gain against the migration cost. Forced and dry-run decisions record it
    too."""
    if policy.paused:
        return "skip_paused", "the deployment is paused"
    if windows < policy.min_windows:
        return "skip_min_windows", f"only {windows} of {policy.min_windows} windows seen"
    if last_rebalance is not None and now - last_rebalance < policy.min_interval_seconds:
        return (
            "skip_min_interval",
            f"last rebalance {now - last_rebalance:.1f} s ago "
            f"(< {policy.min_interval_seconds:g} s)",
        )
    if not ev.fitted:
        return (
            "skip_gain",
            f"best reachable balancedness {ev.bound:.3f} is less than threshold "
            f"{policy.gain_threshold:g}"
            + (f" + noise margin {ev.noise_margin:.3f}" if ev.noise_margin else "")
            + f" above the current {ev.b_current:.3f}: no candidate fitted",
        )
    if ev.slots_moved == 0:
        return "skip_gain", "the candidate equals the current placement"
    if ev.b_candidate - ev.b_current < policy.gain_threshold + ev.noise_margin:
        return (
            "skip_gain",
            f"balancedness gain {ev.b_candidate - ev.b_current:+.3f} below threshold "
            f"{policy.gain_threshold:g}"
            + (f" + noise margin {ev.noise_margin:.3f}" if ev.noise_margin else ""),
        )
    if ev.gain <= ev.cost.seconds:
        return "skip_gain", "predicted gain does not beat the migration cost"
    return "rebalance", "predicted gain beats the migration cost"


def _outcome(
    gate: str, why: str, ev: _Evaluation, policy: PolicyConfig, forced: bool, dry_run: bool
) -> tuple[str, str]:
    """The outcome and its reason: the gate's, unless the caller forced or dry-ran it."""
    numbers = ev.summary(policy.horizon_seconds)
    if dry_run:
        return "dry_run", f"dry run (gate: {gate}): {numbers}"
    if forced and ev.slots_moved == 0:
        # A plan that moves nothing would only bump the version: not even forced.
        return "skip_gain", f"forced, but the candidate equals the current placement: {numbers}"
    if forced:
        return "forced", f"forced (gate: {gate}): {numbers}"
    return gate, f"{why}: {numbers}"


def _record(outcome: str, reason: str, gate: str, ev: _Evaluation, now: float) -> Decision:
    """The Decision with every number behind it; the candidate only where a plan may follow."""
    return Decision(
        outcome=outcome,
        reason=reason,
        balancedness_current=ev.b_current,
        balancedness_candidate=ev.b_candidate,
        bound_balancedness=ev.bound,
        moved_fraction=ev.moved_fraction,
        slots_moved=ev.slots_moved,
        bytes_to_move=ev.cost.bytes_between_gpus,
        predicted_gain_seconds=ev.gain,
        migration_cost_seconds=ev.cost.seconds,
        candidate=ev.candidate if outcome in ("rebalance", "forced", "dry_run") else None,
        transfer_seconds=ev.cost.transfer_seconds,
        gate=gate,
        noise_margin=ev.noise_margin if math.isfinite(ev.noise_margin) else 1.0,
        time=now,
    )
