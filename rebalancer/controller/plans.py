"""A plan's life on the controller: start, fan out, follow the ranks' reports, finish.

coordinate.py is the pure state machine; this module does what its transitions say:
store the plan before any rank hears of it (and "committing" before any rank hears its
Commit), queue Prepare / Commit / Abort on every session's stream, resend the phase a
reconnecting session missed, commit to the store on the first confirmation, and tell the
observers. One plan in flight per deployment.

A session is one rank or a group of ranks (a pod's sidecar): a group's report counts for
each of its ranks, and its stream ending is a disconnect of all of them.

Applied in part: after its Commit a plan cannot abort, but an engine whose updater moves
the live weights layer by layer (SGLang's) can lose a peer midway; its survivors then
serve the plan on some layers and its base on the others, and report FAILED with that
placement. The plan ends "partial" and the deployment records the mix (`Deployment.mixed`,
stored): it is what the ranks serve, no plan starts on top of it (every plan's transfers
assume the placement the controller holds), and a restarted group clears it
(registry.register).

Level-triggered: every window a session sends states the placement its ranks serve
(version and digest). Reports are edges, and any of them can be lost with a link, refused
for a session that ended, or outlived by a restart; the statements are the level. Once
every rank states one version above the committed one that the controller started
(stored, digest equal), the controller takes it as the truth (`serving`), whichever
messages were lost, duplicated or reordered and whichever process restarted.

Staging left behind: when a session's link goes down mid-prepare (its sidecar was killed,
or the controller restarted), the plan aborts without that session hearing Abort, and
its ranks may still hold the plan's staging. So a session opening its stream is told the
newest aborted plan again while that plan is above the committed version
(`Deployment.last_aborted`); a rank that never staged it ignores it. That keeps
invariant 5 (staging dropped everywhere) without any state in the sidecar surviving its
restart, and cannot break invariant 2: no rank commits a plan without its Commit, and
Commit is never sent for an aborted plan.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from rebalancer import placement
from rebalancer.controller import coordinate, reconcile
from rebalancer.controller.clock import Clock
from rebalancer.controller.coordinate import (
    Mixed,
    Plan,
    PlanState,
    Transition,
)
from rebalancer.controller.deployment import Deployment, Observers, Session
from rebalancer.controller.store import Store
from rebalancer.errors import StateError
from rebalancer.wire.layout import placement_digest

log = logging.getLogger("rebalancer.controller")


class Plans:
    def __init__(self, store: Store, clock: Clock, observers: Observers) -> None:
        self.store = store
        self.clock = clock
        self.observers = observers
        # Outcome writes SQLite refused (disk full, read-only, I/O error), per deployment,
        # in order: retried at every tick until written. The plan's outcome is decided and
        # told to the ranks regardless; only the record waits.
        self._unwritten: dict[str, list[Callable[[], None]]] = {}
        self._refused: dict[
            str, tuple[int, int]
        ] = {}  # statement last refused, per deployment (logged once)
        self._placements: dict[
            str, tuple[int, np.ndarray]
        ] = {}  # the stored placement last looked up

    def start(self, dep: Deployment, new: np.ndarray, trigger: str, now: float) -> Plan:
        """Store plan v+1 toward `new` and send Prepare to every connected rank."""
        G, N = dep.shape.num_gpus, dep.shape.num_nodes
        transfers = placement.transfers(dep.phy2log, new, G, N)
        version = max(self.store.max_version(dep.name), dep.version) + 1
        moved = int(transfers.shape[0])
        bytes_moved = moved * int(dep.shape.expert_bytes)
        plan = Plan(
            version=version,
            base_version=dep.version,
            phy2log=new,
            transfers=transfers,
            num_ranks=G,
            trigger=trigger,
            created=now,
            deadline=now + dep.policy.prepare_timeout_seconds,
            slots_moved=moved,
            bytes_moved=bytes_moved,
            started_at=now,
        )
        self.store.begin_plan(
            dep.name, version, dep.version, trigger, new, moved, bytes_moved, now=now
        )
        dep.begin(plan)
        log.info(
            "%s: plan v%d (%s) moves %d slots, %d bytes",
            dep.name,
            version,
            trigger,
            moved,
            bytes_moved,
        )
        dep.send_all("prepare", plan)
        self._notify(dep, plan, "proposed")
        return plan

    def catch_up(self, dep: Deployment, session: Session) -> None:
        """A session (re)opened its stream: tell it the newest aborted plan if its ranks may
        hold staging of it, then resend the phase of the plan in flight it missed."""
        if session.send is None:
            return
        unconfirmed = dep.last_unconfirmed
        if unconfirmed is not None and unconfirmed.version > dep.version:
            dep.send(session, "commit", unconfirmed)
        aborted = dep.last_aborted
        if aborted is not None and aborted.version > dep.version:
            session.send("abort", aborted)
        plan = dep.plan
        if plan is None:
            return
        ranks = set(session.ranks)
        if plan.state is PlanState.PREPARING and not ranks <= plan.prepared:
            session.send("prepare", plan)
        elif (
            plan.state in (PlanState.COMMITTING, PlanState.COMMITTED)
            and not ranks <= plan.committed
        ):
            dep.send(session, "commit", plan)

    def registered(self, dep: Deployment, session: Session, version: int) -> None:
        """A session registered serving `version`.

        Serving the version of the plan whose Commit went out is its ranks' confirmation:
        their COMMITTED report may have been lost with the link they lost (a report the
        controller refused for a session it had already ended is not sent again), and
        waiting for it held the plan until its commit grace, then left it unconfirmed
        with every rank serving it (the short chaos campaign in CI, invariant 7).

        A plan whose commit went out, that no rank confirmed, is moot once ranks come back
        on an older version (its base, or the one they restarted on) and no session that
        had the Commit is left: the group restarted (a gloo group that lost a rank starts
        again), so no rank can switch to the plan any more. It is finished as unconfirmed now
        instead of after its commit grace, which would hold every later plan back; one that
        some ranks confirmed before the group restarted is finished too. Ranks that did switch
        (their sessions only lost their link) report it, and the controller adopts it then
        (`_report_off_plan`)."""
        plan = dep.plan
        if (
            plan is not None
            and plan.version == version
            and plan.state in (PlanState.COMMITTING, PlanState.COMMITTED)
        ):
            self.apply(dep, coordinate.on_committed(plan, session.ranks, self.clock()))
            return
        if (
            plan is None
            or plan.state not in (PlanState.COMMITTING, PlanState.COMMITTED)
            or version >= plan.version
            or any(s.session_id in plan.commit_sessions for s in dep.live_sessions())
        ):
            return
        if plan.committed:
            # Some ranks confirmed it, then the whole group restarted on an older version
            # (reconcile took that one): nothing is left to confirm. Waiting for the
            # others held the slot until the commit grace ran out (seed 106 of the short
            # campaign beside a hog: "plan 6 committed" 30 s after the episode).
            log.warning(
                "%s: plan v%d ends: %s came back on v%d after the group restarted",
                dep.name,
                plan.version,
                session.label,
                version,
            )
            self.apply(dep, Transition(finished=True))
            return
        plan.reason = (
            f"{session.label} came back on v{version} before any rank confirmed the commit"
        )
        self.apply(dep, Transition(finished=True, unconfirmed=True))

    def serving(self, dep: Deployment, ranks: tuple[int, ...], version: int, digest: int) -> None:
        """A session's window states the placement its ranks serve (level-triggered
        reconciliation, module docstring): once every rank of the group states one
        version above the committed one, and the store holds that plan with the same
        placement (digest checked), it is what the ranks serve: confirmed as the plan in
        flight's commit, or adopted. A statement that matches no plan is refused (logged
        once): nothing is adopted that the controller did not start."""
        dep.state_serving(ranks, version, digest)
        if version <= dep.version:
            return  # the usual case: nothing to reconcile
        said = dep.served_by_all()
        if said is None or said[0] <= dep.version:
            return
        version, digest = said
        known = self._placement(dep, version)
        if known is None or placement_digest(known) != digest:
            if self._refused.get(dep.name) != said:
                self._refused[dep.name] = said
                log.warning(
                    "%s: every rank states it serves v%d (digest %016x), which matches no plan of "
                    "the controller (%s): not adopted",
                    dep.name,
                    version,
                    digest,
                    "unknown version" if known is None else "another placement",
                )
            return
        plan, now = dep.plan, self.clock()
        why = f"every rank's windows state it (digest {digest:016x})"
        if plan is not None and plan.version == version:
            if plan.state in (PlanState.COMMITTING, PlanState.COMMITTED):
                log.info("%s: plan v%d confirmed by what the ranks serve", dep.name, version)
                self.apply(dep, coordinate.on_committed(plan, tuple(range(plan.num_ranks)), now))
            return  # preparing: no rank can serve it before its Commit (a stale statement)
        if plan is not None and plan.base_version < version:
            self.apply(
                dep,
                coordinate.abort(
                    plan, f"every rank serves v{version}, the plan is based on v{plan.base_version}"
                ),
            )
        if dep.plan is None:
            reconcile.adopt(
                self.store,
                dep,
                version,
                known,
                why,
                now,
                record=lambda write: self._write(dep.name, write),
            )

    def _offered(self, dep: Deployment, version: int) -> bool:
        """Whether plan `version` is a pool's warm start offered at Register (installed
        by fresh ranks without a Commit: replica_pools/warm_start.py). Its trigger, not its state:
        ranks that register one by one may have it adopted (a rank registered serving it),
        then v0 again (another registered before its switch), before their COMMITTED comes."""
        return any(
            p.version == version and p.trigger == "warm_start"
            for p in self.store.plans(dep.name, 5)
        )

    def _placement(self, dep: Deployment, version: int) -> np.ndarray | None:
        """The stored placement of plan `version` (kept while the ranks state it)."""
        cached = self._placements.get(dep.name)
        if cached is None or cached[0] != version:
            known = self.store.placement(dep.name, version)
            if known is None:
                return None
            cached = self._placements[dep.name] = (version, known)
        return cached[1]

    def report(
        self,
        dep: Deployment,
        session: Session,
        version: int,
        phase: str,
        error: str = "",
        serving: np.ndarray | None = None,
    ) -> None:
        """A session's plan progress (for each of its ranks): prepared / failed / committed /
        aborted. `serving`: with failed after a Commit, the placement the ranks serve now."""
        plan = dep.plan
        now = self.clock()
        if plan is None or plan.version != version:
            self._report_off_plan(dep, session, version, phase, now, error, serving)
            return
        if phase == "prepared":
            t = coordinate.on_prepared(plan, session.ranks, now)
        elif phase == "failed":
            t = coordinate.on_failed(plan, session.ranks, error, session.pod)
            if t.partial:
                self._record_mixed(dep, plan.version, plan.base_version, plan.reason, serving, now)
        elif phase == "committed":
            t = coordinate.on_committed(plan, session.ranks, now)
        elif phase == "aborted":
            t = coordinate.on_aborted(plan, session.ranks)
        else:
            raise StateError("INVALID_ARGUMENT", f"plan phase {phase!r} is not reportable")
        self.apply(dep, t)

    def _record_mixed(
        self,
        dep: Deployment,
        version: int,
        base_version: int,
        reason: str,
        serving: np.ndarray | None,
        now: float,
    ) -> None:
        """Plan `version` was applied in part: record what the ranks serve (module docstring)."""
        workers = frozenset(s.worker_id for s in dep.live_sessions() if s.worker_id)
        mixed = Mixed(version, base_version, serving, reason, now, workers)
        dep.serve_mixed(mixed, counted=True)
        log.error(
            "%s: the ranks serve a mixed placement: %s; no plan starts until the group restarts",
            dep.name,
            mixed.describe(),
        )
        self._write(dep.name, lambda: self.store.set_mixed(dep.name, mixed, reason, now=now))

    def _failed_after_commit(
        self,
        dep: Deployment,
        session: Session,
        version: int,
        error: str,
        serving: np.ndarray | None,
        now: float,
    ) -> bool:
        """FAILED of a plan no longer in flight whose Commit went out: told by another
        survivor of the same partial plan (the placement filled in if still unknown), or
        after the plan finished unconfirmed (its commit grace ran out, or the controller
        restarted). True when handled."""
        mixed = dep.mixed
        if mixed is not None and mixed.version == version:
            if mixed.phy2log is None and serving is not None:
                known = replace(mixed, phy2log=serving)
                dep.serve_mixed(known)
                self._write(
                    dep.name, lambda: self.store.set_mixed(dep.name, known, known.reason, now=now)
                )
            return True
        if dep.last_unconfirmed is None or dep.last_unconfirmed.version != version:
            return False
        row = next((p for p in self.store.plans(dep.name, 5) if p.version == version), None)
        base = row.base_version if row is not None else dep.version
        reason = f"{session.label} failed after the commit: {error or 'no reason given'}"
        self._record_mixed(dep, version, base, reason, serving, now)
        return True

    def _left_outside_plans(
        self, dep: Deployment, session: Session, error: str, serving: np.ndarray, now: float
    ) -> None:
        """FAILED of the committed version, with the placement served: the engine moved the
        ranks off it outside any plan (SGLang's elastic EP placed the survivors of a rank
        fault). Recorded as the deployment's mixed placement (what the ranks serve; no plan
        starts on top of it, and the one in flight aborts: its transfers assume the
        committed placement); a restarted group clears it. Told again by the other ranks:
        the first placement is kept."""
        if dep.mixed is not None:
            return
        plan = dep.plan
        reason = f"{session.label}: {error or 'the ranks left the committed placement'}"
        if plan is not None:
            self.apply(dep, coordinate.abort(plan, reason))
        self._record_mixed(dep, dep.version, dep.version, reason, serving, now)

    def _report_off_plan(
        self,
        dep: Deployment,
        session: Session,
        version: int,
        phase: str,
        now: float,
        error: str = "",
        serving: np.ndarray | None = None,
    ) -> None:
        """A report of a version that is not the plan in flight."""
        plan = dep.plan
        if phase == "failed" and self._failed_after_commit(
            dep, session, version, error, serving, now
        ):
            return
        if phase == "failed" and version == dep.version and serving is not None:
            self._left_outside_plans(dep, session, error, serving, now)
            return
        if version == dep.version and phase in ("committed", "prepared"):
            return  # late confirmation of a plan already finished: harmless
        known = self.store.placement(dep.name, version) if version > dep.version else None
        if (
            phase == "committed"
            and known is not None
            and session.commit_told < version
            and not self._offered(dep, version)
        ):
            # No Commit of it went to this session: the report is from ranks that are gone
            # (a sidecar's queue outliving the group it restarted; seed 213 of the short
            # campaign beside a hog adopted v10 after the group came back on v0).
            log.warning(
                "%s: %s says it committed v%d, but was never told to: a stale report, refused",
                dep.name,
                session.label,
                version,
            )
            raise StateError(
                "FAILED_PRECONDITION",
                f"{session.label} was never sent the commit of plan v{version}",
            )
        if (
            phase == "committed"
            and known is not None
            and plan is not None
            and plan.state is PlanState.PREPARING
            and plan.base_version < version
        ):
            # The ranks switched to a plan the controller had given up on: the plan in
            # flight is based on an older version and cannot prepare anywhere.
            self.apply(
                dep,
                coordinate.abort(
                    plan,
                    f"{session.label} serves v{version}, the plan is based on v{plan.base_version}",
                ),
            )
            plan = dep.plan
        if phase == "committed" and known is not None and plan is None:
            # Recorded like a plan's outcome: a confirmation is told once, so a store that
            # refuses the record (disk full) must not make the controller forget it.
            reconcile.adopt(
                self.store,
                dep,
                version,
                known,
                f"{session.label} confirmed it late",
                now,
                record=lambda write: self._write(dep.name, write),
            )
            return
        latest = max(
            dep.version,
            plan.version if plan else 0,
            dep.last_aborted.version if dep.last_aborted else 0,
            dep.last_unconfirmed.version if dep.last_unconfirmed else 0,
        )
        if phase == "aborted" and version <= latest:
            return  # staging of a finished plan dropped (an Abort told again): harmless
        if (
            phase == "failed"
            and dep.last_aborted is not None
            and dep.last_aborted.version == version
        ):
            return  # another rank failing (or stopping) a plan already aborted: harmless
        if version > latest:
            raise StateError(
                "NOT_FOUND", f"plan v{version} unknown for {dep.name!r} (latest v{latest})"
            )
        raise StateError(
            "FAILED_PRECONDITION",
            f"plan v{version} of {dep.name!r} is not in flight (committed v{dep.version}"
            + (f", in flight v{plan.version})" if plan else ", none in flight)"),
        )

    def tick(self, dep: Deployment, now: float) -> None:
        """Timeouts of the plan in flight; outcome writes the store refused, again."""
        self._write_pending(dep.name)
        if dep.plan is not None:
            self.apply(dep, coordinate.on_tick(dep.plan, now))

    def _write(self, name: str, write: Callable[[], None]) -> None:
        """Record a plan's outcome in the store, after any still unwritten (order kept). A
        write SQLite refuses is kept for the next tick: the plan still finishes in memory
        and on the ranks, so a full or read-only disk never leaves a plan stuck in flight
        (which would stop every later plan)."""
        self._unwritten.setdefault(name, []).append(write)
        self._write_pending(name)

    def _write_pending(self, name: str) -> None:
        pending = self._unwritten.get(name)
        while pending:
            try:
                pending[0]()
            except sqlite3.Error as exc:
                log.error(
                    "%s: store refused a plan record (%s); %d write(s) retried at the next tick",
                    name,
                    exc,
                    len(pending),
                )
                return
            pending.pop(0)

    def _record_commit(self, dep: Deployment, plan: Plan) -> str:
        """Record that plan's Commit goes out, before it does (after any outcome still
        unwritten, order kept): "" once written, else why the store refused."""
        self._write_pending(dep.name)
        if self._unwritten.get(dep.name):
            return "earlier plan records are still unwritten"
        try:
            self.store.mark_committing(dep.name, plan.version)
        except sqlite3.Error as exc:
            log.error(
                "%s: store refused to record the commit of plan v%d (%s)",
                dep.name,
                plan.version,
                exc,
            )
            return str(exc)
        return ""

    def disconnected(self, dep: Deployment, session: Session) -> None:
        """A session ended (a group's: all its ranks): a plan still preparing cannot complete."""
        if dep.plan is not None:
            self.apply(dep, coordinate.on_disconnect(dep.plan, session.ranks, session.pod))

    def apply(self, dep: Deployment, t: Transition) -> None:
        """Do what a transition says: fan out, store, count, notify, free the slot."""
        plan = dep.plan
        if plan is None:
            return
        now = self.clock()
        if t.send_commit:
            refused = self._record_commit(dep, plan)
            if refused:
                t = coordinate.commit_unrecorded(
                    plan, f"the store refused to record the commit ({refused})"
                )
        if t.send_commit:
            log.info("%s: plan v%d prepared on all ranks, committing", dep.name, plan.version)
            plan.commit_sessions = frozenset(
                s.session_id for s in dep.live_sessions() if s.streaming
            )
            dep.send_all("commit", plan)
            self._notify(dep, plan, "prepared")
        if t.send_abort:
            log.log(
                logging.INFO if plan.stopped else logging.WARNING,  # a planned stop is no fault
                "%s: plan v%d aborted: %s",
                dep.name,
                plan.version,
                plan.reason,
            )
            version, reason = plan.version, plan.reason
            self._write(
                dep.name,
                lambda: self.store.set_plan_state(dep.name, version, "aborted", reason, now=now),
            )
            dep.abort(plan)
            dep.send_all("abort", plan)
            self._notify(dep, plan, "aborted")
        if t.became_committed:
            version = plan.version
            self._write(dep.name, lambda: self.store.commit_plan(dep.name, version, now=now))
            dep.commit(plan)
            log.info("%s: plan v%d committed", dep.name, plan.version)
            self._notify(dep, plan, "committed")
        if t.partial:
            self._notify(dep, plan, "partial")
        if t.unconfirmed:
            log.error("%s: plan v%d: %s", dep.name, plan.version, plan.reason)
            dep.leave_unconfirmed(plan)
            version, reason = plan.version, plan.reason
            self._write(
                dep.name,
                lambda: self.store.set_plan_state(
                    dep.name, version, "unconfirmed", reason, now=now
                ),
            )
            self._notify(dep, plan, "unconfirmed")
        if t.finished:
            dep.finish()

    def _notify(self, dep: Deployment, plan: Plan, what: str) -> None:
        for observer in self.observers.plan:
            observer(dep.name, plan, what)
