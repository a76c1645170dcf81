"""The controller's replica pools: membership, warm offers, pool decisions, rolling.

What a pool is: the package's docstring (__init__.py); each pool's state and transitions:
replica_pool.py. Here the I/O and orchestration, on the same store, clock, registry,
decision runner and plans as everything else:

- `check_join` (before a Register changes anything) and `joined` (after): membership,
  stored; the pool's shape is its first member's.
- `warm_offer`: the pool placement for a fresh member (warm_start.py).
- `folded`: each member window: the divergence test, then into the pool estimate if the
  member follows the pool; a following member's decisions are the pool's (one decision
  per pool instead of one per member); a diverged member decides alone.
- `roll`: the pool placement is started as a plan on each following member that does not
  serve it, at most `max_moving` at a time (on each pool decision, each plan's end and
  each tick).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from rebalancer import placement
from rebalancer.controller.clock import Clock
from rebalancer.controller.coordinate import Plan
from rebalancer.controller.decide import Decision, PolicyConfig
from rebalancer.controller.decision_runner import DecisionRunner
from rebalancer.controller.deployment import Deployment, check_moved_fraction
from rebalancer.controller.plans import Plans
from rebalancer.controller.regimes import RegimeLibrary
from rebalancer.controller.registry import Registry
from rebalancer.controller.replica_pools.divergence import DivergenceConfig
from rebalancer.controller.replica_pools.replica_pool import (
    DEFAULT_MAX_MOVING,
    POOL_TRIGGER,
    ReplicaPool,
)
from rebalancer.controller.replica_pools.warm_start import WarmStarts
from rebalancer.controller.store import Store
from rebalancer.errors import StateError
from rebalancer.wire.shape import UNKNOWN_EXPERT_BYTES, ClusterShape, shape_key

log = logging.getLogger("rebalancer.controller")


@dataclass(frozen=True)
class MemberMove:
    """One member's share of a pool rebalance: what its own plan would move."""

    deployment: str
    version: int  # the placement it serves
    slots_moved: int
    bytes_to_move: int
    moved_fraction: float
    diverged: bool  # balanced alone: not rolled to, moves nothing


@dataclass
class PoolObservers:
    """(pool, member, what) with what "diverged" or "rejoined"; (pool, decision)."""

    member: list[Callable[[str, str, str], None]] = field(default_factory=list)
    decision: list[Callable[[str, Decision], None]] = field(default_factory=list)


