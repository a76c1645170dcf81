"""The per-deployment decision loop: fold a window, and when a decision is due, decide.

The live controller and the simulator both drive a `PolicyLoop` (the controller on the
wall clock as merged windows arrive, the simulator on a virtual clock as it replays a
trace), so they keep the same estimate and take the same decisions on the same input.
The loop starts nothing itself: a decision with `take` set hands its candidate to the
caller, which builds and runs the plan (coordinator in the controller, the transfer model
in the simulator) and calls `started` once it has: only a plan that started counts as
the last rebalance (a take the controller could not start, ranks missing, does not).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from rebalancer.controller.decide import Decision, PolicyConfig, decide
from rebalancer.controller.estimate import EstimateSums, LoadEstimator
from rebalancer.controller.regimes import RegimeLibrary, decide_regimes
from rebalancer.wire.shape import ClusterShape

# Windows the regimes policy keeps for its next decision (while paused, say): the newest.
MAX_PENDING_WINDOWS = 64


class PolicyLoop:
    """Estimate + decision timing for one deployment."""

    def __init__(self, shape: ClusterShape, policy: PolicyConfig) -> None:
        shape.validate()
        policy.validate()
        self.shape = shape
        self.policy = policy
        self.estimator = LoadEstimator(shape.num_layers, shape.num_logical, policy.estimator)
        self.last_decision_time: float | None = None
        self.last_rebalance: float | None = None
        self.last_decision: Decision | None = None
        # The regimes policy (policy.regimes): the library, and the windows folded since
        # the last decision, which the next decision adds to it.
        self.regimes: RegimeLibrary | None = RegimeLibrary() if policy.regimes else None
        self._pending: list[np.ndarray] = []

    def set_policy(self, policy: PolicyConfig) -> None:
        """Switch policy; the estimate is kept unless its mode (decay vs window) changes."""
        policy.validate()
        new = policy.estimator
        old = self.estimator.config
        if (new.window > 0) != (old.window > 0) or (new.window > 0 and new.window != old.window):
            # The stored state of one mode cannot feed the other: start the estimate afresh.
            self.estimator = LoadEstimator(self.shape.num_layers, self.shape.num_logical, new)
        else:
            self.estimator.config = new
        self.policy = dataclasses.replace(policy)
        if policy.regimes and self.regimes is None:
            self.regimes = RegimeLibrary()

    def restore_regimes(self, library: RegimeLibrary) -> None:
        """The regime library read back from the store (a restart)."""
        self.regimes = library

    def observe(self, counts: np.ndarray, checked: bool = False) -> None:
        """Fold one window of counts [L, E], summed over the deployment's ranks
        (`checked`: validated already, LoadEstimator.add)."""
        self.estimator.add(counts, checked)
        if self.policy.regimes:
            self._pending.append(np.array(counts, dtype=np.float64, copy=True))
            del self._pending[:-MAX_PENDING_WINDOWS]

    def due(self, now: float) -> bool:
        """Whether a decision period has passed since the last decision."""
        return (
            self.last_decision_time is None
            or now - self.last_decision_time >= self.policy.decision_period_seconds - 1e-9
        )

    def prepare_decision(self, current: np.ndarray, now: float) -> Callable[[], Decision]:
        """The policy's decision on the inputs as they are now, to run later or elsewhere.

        Every input is copied here, so the returned call may run on another thread
        while windows keep folding (the controller does that); `record` it afterwards.
        The estimate itself is computed by the call, from a copy of the estimator's sums
        (`decide_on_sums`)."""
        sums = self.estimator.sums(copy=True)
        kwargs: dict[str, Any] = dict(
            current=np.array(current, copy=True),
            shape=self.shape,
            policy=dataclasses.replace(self.policy),
            now=now,
            last_rebalance=self.last_rebalance,
            windows=self.estimator.windows,
        )
        # A partial of a module-level function: picklable, so it can run in another process.
        if self.policy.regimes:
            if self.regimes is None:
                self.regimes = RegimeLibrary()
            pending, self._pending = [(c, now) for c in self._pending], []
            return functools.partial(
                decide_on_sums,
                decide_regimes,
                sums,
                library=self.regimes,
                pending=pending,
                **kwargs,
            )
        return functools.partial(decide_on_sums, decide, sums, **kwargs)

    def tick(self, current: np.ndarray, now: float, in_flight: bool = False) -> Decision | None:
        """Run the policy's decision if one is due and no plan is in flight, else None."""
        if in_flight or not self.due(now):
            return None
        decision = self.prepare_decision(current, now)()
        self.record(decision, now)
        return decision

    def on_window(
        self, counts: np.ndarray, current: np.ndarray, now: float, in_flight: bool = False
    ) -> Decision | None:
        """Fold a window then run `tick`: the one call per window both callers make."""
        self.observe(counts)
        return self.tick(current, now, in_flight=in_flight)

    def force(
        self,
        current: np.ndarray,
        now: float,
        dry_run: bool = False,
        max_moved_fraction: float | None = None,
    ) -> Decision:
        """An operator's forced rebalance (or dry run): the gate is skipped.

        `max_moved_fraction` overrides the policy's for this decision only. The decision
        is recorded on this loop, with or without the override; a dry run records nothing."""
        policy = self.policy
        if max_moved_fraction is not None:
            policy = dataclasses.replace(policy, max_moved_fraction=max_moved_fraction)
        estimate, effective_windows = self.estimator.estimate_and_noise()
        decision = decide(
            estimate,
            current,
            self.shape,
            policy,
            now=now,
            last_rebalance=self.last_rebalance,
            windows=self.estimator.windows,
            effective_windows=effective_windows,
            forced=not dry_run,
            dry_run=dry_run,
        )
        if not dry_run:
            self.record(decision, now)
        return decision

    def record(self, decision: Decision, now: float) -> None:
        """Note a decision taken on this loop's inputs (the controller decides off its event loop).

        A take is not a rebalance yet: the caller calls `started` when its plan starts."""
        self.last_decision_time = now
        self.last_decision = decision
        if isinstance(decision.state, RegimeLibrary):
            self.regimes = decision.state

    def started(self, now: float) -> None:
        """A plan of this loop's decision started at `now`: the min interval counts from here."""
        self.last_rebalance = now

    def amend(self, decision: Decision) -> None:
        """Replace the recorded last decision by what the caller made of it (a take it
        could not start, say); the decision and rebalance times stay as recorded."""
        self.last_decision = decision


def decide_on_sums(
    decide_fn: Callable[..., Decision], sums: EstimateSums, **inputs: Any
) -> Decision:
    """`decide_fn` (`decide` or `decide_regimes`) on the estimate computed from `sums` where
    this runs: in the decision worker, so the estimate's passes over [L, E] (most of a
    settled decision's work) stay off the controller's event loop. `inputs`: its other
    arguments."""
    estimate, effective_windows = sums.estimate_and_noise()
    return decide_fn(estimate=estimate, effective_windows=effective_windows, **inputs)
