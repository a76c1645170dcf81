"""The migration-cost model: what a plan costs, and the timing defaults that follow.

This module owns the arithmetic and the defaults of what moving expert weights costs.
The controller's gate (`decide`, rebalancer/controller/decide.py) and the simulator
(rebalancer/sim) both call the functions below with the same `CostParams`; neither keeps
a formula or a default of its own. `PolicyConfig` (the admin API's Policy) carries the
parameters per deployment as its `cost` section, `DEFAULT_COST` unless set.

A plan is a transfer list `[K, 5]` (columns `rebalancer.wire.layout`: LAYER, DST_RANK,
DST_SLOT, SRC_RANK, SRC_SLOT), one row per physical slot that changes. Its cost:
- Weights move beside serving. A rank receives the experts of its rows whose source is
  another rank, at `intra_node_gbps` from a rank of its own node and `inter_node_gbps`
  across nodes; a row whose source is the same rank is an HBM copy, charged nothing
  here. All ranks receive in parallel: the transfers take as long as the busiest
  receiver (`transfer_seconds`).
- While they run, serving is slower by the fraction `overlap_penalty` (the copies share
  SMs, HBM and links with the all-to-all): `transfer_seconds * overlap_penalty` seconds
  of serving are lost.
- At commit every rank pauses between two graph replays to copy its staged experts
  (every row it receives, local ones included) into their live slots at `commit_gbps`;
  the busiest rank sets the pause (`commit_pause_seconds`). Then the maps are swapped in
  place (`swap_seconds`).
- In all, `plan_cost` = transfer_seconds * overlap_penalty + commit pause + swap_seconds
  (0 for an empty plan): the serving seconds the plan takes from the deployment.

The gain side: with r = sum over layers of the busiest GPU's load / sum over layers of
the mean GPU load (`imbalance_ratio`, >= 1), a serving step takes `step_seconds * r`,
so a placement with ratio r' instead of r saves `seconds * (r - r')` over `seconds` of
serving (`gain_seconds`). The simulator's own serving clock (sim/cost.py: a fixed part
per layer and step plus a part that scales with the busiest GPU's tokens) refines this;
both read the busiest GPU's load through `peak_load`.

Timing defaults (`derived_timing`), from the same arithmetic on a deployment and its
window length; PolicyConfig's defaults are those of `REFERENCE` (DeepSeek-V3, 58 MoE
layers, EP32 on 4 nodes, 288 slots, FP8 experts, windows of about a second: the workers'
16-step windows at 50 ms per step are 0.8 s). A folded window moves the estimate by the
weight 1 - decay, so it has moved half-way to new traffic after the half-life
h = log(2) / log(1 / decay) windows (0.58 at decay 0.3; N / 2 for the sliding mean of
`estimate_window` = N windows).
- `min_interval_seconds` = max(repay, settle), rounded up to 0.1 s:
  - repay: the time the smallest gain the gate accepts (a balancedness gain of
    `gain_threshold`; the step-time ratio then falls by at least as much, since
    r ~ 1 / balancedness and balancedness <= 1) needs to repay the largest plan the
    budget allows (`max_moved_fraction` of every rank's slots, sources spread over the
    other ranks): `plan_cost(reference plan) / gain_threshold`. Sooner, a new plan may
    replace one that has not paid for itself yet. At the reference: 130 experts of 44 MB
    into the busiest rank, 24/31 of them across nodes: transfer 0.229 s (x 0.15 = 0.034 s
    lost), commit pause 8.2 ms, swap 20 us: 0.0425 s, repaid at 0.02 in 2.13 s.
  - settle: (1 + h) windows. A plan fitted right after the traffic changed sees an
    estimate that still holds `decay` of the old traffic; a follow-up plan at the very
    next fold corrects little, often less than the hysteresis asks, and the half-fitted
    placement then stays until the traffic changes again (the simulator's 5 s phase
    traces lost 0.2-0.4 % of throughput that way). At the reference: 1.58 s.
  So 2.2 s at the reference (the old constant, 10 s, let the controller follow nothing
  that changes every few one-second windows); 7.9 s for 5 s windows.
- `decision_period_seconds` = max(1, h) windows, rounded up to 0.1 s: a decision can
  change only when a window is folded, and the estimate needs h windows to move
  half-way. At decay 0.3: every window, 1.0 s at the reference (5.0 s for 5 s windows).
  The live controller and the simulator decide only on a folded window, so any period
  up to the window length means "every window".
A window longer than `MAX_WINDOW_SECONDS` (1e6 s) is refused with an InputError, as is a
derived figure that is not finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np

from rebalancer.errors import InputError
from rebalancer.placement import gpu_load
from rebalancer.wire.layout import DST_RANK, DST_SLOT, LAYER, SRC_RANK, SRC_SLOT
from rebalancer.wire.shape import ClusterShape

# The longest counts window the timing defaults are derived for (and the simulator's
# traces may declare): about 11.6 days, far beyond any real window (seconds to minutes),
# yet small enough that every timing figure stays a finite float.
MAX_WINDOW_SECONDS = 1e6


@dataclass(frozen=True)
class CostParams:
    """What moving expert weights costs; defaults measured on H200 where measured. The
    `cost` section of a deployment's PolicyConfig (flat names on the wire and in TOML:
    the same, but `inter_node_gbps` is `link_bandwidth_gbps`).

    Measurements: BENCHMARKS.md, "Worker hooks on GPU (H200)" (`python -m
    bench.gpu_hooks`, `python -m bench.gpu_migration`, 2 x H200 on one node).
    """

    step_seconds: float = 0.05
    """Serving step at perfect balance (seconds): turns engine step counts into time.
    DeepSeek-V3 decode at EP32; not measured here (a multi-GPU step-time run is missing)."""

    intra_node_gbps: float = 300.0
    """GB/s one rank receives expert weights at from a rank of its own node, beside a
    serving loop: the ipc transport (copy engines) measured 306-310 GB/s beside serving,
    313 GB/s alone; NCCL p2p 289-299 GB/s ("Fourth run")."""

    inter_node_gbps: float = 20.0
    """The same across nodes: not measured; a 400 Gb/s NIC (50 GB/s) shared with the
    all-to-all's RDMA traffic."""

    overlap_penalty: float = 0.15
    """Share of serving time lost while transfers run beside it: measured +6.8 % for the
    ipc transport inside a node and +31 % for NCCL (host sync every 2 replays); plans
    across nodes use NCCL, so 0.15 sits between."""

    commit_gbps: float = 700.0
    """GB/s of the commit copy of staged experts into their live slots, between two
    replays: 54 experts of 84 MiB in 6.7 ms (~700 GB/s; 30 in 3.9 ms). Workers with enough
    spare rows (worker_hooks/rows.py) copy nothing at commit: a very large value models
    them."""

    swap_seconds: float = 20e-6
    """The in-place map swap between two replays: 13.6 us device time (61 layers x 256
    experts), 12.8 us in the migration run, 26.7 us host time of the call: ~20 us."""

    def validate(self) -> None:
        """Raise InputError naming the first parameter out of range."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputError(f"cost {f.name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise InputError(f"cost {f.name} must be finite, got {value}")
        for name in ("step_seconds", "intra_node_gbps", "inter_node_gbps", "commit_gbps"):
            if getattr(self, name) <= 0:
                raise InputError(f"cost {name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.overlap_penalty <= 1.0:
            raise InputError(f"cost overlap_penalty must be in [0, 1], got {self.overlap_penalty}")
        if self.swap_seconds < 0:
            raise InputError(f"cost swap_seconds must be >= 0, got {self.swap_seconds}")


DEFAULT_COST = CostParams()


@dataclass(frozen=True)
class PlanCost:
    """What one transfer list costs under `CostParams`."""

    # Seconds the busiest receiving rank needs for its experts from other ranks.
    transfer_seconds: float
    # Serving pause to copy staged experts into live slots (busiest rank), without the swap.
    commit_pause_seconds: float
    # The map swap (0 for an empty plan).
    swap_seconds: float
    # Bytes sent between GPUs (rows whose source is another rank).
    bytes_between_gpus: int
    # transfer_seconds * overlap_penalty + commit_pause_seconds + swap_seconds.
    seconds: float


def _rows(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] != 5:
        raise InputError(f"a transfer list has shape [K, 5], got {list(rows.shape)}")
    return rows


def rank_receive_seconds(
    rows: np.ndarray, num_gpus: int, num_nodes: int, expert_bytes: int, params: CostParams
) -> np.ndarray:
    """Seconds each rank [G] needs to receive its experts from other ranks."""
    rows = _rows(rows)
    if rows.shape[0] == 0:
        return np.zeros(num_gpus)
    dst, src = rows[:, DST_RANK], rows[:, SRC_RANK]
    remote = dst != src  # a copy inside one GPU costs HBM time only
    per_node = num_gpus // num_nodes
    inter = remote & (dst // per_node != src // per_node)
    intra = remote & ~inter
    intra_n = np.bincount(dst[intra], minlength=num_gpus)
    inter_n = np.bincount(dst[inter], minlength=num_gpus)
    return float(expert_bytes) * (
        intra_n / (params.intra_node_gbps * 1e9) + inter_n / (params.inter_node_gbps * 1e9)
    )


def transfer_seconds(
    rows: np.ndarray, num_gpus: int, num_nodes: int, expert_bytes: int, params: CostParams
) -> float:
    """Seconds the transfers of a list take: the busiest receiver's."""
    per_rank = rank_receive_seconds(rows, num_gpus, num_nodes, expert_bytes, params)
    return float(per_rank.max()) if per_rank.size else 0.0


