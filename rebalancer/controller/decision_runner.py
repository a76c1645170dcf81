"""DecisionRunner: run the policy's decisions off the event loop, then record and act on them.

A due decision is computed by `background` (in the server: a worker process, see
decision_process.py) on inputs copied at the time it is due, so ingest goes on meanwhile; when it
comes back it is noted on the deployment's PolicyLoop and acted on. Acting is the same
for the policy's and an operator's decisions: store it with its numbers, and start the
plan when it says take and every rank is connected.
"""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from rebalancer.controller.clock import Clock
from rebalancer.controller.coordinate import Plan
from rebalancer.controller.decide import Decision
from rebalancer.controller.deployment import Deployment, Observers
from rebalancer.controller.plans import Plans
from rebalancer.controller.regimes import RegimeLibrary
from rebalancer.controller.store import Store

log = logging.getLogger("rebalancer.controller")

# What starts a plan: the policy's decision, or an operator's force.
TRIGGERS = ("policy", "forced")
# The outcomes of the decisions the controller records (decide.py and `act`). While a
# deployment is paused its policy does not decide; a forced decision's reason names the
# gate it skipped, skip_paused included. A dry run is not a decision.
RECORDED_OUTCOMES = (
    "rebalance",
    "forced",
    "skip_min_interval",
    "skip_min_windows",
    "skip_gain",
    "skip_no_load",
    "skip_ranks",
    "skip_store",
    "skip_mixed",
)

# Runs fn, then done(result), or done(None) if fn raised, back on the event loop thread.
Background = Callable[[Callable[[], Any], Callable[[Any], None]], None]


def run_inline(fn: Callable[[], Any], done: Callable[[Any], None]) -> None:
    """The `Background` without a worker process (tests, replays)."""
    try:
        result = fn()
    except Exception:  # a bug in one decision must not stop the next ones
        log.exception("decision failed")
        result = None
    done(result)


# Policy decisions handed to `background` and not yet back, over all deployments: one
# running and one queued keeps the worker busy. More would only queue inputs that are
# stale by the time they run, each prepared on the event loop (the estimate): with 512
# deployments due every few seconds that work made windows wait (issue 12). A deployment
# found due while the queue is full decides at one of its next windows.
MAX_DECISIONS_IN_FLIGHT = 2

# The worker's share of a core the policy's decisions may take, in the long run
# (`[server] decision_cpu_share`). A deployment's decision is due every window, and
# with thousands of them due the worker would take every cycle it can get, beside
# ingest on the same node; past the share, each deployment decides less often.
DEFAULT_DECISION_CPU_SHARE = 0.5
# Worker seconds the share lets build up while decisions are few, spent in a burst (a
# traffic shift that makes every deployment's decision fit a candidate).
DECISION_BURST_SECONDS = 1.0
# A deployment or pool counts among those sharing the worker while it decided this recently.
DECIDER_SECONDS = 60.0
# The cost of a decision is averaged over about this many of them.
COST_WINDOW = 32


# Under `[server] cpu_cores` the worker's share never drops below this: a controller whose
# own work takes every core it was given still decides, less often.
MIN_DECISION_CPU_SHARE = 0.05
# The controller process's own CPU rate (ingest, gRPC, the store's thread, scrapes) is
# measured at most once a second and averaged over about this many seconds.
CPU_RATE_SECONDS = 10.0


