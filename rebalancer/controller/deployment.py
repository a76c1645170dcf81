"""What the controller holds about one deployment, and who is told when it changes.

A deployment is one model served by one EP group of G ranks: its shape, committed
placement, the ranks' sessions (one per rank, or one per group of ranks: a pod's
sidecar), the window merger, the policy loop (estimate + decision timing), the plan in
flight, the newest aborted plan (retold to a session that reconnects) and running
totals. The deployment owns this state: it changes only through its own transitions
(restore, reshape, begin, commit, abort, leave unconfirmed, finish, adopt, ingest a
window, note what ranks state they serve, fold, decide, amend, force, set its policy, mark
a save), each keeping its invariants; the modules beside this one (registry, reconcile,
fold, decisions, plans, operate) do the I/O, decide when, and ask it; they neither assign
its fields nor call through its parts (tests/unit/controller/test_deployment_owns_its_state.py
holds that). Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rebalancer.controller.coordinate import Aborted, Mixed, Plan, Unconfirmed
from rebalancer.controller.decide import Decision, PolicyConfig
from rebalancer.controller.estimate import LoadEstimator
from rebalancer.controller.policy_loop import PolicyLoop
from rebalancer.controller.regimes import RegimeLibrary
from rebalancer.errors import StateError
from rebalancer.wire.codec import Statement
from rebalancer.wire.shape import ClusterShape
from rebalancer.wire.windows import CountWindow, Ranks, SeqMerger, who

# (kind, payload) -> queued for the rank's stream; kind is "prepare", "commit" or "abort".
Send = Callable[[str, Any], None]


@dataclass
class Session:
    """One registration: of one rank, or of a group of ranks (`ranks`, a pod's sidecar),
    which then speaks for all of them: windows summed over them, reports for all."""

    session_id: str
    rank: int  # the rank, or a group's lowest rank
    worker_id: str
    registered_at: float  # controller clock
    send: Send | None = None
    streaming: bool = False
    ranks: tuple[int, ...] = ()  # every rank it stands for; () means (rank,)
    pod: str = ""  # a group's pod, for logs
    # Ranks of a group its sidecar reports without a stream to it (their engine exited
    # or is restarting: ReportRanks). Not connected, though the group's stream is open.
    absent: frozenset[int] = frozenset()
    # The newest plan version whose Commit this session was sent: its ranks can have
    # switched to no newer one (a late confirmation of a newer one is a stale report).
    commit_told: int = 0
    # Its deployment was resized (rebalancer/controller/resize.py): the session stands for ranks of
    # a world that is gone; its stream is refused at its next window.
    ended_by_resize: bool = False

    def __post_init__(self) -> None:
        self.ranks = tuple(sorted(self.ranks)) if self.ranks else (self.rank,)

    @property
    def group(self) -> bool:
        return len(self.ranks) > 1 or bool(self.pod)

    @property
    def label(self) -> str:
        """`rank 3`, or `ranks 0-7 (pod ns/name)`."""
        return who(self.ranks, self.pod)


@dataclass
class WindowEvent:
    """One folded window, for observers (demo display, metrics)."""

    deployment: str
    seq: int
    ranks: int
    version: int
    tokens: int
    balancedness_actual: float  # routed load of this window on the GPUs, measured
    balancedness_estimated: float  # current placement on the estimate
    balancedness_best: float  # a fresh placement on this window's counts


@dataclass
class DeploymentStats:
    windows_ingested: int = 0
    tokens_folded: int = 0  # routed (token, k) pairs counted; persisted with the cursor
    duplicate_windows: int = 0  # resent windows recognised (the merger refuses them)
    plans_committed: int = 0
    plans_aborted: int = 0
    plans_stopped: int = 0  # aborted because a rank stopped as planned (Plan.stopped): no fault
    plans_partial: int = 0  # Commit out, then a rank failed: applied in part (Mixed)
    slots_moved: int = 0
    bytes_moved: int = 0
    balancedness_actual: float = float("nan")
    # [L, G] routed load per GPU of the newest window with dispatch counts (metrics.py
    # derives the per-layer balancedness quantiles and the per-rank series from it).
    gpu_load: np.ndarray | None = None


@dataclass
class Observers:
    """Callbacks on the controller's event loop: (deployment, plan, what) with what in
    proposed / prepared / committed / aborted / unconfirmed / partial, (deployment,
    decision, trigger) with trigger "policy" or "forced", and (deployment) for one created
    by a Register (those read back from the store at start are in `Controller.deployments`)."""

    window: list[Callable[[WindowEvent], None]] = field(default_factory=list)
    deployment: list[Callable[[str], None]] = field(default_factory=list)
    plan: list[Callable[[str, Plan, str], None]] = field(default_factory=list)
    decision: list[Callable[[str, Decision, str], None]] = field(default_factory=list)


@dataclass(frozen=True)
class Resize:
    """What a rank of a resized EP group states: the world it served before (proto
    `Resize`; rebalancer/controller/resize.py)."""

    version: int  # the placement version the old world served
    num_gpus: int  # its GPU count

    def describe(self) -> str:
        return f"v{self.version} on {self.num_gpus} GPUs"


class Deployment:
    def __init__(
        self,
        name: str,
        shape: ClusterShape,
        policy: PolicyConfig,
        version: int,
        phy2log: np.ndarray,
    ) -> None:
        self.name = name
        self.shape = shape
        self.version = version
        self.phy2log = phy2log
        self.sessions: dict[int, Session] = {}  # rank -> its session (a group's under each rank)
        self.windows = SeqMerger(range(shape.num_gpus), dtype=np.float64)
        self.persisted_at = -float("inf")
        self.deciding = False  # a decision is being computed off the event loop
        # Estimate and decision timing: the same object the simulator drives.
        self.loop = PolicyLoop(shape, policy)
        self.plan: Plan | None = None
        # The newest aborted plan while it is above the committed version: told again to
        # a session opening its stream, so staging made while it was away is dropped.
        self.last_aborted: Aborted | None = None
        # The newest plan whose Commit went out unconfirmed, while above the committed
        # version: its Commit is told again to a session opening its stream.
        self.last_unconfirmed: Unconfirmed | None = None
        # Set while the ranks serve a placement a plan left applied in part: no plan
        # starts until the group restarts (registry.register clears it).
        self.mixed: Mixed | None = None
        self.stats = DeploymentStats()
        # Shape fields the store held no value for (written before they existed): the
        # first rank that reports them sets them (`merge_shape`).
        self.unknown_fields: frozenset[str] = frozenset()
        # What each rank last stated it serves, (version, placement digest; 0: not
        # stated), from its session's windows; set again at its Register (it may have
        # restarted). Read by plans.serving: level-triggered reconciliation.
        self.stated: dict[int, Statement] = {}
        # The world the EP group served before an elastic engine resized it, once the
        # controller took the resize (rebalancer/controller/resize.py): its later ranks join at
        # once.
        self.resized_from: Resize | None = None

    @property
    def policy(self) -> PolicyConfig:
        return self.loop.policy

    @property
    def estimator(self) -> LoadEstimator:
        return self.loop.estimator

    @property
    def last_decision(self) -> Decision | None:
        """The newest decision recorded (the policy's, a force's or an amended one)."""
        return self.loop.last_decision

    @property
    def regime_library(self) -> RegimeLibrary | None:
        """The regimes the deployment learned (None: the regimes policy is off)."""
        return self.loop.regimes

    @property
    def next_seq(self) -> dict[int, int]:
        return self.windows.next_seq

    @property
    def connected_ranks(self) -> int:
        """Ranks there: with a stream open, their own or their group's, and for a group
        one its sidecar does not report absent (what metrics, status and plans count)."""
        return sum(1 for r, s in self.sessions.items() if s.streaming and r not in s.absent)

    @property
    def streaming_ranks(self) -> int:
        """Ranks under a session with a stream open, present or not (reconcile: a
        placement a streaming session stands for is not given up)."""
        return sum(1 for s in self.sessions.values() if s.streaming)

    def missing_ranks(self) -> list[int]:
        """The ranks of the EP group not counted in `connected_ranks`."""
        return [
            r
            for r in range(self.shape.num_gpus)
            if (s := self.sessions.get(r)) is None or not s.streaming or r in s.absent
        ]

    def live_sessions(self) -> list[Session]:
        """Each session once (a group's is held under each of its ranks)."""
        return list({id(s): s for s in self.sessions.values()}.values())

    def session_of(self, rank: int) -> Session | None:
        """The session that stands for `rank`, if any."""
        return self.sessions.get(rank)

    def expected_window(self, ranks: tuple[int, ...]) -> int:
        """The window sequence number `ranks` are to send next (told at Register)."""
        return self.windows.expected(ranks)

    def estimate(self) -> np.ndarray:
        """The load estimate [L, E] built from the folded windows."""
        return self.estimator.estimate()

    def cursor(self) -> dict[str, Any]:
        """What a restart resumes ingest from (`restore`): per-rank next window seq, the
        estimate built from them, the tokens folded."""
        return {
            "next_seq": {str(k): v for k, v in self.next_seq.items()},
            "estimator": self.estimator.state(),
            "tokens_folded": self.stats.tokens_folded,
        }

    def due(self, now: float) -> bool:
        """Whether its policy decides now: no plan or decision under way, not paused, the
        ranks not on a mixed placement, and a decision period passed."""
        return (
            self.plan is None
            and not self.deciding
            and not self.policy.paused
            and self.mixed is None
            and self.loop.due(now)
        )

    def why_no_plan(self) -> tuple[str, str] | None:
        """(outcome, reason) a decision to take a placement is recorded with when no plan
        can start now (the ranks serve a mixed placement, or not all are connected)."""
        if self.mixed is not None:
            return "skip_mixed", f"the ranks serve a mixed placement: {self.mixed.describe()}"
        if self.connected_ranks < self.shape.num_gpus:
            return (
                "skip_ranks",
                f"only {self.connected_ranks} of {self.shape.num_gpus} ranks connected "
                f"(missing: {who(self.missing_ranks())})",
            )
        return None

    # -- transitions: the only code that writes this deployment's state -------------

    def add_session(self, session: Session) -> None:
        """A registration: the session stands for each of its ranks from now on."""
        for r in session.ranks:
            self.sessions[r] = session

    def drop_session(self, session: Session) -> None:
        """The session is gone: its ranks have none (unless a newer one holds them)."""
        for r in session.ranks:
            if self.sessions.get(r) is session:
                del self.sessions[r]

    def restore(
        self, next_seq: dict[int, int], estimator_state: dict[str, Any], tokens_folded: int
    ) -> None:
        """Resume ingest from a saved cursor and the estimate built up to it (a restart)."""
        self.windows.restore(next_seq)
        self.estimator.load_state_dict(estimator_state)
        self.stats.tokens_folded = tokens_folded

    def restore_regimes(self, library: RegimeLibrary) -> None:
        """The regime library the store kept (a restart): the regimes policy recognises
        what it learned before."""
        self.loop.restore_regimes(library)

    def mark_unknown(self, fields: frozenset[str]) -> None:
        """Shape fields the store held no value for (a row written before they existed)."""
        self.unknown_fields = fields

    def state_serving(
        self, ranks: tuple[int, ...], version: int, digest: int, registering: bool = False
    ) -> None:
        """`ranks` state the placement they serve: by a window (never backwards: a window
        resent late states an older version), or by a Register (outright, digest unknown)."""
        for r in ranks:
            if registering or version >= self.stated.get(r, (0, 0))[0]:
                self.stated[r] = (version, digest)

    def served_by_all(self) -> Statement | None:
        """The (version, digest) every rank of the group states it serves, when they all
        state one placement (digest known); else None."""
        said = self.stated.get(0)
        if said is None or not said[1]:
            return None
        for r in range(1, self.shape.num_gpus):
            if self.stated.get(r) != said:
                return None
        return said

    def remember_unfinished(self, newest: Aborted | Unconfirmed) -> None:
        """The newest plan above the committed version ended unfinished: retold to every
        session that reconnects (aborted: drop staging; unconfirmed: its Commit again)."""
        if newest.version <= self.version:
            raise ValueError(f"plan v{newest.version} is not above the committed v{self.version}")
        if isinstance(newest, Aborted):
            self.last_aborted = newest
        else:
            self.last_unconfirmed = newest

    def reshape(self, shape: ClusterShape, unknown: frozenset[str] = frozenset()) -> None:
        """The shape once a rank filled in its unknown fields (`merge_shape`); `unknown`:
        those still not known."""
        self.shape = self.loop.shape = shape
        self.unknown_fields = unknown

    def resize(
        self, shape: ClusterShape, version: int, phy2log: np.ndarray, resized_from: Resize
    ) -> None:
        """An elastic engine resized the EP group (rebalancer/controller/resize.py): the new world's
        shape and placement `version`. The old world's sessions, partial windows, statements
        and unfinished plans are gone; the estimate per logical expert is kept (the same
        experts), the regime library is not (its placements have the old world's slots)."""
        if self.plan is not None or self.deciding:
            raise ValueError(f"{self.name}: no resize while a plan or decision is under way")
        estimate = self.loop.estimator.state_dict()
        self.shape = shape
        self.loop = PolicyLoop(shape, self.policy)
        self.loop.estimator.load_state_dict(estimate)
        self.version, self.phy2log = version, np.array(phy2log, dtype=np.int64, copy=True)
        for session in self.live_sessions():
            session.ended_by_resize = True
        self.sessions.clear()
        self.windows = SeqMerger(range(shape.num_gpus), dtype=np.float64)
        self.stated.clear()
        self.last_aborted = self.last_unconfirmed = None
        self.mixed = None
        self.resized_from = resized_from

    def begin(self, plan: Plan) -> None:
        """Plan v+1 is in flight (one at a time, built on the committed placement)."""
        if self.plan is not None:
            raise ValueError(f"{self.name}: plan v{self.plan.version} is still in flight")
        if plan.base_version != self.version:
            raise ValueError(
                f"{self.name}: plan v{plan.version} is built on v{plan.base_version}, "
                f"the deployment is at v{self.version}"
            )
        self.plan = plan

    def commit(self, plan: Plan) -> None:
        """The plan in flight is every rank's placement now."""
        self._check_in_flight(plan)
        self.version, self.phy2log = plan.version, plan.phy2log
        self.stats.plans_committed += 1
        self.stats.slots_moved += plan.slots_moved
        self.stats.bytes_moved += plan.bytes_moved

    def abort(self, plan: Plan) -> None:
        """The plan in flight was dropped on every rank; the committed placement stays."""
        self._check_in_flight(plan)
        if plan.stopped:
            self.stats.plans_stopped += 1
        else:
            self.stats.plans_aborted += 1
        self.last_aborted = Aborted(plan.version, plan.reason)

    def leave_unconfirmed(self, plan: Plan) -> None:
        """The plan's Commit went out, and no rank confirmed it in time."""
        self._check_in_flight(plan)
        self.last_unconfirmed = Unconfirmed(plan.version)

    def finish(self) -> None:
        """No plan in flight any more: the next one may start."""
        self.plan = None

    def adopt(self, version: int, phy2log: np.ndarray) -> None:
        """A stored placement is the committed one, because the ranks serve it. An
        unfinished plan at or below it is settled: nothing is left to tell of it."""
        self.version, self.phy2log = version, phy2log
        if self.last_unconfirmed is not None and self.last_unconfirmed.version <= version:
            self.last_unconfirmed = None
        if self.last_aborted is not None and self.last_aborted.version <= version:
            self.last_aborted = None

    def serve_mixed(self, mixed: Mixed, counted: bool = False) -> None:
        """The ranks serve what a plan left applied in part: that is the current placement
        (when known) until the group restarts; `counted`: a new partial plan, not one read
        back or filled in. Its Commit is not retold: nothing is left to switch to."""
        self.mixed = mixed
        if mixed.phy2log is not None:
            self.phy2log = mixed.phy2log
        if counted:
            self.stats.plans_partial += 1
        if self.last_unconfirmed is not None and self.last_unconfirmed.version == mixed.version:
            self.last_unconfirmed = None

    def end_mixed(self, committed: np.ndarray | None) -> None:
        """The ranks that served a mixed placement are gone: back to the committed one."""
        if committed is not None:
            self.phy2log = committed
        self.mixed = None

    def ingest(
        self, rank: Ranks, seq: int, logical: np.ndarray, physical: np.ndarray | None
    ) -> bool:
        """Merge one session's window (a group's: summed over its ranks), counted; False
        for a resent one, dropped. What it completed comes out of `ready_windows`."""
        fresh = self.windows.add(rank, seq, logical, physical)
        if fresh:
            self.stats.windows_ingested += 1
        else:
            self.stats.duplicate_windows += 1
        return fresh

    def ready_windows(self) -> Iterator[CountWindow]:
        """The merged windows to fold, oldest first: complete, or left behind."""
        return self.windows.ready()

    def fold(
        self,
        logical: np.ndarray,
        gpu_load: np.ndarray | None,
        balancedness_actual: float,
        picks: np.ndarray,
    ) -> None:
        """A merged window into the estimate: its routed counts [L, E] and their sums per
        layer `picks` [L], and when the ranks sent dispatched counts, the GPUs' load [L, G]
        and its measured balancedness."""
        self.stats.tokens_folded += int(picks.sum())
        if gpu_load is not None:
            self.stats.gpu_load = gpu_load
            self.stats.balancedness_actual = balancedness_actual
        self.loop.observe(logical, checked=True)  # merged from windows the codec checked

    def decide(self, now: float) -> Callable[[], Decision]:
        """Its policy's decision on its inputs as they are at `now`, to run off the event
        loop; it is deciding until `decided`."""
        work = self.loop.prepare_decision(self.phy2log, now)
        self.deciding = True
        return work

    def decided(self, decision: Decision | None, decided_at: float) -> None:
        """The decision asked for at `decided_at` came back (None: it failed)."""
        self.deciding = False
        if decision is not None:
            self.loop.record(decision, decided_at)

    def amend(self, decision: Decision) -> None:
        """What became of its last decision (a take whose plan could not start)."""
        self.loop.amend(decision)

    def rebalanced(self, now: float) -> None:
        """A plan of its decision started at `now`: the min interval counts from here."""
        self.loop.started(now)

    def force(self, now: float, dry_run: bool, max_moved_fraction: float) -> Decision:
        """An operator's decision on its estimate, the gate skipped (a dry run is not
        recorded); refused (StateError, nothing changed) while a plan is in flight, before
        any counts, or on a mixed placement. `max_moved_fraction` (0: the policy's) bounds
        this plan's moved slots only."""
        if self.plan is not None and not dry_run:
            raise StateError(
                "FAILED_PRECONDITION", f"plan v{self.plan.version} is in flight for {self.name!r}"
            )
        if self.estimator.windows == 0:
            raise StateError("FAILED_PRECONDITION", f"no counts ingested yet for {self.name!r}")
        if self.mixed is not None and not dry_run:
            raise StateError(
                "FAILED_PRECONDITION",
                f"{self.name!r} serves a mixed placement, no plan can start "
                f"until its ranks restart: {self.mixed.describe()}",
            )
        check_moved_fraction(max_moved_fraction)
        return self.loop.force(
            self.phy2log, now, dry_run=dry_run, max_moved_fraction=max_moved_fraction or None
        )

    def set_policy(self, policy: PolicyConfig) -> None:
        """Its policy from now on (validated; pause and resume are policies too)."""
        self.loop.set_policy(policy)

    def saved(self, at: float) -> None:
        """The ingest cursor was saved at `at` (controller clock; earlier for the first
        save, which sets the phase of this deployment's saves)."""
        self.persisted_at = at

    def _check_in_flight(self, plan: Plan) -> None:
        if plan is not self.plan:
            raise ValueError(f"{self.name}: plan v{plan.version} is not the plan in flight")

    def send_all(self, kind: str, plan: Plan) -> None:
        """Queue one plan phase on every session with a stream open (once per group)."""
        for session in self.live_sessions():
            self.send(session, kind, plan)

    def send(self, session: Session, kind: str, plan: Plan | Unconfirmed) -> None:
        """Queue one plan phase on one session's stream (if open), noting a Commit told."""
        if session.send is None:
            return
        if kind == "commit":
            session.commit_told = max(session.commit_told, plan.version)
        session.send(kind, plan)


def check_moved_fraction(max_moved_fraction: float) -> None:
    """An operator's bound on one forced plan's moved slots: 0 (the policy's) or in (0, 1]."""
    if max_moved_fraction and not 0.0 < max_moved_fraction <= 1.0:
        raise StateError(
            "INVALID_ARGUMENT",
            f"max_moved_fraction must be in (0, 1], got {max_moved_fraction}",
        )
