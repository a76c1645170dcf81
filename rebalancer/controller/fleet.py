"""The controller's replica pools: membership, warm offers, pool decisions, rolling.

What a pool is: replica_pools.py. Here the controller's side of it, on the same store,
clock, registry, decision runner and plans as everything else:

- `check_join` (before a Register changes anything) and `joined` (after): membership,
  stored; the pool's shape is its first member's.
- `warm_offer`: the pool placement for a fresh member (contract: the proto's
  RegisterResponse.warm_start), stored as an "offered" plan version.
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
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np

from rebalancer import placement
from rebalancer.controller.clock import Clock
from rebalancer.controller.coordinate import Plan
from rebalancer.controller.decide import Decision, PolicyConfig
from rebalancer.controller.decision_runner import DecisionRunner
from rebalancer.controller.deployment import (
    UNKNOWN_EXPERT_BYTES,
    Deployment,
    shape_key,
    stored_shape,
)
from rebalancer.controller.plans import Plans
from rebalancer.controller.regimes import RegimeLibrary, copy_library, pool_key
from rebalancer.controller.registry import Registry
from rebalancer.controller.replica_pools import (
    DEFAULT_MAX_MOVING,
    POOL_TRIGGER,
    DivergenceConfig,
    PoolObservers,
    ReplicaPool,
    at_target,
    check_member_shape,
    members_moving,
)
from rebalancer.controller.store import Store
from rebalancer.errors import StateError
from rebalancer.wire.shape import ClusterShape

log = logging.getLogger("rebalancer.controller")

# How long a member offered a warm start is left to install it before the rolling plans
# from what the controller holds (its v0): ten times the hooks' default wait.
OFFER_GRACE_SECONDS = 30.0


@dataclass(frozen=True)
class MemberMove:
    """One member's share of a pool rebalance: what its own plan would move."""

    deployment: str
    version: int  # the placement it serves
    slots_moved: int
    bytes_to_move: int
    moved_fraction: float
    diverged: bool  # balanced alone: not rolled to, moves nothing


