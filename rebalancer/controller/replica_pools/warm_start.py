"""Warm starts: a fresh member is offered the pool placement at Register.

The contract is the proto's RegisterResponse.warm_start: a member serving v0 with no plan
ever committed may install the pool placement before it serves, offered as a stored
"offered" plan version W; its ranks confirm W, or the rolling plans from what the
controller holds once OFFER_GRACE_SECONDS pass.
"""

from __future__ import annotations

import logging
import sqlite3

import numpy as np

from rebalancer.controller.clock import Clock
from rebalancer.controller.deployment import Deployment
from rebalancer.controller.replica_pools.replica_pool import ReplicaPool
from rebalancer.controller.store import Store
from rebalancer.errors import StateError

log = logging.getLogger("rebalancer.controller")

# How long a member offered a warm start is left to install it before the rolling plans
# from what the controller holds (its v0): ten times the hooks' default wait.
OFFER_GRACE_SECONDS = 30.0


class WarmStarts:
    """The offers made, and when: a member offered one is not rolled to until its ranks
    confirm it or OFFER_GRACE_SECONDS pass (a plan on v0 would be refused by ranks on W)."""

    def __init__(self, store: Store, clock: Clock) -> None:
        self.store = store
        self.clock = clock
        self.offered_at: dict[str, float] = {}

    def offer(
        self, pool: ReplicaPool, dep: Deployment, version: int
    ) -> tuple[int, np.ndarray] | None:
        """The warm start for a member of `pool` registering with `version`, or None."""
        if pool.phy2log is None or version != 0:
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

    def pending(self, dep: Deployment, now: float) -> bool:
        """Whether the member's ranks may still be installing the warm start offered."""
        at = self.offered_at.get(dep.name)
        if at is None:
            return False
        if dep.version != 0 or now - at >= OFFER_GRACE_SECONDS:
            del self.offered_at[dep.name]
            return False
        return True
