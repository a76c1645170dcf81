"""The controller's in-memory model of every deployment, backed by the store.

A deployment is one model served by one EP group of G ranks. This module owns
what happens to it, independent of gRPC: ranks join and leave, windows are
merged per sequence number across ranks and folded into the load estimate,
the decision policy runs, and plans move through the coordinator. The gRPC
layer (service.py, admin.py) only translates messages and statuses.

Everything here runs on the controller's event loop thread; nothing blocks for
long (numpy on [L, E] arrays, a few SQLite writes per plan).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from rebalancer import placement
from rebalancer.controller import coordinate
from rebalancer.controller.coordinate import Plan, PlanState, ReportError, Transition
from rebalancer.controller.decide import ClusterShape, Decision, PolicyConfig
from rebalancer.controller.errors import StateError
from rebalancer.controller.ingest import MergedWindow, WindowMerger
from rebalancer.controller.policy_loop import PolicyLoop
from rebalancer.controller.store import Store
from rebalancer.errors import InputError

log = logging.getLogger("rebalancer.controller")



@dataclass
class Session:
    session_id: str
    rank: int
    worker_id: str
    send: Callable[[str, Any], None] | None = None  # (kind, payload) -> queued for the stream
    streaming: bool = False
    registered_at: float = field(default_factory=time.monotonic)


@dataclass
class WindowEvent:
    """One folded window, for observers (demo display, metrics)."""

    deployment: str
    seq: int
    ranks: int
    version: int
    tokens: int
    balancedness_actual: float     # routed load of this window on the GPUs, measured
    balancedness_estimated: float  # current placement on the estimate
    balancedness_best: float       # a fresh placement on this window's counts


@dataclass
class DeploymentStats:
    windows_ingested: int = 0
    windows_folded: int = 0
    tokens_folded: int = 0   # routed (token, k) pairs counted; persisted with the cursor
    duplicate_windows: int = 0
    plans_committed: int = 0
    plans_aborted: int = 0
    slots_moved: int = 0
    bytes_moved: int = 0
    balancedness_actual: float = float("nan")


class Deployment:
    def __init__(
        self, name: str, shape: ClusterShape, policy: PolicyConfig, version: int, phy2log: np.ndarray
    ) -> None:
        self.name = name
        self.shape = shape
        self.version = version
        self.phy2log = phy2log
        self.sessions: dict[int, Session] = {}
        self.windows = WindowMerger(shape.num_gpus)
        self.persisted_at = -float("inf")
        self.deciding = False  # a decision is being computed off the event loop
        # Estimate and decision timing: the same object the simulator drives.
        self.loop = PolicyLoop(shape, policy)
        self.plan: Plan | None = None
        self.stats = DeploymentStats()

    @property
    def policy(self) -> PolicyConfig:
        return self.loop.policy

    @property
    def estimator(self) -> Any:
        return self.loop.estimator

    @property
    def next_seq(self) -> dict[int, int]:
        return self.windows.next_seq

    @property
    def connected_ranks(self) -> int:
        return sum(1 for s in self.sessions.values() if s.streaming)


def _shape_key(shape: ClusterShape) -> dict[str, int]:
    return {k: int(v) for k, v in asdict(shape).items()}


def _policy_dict(policy: PolicyConfig) -> dict[str, Any]:
    return policy.to_dict()


class Controller:
    """All deployments, the store, and the observers of what happens."""

    def __init__(
        self, store: Store, default_policy: PolicyConfig | None = None, persist_seconds: float = 5.0
    ) -> None:
        self.store = store
        # Monotonic seconds; tests (and replays) substitute their own clock.
        self.clock: Callable[[], float] = time.monotonic
        # The ingest cursor (per-rank next seq + estimate) is saved at most this often per
        # deployment; a crash loses at most that much counting, and never counts twice.
        self.persist_seconds = persist_seconds
        self.default_policy = default_policy or PolicyConfig()
        self.deployments: dict[str, Deployment] = {}
        self.sessions: dict[str, tuple[str, int]] = {}
        self.window_observers: list[Callable[[WindowEvent], None]] = []
        # Runs fn, then done(result), or done(None) if fn raised, on the caller's thread.
        # The server replaces this with a worker process, so placement work neither
        # blocks the event loop nor competes with ingest for the GIL.
        self.background: Callable[[Callable[[], Any], Callable[[Any], None]], None] = _run_inline
        self.plan_observers: list[Callable[[str, Plan, str], None]] = []
        self.decision_observers: list[Callable[[str, Decision, str], None]] = []
        self._load()

    # ------------------------------------------------------------ restart

    def _load(self) -> None:
        for row in self.store.load_deployments():
            shape = ClusterShape(**row.shape)
            policy = PolicyConfig.from_dict(row.policy)
            dep = Deployment(row.name, shape, policy, row.committed_version, row.phy2log)
            saved = self.store.ingest_state(row.name)
            if saved:
                dep.windows.restore({int(k): int(v) for k, v in saved["next_seq"].items()})
                dep.estimator.load_state_dict(saved["estimator"])
                dep.stats.tokens_folded = int(saved.get("tokens_folded", 0))
            for plan in self.store.unfinished_plans(row.name):
                # A plan that never reached commit before the restart is void; ranks that
                # staged it drop their staging when they re-register with the old version.
                self.store.set_plan_state(row.name, plan.version, "aborted", "controller restarted")
            self.deployments[row.name] = dep
            log.info("loaded deployment %s at placement v%d", row.name, row.committed_version)

    # ------------------------------------------------------------ registration

    def register(
        self, name: str, rank: int, shape: ClusterShape, version: int,
        initial: np.ndarray | None, worker_id: str,
    ) -> tuple[Session, Deployment]:
        dep = self.deployments.get(name)
        if dep is None:
            phy2log = initial if initial is not None else placement.trivial_placement(
                shape.num_layers, shape.num_logical, shape.num_slots, shape.num_gpus
            )
            dep = Deployment(name, shape, self.default_policy, version, phy2log)
            self.store.create_deployment(name, _shape_key(shape), _policy_dict(dep.policy), version, phy2log)
            self.deployments[name] = dep
            log.info("new deployment %s: %s", name, _shape_key(shape))
        elif _shape_key(dep.shape) != _shape_key(shape):
            raise StateError(
                "FAILED_PRECONDITION",
                f"deployment {name!r} is registered with shape {_shape_key(dep.shape)}, rank {rank} reports {_shape_key(shape)}",
            )
        old = dep.sessions.get(rank)
        if old is not None and (old.streaming or time.monotonic() - old.registered_at < 10.0):
            raise StateError("ALREADY_EXISTS", f"rank {rank} of {name!r} is already registered (session {old.session_id[:8]})")
        if version != dep.version:
            self._reconcile(dep, rank, version)
        if old is not None:
            self.sessions.pop(old.session_id, None)
        session = Session(uuid.uuid4().hex, rank, worker_id)
        dep.sessions[rank] = session
        self.sessions[session.session_id] = (name, rank)
        log.info("rank %d of %s registered (worker %s, v%d)", rank, name, worker_id or "?", version)
        return session, dep

    def _reconcile(self, dep: Deployment, rank: int, version: int) -> None:
        """A rank reports another version than the controller holds as committed."""
        plan = dep.plan
        if plan is not None and plan.version == version and plan.state in (PlanState.COMMITTING, PlanState.COMMITTED):
            return  # it already switched; its COMMITTED report will follow
        known = self.store.placement(dep.name, version)
        if version > dep.version and known is not None:
            # The ranks committed a plan whose confirmation the controller lost: theirs wins.
            self._adopt(dep, version, known, f"rank {rank} registered serving it")
            return
        if dep.connected_ranks == 0 and known is not None:
            log.warning("%s: ranks restarted on v%d (controller had v%d)", dep.name, version, dep.version)
            self.store.commit_plan(dep.name, version)
            dep.version, dep.phy2log = version, known
            return
        raise StateError(
            "FAILED_PRECONDITION",
            f"rank {rank} of {dep.name!r} serves placement v{version}, the deployment is at v{dep.version}",
        )

    def _adopt(self, dep: Deployment, version: int, phy2log: np.ndarray, why: str) -> None:
        log.warning("%s: adopting placement v%d (controller had v%d): %s", dep.name, version, dep.version, why)
        self.store.commit_plan(dep.name, version)
        dep.version, dep.phy2log = version, phy2log

    def session(self, session_id: str) -> tuple[Deployment, Session]:
        entry = self.sessions.get(session_id)
        if entry is None:
            raise StateError("NOT_FOUND", f"unknown session {session_id[:16]!r}: register first")
        name, rank = entry
        dep = self.deployments[name]
        return dep, dep.sessions[rank]

    def attach(self, session_id: str, send: Callable[[str, Any], None]) -> tuple[Deployment, Session]:
        dep, session = self.session(session_id)
        if session.streaming:
            raise StateError("ALREADY_EXISTS", f"session of rank {session.rank} already has a stream")
        session.send, session.streaming = send, True
        # A plan in flight this rank missed (it reconnected): resend the phase it needs.
        plan = dep.plan
        if plan is not None and plan.state is PlanState.PREPARING and session.rank not in plan.prepared:
            send("prepare", plan)
        elif plan is not None and plan.state in (PlanState.COMMITTING, PlanState.COMMITTED) and session.rank not in plan.committed:
            send("commit", plan)
        return dep, session

    def detach(self, session_id: str) -> None:
        entry = self.sessions.pop(session_id, None)
        if entry is None:
            return
        name, rank = entry
        dep = self.deployments[name]
        session = dep.sessions.get(rank)
        if session is not None and session.session_id == session_id:
            del dep.sessions[rank]
        log.info("rank %d of %s disconnected", rank, name)
        if dep.plan is not None:
            self._apply(dep, coordinate.on_disconnect(dep.plan, rank))

    # ------------------------------------------------------------ ingest

    def ingest(
        self, dep: Deployment, rank: int, seq: int, version: int,
        logical: np.ndarray, physical: np.ndarray | None,
    ) -> bool:
        """Merge one rank's window and fold what became complete; False for a duplicate."""
        if not dep.windows.add(rank, seq, logical, physical):
            dep.stats.duplicate_windows += 1
            return False
        dep.stats.windows_ingested += 1
        for window in dep.windows.ready():
            self._fold(dep, window)
        return True

    def _fold(self, dep: Deployment, window: MergedWindow) -> None:
        logical = window.logical
        G = dep.shape.num_gpus
        dep.stats.windows_folded += 1
        dep.stats.tokens_folded += int(logical.sum())
        actual = float("nan")
        if window.physical is not None:
            per_gpu = window.physical.reshape(dep.shape.num_layers, G, -1).sum(axis=2)
            actual = _balancedness_of_gpu_load(per_gpu)
            dep.stats.balancedness_actual = actual
        now = self.clock()
        dep.loop.observe(logical)
        if now - dep.persisted_at >= self.persist_seconds:
            self.persist(dep, now)
        if self.window_observers:
            best = float("nan")
            if logical.sum() > 0:
                best = placement.compute_placement(logical, dep.shape.num_slots, G, dep.shape.num_nodes).balancedness
            event = WindowEvent(
                dep.name, window.seq, len(window.ranks), dep.version, int(logical.sum()), actual,
                placement.balancedness(dep.phy2log, dep.estimator.estimate(), G), best,
            )
            for observer in self.window_observers:
                observer(event)
        if dep.plan is None and not dep.deciding and not dep.policy.paused and dep.loop.due(now):
            self._decide(dep, now)

    def _decide(self, dep: Deployment, now: float) -> None:
        """The policy's decision on this window, computed by `self.background` (a worker
        thread in the server, so ingest goes on meanwhile) on inputs copied here."""
        loop = dep.loop

        def done(decision: Decision | None) -> None:
            dep.deciding = False
            if decision is None:
                return
            loop.record(decision, now)
            if dep.plan is None:
                self._act(dep, decision, "policy", self.clock())

        dep.deciding = True
        self.background(loop.prepare_decision(dep.phy2log, now), done)

    def persist(self, dep: Deployment, now: float | None = None) -> None:
        """Save the ingest cursor: per-rank next window seq with the estimate built from them."""
        dep.persisted_at = self.clock() if now is None else now
        self.store.save_ingest_state(
            dep.name,
            {
                "next_seq": {str(k): v for k, v in dep.next_seq.items()},
                "estimator": dep.estimator.state_dict(),
                "tokens_folded": dep.stats.tokens_folded,
            },
        )

    # ------------------------------------------------------------ decide

    def tick(self, now: float | None = None) -> None:
        """Plan timeouts of every deployment (decisions run as windows fold)."""
        now = self.clock() if now is None else now
        for dep in self.deployments.values():
            if dep.plan is not None:
                self._apply(dep, coordinate.on_tick(dep.plan, now))

    def force(
        self, name: str, dry_run: bool = False, max_moved_fraction: float = 0.0
    ) -> tuple[Decision, Plan | None]:
        """An operator's rebalance: skips the gate; a dry run changes nothing."""
        dep = self.deployment(name)
        if dep.plan is not None and not dry_run:
            raise StateError("FAILED_PRECONDITION", f"plan v{dep.plan.version} is in flight for {name!r}")
        if dep.estimator.windows == 0:
            raise StateError("FAILED_PRECONDITION", f"no counts ingested yet for {name!r}")
        loop = dep.loop
        if max_moved_fraction:
            if not 0.0 < max_moved_fraction <= 1.0:
                raise StateError("INVALID_ARGUMENT", f"max_moved_fraction must be in (0, 1], got {max_moved_fraction}")
            loop = PolicyLoop(dep.shape, replace(dep.policy, max_moved_fraction=max_moved_fraction))
            loop.estimator = dep.estimator
        now = self.clock()
        decision = loop.force(dep.phy2log, now, dry_run=dry_run)
        if dry_run:
            return decision, None
        if loop is not dep.loop:
            dep.loop.last_rebalance, dep.loop.last_decision_time = now, now
            dep.loop.last_decision = decision
        return decision, self._act(dep, decision, "forced", now)

    def _act(self, dep: Deployment, decision: Decision, trigger: str, now: float) -> Plan | None:
        """Record a decision; start its plan when it says so and every rank is there."""
        plan = None
        candidate = decision.candidate
        if decision.take and candidate is not None:
            if dep.connected_ranks < dep.shape.num_gpus:
                decision = replace(
                    decision, outcome="skip_ranks",
                    reason=f"only {dep.connected_ranks} of {dep.shape.num_gpus} ranks connected",
                )
                dep.loop.last_decision = decision
            else:
                plan = self._start_plan(dep, candidate, trigger, now)
        record = decision.to_dict()
        record.update(time=time.time(), plan_version=plan.version if plan else 0)
        self.store.record_decision(dep.name, record)
        log.info("%s decision: %s (%s)", dep.name, decision.outcome, decision.reason)
        for observer in self.decision_observers:
            observer(dep.name, decision, trigger)
        return plan

    # ------------------------------------------------------------ plans

    def _start_plan(self, dep: Deployment, new: np.ndarray, trigger: str, now: float) -> Plan:
        G, N = dep.shape.num_gpus, dep.shape.num_nodes
        transfers = placement.transfers(dep.phy2log, new, G, N)
        version = max(self.store.max_version(dep.name), dep.version) + 1
        moved = int(transfers.shape[0])
        bytes_moved = moved * int(dep.shape.expert_bytes)
        plan = Plan(
            version=version, base_version=dep.version, phy2log=new, transfers=transfers,
            num_ranks=G, trigger=trigger, created=time.time(),
            deadline=now + dep.policy.prepare_timeout_seconds,
            slots_moved=moved, bytes_moved=bytes_moved, started_at=now,
        )
        self.store.begin_plan(dep.name, version, dep.version, trigger, new, moved, bytes_moved)
        dep.plan = plan
        log.info("%s: plan v%d (%s) moves %d slots, %d bytes", dep.name, version, trigger, moved, bytes_moved)
        for session in dep.sessions.values():
            if session.send is not None:
                session.send("prepare", plan)
        self._notify(dep, plan, "proposed")
        return plan

    def report(self, session_id: str, version: int, phase: str, error: str = "") -> None:
        """A rank's plan progress: prepared / failed / committed / aborted."""
        dep, session = self.session(session_id)
        plan = dep.plan
        if plan is None or plan.version != version:
            if version == dep.version and phase in ("committed", "prepared"):
                return  # late confirmation of a plan already finished: harmless
            known = self.store.placement(dep.name, version) if version > dep.version else None
            if phase == "committed" and known is not None and plan is None:
                self._adopt(dep, version, known, f"rank {session.rank} confirmed it late")
                return
            if version > max(dep.version, plan.version if plan else 0):
                raise StateError("NOT_FOUND", f"plan v{version} unknown for {dep.name!r} (latest v{max(dep.version, plan.version if plan else 0)})")
            raise StateError(
                "FAILED_PRECONDITION",
                f"plan v{version} of {dep.name!r} is not in flight (committed v{dep.version}"
                + (f", in flight v{plan.version})" if plan else ", none in flight)"),
            )
        try:
            if phase == "prepared":
                t = coordinate.on_prepared(plan, session.rank, self.clock())
            elif phase == "failed":
                t = coordinate.on_failed(plan, session.rank, error)
            elif phase == "committed":
                t = coordinate.on_committed(plan, session.rank, self.clock())
            elif phase == "aborted":
                t = coordinate.on_aborted(plan, session.rank)
            else:
                raise StateError("INVALID_ARGUMENT", f"plan phase {phase!r} is not reportable")
        except ReportError as exc:
            raise StateError(exc.code, str(exc)) from exc
        self._apply(dep, t)

    def _apply(self, dep: Deployment, t: Transition) -> None:
        plan = dep.plan
        if plan is None:
            return
        if t.send_commit:
            log.info("%s: plan v%d prepared on all ranks, committing", dep.name, plan.version)
            for session in dep.sessions.values():
                if session.send is not None:
                    session.send("commit", plan)
            self._notify(dep, plan, "prepared")
        if t.send_abort:
            log.warning("%s: plan v%d aborted: %s", dep.name, plan.version, plan.reason)
            self.store.set_plan_state(dep.name, plan.version, "aborted", plan.reason)
            dep.stats.plans_aborted += 1
            for session in dep.sessions.values():
                if session.send is not None:
                    session.send("abort", plan)
            self._notify(dep, plan, "aborted")
        if t.became_committed:
            self.store.commit_plan(dep.name, plan.version)
            dep.version, dep.phy2log = plan.version, plan.phy2log
            dep.stats.plans_committed += 1
            dep.stats.slots_moved += plan.slots_moved
            dep.stats.bytes_moved += plan.bytes_moved
            log.info("%s: plan v%d committed", dep.name, plan.version)
            self._notify(dep, plan, "committed")
        if t.unconfirmed:
            log.error("%s: plan v%d: %s", dep.name, plan.version, plan.reason)
            self.store.set_plan_state(dep.name, plan.version, "unconfirmed", plan.reason)
            self._notify(dep, plan, "unconfirmed")
        if t.finished:
            dep.plan = None

    def _notify(self, dep: Deployment, plan: Plan, what: str) -> None:
        for observer in self.plan_observers:
            observer(dep.name, plan, what)

    # ------------------------------------------------------------ admin

    def deployment(self, name: str) -> Deployment:
        dep = self.deployments.get(name)
        if dep is None:
            raise StateError("NOT_FOUND", f"unknown deployment {name!r}")
        return dep

    def set_policy(self, name: str, policy: PolicyConfig) -> PolicyConfig:
        dep = self.deployment(name)
        try:
            policy.validate()
        except InputError as exc:
            raise StateError("INVALID_ARGUMENT", str(exc)) from exc
        dep.loop.set_policy(policy)
        self.store.set_policy(name, _policy_dict(policy))
        return policy

    def set_paused(self, name: str, paused: bool) -> None:
        dep = self.deployment(name)
        self.set_policy(name, replace(dep.policy, paused=paused))


def _balancedness_of_gpu_load(per_gpu: np.ndarray) -> float:
    """Mean over layers with load of mean/max GPU load; per_gpu: [L, G]."""
    peak = per_gpu.max(axis=1)
    live = peak > 0
    if not live.any():
        return float("nan")
    return float((per_gpu[live].mean(axis=1) / peak[live]).mean())




def _run_inline(fn: Callable[[], Any], done: Callable[[Any], None]) -> None:
    try:
        result = fn()
    except Exception:  # a bug in one decision must not stop the next ones
        log.exception("decision failed")
        result = None
    done(result)
