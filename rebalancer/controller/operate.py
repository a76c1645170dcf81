"""What an operator does to a deployment: force (or dry-run) a rebalance, set its policy,
pause and resume it.

The AdminService (admin.py) translates messages; the checks and the state changes are
here, each refused with a StateError that names the gRPC status before anything changes.
"""

from __future__ import annotations

from dataclasses import replace

from rebalancer.controller.clock import Clock
from rebalancer.controller.contingency import check_scale_down_nodes
from rebalancer.controller.coordinate import Plan
from rebalancer.controller.decide import Decision, PolicyConfig
from rebalancer.controller.decision_runner import DecisionRunner
from rebalancer.controller.registry import Registry
from rebalancer.controller.store import Store
from rebalancer.errors import InputError, StateError


class Operations:
    def __init__(
        self, store: Store, clock: Clock, registry: Registry, decisions: DecisionRunner
    ) -> None:
        self.store = store
        self.clock = clock
        self.registry = registry
        self.decisions = decisions

    def force(
        self, name: str, dry_run: bool = False, max_moved_fraction: float = 0.0
    ) -> tuple[Decision, Plan | None]:
        """An operator's rebalance (`Deployment.force`): skips the gate; a dry run changes
        nothing."""
        dep = self.registry.deployment(name)
        now = self.clock()
        decision = dep.force(now, dry_run, max_moved_fraction)
        if dry_run:
            return decision, None
        plan = self.decisions.act(dep, decision, "forced", now)
        # Acting may amend it (skip_ranks: a rank is not connected): the operator is told
        # what was recorded, as status and history tell it.
        return dep.last_decision or decision, plan

    def set_policy(self, name: str, policy: PolicyConfig) -> PolicyConfig:
        dep = self.registry.deployment(name)
        try:
            policy.validate()
            if policy.contingency != dep.policy.contingency:  # declared now: for this shape
                check_scale_down_nodes(policy.contingency.scale_down_nodes, dep.shape.num_nodes)
        except InputError as exc:
            raise StateError("INVALID_ARGUMENT", str(exc)) from exc
        dep.set_policy(policy)
        self.store.set_policy(name, policy.to_stored())
        return policy

    def set_paused(self, name: str, paused: bool) -> None:
        dep = self.registry.deployment(name)
        self.set_policy(name, replace(dep.policy, paused=paused))
