"""Replay a trace through each placement policy and account what it buys and costs.

Every policy serves the same windows under the same cost model: the serving clock of
rebalancer.sim.cost and, for every weight move, the controller's migration-cost model
(rebalancer.controller.cost, on the adaptive policy's `PolicyConfig.cost`, the
parameters its gate decides with); each keeps its own virtual clock, which advances by the serving
time of each window plus its stalls, so decisions see the time they would see in production:
- `none`: the trivial contiguous placement, never changed;
- `static`: fitted once (DeepSeek greedy) on the first windows, then frozen, like an
  engine started with a recorded expert distribution;
- `periodic`: a from-scratch greedy refit on the recent windows every K windows, with a
  blocking stall, like SGLang's and vLLM's in-process EPLB;
- `adaptive`: the controller as shipped. Windows go through `PolicyLoop.on_window` (the
  estimator and the decision policy the live controller runs); a taken decision becomes
  a plan (transfer list from `transfers`) driven through the controller's coordinator
  (`rebalancer.controller.coordinate`) by simulated ranks: each rank reports prepared
  once its incoming weights are staged (beside serving, with the overlap penalty), the
  plan commits when all did and every rank copies its staged experts into their slots and
  swaps its maps (the commit pause), or it aborts
  at the prepare timeout and the old maps keep serving;
- `follow`: refit from scratch on the previous window before each window, free;
- `oracle`: refit on each window's own counts, free (an upper bound);
- `hindsight`: one placement fitted on the whole trace's summed counts, in place from
  the first window, free: what the best-informed fixed placement reaches, so a trace
  tells how much of `oracle` comes from tracking change and how much only from fitting
  each window's sampling noise, which no causal policy can do;
- `regimes`: `adaptive` with the regimes policy on (`PolicyConfig.regimes`,
  rebalancer/controller/regimes.py): the same loop, coordinator and costs, deciding on a
  recognised regime's centroid (and its ready placement), the drift forecast or the
  estimate, whichever predicts best.
`follow`, `oracle` and `hindsight` use the engine's best from-scratch algorithm ("auto").
The changing policies (periodic, adaptive, follow, oracle) start from `SimConfig.start`:
the trivial placement an engine loads (default), or the static fit (a deployment started
with a recorded expert distribution).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

import numpy as np

from rebalancer.controller import coordinate
from rebalancer.controller.cost import (
    CostParams,
    bytes_between_gpus,
    peak_load,
    plan_cost,
    rank_receive_seconds,
    transfer_seconds,
)
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.policy_loop import PolicyLoop
from rebalancer.errors import InputError
from rebalancer.placement import compute_placement, transfers, trivial_placement
from rebalancer.sim.cost import CostModel, WindowClock
from rebalancer.sim.trace import Trace
from rebalancer.wire.shape import DEEPSEEK_V3_EXPERT_BYTES, ClusterShape

PolicyName = Literal[
    "none", "static", "periodic", "adaptive", "follow", "oracle", "hindsight", "regimes"
]
POLICIES: tuple[PolicyName, ...] = get_args(PolicyName)
# Where the changing policies start: the trivial placement or the static fit.
Start = Literal["trivial", "static"]
STARTS: tuple[Start, ...] = get_args(Start)
# From-scratch algorithms of the static, periodic and reference fits
# (rebalancer.placement.ALGORITHMS without the migration-aware and reference ones).
FitAlgorithm = Literal["greedy", "balanced", "auto"]
FIT_ALGORITHMS: tuple[FitAlgorithm, ...] = get_args(FitAlgorithm)


@dataclass(frozen=True)
class PeriodicConfig:
    """The in-process EPLB baseline, in serving steps like the engines count them."""

    # SGLang --eplb-rebalance-num-iterations (1000); vLLM's step_interval is 3000.
    period_steps: int = 1000
    # Steps of counts the refit uses (SGLang's recorder buffer, vLLM's window_size: 1000).
    fit_steps: int = 1000
    # DeepSeek's greedy, what both engines run.
    algorithm: FitAlgorithm = "greedy"


@dataclass(frozen=True)
class SimConfig:
    # The simulated deployment's EP group: its layers and experts are the trace's
    # (`SimConfig.for_trace` builds it), its expert bytes what every plan's transfer is
    # charged; the adaptive policy decides under its dispatch mode, deriving the shared
    # expert's load from its top_k (0: unknown).
    shape: ClusterShape
    # The serving clock and the engines' stall; the migration parameters are the policy's.
    cost: CostModel = field(default_factory=CostModel)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    periodic: PeriodicConfig = field(default_factory=PeriodicConfig)
    # Algorithm of the from-scratch references (follow, oracle, hindsight).
    reference_algorithm: FitAlgorithm = "auto"
    # Where periodic, adaptive, follow and oracle start (STARTS): the trivial placement
    # an engine loads, or the static fit (an engine given a recorded distribution).
    start: Start = "trivial"

    @property
    def params(self) -> CostParams:
        """What moving weights costs: the adaptive policy's cost parameters, for every policy."""
        return self.policy.cost

    def check(self, trace: Trace) -> None:
        """Refuse a shape that is not `trace`'s deployment's: other layers or experts than
        the trace's."""
        self.cost.validate()
        s = self.shape
        if (s.num_layers, s.num_logical) != (trace.num_layers, trace.num_experts):
            raise InputError(
                f"shape has {s.num_layers} layers x {s.num_logical} experts, the trace "
                f"{trace.num_layers} x {trace.num_experts}"
            )
        s.validate()

    @classmethod
    def for_trace(
        cls,
        trace: Trace,
        *,
        num_slots: int,
        num_gpus: int,
        num_nodes: int = 1,
        num_groups: int = 0,
        expert_bytes: int = DEEPSEEK_V3_EXPERT_BYTES,
        **fields: Any,
    ) -> SimConfig:
        """The config of `trace`'s deployment on `num_gpus` GPUs and `num_slots` slots a
        layer, with the policy's timing derived from the trace's window length (what
        `rebalancer simulate --timing trace` does; a `policy` given is the base)."""
        shape = ClusterShape(
            num_layers=trace.num_layers,
            num_logical=trace.num_experts,
            num_slots=num_slots,
            num_gpus=num_gpus,
            num_nodes=num_nodes,
            num_groups=num_groups,
            expert_bytes=expert_bytes,
        )
        config = cls(shape=shape, **fields)
        return replace(config, policy=config.policy.for_windows(shape, trace.window_seconds))

    def windows_for_steps(self, steps: int, trace: Trace) -> int:
        """How many trace windows hold `steps` serving steps (at least one)."""
        steps_per_window = trace.window_seconds / self.policy.cost.step_seconds
        return max(1, int(round(steps / steps_per_window)))


