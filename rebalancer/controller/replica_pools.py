"""Replica pools: deployments of one model behind one endpoint, balanced together.

(Not the decision worker process of decision_process.py: a *replica pool* is a group of deployments.)

A deployment names its pool at Register (`RegisterRequest.pool`). Every member has the
pool's shape and dispatch mode. The pool keeps one load estimate from the windows of
every member that follows it, and one placement: a pool decision runs once on the pool's
estimate (the same `PolicyLoop` and decision as a deployment's), and its candidate is
rolled out to the members as each member's own plan (its own versions, transfers from
what it serves, its own commit), at most `max_moving` members at a time.

Divergence: each member window is compared with the pool estimate (`divergence`); a
member whose windows stop matching is taken out of the pool estimate and balanced alone
(its own policy decisions, as without a pool) until its windows match again.

Warm start: a fresh member (placement v0, no plan ever committed) is offered the pool's
placement at Register (registry.py; the contract is the proto's RegisterResponse.warm_start).

`ReplicaPool` owns a pool's state and changes only through its transitions (join, leave,
observe, take, diverge, ...); `ReplicaPools` holds them and decides when.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rebalancer.controller.decide import Decision, PolicyConfig
from rebalancer.controller.deployment import Deployment, shape_key
from rebalancer.controller.policy_loop import PolicyLoop
from rebalancer.controller.regimes import RegimeLibrary
from rebalancer.errors import StateError
from rebalancer.wire.shape import ClusterShape

log = logging.getLogger("rebalancer.controller")

# Members of one pool with a plan toward the pool placement in flight at once (the
# rolling cap; ControllerConfig.pool_max_moving, [server] pool_max_moving): one keeps the
# pool's capacity loss to one replica's migration.
DEFAULT_MAX_MOVING = 1

# The trigger of a plan (and the record of a decision) that rolls a pool placement out.
POOL_TRIGGER = "pool"


@dataclass(frozen=True)
class DivergenceConfig:
    """When a member's windows stop matching the pool's estimate (docs/operations.md
    "Pools" justifies the numbers).

    The statistic of one window is its excess total variation: per layer, the total
    variation distance between the window's routed-count distribution and the pool
    estimate's, minus what multinomial sampling noise of that many picks gives on
    average (`sampling_tv`), averaged over layers. A member is diverged after `windows`
    windows in a row above `threshold`, and follows the pool again after `windows` in a
    row below `threshold / 2` (hysteresis: a member near the line does not flap)."""

    threshold: float = 0.05
    windows: int = 3

    def validate(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"divergence threshold must be in (0, 1), got {self.threshold}")
        if self.windows < 1:
            raise ValueError(f"divergence windows must be >= 1, got {self.windows}")


def sampling_tv(p: np.ndarray, picks: np.ndarray) -> np.ndarray:
    """Expected total variation between an empirical distribution of `picks` multinomial
    draws from `p` [L, E] and `p` itself, per layer (normal approximation of each count:
    E|X - np| = sqrt(2 n p (1-p) / pi))."""
    n = np.maximum(picks, 1.0)
    return 0.5 * np.sqrt(2.0 / (math.pi * n)) * np.sqrt(p * (1.0 - p)).sum(axis=1)


def excess_tv(window: np.ndarray, reference: np.ndarray) -> float:
    """The divergence statistic of one window [L, E] against the pool's reference
    distribution [L, E] (any positive scale per layer; DivergenceConfig). NaN when either
    has no load on every layer. A few passes over [L, E]: it runs for every member window."""
    picks = window.sum(axis=1)
    mass = reference.sum(axis=1)
    layers = (picks > 0) & (mass > 0)
    if not layers.any():
        return float("nan")
    q = window[layers] / picks[layers, None]
    p = reference[layers] / mass[layers, None]
    tv = 0.5 * np.abs(q - p).sum(axis=1)
    return float(np.mean(tv - sampling_tv(p, picks[layers])))


# The pool's reference distribution for the divergence test is a decayed sum of its
# following members' windows, remembering about this many rounds of windows (one round:
# a window from each following member). Cheaper than the pool estimate (which shrinks
# and weighs), and recomputed per window, it costs ~0.1 ms at DeepSeek-V3's [58, 256].
REFERENCE_ROUNDS = 4


@dataclass
class MemberTrack:
    """A member's run of windows above (or below) the divergence line."""

    diverged: bool = False
    run: int = 0  # windows in a row on the other side of the line
    last_statistic: float = float("nan")


@dataclass
class PoolStats:
    decisions: int = 0
    placements: int = 0  # pool decisions that took a candidate
    diverged_events: int = 0  # members that left the pool estimate
    rejoined_events: int = 0  # members that matched again
    warm_offers: int = 0  # warm starts offered at Register


