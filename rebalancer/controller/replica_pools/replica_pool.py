"""One replica pool's state: its members, their divergence, the pool estimate and placement.

`ReplicaPool` owns it and changes only through its transitions (join, welcome, leave,
learn the shape, test a window (diverge or rejoin), take a window, decide, take a
placement, ...); fleet.py decides when, does the I/O and asks it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rebalancer.controller.decide import Decision, PolicyConfig
from rebalancer.controller.deployment import Deployment
from rebalancer.controller.policy_loop import PolicyLoop
from rebalancer.controller.regimes import RegimeLibrary, copy_library, pool_key
from rebalancer.controller.replica_pools.divergence import (
    REFERENCE_ROUNDS,
    DivergenceConfig,
    Expected,
    MemberTrack,
    excess_tv_of,
    expected_of,
)
from rebalancer.errors import StateError
from rebalancer.wire.shape import UNKNOWN_EXPERT_BYTES, ClusterShape, shape_key, stored_shape

# Members of one pool with a plan toward the pool placement in flight at once (the
# rolling cap; ControllerConfig.pool_max_moving, [server] pool_max_moving): one keeps the
# pool's capacity loss to one replica's migration.
DEFAULT_MAX_MOVING = 1

# The trigger of a plan (and the record of a decision) that rolls a pool placement out.
POOL_TRIGGER = "pool"


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
        # Shape fields no member has reported yet (expert_bytes: wire/shape.py
        # UNKNOWN_EXPERT_BYTES).
        self.unknown_fields: frozenset[str] = frozenset()
        self.members: set[str] = set()
        self.tracks: dict[str, MemberTrack] = {}
        self._following = 0  # members not diverged: read at every member window
        self.version = 0  # pool placements taken so far
        self.phy2log: np.ndarray | None = None  # the pool placement; None before the first
        self.reference: np.ndarray | None = None  # decayed sum of following windows (divergence)
        # The reference normalised for the test, and the windows observed since: renewed
        # once a round (a window of each following member), not at every window.
        self._expected: Expected | None = None
        self._expected_age = 0
        self.deciding = False
        self.stats = PoolStats()
        # member -> (its placement and the pool's compared, whether equal): every tick asks
        # for every member, and a placement array is replaced, never changed in place.
        self._at_target: dict[str, tuple[np.ndarray, np.ndarray, bool]] = {}

    # -- views -------------------------------------------------------------------

    @property
    def key(self) -> str:
        """The store's key of its regime library (beside the deployments' names)."""
        return pool_key(self.name)

    def stored_shape(self) -> dict[str, Any]:
        """Its shape as stored: without the fields no member reported yet."""
        return stored_shape(self.shape, self.unknown_fields)

    def following(self) -> list[str]:
        """Members in the pool estimate (not diverged), sorted."""
        return sorted(m for m in self.members if not self.tracks[m].diverged)

    def following_count(self) -> int:
        """How many members are in the pool estimate (`len(following())`), kept as
        members join, leave, diverge and rejoin."""
        return self._following

    def diverged(self) -> list[str]:
        return sorted(m for m in self.members if self.tracks[m].diverged)

    def is_following(self, name: str) -> bool:
        return name in self.members and not self.tracks[name].diverged

    def statistic(self, name: str) -> float:
        """The divergence statistic of the member's newest window tested."""
        return self.tracks[name].last_statistic

    def estimate(self) -> np.ndarray:
        """The pool estimate [L, E] from its following members' windows."""
        return self.loop.estimator.estimate()

    @property
    def windows_seen(self) -> int:
        """Members' windows folded into the pool estimate so far."""
        return self.loop.estimator.windows

    @property
    def last_decision(self) -> Decision | None:
        """The pool's newest decision."""
        return self.loop.last_decision

    @property
    def regime_library(self) -> RegimeLibrary | None:
        """The regimes the pool learned (None: the regimes policy is off)."""
        return self.loop.regimes

    def due(self, now: float) -> bool:
        """Whether the pool's policy decides now (no decision of it under way)."""
        return not self.deciding and self.loop.due(now)

    def members_moving(self, deployments: dict[str, Deployment]) -> list[str]:
        """Following members with a plan toward the pool placement in flight."""
        return [
            m
            for m in self.following()
            if (dep := deployments.get(m)) is not None
            and dep.plan is not None
            and dep.plan.trigger == POOL_TRIGGER
        ]

    def at_target(self, dep: Deployment) -> bool:
        """Whether a member serves the pool placement (True when the pool has none yet)."""
        if self.phy2log is None:
            return True
        seen = self._at_target.get(dep.name)
        if seen is not None and seen[0] is dep.phy2log and seen[1] is self.phy2log:
            return seen[2]
        answer = bool(np.array_equal(dep.phy2log, self.phy2log))
        self._at_target[dep.name] = (dep.phy2log, self.phy2log, answer)
        return answer

    def check_member(
        self, deployment: str, shape: ClusterShape, unknown: frozenset[str] = frozenset()
    ) -> None:
        """FAILED_PRECONDITION naming the first field on which `shape` differs from the
        pool's; a field unknown to the pool or to the registration (`unknown`) is not compared."""
        ours, theirs = shape_key(self.shape), shape_key(shape)
        for key in ours:
            if key == "top_k" and (not ours[key] or not theirs[key]):
                continue  # 0: unknown, as for a deployment's own ranks
            if key in unknown or key in self.unknown_fields:
                continue
            if ours[key] != theirs[key]:
                what = "dispatch mode" if key == "dispatch_mode" else f"shape field {key}"
                raise StateError(
                    "FAILED_PRECONDITION",
                    f"deployment {deployment!r} cannot join pool {self.name!r}: its {what} is "
                    f"{theirs[key]!r}, the pool's {ours[key]!r}",
                )

    # -- transitions -------------------------------------------------------------

    def set_shape(self, shape: ClusterShape, unknown: frozenset[str]) -> None:
        """The pool's shape and the fields of it no member reported yet (at creation or load)."""
        self.shape = self.loop.shape = shape
        self.unknown_fields = unknown

    def learn_shape(self, dep: Deployment) -> bool:
        """The pool's expert bytes, unknown to the member that created it, from the first
        member that knows them (a member's shape was checked against the pool's); True
        when they changed."""
        if "expert_bytes" not in self.unknown_fields or "expert_bytes" in dep.unknown_fields:
            return False
        self.set_shape(
            replace(self.shape, expert_bytes=dep.shape.expert_bytes),
            self.unknown_fields - UNKNOWN_EXPERT_BYTES,
        )
        return True

    def join(self, name: str) -> None:
        if name not in self.members:
            self.members.add(name)
            self.tracks[name] = MemberTrack()
            self._following += 1

    def welcome(self, dep: Deployment) -> None:
        """A deployment joins at its Register: a member from now on, and it knows the
        regimes the pool learned unless it learned its own."""
        self.join(dep.name)
        library = self.loop.regimes
        if (
            library is not None
            and library.regimes
            and not (dep.regime_library and dep.regime_library.regimes)
        ):
            dep.restore_regimes(copy_library(library))

    def leave(self, name: str) -> None:
        self.members.discard(name)
        self._at_target.pop(name, None)
        track = self.tracks.pop(name, None)
        if track is not None and not track.diverged:
            self._following -= 1

    def observe(self, logical: np.ndarray) -> None:
        """A following member's merged window into the pool estimate and the reference."""
        self.loop.observe(logical, checked=True)  # a member's merged window, checked at decode
        if self.reference is None:
            self.reference = np.array(logical, dtype=np.float64)
        else:
            decay = 1.0 - 1.0 / (REFERENCE_ROUNDS * max(1, self.following_count()))
            self.reference *= decay
            self.reference += logical
        self._expected_age += 1

    def test_window(self, name: str, logical: np.ndarray, picks: np.ndarray) -> str | None:
        """Run the divergence test of one member window [L, E] (`picks`: its sums per layer
        [L]) against the pool estimate: the
        member diverges or rejoins after a run of windows on the other side of the line.
        Returns "diverged" or "rejoined" when the member changes side, else None."""
        track = self.tracks[name]
        if self.reference is None:
            return None
        if self._expected is None or self._expected_age >= max(1, self.following_count()):
            # One round moves the reference by about 1 / REFERENCE_ROUNDS: a test against
            # the reference of up to a round ago reads the same, at a third of the cost.
            self._expected, self._expected_age = expected_of(self.reference), 0
        statistic = excess_tv_of(logical, self._expected, picks)
        track.last_statistic = statistic
        if not math.isfinite(statistic):
            return None
        line = self.divergence.threshold / 2 if track.diverged else self.divergence.threshold
        crossing = statistic < line if track.diverged else statistic > line
        track.run = track.run + 1 if crossing else 0
        if track.run < self.divergence.windows:
            return None
        track.diverged, track.run = not track.diverged, 0
        self._following += -1 if track.diverged else 1
        if track.diverged:
            self.stats.diverged_events += 1
            return "diverged"
        self.stats.rejoined_events += 1
        return "rejoined"

    def take_window(self, name: str, logical: np.ndarray) -> bool:
        """A member's window (tested) into the pool estimate when the member follows the
        pool; True when it does (the pool decides for it)."""
        if not self.is_following(name):
            return False
        if self.tracks[name].run == 0:
            # A window above the line is held out of the pool estimate even before its
            # member is flagged: otherwise a few of them pull the estimate toward it (the
            # estimate weighs recent windows most) and the member is never flagged.
            self.observe(logical)
        return True

    def restore_regimes(self, library: RegimeLibrary) -> None:
        """The pool's regime library the store kept (a restart)."""
        self.loop.restore_regimes(library)

    def decide(self, base: np.ndarray, now: float) -> Callable[[], Decision]:
        """The pool's decision on its estimate from `base`, to run off the event loop; it
        is deciding until `decided`."""
        work = self.loop.prepare_decision(base, now)
        self.deciding = True
        return work

    def decided(self, decision: Decision | None, now: float) -> None:
        self.deciding = False
        if decision is None:
            return
        self.loop.record(decision, now)
        self.stats.decisions += 1

    def force(
        self, base: np.ndarray, now: float, dry_run: bool, max_moved_fraction: float
    ) -> Decision:
        """An operator's decision on the pool estimate from `base`, the gate skipped."""
        return self.loop.force(
            base, now, dry_run=dry_run, max_moved_fraction=max_moved_fraction or None
        )

    def take(self, phy2log: np.ndarray) -> None:
        """A pool decision's candidate is the pool placement now."""
        self.phy2log = np.array(phy2log, copy=True)
        self.version += 1
        self.stats.placements += 1

    def rebalanced(self, now: float) -> None:
        """The pool placement changed at `now`: the min interval counts from here."""
        self.loop.started(now)

    def restore(self, version: int, phy2log: np.ndarray | None) -> None:
        """The stored pool placement (a controller restart)."""
        self.version, self.phy2log = version, phy2log

    def offered(self) -> None:
        self.stats.warm_offers += 1