@dataclass
class PolicyResult:
    policy: str
    windows: int
    mean_balancedness: float
    relative_throughput: float
    rebalances: int
    slots_moved: int
    bytes_moved: int
    stall_seconds: float
    overlap_seconds: float
    serving_seconds: float
    ideal_seconds: float
    decisions: dict[str, int] = field(default_factory=dict)
    plans_aborted: int = 0
    balancedness_per_window: list[float] = field(default_factory=list, repr=False)
    rebalance_windows: list[int] = field(default_factory=list, repr=False)
    # adaptive: per decision, the window it followed, the virtual time, whether a plan was
    # in flight, the placement served, and the Decision (to replay through the controller).
    decision_log: list[dict[str, Any]] = field(default_factory=list, repr=False)
    # The placement serving each window (from its start), for the per-step model.
    placements: list[np.ndarray] = field(default_factory=list, repr=False)
    # Per-step balance under each dispatch mode (sim/steps.py), when asked for.
    dispatch: dict[str, Any] = field(default_factory=dict, repr=False)
    # adaptive with the per-step model: its plans when deciding under each dispatch mode.
    dispatch_decisions: dict[str, Any] = field(default_factory=dict, repr=False)

    def summary(self) -> dict[str, Any]:
        """The JSON-ready figures (without the per-window series)."""
        out: dict[str, Any] = {
            "policy": self.policy,
            "windows": self.windows,
            "mean_balancedness": round(self.mean_balancedness, 6),
            "relative_throughput": round(self.relative_throughput, 6),
            "rebalances": self.rebalances,
            "slots_moved": self.slots_moved,
            "bytes_moved": self.bytes_moved,
            "stall_seconds": round(self.stall_seconds, 6),
            "overlap_seconds": round(self.overlap_seconds, 6),
            "serving_seconds": round(self.serving_seconds, 6),
        }
        if self.decisions:
            out["decisions"] = dict(sorted(self.decisions.items()))
            out["plans_aborted"] = self.plans_aborted
        if self.dispatch:
            out["dispatch"] = self.dispatch
        if self.dispatch_decisions:
            out["decided_under_mode"] = self.dispatch_decisions
        return out