def bytes_between_gpus(rows: np.ndarray, expert_bytes: int) -> int:
    """Bytes a transfer list sends from one GPU to another (local copies excluded)."""
    rows = _rows(rows)
    return int(np.count_nonzero(rows[:, DST_RANK] != rows[:, SRC_RANK])) * int(expert_bytes)


def commit_pause_seconds(
    rows: np.ndarray, num_gpus: int, expert_bytes: int, params: CostParams
) -> float:
    """The pause to copy staged experts into live slots: the busiest receiver's rows."""
    rows = _rows(rows)
    if rows.shape[0] == 0:
        return 0.0
    received = np.bincount(rows[:, DST_RANK], minlength=num_gpus)
    return float(received.max()) * float(expert_bytes) / (params.commit_gbps * 1e9)


def plan_cost(
    rows: np.ndarray, num_gpus: int, num_nodes: int, expert_bytes: int, params: CostParams
) -> PlanCost:
    """Every figure of a transfer list's cost (see the module docstring)."""
    rows = _rows(rows)
    transfer = transfer_seconds(rows, num_gpus, num_nodes, expert_bytes, params)
    commit = commit_pause_seconds(rows, num_gpus, expert_bytes, params)
    swap = params.swap_seconds if rows.shape[0] else 0.0
    return PlanCost(
        transfer_seconds=transfer,
        commit_pause_seconds=commit,
        swap_seconds=swap,
        bytes_between_gpus=bytes_between_gpus(rows, expert_bytes),
        seconds=transfer * params.overlap_penalty + commit + swap,
    )