class ReplicaPool:
    """One pool's state; it changes only through the methods below."""

    def __init__(
        self,
        name: str,
        shape: ClusterShape,
        policy: PolicyConfig,
        max_moving: int = DEFAULT_MAX_MOVING,
        divergence: DivergenceConfig | None = None,
    ) -> None:
        if max_moving < 1:
            raise ValueError(f"max_moving must be >= 1, got {max_moving}")
        self.name = name
        self.shape = shape
        self.max_moving = max_moving
        self.divergence = divergence or DivergenceConfig()
        self.divergence.validate()
        self.loop = PolicyLoop(shape, policy)  # the pool estimate and decision timing
        # Shape fields no member has reported yet (expert_bytes: deployment.UNKNOWN_EXPERT_BYTES).
        self.unknown_fields: frozenset[str] = frozenset()
        self.members: set[str] = set()
        self.tracks: dict[str, MemberTrack] = {}
        self.version = 0  # pool placements taken so far
        self.phy2log: np.ndarray | None = None  # the pool placement; None before the first
        self.reference: np.ndarray | None = None  # decayed sum of following windows (divergence)
        self.deciding = False
        self.stats = PoolStats()

    def set_shape(self, shape: ClusterShape, unknown: frozenset[str]) -> None:
        """The pool's shape and the fields of it no member reported yet (at creation or
        load; and once a member reports its expert bytes: fleet.py `_fill_unknown`)."""
        self.shape = self.loop.shape = shape
        self.unknown_fields = unknown

    # -- views -------------------------------------------------------------------

    def following(self) -> list[str]:
        """Members in the pool estimate (not diverged), sorted."""
        return sorted(m for m in self.members if not self.tracks[m].diverged)

    def diverged(self) -> list[str]:
        return sorted(m for m in self.members if self.tracks[m].diverged)

    def is_following(self, name: str) -> bool:
        return name in self.members and not self.tracks[name].diverged

    # -- transitions -------------------------------------------------------------

    def join(self, name: str) -> None:
        if name not in self.members:
            self.members.add(name)
            self.tracks[name] = MemberTrack()

    def leave(self, name: str) -> None:
        self.members.discard(name)
        self.tracks.pop(name, None)

    def observe(self, logical: np.ndarray) -> None:
        """A following member's merged window into the pool estimate and the reference."""
        self.loop.observe(logical, checked=True)  # a member's merged window, checked at decode
        if self.reference is None:
            self.reference = np.array(logical, dtype=np.float64)
        else:
            decay = 1.0 - 1.0 / (REFERENCE_ROUNDS * max(1, len(self.following())))
            self.reference *= decay
            self.reference += logical

    def test_window(self, name: str, logical: np.ndarray) -> str | None:
        """Run the divergence test of one member window against the pool estimate.
        Returns "diverged" or "rejoined" when the member changes side, else None."""
        track = self.tracks[name]
        if self.reference is None:
            return None
        statistic = excess_tv(logical, self.reference)
        track.last_statistic = statistic
        if not math.isfinite(statistic):
            return None
        line = self.divergence.threshold / 2 if track.diverged else self.divergence.threshold
        crossing = statistic < line if track.diverged else statistic > line
        track.run = track.run + 1 if crossing else 0
        if track.run < self.divergence.windows:
            return None
        track.diverged, track.run = not track.diverged, 0
        if track.diverged:
            self.stats.diverged_events += 1
            return "diverged"
        self.stats.rejoined_events += 1
        return "rejoined"

    def decision_started(self) -> None:
        self.deciding = True

    def restore_regimes(self, library: RegimeLibrary) -> None:
        """The pool's regime library the store kept (a restart)."""
        self.loop.restore_regimes(library)

    def decision_done(self, decision: Decision | None, now: float) -> None:
        self.deciding = False
        if decision is None:
            return
        self.loop.record(decision, now)
        self.stats.decisions += 1

    def take(self, phy2log: np.ndarray) -> None:
        """A pool decision's candidate is the pool placement now."""
        self.phy2log = np.array(phy2log, copy=True)
        self.version += 1
        self.stats.placements += 1

    def restore(self, version: int, phy2log: np.ndarray | None) -> None:
        """The stored pool placement (a controller restart)."""
        self.version, self.phy2log = version, phy2log

    def offered(self) -> None:
        self.stats.warm_offers += 1


def check_member_shape(
    pool: ReplicaPool, deployment: str, shape: ClusterShape, unknown: frozenset[str] = frozenset()
) -> None:
    """FAILED_PRECONDITION naming the first field on which `shape` differs from the pool's;
    a field unknown to the pool or to the registration (`unknown`) is not compared."""
    ours, theirs = shape_key(pool.shape), shape_key(shape)
    for key in ours:
        if key == "top_k" and (not ours[key] or not theirs[key]):
            continue  # 0: unknown, as for a deployment's own ranks
        if key in unknown or key in pool.unknown_fields:
            continue
        if ours[key] != theirs[key]:
            what = "dispatch mode" if key == "dispatch_mode" else f"shape field {key}"
            raise StateError(
                "FAILED_PRECONDITION",
                f"deployment {deployment!r} cannot join pool {pool.name!r}: its {what} is "
                f"{theirs[key]!r}, the pool's {ours[key]!r}",
            )


@dataclass
class PoolObservers:
    """(pool, member, what) with what "diverged" or "rejoined"; (pool, decision)."""

    member: list[Callable[[str, str, str], None]] = field(default_factory=list)
    decision: list[Callable[[str, Decision], None]] = field(default_factory=list)


def members_moving(pool: ReplicaPool, deployments: dict[str, Deployment]) -> list[str]:
    """Following members with a plan toward the pool placement in flight."""
    return [
        m
        for m in pool.following()
        if (dep := deployments.get(m)) is not None
        and dep.plan is not None
        and dep.plan.trigger == POOL_TRIGGER
    ]


def at_target(pool: ReplicaPool, dep: Deployment) -> bool:
    """Whether a member serves the pool placement (True when the pool has none yet)."""
    return pool.phy2log is None or bool(np.array_equal(dep.phy2log, pool.phy2log))
