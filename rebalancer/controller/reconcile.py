"""When a rank and the controller disagree on the committed placement version.

A rank (or a pod's sidecar, for its ranks) registers with the version it serves, or
confirms a commit the controller no longer has in flight. Either side may be ahead: the controller
may have lost a commit confirmation (crash after the ranks switched), or the ranks may have
restarted on an older stored version. What is decided here: adopt the ranks' version when the store
knows it and they are ahead (or all ranks are gone), refuse otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from rebalancer.controller.coordinate import PlanState
from rebalancer.controller.deployment import Deployment
from rebalancer.controller.store import Store
from rebalancer.errors import StateError

log = logging.getLogger("rebalancer.controller")


def reconcile(store: Store, dep: Deployment, who: str, version: int, now: float) -> None:
    """A rank (`who`: "rank 3", or a group's "ranks 0-7 (pod p)") registers with another
    version than the controller holds as committed."""
    plan = dep.plan
    if (
        plan is not None
        and plan.version == version
        and plan.state in (PlanState.COMMITTING, PlanState.COMMITTED)
    ):
        return  # it switched: the registration counts as its confirmation (plans.registered)
    known = store.placement(dep.name, version)
    if version > dep.version and known is not None:
        # The ranks committed a plan whose confirmation the controller lost: theirs wins.
        adopt(store, dep, version, known, f"{who} registered serving it", now)
        return
    if dep.streaming_ranks == 0 and known is not None:
        log.warning(
            "%s: ranks restarted on v%d (controller had v%d)", dep.name, version, dep.version
        )
        store.commit_plan(dep.name, version, now=now)
        dep.adopt(version, known)
        return
    raise StateError(
        "FAILED_PRECONDITION",
        f"{who} of {dep.name!r} serves placement v{version}, the deployment is at v{dep.version}",
    )


def adopt(
    store: Store,
    dep: Deployment,
    version: int,
    phy2log: np.ndarray,
    why: str,
    now: float,
    record: Callable[[Callable[[], None]], None] | None = None,
) -> None:
    """Make a stored placement the committed one because the ranks serve it.

    `record`: how the store's record is written (plans.py's writer keeps one SQLite
    refuses and writes it later); None: at once, and a refusal raises (the caller's
    request fails and its sender tries again)."""
    log.warning(
        "%s: adopting placement v%d (controller had v%d): %s", dep.name, version, dep.version, why
    )
    name = dep.name

    def write() -> None:
        store.commit_plan(name, version, now=now)

    if record is None:
        write()
    else:
        record(write)
    dep.adopt(version, phy2log)