class DecisionBudget:
    """Worker time the policy's decisions may take: `share` seconds each wall second, up to
    DECISION_BURST_SECONDS saved up (`allows`), spread evenly over those that decide: each
    decides at most every `spacing` seconds, its share of the budget, so where the budget
    is short every deployment's decisions come less often, none is left out.

    `cores` (0: none): the cores the controller process and its worker may use together.
    The share is then what the controller's own CPU (`process_cpu`, averaged) leaves of
    them, between MIN_DECISION_CPU_SHARE and `max_share`: ingest comes first, and where
    the pod was given one core, the two stay within it.

    The worker runs one decision at a time, so a decision's worker time is from when it
    was handed over, or when the one before came back if later, to when it comes back.
    That is wall time on purpose: it includes the wait for the event loop to take the
    result, so a lagging loop gets fewer decisions (and fewer plans to start). Counting the
    worker's CPU instead (tried on issue 32) took that back-pressure away: at 65,536 ranks
    the worker went to its whole share and p99 to 15 s in the first minutes, against about
    2 s counting wall time on the same machine."""

    def __init__(
        self,
        share: float,
        clock: Callable[[], float] = time.monotonic,
        cores: float = 0.0,
        process_cpu: Callable[[], float] = time.process_time,
    ) -> None:
        self.max_share = share
        self.share = share  # the share now: max_share, less under `cores`
        self.cores = cores
        self.clock = clock
        self.process_cpu = process_cpu
        self.seconds = DECISION_BURST_SECONDS  # saved up, negative when overspent
        self.cost = 0.0  # mean worker seconds per decision
        self.busy_seconds = 0.0  # worker seconds spent, all decisions (a metric)
        self.controller_cores = 0.0  # the controller's own CPU rate, averaged (with cores)
        self._at = clock()
        self._measured = (self._at, process_cpu()) if cores > 0 else (self._at, 0.0)
        self._free_at = -math.inf  # when the worker finished its last decision
        self._deciders: dict[str, float] = {}  # who had a decision due, and when last

    def allows(self) -> bool:
        """Whether another decision may be handed over now (share 1: always)."""
        now = self.clock()
        self._measure(now)
        if self.share >= 1.0:
            return True
        self.seconds = min(DECISION_BURST_SECONDS, self.seconds + (now - self._at) * self.share)
        self._at = now
        return self.seconds > 0

    def _measure(self, now: float) -> None:
        """With `cores`: the controller's CPU rate since the last measure, into its average,
        and the share it leaves."""
        at, used = self._measured
        if self.cores <= 0 or now - at < 1.0:
            return
        cpu = self.process_cpu()
        weight = min(1.0, (now - at) / CPU_RATE_SECONDS)
        self.controller_cores += ((cpu - used) / (now - at) - self.controller_cores) * weight
        self._measured = (now, cpu)
        left = self.cores - self.controller_cores
        self.share = min(self.max_share, max(MIN_DECISION_CPU_SHARE, left))

    def spacing(self) -> float:
        """Seconds between two decisions of one deployment or pool that keep all those with
        decisions due within the share at the mean cost (0 with share 1)."""
        if self.share >= 1.0:
            return 0.0
        return len(self._deciders) * self.cost / self.share

    def wants(self, key: str) -> None:
        """`key` (a deployment or pool) has a decision due: it shares the worker."""
        now = self.clock()
        self._deciders.pop(key, None)
        self._deciders[key] = now  # the dict stays ordered oldest first
        if next(iter(self._deciders.values())) < now - DECIDER_SECONDS:
            self._deciders = {k: t for k, t in self._deciders.items() if t >= now - DECIDER_SECONDS}

    def spend(self, handed_at: float) -> None:
        """A decision handed over at `handed_at` came back now."""
        now = self.clock()
        seconds = max(0.0, now - max(handed_at, self._free_at))
        self._free_at = now
        self.seconds -= seconds
        self.busy_seconds += seconds
        self.cost += (seconds - self.cost) / (COST_WINDOW if self.cost else 1)