class Fleet:
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
        self.member_of: dict[str, str] = {}  # deployment -> its pool
        # Members offered a warm start, and when: not rolled to until their ranks confirm
        # it or OFFER_GRACE_SECONDS pass (a plan on v0 would be refused by ranks on W).
        self.offered_at: dict[str, float] = {}
        self.observers = PoolObservers()

    def load(self) -> None:
        """Pools and membership back from the store (a restart)."""
        for name, shape, version, phy2log in self.store.load_pools():
            pool = self._new_pool(name, ClusterShape(**cast(dict[str, Any], shape)))
            pool.set_shape(pool.shape, UNKNOWN_EXPERT_BYTES - shape.keys())
            pool.restore(version, phy2log)
            regimes = self.store.regimes(pool_key(name))
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
            self.member_of[dep_name] = pool_name

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
        name = self.member_of.get(dep.name)
        return self.pools.get(name) if name else None

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
        current = self.member_of.get(deployment, "")
        if current != pool_name:
            dep = self.registry.deployments.get(deployment)
            if dep is not None and dep.live_sessions():
                raise StateError(
                    "FAILED_PRECONDITION",
                    f"deployment {deployment!r} is in pool {current or '(none)'!r}, this registration "
                    f"names {pool_name or '(none)'!r}; a deployment moves only when all its ranks restart",
                )
        if pool_name and pool_name in self.pools:
            check_member_shape(self.pools[pool_name], deployment, shape, unknown)

    def joined(self, dep: Deployment, pool_name: str) -> None:
        """After a registration `check_join` passed: the deployment is in `pool_name`."""
        current = self.member_of.get(dep.name, "")
        if current == pool_name:
            if pool_name:
                self._fill_unknown(self.pools[pool_name], dep)
            return
        if current:
            self.pools[current].leave(dep.name)
            del self.member_of[dep.name]
            log.info("deployment %s left pool %s", dep.name, current)
        if pool_name:
            pool = self.pools.get(pool_name)
            if pool is None:
                pool = self._new_pool(pool_name, dep.shape)
                pool.set_shape(dep.shape, dep.unknown_fields & UNKNOWN_EXPERT_BYTES)
                self.store.save_pool(
                    pool_name, stored_shape(dep.shape, pool.unknown_fields), 0, None
                )
                log.info("new pool %s: %s", pool_name, shape_key(dep.shape))
            else:
                self._fill_unknown(pool, dep)
            pool.join(dep.name)
            self.member_of[dep.name] = pool_name
            library = pool.loop.regimes
            if (
                library is not None
                and library.regimes
                and not (dep.loop.regimes and dep.loop.regimes.regimes)
            ):
                dep.restore_regimes(copy_library(library))  # a new member knows the pool's regimes
            log.info("deployment %s joined pool %s", dep.name, pool_name)
        self.store.set_pool_member(dep.name, pool_name)

    def _fill_unknown(self, pool: ReplicaPool, dep: Deployment) -> None:
        """The pool's expert bytes, unknown to the member that created it, from the first
        member that knows them (a member's shape was checked against the pool's)."""
        if "expert_bytes" not in pool.unknown_fields or "expert_bytes" in dep.unknown_fields:
            return
        pool.set_shape(
            replace(pool.shape, expert_bytes=dep.shape.expert_bytes),
            pool.unknown_fields - UNKNOWN_EXPERT_BYTES,
        )
        self.store.save_pool(
            pool.name, stored_shape(pool.shape, pool.unknown_fields), pool.version, pool.phy2log
        )
        log.info("pool %s: expert_bytes %d from %s", pool.name, pool.shape.expert_bytes, dep.name)

    def warm_offer(self, dep: Deployment, version: int) -> tuple[int, np.ndarray] | None:
        """The warm start for a registration serving `version` (contract in the module
        docstring of replica_pools.py and the proto), or None."""
        pool = self.pool_of(dep)
        if pool is None or pool.phy2log is None or version != 0:
            return None
        if dep.version != 0 or dep.plan is not None or dep.mixed is not None:
            return None
        newest = self.store.plans(dep.name, 1)
        if newest and newest[0].state == "offered":
            offered = self.store.placement(dep.name, newest[0].version)
            if offered is not None:
                return newest[0].version, offered
        if newest and newest[0].state == "committed":
            return None
        if np.array_equal(dep.phy2log, pool.phy2log):
            return None
        w = max(self.store.max_version(dep.name), dep.version) + 1
        try:
            self.store.offer_plan(dep.name, w, pool.phy2log, now=self.clock())
        except (sqlite3.Error, StateError) as exc:  # no offer: the member starts as without a pool
            log.error("%s: warm start not offered, the store refused it: %s", dep.name, exc)
            return None
        pool.offered()
        self.offered_at[dep.name] = self.clock()
        log.info("%s: pool %s placement offered as v%d (warm start)", dep.name, pool.name, w)
        return w, pool.phy2log

    # -- windows and decisions ---------------------------------------------------

    def folded(self, dep: Deployment, logical: np.ndarray, now: float) -> bool:
        """A member's merged window folded into its own estimate: the divergence test, the
        pool estimate, the pool's decision. True when the pool decides for this member
        (it follows the pool), False when it decides alone (no pool, or diverged)."""
        pool = self.pool_of(dep)
        if pool is None:
            return False
        change = pool.test_window(dep.name, logical)
        if change is not None:
            statistic = pool.tracks[dep.name].last_statistic
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
        if not pool.is_following(dep.name):
            return False
        if pool.tracks[dep.name].run == 0:
            # A window above the line is held out of the pool estimate even before its
            # member is flagged: otherwise a few of them pull the estimate toward it (the
            # estimate weighs recent windows most) and the member is never flagged.
            pool.observe(logical)
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
            f"(threshold {pool.divergence.threshold:.3f}, {pool.divergence.windows} windows in a row)",
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
            pool.deciding
            or not pool.loop.due(now)
            or not self.decisions.has_room()
            or members_moving(pool, self.registry.deployments)
        ):
            return
        base = self._base(pool)
        if base is None:
            return
        work = pool.loop.prepare_decision(base, now)
        pool.decision_started()

        def done(decision: Decision | None) -> None:
            pool.decision_done(decision, now)
            self.decisions.save_library(pool_key(pool.name), pool.loop.regimes)
            if decision is not None:
                self._act(pool, decision, "policy", self.clock())

        self.decisions.submit(work, done)

    def _act(self, pool: ReplicaPool, decision: Decision, trigger: str, now: float) -> list[Plan]:
        if decision.take and decision.candidate is not None:
            pool.take(decision.candidate)
            pool.loop.started(now)  # the pool's rebalance: its placement changes now
            try:
                self.store.save_pool(
                    pool.name,
                    stored_shape(pool.shape, pool.unknown_fields),
                    pool.version,
                    pool.phy2log,
                )
            except sqlite3.Error as exc:
                log.error("pool %s: the store refused the pool placement (%s)", pool.name, exc)
            log.info(
                "pool %s: placement %d (%s): %s", pool.name, pool.version, trigger, decision.reason
            )
        elif trigger == "forced" or decision.outcome != (
            pool.loop.last_decision.outcome if pool.loop.last_decision else ""
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
        moving = len(members_moving(pool, deployments))
        started = []
        for name in pool.following():
            if moving >= pool.max_moving:
                break
            dep = deployments.get(name)
            if (
                dep is None
                or dep.plan is not None
                or dep.deciding
                or dep.mixed is not None
                or dep.policy.paused
                or dep.connected_ranks < dep.shape.num_gpus
                or at_target(pool, dep)
                or self._warm_pending(dep, now)
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

    def _warm_pending(self, dep: Deployment, now: float) -> bool:
        """Whether the member's ranks may still be installing the warm start offered."""
        at = self.offered_at.get(dep.name)
        if at is None:
            return False
        if dep.version != 0 or now - at >= OFFER_GRACE_SECONDS:
            del self.offered_at[dep.name]
            return False
        return True

    def _record_roll(self, dep: Deployment, pool: ReplicaPool, plan: Plan, now: float) -> None:
        """The pool decision a member's plan carries out, in the member's history."""
        decision = pool.loop.last_decision
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

    def tick(self, now: float) -> None:
        """Rolling goes on as plans end and members connect (the controller ticks every
        fraction of a second)."""
        for pool in self.pools.values():
            self.roll(pool, now)

    # -- operators ---------------------------------------------------------------

    def member_moves(self, pool_name: str, candidate: np.ndarray) -> list[MemberMove]:
        """Each member's own move to `candidate`, as `roll` would plan it: from the placement
        the member serves, which is not the pool's last one for a member balanced alone
        while diverged (or one that has not taken the pool placement yet). A diverged member
        is not rolled to: listed, moving nothing."""
        pool = self.pool(pool_name)
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
        if pool.loop.estimator.windows == 0:
            raise StateError(
                "FAILED_PRECONDITION", f"no counts ingested yet for pool {pool_name!r}"
            )
        if max_moved_fraction and not 0.0 < max_moved_fraction <= 1.0:
            raise StateError(
                "INVALID_ARGUMENT",
                f"max_moved_fraction must be in (0, 1], got {max_moved_fraction}",
            )
        moving = members_moving(pool, self.registry.deployments)
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
        decision = pool.loop.force(
            base, now, dry_run=dry_run, max_moved_fraction=max_moved_fraction or None
        )
        if dry_run:
            return decision, []
        return decision, self._act(pool, decision, "forced", now)
