"""Two-phase plan coordination: prepare on every rank, then commit, or abort.

One plan in flight per deployment. The controller is the only party that
decides: it sends Commit only after every rank reported PREPARED, and once
Commit is out the plan can no longer abort (ranks then agree among themselves
on the step at which they switch, see worker_hooks.agree). Any failure or
timeout before that aborts the plan on every rank (invariant 5).

The coordinator is a plain state machine; it never does I/O itself. Each
transition returns what to send to whom, so the server and the simulator can
drive the same code. A report that does not fit the plan raises StateError.

A report comes from one rank or from a group session (a pod's sidecar), which stands
for all its ranks at once: `rank` is an int or a collection of ints everywhere here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from rebalancer.errors import SHUTTING_DOWN, StateError
from rebalancer.wire.windows import Ranks, rank_set, who

# How long past its prepare deadline a committing plan may wait for confirmations.
COMMIT_GRACE_SECONDS = 60.0


class PlanState(enum.Enum):
    PREPARING = "preparing"
    COMMITTING = "committing"
    COMMITTED = "committed"
    ABORTED = "aborted"
    # Commit went out and a rank reported FAILED: applied in part (Mixed, below).
    PARTIAL = "partial"


@dataclass
class Plan:
    version: int
    base_version: int
    phy2log: np.ndarray  # [L, P] the placement being installed
    transfers: np.ndarray  # [K, 5] (layer, dst_rank, dst_slot, src_rank, src_slot)
    num_ranks: int
    trigger: str
    created: float
    deadline: float  # controller clock seconds; preparing past this aborts
    slots_moved: int
    bytes_moved: int
    state: PlanState = PlanState.PREPARING
    prepared: set[int] = field(default_factory=set)
    committed: set[int] = field(default_factory=set)
    reason: str = ""
    # Aborted because a rank stopped as planned (it reported SHUTTING_DOWN): no fault,
    # counted apart from the failed plans (metrics, logs); aborted all the same.
    stopped: bool = False
    started_at: float = 0.0  # controller clock seconds when Prepare went out
    prepared_at: float = 0.0
    committed_at: float = 0.0
    # Sessions with a stream open when Commit went out: only their ranks can switch.
    commit_sessions: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Aborted:
    """The newest aborted plan, retold to a session that (re)opens its stream: what it
    staged while away is dropped (a sidecar or controller restarted mid-prepare)."""

    version: int
    reason: str


@dataclass(frozen=True)
class Unconfirmed:
    """The newest plan whose Commit went out but that no rank confirmed (the controller
    restarted, or the confirmations did not come in time), while it is above the committed
    version: its Commit is told again to a session that (re)opens its stream, so ranks
    holding it staged (one of them perhaps waiting on a peer that missed the Commit) switch
    together, and the controller adopts the version when they report it. Never an Abort:
    after a Commit, an Abort could leave one rank switching and another not."""

    version: int


@dataclass(frozen=True)
class Mixed:
    """The ranks serve a placement no plan describes: plan `version`'s Commit went out and
    a rank reported FAILED after it (an engine whose updater moves the live weights layer
    by layer, SGLang's, lost a peer midway; invariant 5 is what it cannot keep), or, with
    `version == base_version`, the engine left the committed placement outside any plan
    (SGLang's elastic EP placing a rank fault's survivors). Recorded
    (store, status, metrics) until the group restarts; no plan starts on top of it, since
    every plan's transfers assume the ranks serve the placement the controller holds."""

    version: int  # the plan applied in part
    base_version: int  # the version the ranks still report serving
    phy2log: np.ndarray | None  # [L, P] what they serve, as a rank reported it (None: unknown)
    reason: str
    since: float  # controller clock
    workers: frozenset[str]  # worker ids of the sessions that hold it (a restart clears)

    def describe(self) -> str:
        served = "" if self.phy2log is not None else "; the placement served is unknown"
        if self.version == self.base_version:  # the engine left it outside any plan
            return f"the ranks left v{self.version} outside any plan ({self.reason}){served}"
        return (
            f"plan v{self.version} applied in part over v{self.base_version} "
            f"({self.reason}){served}"
        )


@dataclass(frozen=True)
class Transition:
    """What a call changed: messages to send and whether the plan ended."""

    send_commit: bool = False
    send_abort: bool = False
    became_committed: bool = False  # first rank confirmed the switch
    finished: bool = False  # plan left the in-flight slot
    duplicate: bool = False
    unconfirmed: bool = False  # finished without any rank confirming the commit
    partial: bool = False  # finished applied in part: the ranks serve a mix


def on_prepared(plan: Plan, rank: Ranks, now: float) -> Transition:
    ranks = rank_set(rank)
    if plan.state is not PlanState.PREPARING:
        if ranks <= plan.prepared:
            return Transition(duplicate=True)
        raise StateError(
            "FAILED_PRECONDITION", f"plan v{plan.version} is {plan.state.value}, not preparing"
        )
    if ranks <= plan.prepared:
        return Transition(duplicate=True)
    plan.prepared |= ranks
    if len(plan.prepared) == plan.num_ranks:
        plan.state = PlanState.COMMITTING
        plan.prepared_at = now
        return Transition(send_commit=True)
    return Transition()


def on_failed(plan: Plan, rank: Ranks, error: str, pod: str = "") -> Transition:
    """Before the Commit a failure aborts the plan everywhere. After it nothing can abort
    it: a rank failing then applied it in part, and the plan ends PARTIAL (the deployment
    records what the ranks serve, plans.py)."""
    if plan.state is PlanState.PREPARING:
        if SHUTTING_DOWN in error:  # a planned stop (rebalancer.errors.SHUTTING_DOWN)
            t = abort(plan, f"{who(rank, pod)} stopped: {error}")
            plan.stopped = True
            return t
        return abort(plan, f"{who(rank, pod)} failed to prepare: {error or 'no reason given'}")
    if plan.state in (PlanState.ABORTED, PlanState.PARTIAL):
        return Transition(duplicate=True)
    if rank_set(rank) & plan.committed:
        raise StateError(
            "FAILED_PRECONDITION",
            f"plan v{plan.version}: {who(rank, pod)} confirmed it committed, it cannot fail it",
        )
    plan.state = PlanState.PARTIAL
    plan.reason = f"{who(rank, pod)} failed after the commit: {error or 'no reason given'}"
    return Transition(partial=True, finished=True)


def on_committed(plan: Plan, rank: Ranks, now: float) -> Transition:
    ranks = rank_set(rank)
    if plan.state not in (PlanState.COMMITTING, PlanState.COMMITTED):
        raise StateError(
            "FAILED_PRECONDITION", f"plan v{plan.version} is {plan.state.value}; no commit was sent"
        )
    if ranks <= plan.committed:
        return Transition(duplicate=True)
    first = not plan.committed
    plan.committed |= ranks
    if first:
        plan.state = PlanState.COMMITTED
        plan.committed_at = now
    done = len(plan.committed) == plan.num_ranks
    return Transition(became_committed=first, finished=done)


def commit_unrecorded(plan: Plan, reason: str) -> Transition:
    """Every rank prepared but the store refused to record that Commit goes out: abort
    instead, before any Commit is sent (a controller restarting on that store would hold
    the plan as preparing and abort it, while ranks might already have switched)."""
    if plan.state is not PlanState.COMMITTING or plan.committed:
        raise StateError(
            "FAILED_PRECONDITION", f"plan v{plan.version} is {plan.state.value}, its commit is out"
        )
    plan.state = PlanState.ABORTED
    plan.reason = reason
    return Transition(send_abort=True, finished=True)


def on_aborted(plan: Plan, rank: Ranks) -> Transition:
    # A rank confirming it dropped its staging; nothing left to decide.
    return Transition(duplicate=True)


def abort(plan: Plan, reason: str) -> Transition:
    if plan.state is not PlanState.PREPARING:
        return Transition(duplicate=True)
    plan.state = PlanState.ABORTED
    plan.reason = reason
    return Transition(send_abort=True, finished=True)


def on_tick(plan: Plan, now: float) -> Transition:
    """Timeouts: preparing past the deadline aborts; a commit whose ranks did not all
    confirm in time is finished as committed if any confirmed (they agreed on a step)."""
    if plan.state is PlanState.PREPARING and now > plan.deadline:
        missing = sorted(set(range(plan.num_ranks)) - plan.prepared)
        return abort(plan, f"timeout: ranks {missing} not prepared")
    if plan.state is PlanState.COMMITTED and now > plan.deadline + COMMIT_GRACE_SECONDS:
        return Transition(finished=True)
    if plan.state is PlanState.COMMITTING and now > plan.deadline + COMMIT_GRACE_SECONDS:
        # Commit went out but no rank confirmed (their agreement lost a peer, or the
        # confirmations were lost): free the slot. A rank that did switch reports its
        # version when it re-registers and the controller adopts it then.
        plan.reason = "commit sent, no rank confirmed in time"
        return Transition(finished=True, unconfirmed=True)
    return Transition()


def on_disconnect(plan: Plan, rank: Ranks, pod: str = "") -> Transition:
    """A session's stream ended: for a group session, all its ranks at once."""
    if plan.state is PlanState.PREPARING:
        return abort(plan, f"{who(rank, pod)} disconnected while preparing")
    return Transition()