def peak_load(phy2log: np.ndarray, load: np.ndarray, num_gpus: int) -> float:
    """Sum over layers of the busiest GPU's load (`placement.gpu_load`) under a placement."""
    return float(gpu_load(phy2log, load, num_gpus).max(axis=1).sum())


def imbalance_ratio(phy2log: np.ndarray, load: np.ndarray, num_gpus: int) -> float:
    """Step time over step time at perfect balance: sum of max / sum of mean GPU load (>= 1)."""
    mean = float(np.asarray(load, dtype=np.float64).sum()) / num_gpus
    return peak_load(phy2log, load, num_gpus) / mean if mean > 0 else 1.0


def gain_seconds(seconds: float, ratio_before: float, ratio_after: float) -> float:
    """Serving seconds saved over `seconds` of serving when the ratio falls by this much."""
    return seconds * (ratio_before - ratio_after)


# -- timing defaults -------------------------------------------------------------------


@dataclass(frozen=True)
class ReferenceDeployment:
    """The shape of deployment the timing defaults are derived for (not a live one:
    controller/deployment.py's `Deployment` is that)."""

    shape: ClusterShape = ClusterShape(
        num_layers=58,  # DeepSeek-V3: 61 layers, the first 3 dense
        num_logical=256,
        num_slots=288,  # 256 experts + 32 redundant, 9 per GPU
        num_gpus=32,
        num_nodes=4,  # and FP8 experts: ClusterShape's default expert_bytes
    )
    # Seconds per counts window: worker_hooks' 16-step windows at 50 ms per step are 0.8 s.
    window_seconds: float = 1.0


REFERENCE = ReferenceDeployment()