class Fleet:
    """Every replica pool, which deployment is in which, and the pools' I/O: the store,
    the registry's deployments, the decision runner and the plans."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        registry: Registry,
        decisions: DecisionRunner,
        plans: Plans,
        policy: PolicyConfig,
        max_moving: int = DEFAULT_MAX_MOVING,
        divergence: DivergenceConfig | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.registry = registry
        self.decisions = decisions
        self.plans = plans
        self.policy = policy
        self.max_moving = max_moving
        self.divergence = divergence or DivergenceConfig()
        self.pools: dict[str, ReplicaPool] = {}
        self.member_of: dict[str, ReplicaPool] = {}  # deployment -> its pool
        self.warm = WarmStarts(store, clock)
        self.observers = PoolObservers()

    def load(self) -> None:
        """Pools and membership back from the store (a restart)."""
        for name, shape, version, phy2log in self.store.load_pools():
            pool = self._new_pool(name, ClusterShape(**cast(dict[str, Any], shape)))
            pool.set_shape(pool.shape, UNKNOWN_EXPERT_BYTES - shape.keys())
            pool.restore(version, phy2log)
            regimes = self.store.regimes(pool.key)
            if regimes is not None:
                try:
                    pool.restore_regimes(RegimeLibrary.from_rows(*regimes))
                except (KeyError, ValueError, TypeError) as exc:  # a row this code cannot read
                    log.error("pool %s: the stored regime library is unreadable (%s)", name, exc)
        for dep_name, pool_name in self.store.pool_members().items():
            member_pool = self.pools.get(pool_name)
            if member_pool is None or dep_name not in self.registry.deployments:
                continue
            member_pool.join(dep_name)
            self.member_of[dep_name] = member_pool

    def _new_pool(self, name: str, shape: ClusterShape) -> ReplicaPool:
        pool = ReplicaPool(name, shape, self.policy, self.max_moving, self.divergence)
        self.pools[name] = pool
        return pool

    def pool(self, name: str) -> ReplicaPool:
        pool = self.pools.get(name)
        if pool is None:
            raise StateError("NOT_FOUND", f"unknown pool {name!r}")
        return pool

    def pool_of(self, dep: Deployment) -> ReplicaPool | None:
        return self.member_of.get(dep.name)

    def sharing_pool(self, dep: Deployment) -> ReplicaPool | None:
        """The pool whose members serving one placement share its contingency set
        (contingency.py): `dep`'s pool, when it follows it."""
        pool = self.member_of.get(dep.name)
        if pool is None or not pool.is_following(dep.name):
            return None
        return pool

    # -- registration ------------------------------------------------------------

    def check_join(
        self,
        deployment: str,
        pool_name: str,
        shape: ClusterShape,
        unknown: frozenset[str] = frozenset(),
    ) -> None:
        """Refuse (StateError, nothing changed) a registration whose pool cannot take it
        (`unknown`: shape fields the registration does not know yet)."""
        current = self.member_of.get(deployment)
        if _name(current) != pool_name:
            dep = self.registry.deployments.get(deployment)
            if dep is not None and dep.live_sessions():
                raise StateError(
                    "FAILED_PRECONDITION",
                    f"deployment {deployment!r} is in pool {_name(current) or '(none)'!r}, this "
                    f"registration names {pool_name or '(none)'!r}; a deployment moves only when "
                    "all its ranks restart",
                )
        if pool_name and pool_name in self.pools:
            self.pools[pool_name].check_member(deployment, shape, unknown)

    def joined(self, dep: Deployment, pool_name: str) -> None:
        """After a registration `check_join` passed: the deployment is in `pool_name`."""
        current = self.member_of.get(dep.name)
        if _name(current) == pool_name:
            if current is not None:
                self._learn_shape(current, dep)
            return
        if current is not None:
            current.leave(dep.name)
            del self.member_of[dep.name]
            log.info("deployment %s left pool %s", dep.name, current.name)
        if pool_name:
            pool = self.pools.get(pool_name)
            if pool is None:
                pool = self._create(pool_name, dep)
            else:
                self._learn_shape(pool, dep)
            pool.welcome(dep)
            self.member_of[dep.name] = pool
            log.info("deployment %s joined pool %s", dep.name, pool_name)
        self.store.set_pool_member(dep.name, pool_name)

    def _create(self, name: str, dep: Deployment) -> ReplicaPool:
        """A pool named by its first member's Register, of that member's shape."""
        pool = self._new_pool(name, dep.shape)
        pool.set_shape(dep.shape, dep.unknown_fields & UNKNOWN_EXPERT_BYTES)
        self.store.save_pool(name, pool.stored_shape(), 0, None)
        log.info("new pool %s: %s", name, shape_key(dep.shape))
        return pool

    def _learn_shape(self, pool: ReplicaPool, dep: Deployment) -> None:
        """The pool's expert bytes from a member that knows them, stored."""
        if not pool.learn_shape(dep):
            return
        self._save(pool)
        log.info("pool %s: expert_bytes %d from %s", pool.name, pool.shape.expert_bytes, dep.name)

    def _save(self, pool: ReplicaPool) -> None:
        self.store.save_pool(pool.name, pool.stored_shape(), pool.version, pool.phy2log)

    def warm_offer(self, dep: Deployment, version: int) -> tuple[int, np.ndarray] | None:
        """The warm start for a registration serving `version` (warm_start.py and the
        proto), or None."""
        pool = self.pool_of(dep)
        return None if pool is None else self.warm.offer(pool, dep, version)

    # -- windows and decisions ---------------------------------------------------

    def folded(self, dep: Deployment, logical: np.ndarray, picks: np.ndarray, now: float) -> bool:
        """A member's merged window [L, E] (`picks`: its sums per layer [L]) folded into its
        own estimate: the divergence test, the pool estimate, the pool's decision. True
        when the pool decides for this member (it follows the pool), False when it decides
        alone (no pool, or diverged)."""
        pool = self.pool_of(dep)
        if pool is None:
            return False
        change = pool.test_window(dep.name, logical, picks)
        if change is not None:
            statistic = pool.statistic(dep.name)
            log.warning(
                "%s %s pool %s (excess total variation %.3f, threshold %.3f)",
                dep.name,
                "diverged from" if change == "diverged" else "matches again",
                pool.name,
                statistic,
                pool.divergence.threshold,
            )
            self._record_membership(dep, pool, change, statistic, now)
            for observer in self.observers.member:
                observer(pool.name, dep.name, change)
        if not pool.take_window(dep.name, logical):
            return False
        self.maybe_decide(pool, now)
        return True

    def _record_membership(
        self, dep: Deployment, pool: ReplicaPool, change: str, statistic: float, now: float
    ) -> None:
        """A member leaving or rejoining the pool estimate, in its decision history."""
        record = {
            "time": now,
            "outcome": f"pool_{change}",
            "pool": pool.name,
            "plan_version": 0,
            "reason": f"window excess total variation {statistic:.3f} against the pool's windows "
            f"(threshold {pool.divergence.threshold:.3f}, "
            f"{pool.divergence.windows} windows in a row)",
        }
        try:
            self.store.record_decision(dep.name, record)
        except sqlite3.Error as exc:
            log.error("%s: the store refused a decision record (%s)", dep.name, exc)

    def _base(self, pool: ReplicaPool) -> np.ndarray | None:
        if pool.phy2log is not None:
            return pool.phy2log
        following = pool.following()
        return self.registry.deployments[following[0]].phy2log if following else None

    def maybe_decide(self, pool: ReplicaPool, now: float) -> None:
        """The pool's policy decision when one is due and nothing of the pool is moving."""
        if (
            not pool.due(now)
            or not self.decisions.has_room(pool.key, pool.last_decision, now)
            or pool.members_moving(self.registry.deployments)
        ):
            return
        base = self._base(pool)
        if base is None:
            return
        work = pool.decide(base, now)

        def done(decision: Decision | None) -> None:
            pool.decided(decision, now)
            self.decisions.save_library(pool.key, pool.regime_library)
            if decision is not None:
                self._act(pool, decision, "policy", self.clock())

        self.decisions.submit(work, done)

    def _act(self, pool: ReplicaPool, decision: Decision, trigger: str, now: float) -> list[Plan]:
        if decision.take and decision.candidate is not None:
            pool.take(decision.candidate)
            pool.rebalanced(now)  # the pool's rebalance: its placement changes now
            try:
                self._save(pool)
            except sqlite3.Error as exc:
                log.error("pool %s: the store refused the pool placement (%s)", pool.name, exc)
            log.info(
                "pool %s: placement %d (%s): %s", pool.name, pool.version, trigger, decision.reason
            )
        elif trigger == "forced" or decision.outcome != (
            pool.last_decision.outcome if pool.last_decision else ""
        ):
            log.info("pool %s decision: %s (%s)", pool.name, decision.outcome, decision.reason)
        for observer in self.observers.decision:
            observer(pool.name, decision)
        return self.roll(pool, now) if decision.take else []

    def roll(self, pool: ReplicaPool, now: float) -> list[Plan]:
        """Start the pool placement on following members that do not serve it, keeping at
        most `max_moving` members moving."""
        if pool.phy2log is None:
            return []
        deployments = self.registry.deployments
        moving = len(pool.members_moving(deployments))
        started = []
        for name in pool.following():
            if moving >= pool.max_moving:
                break
            dep = deployments.get(name)
            if (
                dep is None
                or pool.at_target(dep)  # first: most members are, and it is remembered
                or dep.plan is not None
                or dep.deciding
                or dep.mixed is not None
                or dep.policy.paused
                or dep.connected_ranks < dep.shape.num_gpus
                or self.warm.pending(dep, now)
            ):
                continue
            try:
                plan = self.plans.start(dep, pool.phy2log, POOL_TRIGGER, now)
            except (sqlite3.Error, StateError) as exc:
                log.error("%s: pool %s plan not started: %s", name, pool.name, exc)
                continue
            started.append(plan)
            moving += 1
            self._record_roll(dep, pool, plan, now)
        return started

    def _record_roll(self, dep: Deployment, pool: ReplicaPool, plan: Plan, now: float) -> None:
        """The pool decision a member's plan carries out, in the member's history."""
        decision = pool.last_decision
        record: dict[str, Any] = (
            decision.to_dict() if decision is not None else {"outcome": "rebalance", "reason": ""}
        )
        record.update(
            time=now,
            plan_version=plan.version,
            pool=pool.name,
            reason=f"pool {pool.name} placement {pool.version}: " + str(record.get("reason", "")),
        )
        try:
            self.store.record_decision(dep.name, record)
        except sqlite3.Error as exc:
            log.error("%s: the store refused a decision record (%s)", dep.name, exc)

    def tick_steps(self, now: float) -> Iterator[None]:
        """Rolling goes on as plans end and members connect (the controller ticks every
        fraction of a second); yields after each pool that started plans (each start
        writes its plan and sends its Prepares)."""
        for pool in list(self.pools.values()):
            if self.roll(pool, now):
                yield

    # -- operators ---------------------------------------------------------------

    def member_moves(self, pool: ReplicaPool, candidate: np.ndarray) -> list[MemberMove]:
        """Each member's own move to `candidate`, as `roll` would plan it: from the placement
        the member serves, which is not the pool's last one for a member balanced alone
        while diverged (or one that has not taken the pool placement yet). A diverged member
        is not rolled to: listed, moving nothing."""
        G, N = pool.shape.num_gpus, pool.shape.num_nodes
        moves = []
        for name in sorted(pool.members):
            dep = self.registry.deployments.get(name)
            if dep is None:
                continue
            if not pool.is_following(name):
                moves.append(MemberMove(name, dep.version, 0, 0, 0.0, True))
                continue
            moved = int(placement.transfers(dep.phy2log, candidate, G, N).shape[0])
            moves.append(
                MemberMove(
                    name,
                    dep.version,
                    moved,
                    moved * int(dep.shape.expert_bytes),
                    moved / float(dep.phy2log.size),
                    False,
                )
            )
        return moves

    def force(
        self, pool_name: str, dry_run: bool = False, max_moved_fraction: float = 0.0
    ) -> tuple[Decision, list[Plan]]:
        """An operator's pool rebalance: the gate skipped, the placement rolled out."""
        pool = self.pool(pool_name)
        if pool.windows_seen == 0:
            raise StateError(
                "FAILED_PRECONDITION", f"no counts ingested yet for pool {pool_name!r}"
            )
        check_moved_fraction(max_moved_fraction)
        moving = pool.members_moving(self.registry.deployments)
        if moving and not dry_run:
            raise StateError(
                "FAILED_PRECONDITION",
                f"pool {pool_name!r} is rolling its placement {pool.version} out "
                f"(moving: {', '.join(moving)})",
            )
        base = self._base(pool)
        if base is None:
            raise StateError(
                "FAILED_PRECONDITION", f"pool {pool_name!r} has no member that follows it"
            )
        now = self.clock()
        decision = pool.force(base, now, dry_run, max_moved_fraction)
        if dry_run:
            return decision, []
        return decision, self._act(pool, decision, "forced", now)


def _name(pool: ReplicaPool | None) -> str:
    """A pool's name, "" for none (as a Register names no pool)."""
    return pool.name if pool is not None else ""
