"""Replica pools: deployments of one model behind one endpoint, balanced together.

(Not the decision worker process of decision_process.py: a *replica pool* is a group of
deployments.)

A deployment names its pool at Register (`RegisterRequest.pool`). Every member has the
pool's shape and dispatch mode. The pool keeps one load estimate from the windows of
every member that follows it, and one placement: a pool decision runs once on the pool's
estimate (the same `PolicyLoop` and decision as a deployment's), and its candidate is
rolled out to the members as each member's own plan (its own versions, transfers from
what it serves, its own commit), at most `max_moving` members at a time.

Divergence: each member window is compared with the pool estimate (divergence.py); a
member whose windows stop matching is taken out of the pool estimate and balanced alone
(its own policy decisions, as without a pool) until its windows match again.

Warm start: a fresh member (placement v0, no plan ever committed) is offered the pool's
placement at Register (warm_start.py; the contract is the proto's
RegisterResponse.warm_start).

One job per file: divergence.py the statistic and its settings; replica_pool.py
`ReplicaPool`, which owns a pool's state and changes only through its transitions (join,
welcome, leave, test a window, take a window, decide, take a placement, ...);
warm_start.py the offers; fleet.py `Fleet`, which holds the pools and does their I/O and
orchestration (store, registry, decisions, plans, rolling).
"""

from rebalancer.controller.replica_pools.divergence import (
    DivergenceConfig,
    excess_tv,
    sampling_tv,
)
from rebalancer.controller.replica_pools.fleet import Fleet, MemberMove, PoolObservers
from rebalancer.controller.replica_pools.replica_pool import (
    DEFAULT_MAX_MOVING,
    POOL_TRIGGER,
    ReplicaPool,
)
from rebalancer.controller.replica_pools.warm_start import OFFER_GRACE_SECONDS

__all__ = [
    "DEFAULT_MAX_MOVING",
    "OFFER_GRACE_SECONDS",
    "POOL_TRIGGER",
    "DivergenceConfig",
    "Fleet",
    "MemberMove",
    "PoolObservers",
    "ReplicaPool",
    "excess_tv",
    "sampling_tv",
]