class _Ledger:
    """Accumulates one policy's balance and time over the windows it serves."""

    def __init__(self, trace: Trace, clock: WindowClock, num_gpus: int) -> None:
        self.trace = trace
        self.clock = clock
        self.num_gpus = num_gpus
        # Sum over layers of the mean GPU load of each window: what perfect balance costs.
        self.mean_load = trace.counts.sum(axis=2) / num_gpus  # [T, L]
        self.ideal = [clock.seconds(float(m.sum())) for m in self.mean_load]
        self.max_sum = 0.0
        self.mean_sum = 0.0
        self.serving = 0.0
        self.stall = 0.0
        self.overlap = 0.0
        self.per_window: list[float] = []
        self.rebalance_windows: list[int] = []
        self.rebalances = 0
        self.slots_moved = 0
        self.bytes_moved = 0
        self.placements: dict[int, np.ndarray] = {}

    def max_load(self, w: int, phy2log: np.ndarray) -> float:
        """Sum over layers of the busiest GPU's load of window w under a placement."""
        # The placement serving the window's start: the steps model (sim/steps.py) reads it.
        self.placements.setdefault(w, phy2log)
        return peak_load(phy2log, self.trace.counts[w], self.num_gpus)

    def served(self, w: int, max_load: float, seconds: float) -> None:
        mean = float(self.mean_load[w].sum())
        self.mean_sum += mean
        self.max_sum += max_load
        self.serving += seconds
        self.per_window.append(mean / max_load if max_load > 0 else 1.0)

    def moved(self, w: int, slots: int, nbytes: int) -> None:
        self.rebalances += 1
        self.slots_moved += slots
        self.bytes_moved += nbytes
        self.rebalance_windows.append(w)

    def result(
        self,
        name: str,
        decisions: dict[str, int] | None = None,
        decision_log: list[dict[str, Any]] | None = None,
    ) -> PolicyResult:
        total = self.serving + self.stall
        return PolicyResult(
            policy=name,
            windows=self.trace.num_windows,
            mean_balancedness=self.mean_sum / self.max_sum if self.max_sum else 1.0,
            relative_throughput=float(sum(self.ideal)) / total if total else 1.0,
            rebalances=self.rebalances,
            slots_moved=self.slots_moved,
            bytes_moved=self.bytes_moved,
            stall_seconds=self.stall,
            overlap_seconds=self.overlap,
            serving_seconds=self.serving,
            ideal_seconds=float(sum(self.ideal)),
            decisions=decisions or {},
            balancedness_per_window=self.per_window,
            rebalance_windows=self.rebalance_windows,
            decision_log=decision_log or [],
            placements=[self.placements[w] for w in sorted(self.placements)],
        )