class DecisionRunner:
    def __init__(
        self,
        store: Store,
        clock: Clock,
        plans: Plans,
        observers: Observers,
        background: Background = run_inline,
        budget: DecisionBudget | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.plans = plans
        self.observers = observers
        self.background = background
        self.budget = budget or DecisionBudget(1.0)
        self.in_flight = 0  # decisions handed to `background`, not yet back
        self.last_outcome: dict[str, str] = {}  # deployment -> outcome of its newest decision

    def due(self, dep: Deployment, now: float) -> bool:
        """Whether the policy should decide now: no plan or decision under way, not paused,
        the ranks not on a mixed placement, and room for its decision (`has_room`)."""
        return dep.due(now) and self.has_room(dep.name, dep.last_decision, now)

    def has_room(self, key: str, last: Decision | None, now: float) -> bool:
        """Whether `key`'s due decision (a deployment's or pool's; `last`: its newest)
        may be handed to `background` at `now` (the controller's clock): fewer than
        MAX_DECISIONS_IN_FLIGHT are, the worker is within its share, and the spacing
        has passed since `last` (DecisionBudget). Asking counts `key` among those that
        share the worker, granted or not."""
        self.budget.wants(key)
        if self.in_flight >= MAX_DECISIONS_IN_FLIGHT or not self.budget.allows():
            return False
        return last is None or now - last.time >= self.budget.spacing()

    def submit(self, work: Callable[[], Any], done: Callable[[Any], None]) -> None:
        """Run `work` by `background`, counted in the decisions in flight and against the
        budget (a pool's decision: replica_pools/fleet.py; a contingency set)."""
        handed_at = self.budget.clock()

        def finish(result: Any) -> None:
            self.in_flight -= 1
            self.budget.spend(handed_at)
            done(result)

        self.in_flight += 1
        self.background(work, finish)

    def run(self, dep: Deployment, now: float) -> None:
        """The policy's decision on the inputs as they are at `now`, computed by `background`."""

        def done(decision: Decision | None) -> None:
            dep.decided(decision, now)
            if decision is None:
                return
            self.save_regimes(dep)
            if dep.plan is None:
                self.act(dep, decision, "policy", self.clock())

        self.submit(dep.decide(now), done)

    def save_regimes(self, dep: Deployment) -> None:
        """Store the deployment's regime library when it changed enough
        (`RegimeLibrary.save_due`): it survives a restart."""
        self.save_library(dep.name, dep.regime_library)

    def save_library(self, key: str, library: RegimeLibrary | None) -> None:
        """Store a regime library under `key` (a deployment's name, or `pool_key`) when it
        changed enough."""
        if library is None or not library.save_due():
            return
        try:
            self.store.save_regimes(key, *library.changes())
        except sqlite3.Error as exc:  # kept in memory; the next decision tries again
            log.error("%s: the store refused the regime library (%s)", key, exc)
        else:
            library.mark_saved()

    def act(self, dep: Deployment, decision: Decision, trigger: str, now: float) -> Plan | None:
        """Record a decision; start its plan when it says so and every rank is there."""
        plan = None
        candidate = decision.candidate
        if decision.take and candidate is not None:
            refused = dep.why_no_plan()
            if refused is not None:
                decision = replace(decision, outcome=refused[0], reason=refused[1])
                dep.amend(decision)
            else:
                try:
                    plan = self.plans.start(dep, candidate, trigger, now)
                except sqlite3.Error as exc:  # nothing changed: the plan is stored before it starts
                    decision = replace(
                        decision, outcome="skip_store", reason=f"the store refused the plan: {exc}"
                    )
                    dep.amend(decision)
                else:
                    dep.rebalanced(now)  # only a plan that started is a rebalance
        record = decision.to_dict()
        record.update(time=now, plan_version=plan.version if plan else 0)
        try:
            self.store.record_decision(dep.name, record)
        except sqlite3.Error as exc:  # a full or read-only disk: the history misses this one
            log.error("%s: the store refused a decision record (%s)", dep.name, exc)
        # A decision every period would be a line per deployment per second: INFO when
        # the outcome changes, a plan starts or an operator asked; the repeats at DEBUG.
        repeated = (
            trigger == "policy"
            and plan is None
            and self.last_outcome.get(dep.name) == decision.outcome
        )
        self.last_outcome[dep.name] = decision.outcome
        log.log(
            logging.DEBUG if repeated else logging.INFO,
            "%s decision: %s (%s)",
            dep.name,
            decision.outcome,
            decision.reason,
        )
        for observer in self.observers.decision:
            observer(dep.name, decision, trigger)
        return plan