def reference_transfers(deployment: ReferenceDeployment, moved_fraction: float) -> np.ndarray:
    """The largest plan a budget allows: every rank receives `moved_fraction` of its slots.

    Each rank receives round(moved_fraction x slots per GPU x layers) experts, layer by
    layer, from the other ranks in turn (so (G - G/N) / (G - 1) of them cross nodes).
    """
    d = deployment.shape
    per_gpu = d.num_slots // d.num_gpus
    n = int(round(moved_fraction * per_gpu * d.num_layers)) if d.num_gpus > 1 else 0
    i = np.arange(n)
    rows = []
    for dst in range(d.num_gpus):
        out = np.zeros((n, 5), dtype=np.int64)
        out[:, LAYER] = i % d.num_layers
        out[:, DST_RANK] = dst
        out[:, DST_SLOT] = dst * per_gpu + (i // d.num_layers) % per_gpu
        src = (dst + 1 + i % (d.num_gpus - 1)) % d.num_gpus
        out[:, SRC_RANK] = src
        out[:, SRC_SLOT] = src * per_gpu + (i // d.num_layers) % per_gpu
        rows.append(out)
    return np.concatenate(rows) if rows else np.zeros((0, 5), dtype=np.int64)


def _ceil_tenth(seconds: float) -> float:
    """Round up to 0.1 s; InputError (not OverflowError) for a figure that is not finite."""
    if not math.isfinite(seconds):
        raise InputError(
            f"a derived timing figure is not finite ({seconds} s): the window length or the "
            "cost parameters are out of range"
        )
    return math.ceil(round(seconds * 10.0, 6)) / 10.0


def check_window_seconds(value: object, what: str = "window_seconds") -> float:
    """Return a window length in seconds as a float, or raise InputError: a number (not a
    bool), finite, in (0, MAX_WINDOW_SECONDS]."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        text = repr(value)
        text = text if len(text) <= 40 else text[:37] + "..."
        raise InputError(f"{what} must be a number of seconds, got {text}")
    try:
        seconds = float(value)
        shown = f"{seconds:g}"
    except OverflowError:  # an int beyond float's range
        seconds, shown = math.inf, "an integer beyond float's range"
    if not (math.isfinite(seconds) and 0.0 < seconds <= MAX_WINDOW_SECONDS):
        raise InputError(f"{what} must be in (0, {MAX_WINDOW_SECONDS:g}] seconds, got {shown}")
    return seconds


@dataclass(frozen=True)
class Timing:
    """Timing defaults of the policy and the numbers they come from."""

    min_interval_seconds: float
    decision_period_seconds: float
    plan: PlanCost  # the largest plan's cost
    repay_seconds: float  # plan.seconds / gain_threshold
    settle_seconds: float  # (1 + half-life) windows
    half_life_windows: float  # windows the estimate needs to move half-way


def derived_timing(
    decay: float,
    gain_threshold: float,
    max_moved_fraction: float,
    params: CostParams = DEFAULT_COST,
    deployment: ReferenceDeployment = REFERENCE,
    estimate_window: int = 0,
) -> Timing:
    """`min_interval_seconds` and `decision_period_seconds` (see the module docstring)."""
    d = deployment
    check_window_seconds(d.window_seconds, "deployment window_seconds")
    rows = reference_transfers(d, max_moved_fraction)
    plan = plan_cost(rows, d.shape.num_gpus, d.shape.num_nodes, d.shape.expert_bytes, params)
    # gain_threshold 0 accepts any gain: nothing bounds the repay time, only settling.
    repay = plan.seconds / gain_threshold if gain_threshold > 0 else 0.0
    if estimate_window > 0:  # the mean of the last N windows moves half-way in N / 2
        half_life = estimate_window / 2.0
    elif 0.0 < decay < 1.0:
        half_life = math.log(2.0) / math.log(1.0 / decay)
    else:  # 0: only the last window counts; 1: the plain mean (use one window)
        half_life = 0.0 if decay <= 0.0 else 1.0
    settle = (1.0 + half_life) * d.window_seconds
    period = max(1.0, half_life) * d.window_seconds
    return Timing(
        min_interval_seconds=_ceil_tenth(max(repay, settle)),
        decision_period_seconds=_ceil_tenth(period),
        plan=plan,
        repay_seconds=repay,
        settle_seconds=settle,
        half_life_windows=half_life,
    )