class Simulator:
    """Runs policies over one trace; placements shared between policies are cached.

    `start` overrides where the changing policies start (a pool's placement handed to a
    joining member); `observed` [T, L, E] is what the adaptive policy's estimate sees
    instead of the trace's own counts (a pool's windows, summed over its members), while
    the trace's counts are what this deployment serves."""

    def __init__(
        self,
        trace: Trace,
        config: SimConfig,
        start: np.ndarray | None = None,
        observed: np.ndarray | None = None,
    ) -> None:
        if observed is not None and observed.shape != trace.counts.shape:
            raise InputError(
                f"observed counts of shape {list(observed.shape)}, expected "
                f"{list(trace.counts.shape)} like the trace"
            )
        self._start = None if start is None else np.asarray(start)
        self._observed = trace.counts if observed is None else observed
        config.cost.validate()
        config.policy.validate()
        self.params = config.params
        self.trace = trace
        self.config = config
        config.check(trace)
        self.shape = config.shape
        if config.periodic.period_steps <= 0 or config.periodic.fit_steps <= 0:
            raise InputError("periodic period_steps and fit_steps must be > 0")
        if config.start not in STARTS:
            raise InputError(f"unknown start {config.start!r}; expected one of {', '.join(STARTS)}")
        for what, algorithm in (
            ("periodic algorithm", config.periodic.algorithm),
            ("reference_algorithm", config.reference_algorithm),
        ):
            if algorithm not in FIT_ALGORITHMS:
                raise InputError(
                    f"unknown {what} {algorithm!r}; expected one of {', '.join(FIT_ALGORITHMS)}"
                )
        self.clock = WindowClock.calibrate(
            config.cost, self.params, trace.counts, trace.window_seconds, config.shape.num_gpus
        )
        self.period_windows = config.windows_for_steps(config.periodic.period_steps, trace)
        self.fit_windows = config.windows_for_steps(config.periodic.fit_steps, trace)
        self._fits: dict[tuple[int, int, str], np.ndarray] = {}

    # -- placements ------------------------------------------------------------------

    def _fit(self, start: int, stop: int, algorithm: str) -> np.ndarray:
        """From-scratch placement on the summed counts of windows [start, stop)."""
        key = (start, stop, algorithm)
        if key not in self._fits:
            c = self.shape
            load = self.trace.counts[start:stop].sum(axis=0)
            self._fits[key] = np.asarray(
                compute_placement(
                    load,
                    c.num_slots,
                    c.num_gpus,
                    num_nodes=c.num_nodes,
                    num_groups=c.num_groups or None,
                    algorithm=algorithm,
                ).phy2log
            )
        return self._fits[key]

    def trivial(self) -> np.ndarray:
        s = self.shape
        return np.asarray(trivial_placement(s.num_layers, s.num_logical, s.num_slots, s.num_gpus))

    def static_placement(self) -> np.ndarray:
        """The static fit: the engines' greedy on the first `fit_steps` of windows."""
        fit = min(self.fit_windows, self.trace.num_windows)
        return self._fit(0, fit, self.config.periodic.algorithm)

    def start_placement(self) -> np.ndarray:
        """Where every changing policy starts (`start`, else `SimConfig.start`)."""
        if self._start is not None:
            return self._start
        return self.trivial() if self.config.start == "trivial" else self.static_placement()

    def _move(self, old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, float, int]:
        """Transfer list from `old` to `new`, its transfer seconds and bytes between GPUs."""
        s = self.shape
        rows = np.asarray(transfers(old, new, s.num_gpus, s.num_nodes))
        seconds = transfer_seconds(rows, s.num_gpus, s.num_nodes, s.expert_bytes, self.params)
        return rows, seconds, bytes_between_gpus(rows, s.expert_bytes)

    # -- policies --------------------------------------------------------------------

    def run(self, policy: str) -> PolicyResult:
        runners: dict[str, Callable[[], PolicyResult]] = {
            "none": self._frozen_none,
            "static": self._frozen_static,
            "periodic": self._periodic,
            "adaptive": self._adaptive,
            "follow": self._follow,
            "oracle": self._oracle,
            "hindsight": self._hindsight,
            "regimes": self._regimes,
        }
        if policy not in runners:
            raise InputError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
        return runners[policy]()

    def _frozen(self, name: str, phy2log: np.ndarray) -> PolicyResult:
        ledger = _Ledger(self.trace, self.clock, self.shape.num_gpus)
        for w in range(self.trace.num_windows):
            m = ledger.max_load(w, phy2log)
            ledger.served(w, m, self.clock.seconds(m))
        return ledger.result(name)

    def _frozen_none(self) -> PolicyResult:
        return self._frozen("none", self.trivial())

    def _frozen_static(self) -> PolicyResult:
        return self._frozen("static", self.static_placement())

    def _periodic(self) -> PolicyResult:
        cost = self.config.cost
        ledger = _Ledger(self.trace, self.clock, self.shape.num_gpus)
        current = self.start_placement()
        T = self.trace.num_windows
        for w in range(T):
            m = ledger.max_load(w, current)
            ledger.served(w, m, self.clock.seconds(m))
            if (w + 1) % self.period_windows == 0 and w + 1 < T:
                new = self._fit(
                    max(0, w + 1 - self.fit_windows), w + 1, self.config.periodic.algorithm
                )
                rows, seconds, nbytes = self._move(current, new)
                ledger.stall += max(cost.periodic_stall_seconds, seconds)
                ledger.moved(w + 1, int(rows.shape[0]), nbytes)
                current = new
        return ledger.result("periodic")

    def _refit_each(self, name: str, lag: int) -> PolicyResult:
        ledger = _Ledger(self.trace, self.clock, self.shape.num_gpus)
        algorithm = self.config.reference_algorithm
        current = self.start_placement()
        for w in range(self.trace.num_windows):
            if w - lag >= 0:
                new = self._fit(w - lag, w - lag + 1, algorithm)
                if not np.array_equal(new, current):
                    rows, _, nbytes = self._move(current, new)
                    ledger.moved(w, int(rows.shape[0]), nbytes)
                current = new
            m = ledger.max_load(w, current)
            ledger.served(w, m, self.clock.seconds(m))
        return ledger.result(name)

    def _follow(self) -> PolicyResult:
        return self._refit_each("follow", lag=1)

    def _oracle(self) -> PolicyResult:
        return self._refit_each("oracle", lag=0)

    def _hindsight(self) -> PolicyResult:
        fit = self._fit(0, self.trace.num_windows, self.config.reference_algorithm)
        return self._frozen("hindsight", fit)

    def _start_plan(
        self, current: np.ndarray, candidate: np.ndarray, now: float, version: int
    ) -> _InFlight:
        """A plan as the controller's coordinator holds it, with simulated rank timings."""
        c, s = self.config, self.shape
        rows = np.asarray(transfers(current, candidate, s.num_gpus, s.num_nodes))
        per_rank = rank_receive_seconds(rows, s.num_gpus, s.num_nodes, s.expert_bytes, self.params)
        cost = plan_cost(rows, s.num_gpus, s.num_nodes, s.expert_bytes, self.params)
        half_trip = c.cost.plan_overhead_seconds / 2.0
        plan = coordinate.Plan(
            version=version,
            base_version=version - 1,
            phy2log=np.asarray(candidate),
            transfers=rows,
            num_ranks=s.num_gpus,
            trigger="policy",
            created=now,
            deadline=now + c.policy.prepare_timeout_seconds,
            slots_moved=int(rows.shape[0]),
            bytes_moved=cost.bytes_between_gpus,
            started_at=now,
        )
        # Prepare reaches every rank half a round trip after the decision; each rank reports
        # PREPARED once its incoming experts are staged; Commit takes another half trip.
        prepared_at = now + half_trip + per_rank
        last = float(prepared_at.max())
        ends_at = last + half_trip if last <= plan.deadline else plan.deadline
        pause = cost.commit_pause_seconds + cost.swap_seconds
        return _InFlight(plan, prepared_at, ends_at, pause)

    @staticmethod
    def _finish_plan(flight: _InFlight) -> bool:
        """Drive the coordinator through the ranks' reports; True when the plan committed."""
        plan = flight.plan
        for rank in np.argsort(flight.prepared_at, kind="stable"):
            if flight.prepared_at[rank] > plan.deadline:
                break
            coordinate.on_prepared(plan, int(rank), float(flight.prepared_at[rank]))
        if plan.state is coordinate.PlanState.PREPARING:
            coordinate.on_tick(plan, plan.deadline + 1e-9)  # times out: aborted everywhere
            return False
        done = coordinate.Transition()
        for rank in range(plan.num_ranks):  # all ranks swap at the agreed step
            done = coordinate.on_committed(plan, rank, flight.ends_at)
        return done.finished

    def _regimes(self) -> PolicyResult:
        return self._adaptive("regimes")

    def _adaptive(self, name: str = "adaptive") -> PolicyResult:
        penalty = self.params.overlap_penalty
        ledger = _Ledger(self.trace, self.clock, self.shape.num_gpus)
        policy = self.config.policy
        if name == "regimes":
            policy = replace(policy, regimes=True)
        loop = PolicyLoop(self.shape, policy)
        current = self.start_placement()
        now = 0.0
        flight: _InFlight | None = None
        version = 1
        aborted = 0
        outcomes: Counter[str] = Counter()
        log: list[dict[str, Any]] = []
        for w in range(self.trace.num_windows):
            m_old = ledger.max_load(w, current)
            t_old = self.clock.seconds(m_old)
            if flight is None:
                ledger.served(w, m_old, t_old)
                now += t_old
            else:
                remaining = max(0.0, flight.ends_at - now)
                slowed = t_old * (1.0 + penalty)
                if remaining >= slowed:  # the whole window is served beside the transfers
                    ledger.served(w, m_old, slowed)
                    ledger.overlap += slowed - t_old
                    now += slowed
                else:  # the plan ends inside the window
                    part = remaining / slowed
                    committed = self._finish_plan(flight)
                    if committed:  # swap, then serve the rest on the new maps
                        new = flight.plan.phy2log
                        m_new = ledger.max_load(w, new)
                        swap = flight.pause
                        current, version = new, flight.plan.version
                    else:  # aborted: staging dropped, the old maps keep serving
                        m_new, swap = m_old, 0.0
                        aborted += 1
                    t_new = self.clock.seconds(m_new)
                    seconds = remaining + (1.0 - part) * t_new
                    ledger.served(w, part * m_old + (1.0 - part) * m_new, seconds)
                    ledger.overlap += part * (slowed - t_old)
                    ledger.stall += swap
                    now += seconds + swap
                    flight = None
            in_flight = flight is not None
            decision = loop.on_window(self._observed[w], current, now=now, in_flight=in_flight)
            if decision is None:
                continue
            outcomes[decision.outcome] += 1
            # `current` is replaced, never changed in place: keeping a reference is cheap.
            log.append(
                {
                    "window": w,
                    "now": now,
                    "in_flight": in_flight,
                    "current": current,
                    "decision": decision,
                }
            )
            if decision.take and decision.candidate is not None:
                flight = self._start_plan(current, decision.candidate, now, version + 1)
                loop.started(now)
                ledger.moved(w + 1, flight.plan.slots_moved, flight.plan.bytes_moved)
        result = ledger.result(name, dict(outcomes), log)
        result.plans_aborted = aborted
        return result


@dataclass
class _InFlight:
    """The plan in flight: the coordinator's Plan and the simulated ranks' timings."""

    plan: coordinate.Plan
    prepared_at: np.ndarray  # [G] virtual seconds at which each rank reports PREPARED
    ends_at: float  # commit (every rank swaps) or abort at the prepare deadline
    pause: float  # staged weights into live slots + map swap, between two replays


def simulate(trace: Trace, config: SimConfig, policies: Sequence[str]) -> dict[str, PolicyResult]:
    """Run the named policies over one trace; results keyed by policy name."""
    for name in policies:
        if name not in POLICIES:
            raise InputError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
    sim = Simulator(trace, config)
    return {name: sim.run(name) for name in policies}


def relative(results: dict[str, PolicyResult], policy: str, reference: str) -> float:
    """`policy`'s relative throughput as a share of `reference`'s (nan if either is absent)."""
    if policy not in results or reference not in results:
        return math.nan
    return results[policy].relative_throughput / results[reference].relative_throughput
