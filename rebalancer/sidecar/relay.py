"""Plans through the sidecar: relay each phase to the pod's ranks, report for the pod.

A plain state machine (no I/O, no event loop): every call returns `Actions`, the messages
for the ranks' streams and the reports for the controller, so the daemon and the unit
tests drive the same code. The controller decides; the sidecar only narrows what its
ranks say into what one group session may say (invariant 5 across the relay):

- Prepare goes to every rank with a stream open. PREPARED goes up once every rank of
  the pod prepared; FAILED goes up (once, naming the rank) as soon as a rank fails, or a
  rank's stream ends (or was not open) while the plan is preparing: a group's rank that
  left cannot be committed, exactly as a direct rank that left.
- Commit goes to every rank; COMMITTED goes up when every rank committed (ranks whose
  stream ended after Commit are not waited for: nothing can abort a plan then, and the
  ranks switch together by their own agreement, invariant 2), and again each time the
  controller tells Commit of a plan committed here (it did not hear the first).
- Abort goes to every rank, and the pod's reports of that plan still queued are moot.
- A rank that (re)attaches is told what it missed: Commit of a plan committing, Abort of
  an aborted plan it did not confirm, and first the Prepare of the plan preparing or
  aborted: a stream that went down as the Prepare was sent may have lost it, and its
  peers wait (at most the transfer fence's 1.5 s, worker_hooks/fence.py) for every rank
  to take the plan before any weight moves; late, it learns the plan was given up. A
  rank takes a plan once, however often its Prepare comes (worker_hooks.hook); the
  Abort makes it keep nothing.

A sidecar restarted mid-plan knows nothing; the controller tells a group session that
(re)opens its stream the newest aborted plan (and resends Commit of a plan committing),
and `commit` / `abort` of a plan never relayed here are passed to the ranks all the same:
a rank drops staging it holds of that version, or ignores it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from rebalancer.errors import StateError
from rebalancer.v1 import rebalancer_pb2 as pb

Phase = Literal["preparing", "prepared", "committing", "committed", "aborted"]
# What happened to a plan, for metrics and logs.
Event = Literal["proposed", "prepared", "failed", "committed", "aborted"]


@dataclass
class RelayPlan:
    version: int
    phase: Phase
    prepare: pb.Prepare | None  # None: learnt of at its commit or abort (sidecar restarted)
    started_at: float
    prepared: set[int] = field(default_factory=set)
    committed: set[int] = field(default_factory=set)
    aborted: set[int] = field(default_factory=set)  # ranks that confirmed dropping staging
    failed: str = ""  # the FAILED reason sent up (at most once)
    reason: str = ""  # why the controller aborted it
    step: int = 0  # the step its ranks switched at
    bytes_received: int = 0
    seconds: float = 0.0
    prepared_at: float = 0.0
    finished_at: float = 0.0


@dataclass
class Actions:
    """What a call asks the daemon to do, in order."""

    to_ranks: list[tuple[int, pb.ControllerMessage]] = field(default_factory=list)
    upstream: list[pb.PlanReport] = field(default_factory=list)
    drop_reports: int | None = None  # queued upstream reports of this version are moot
    events: list[tuple[Event, RelayPlan]] = field(default_factory=list)


class Relay:
    """The plan relay of one pod's ranks. `connected`: ranks with a stream open;
    `versions`: the placement version each rank last said it serves."""

    def __init__(self, ranks: tuple[int, ...], clock: Callable[[], float] = time.monotonic) -> None:
        self.ranks = frozenset(ranks)
        self.clock = clock
        self.connected: set[int] = set()
        self.versions: dict[int, int] = {}
        self.plan: RelayPlan | None = None

    @property
    def phase(self) -> Phase | Literal["idle"]:
        return self.plan.phase if self.plan is not None else "idle"

    # ------------------------------------------------------------ ranks

    def serves(self, rank: int, version: int, registering: bool = False) -> None:
        """A rank said which version it serves: at Register (its process says it outright:
        it may have restarted), or by a window or a commit (never backwards)."""
        self.versions[rank] = version if registering else max(self.versions.get(rank, 0), version)

    def attached(self, rank: int) -> Actions:
        """A rank opened its stream: what it missed."""
        a = Actions()
        self.connected.add(rank)
        plan = self.plan
        if plan is None:
            return a
        if (
            plan.prepare is not None
            and rank in self.ranks
            and plan.phase in ("preparing", "aborted")
            and rank not in plan.prepared | plan.aborted
        ):
            # Its peers' transfers wait for it; a rank that has it ignores it (the Abort,
            # if any, follows).
            a.to_ranks.append((rank, pb.ControllerMessage(prepare=plan.prepare)))
        if plan.phase in ("committing", "committed") and rank not in plan.committed:
            if self.versions.get(rank, 0) >= plan.version:
                plan.committed.add(rank)
                self._settle_commit(plan, a)
            else:
                a.to_ranks.append((rank, _commit(plan.version)))
        elif plan.phase == "aborted" and rank not in plan.aborted:
            a.to_ranks.append((rank, _abort(plan.version, plan.reason)))
        return a

    def detached(self, rank: int) -> Actions:
        """A rank's stream ended (its process died, or its link to the sidecar broke)."""
        a = Actions()
        self.connected.discard(rank)
        plan = self.plan
        if plan is not None and plan.phase in ("preparing", "prepared"):
            self._fail(plan, f"rank {rank} disconnected from the sidecar while preparing", a)
        elif plan is not None and plan.phase == "committing":
            self._settle_commit(plan, a)
        return a

    def report(self, rank: int, report: pb.PlanReport) -> Actions:
        """A rank's plan progress. Raises StateError for a report that fits no plan."""
        a = Actions()
        plan, phase = self.plan, report.phase
        if phase == pb.PLAN_PHASE_COMMITTED:
            self.serves(rank, report.version)
        if plan is None or plan.version != report.version:
            if phase in (pb.PLAN_PHASE_COMMITTED, pb.PLAN_PHASE_ABORTED):
                return a  # a late confirmation: the version it serves is noted
            now = f" (v{plan.version} is {plan.phase})" if plan is not None else ""
            raise StateError(
                "FAILED_PRECONDITION", f"plan v{report.version} is not in flight here{now}"
            )
        if phase == pb.PLAN_PHASE_PREPARED:
            if plan.phase == "preparing" and rank not in plan.prepared:
                plan.prepared.add(rank)
                plan.bytes_received += report.bytes_received
                plan.seconds = max(plan.seconds, report.seconds)
                if plan.prepared >= self.ranks and not plan.failed:
                    plan.phase, plan.prepared_at = "prepared", self.clock()
                    a.upstream.append(
                        pb.PlanReport(
                            version=plan.version,
                            phase=pb.PLAN_PHASE_PREPARED,
                            bytes_received=plan.bytes_received,
                            seconds=plan.seconds,
                        )
                    )
                    a.events.append(("prepared", plan))
        elif phase == pb.PLAN_PHASE_FAILED:
            if plan.phase in ("preparing", "prepared"):
                self._fail(plan, f"rank {rank}: {report.error or 'no reason given'}", a)
            elif plan.phase in ("committing", "committed") and not plan.failed:
                # After the Commit: the rank applied it in part (an engine's updater lost a
                # peer midway); the controller records the placement it serves.
                plan.failed = f"rank {rank}: {report.error or 'no reason given'}"
                a.upstream.append(
                    pb.PlanReport(
                        version=plan.version,
                        phase=pb.PLAN_PHASE_FAILED,
                        error=plan.failed[:500],
                        serving=report.serving if report.HasField("serving") else None,
                    )
                )
                a.events.append(("failed", plan))
        elif phase == pb.PLAN_PHASE_COMMITTED:
            if plan.phase not in ("committing", "committed"):
                raise StateError(
                    "FAILED_PRECONDITION",
                    f"plan v{plan.version} is {plan.phase}; no commit was sent",
                )
            plan.committed.add(rank)
            plan.step = plan.step or report.step
            self._settle_commit(plan, a)
        elif phase == pb.PLAN_PHASE_ABORTED:
            plan.aborted.add(rank)
        else:
            raise StateError("INVALID_ARGUMENT", f"plan phase {phase} is not reportable")
        return a

    # ------------------------------------------------------------ controller

    def prepare(self, msg: pb.Prepare) -> Actions:
        a = Actions()
        plan = self.plan
        if plan is not None and plan.version == msg.version:
            return a  # told again after a reconnect: the ranks have it (never twice)
        if plan is not None and plan.phase in ("preparing", "prepared"):
            self._abort(plan, f"superseded by plan v{msg.version}", a)
        plan = self.plan = RelayPlan(msg.version, "preparing", msg, self.clock())
        a.events.append(("proposed", plan))
        message = pb.ControllerMessage(prepare=msg)
        for rank in sorted(self.connected & self.ranks):
            a.to_ranks.append((rank, message))
        missing = sorted(self.ranks - self.connected)
        if missing:
            self._fail(plan, f"rank {missing[0]} is not connected to the sidecar", a)
        return a

    def commit(self, version: int) -> Actions:
        a = Actions()
        plan = self.plan
        if plan is not None and plan.version == version and plan.phase == "aborted":
            return a  # never happens: the controller does not commit what it aborted
        if plan is None or plan.version != version:
            # Not relayed by this sidecar (it restarted after the controller sent Commit):
            # its ranks may hold it staged, or have switched already.
            plan = self.plan = RelayPlan(version, "committing", None, self.clock())
        elif plan.phase != "committed":
            plan.phase = "committing"
        if not plan.prepared_at:
            plan.prepared_at = self.clock()
        for rank in sorted(self.ranks):
            if rank not in plan.committed and self.versions.get(rank, 0) >= version:
                plan.committed.add(rank)
        message = _commit(version)
        for rank in sorted(self.connected & self.ranks - plan.committed):
            a.to_ranks.append((rank, message))
        if plan.phase == "committed":
            # Told again: the controller did not hear this pod's COMMITTED (it went with a
            # link, or was refused for a session the controller had already ended).
            a.upstream.append(_committed(plan))
        self._settle_commit(plan, a)
        return a

    def abort(self, version: int, reason: str) -> Actions:
        a = Actions(drop_reports=version)
        plan = self.plan
        if plan is not None and plan.version == version:
            if plan.phase in ("committing", "committed"):
                return Actions()  # never happens: nothing aborts a plan after Commit
            if plan.phase == "aborted":  # told again: whoever did not confirm hears it again
                for rank in sorted(self.connected & self.ranks - plan.aborted):
                    a.to_ranks.append((rank, _abort(version, plan.reason)))
                return a
            self._abort(plan, reason, a)
            return a
        # A plan this sidecar did not relay (it restarted), or an older one: the ranks
        # drop whatever they staged of it. A plan in flight here of another version stays.
        if plan is None or plan.phase in ("committed", "aborted") or plan.version < version:
            self.plan = RelayPlan(version, "aborted", None, self.clock(), reason=reason)
            self.plan.finished_at = self.plan.started_at
        message = _abort(version, reason)
        for rank in sorted(self.connected & self.ranks):
            a.to_ranks.append((rank, message))
        return a

    # ------------------------------------------------------------ transitions

    def _fail(self, plan: RelayPlan, reason: str, a: Actions) -> None:
        if plan.failed:
            return
        plan.failed = reason
        a.upstream.append(
            pb.PlanReport(version=plan.version, phase=pb.PLAN_PHASE_FAILED, error=reason[:500])
        )
        a.events.append(("failed", plan))

    def _abort(self, plan: RelayPlan, reason: str, a: Actions) -> None:
        plan.phase, plan.reason, plan.finished_at = "aborted", reason, self.clock()
        a.drop_reports = plan.version
        message = _abort(plan.version, reason)
        for rank in sorted(self.connected & self.ranks):
            a.to_ranks.append((rank, message))
        a.events.append(("aborted", plan))

    def _settle_commit(self, plan: RelayPlan, a: Actions) -> None:
        """COMMITTED goes up once every rank committed, or every rank still connected did."""
        if plan.phase != "committing" or not plan.committed:
            return
        if self.ranks <= plan.committed or (self.connected & self.ranks) <= plan.committed:
            plan.phase, plan.finished_at = "committed", self.clock()
            a.upstream.append(_committed(plan))
            a.events.append(("committed", plan))


def _committed(plan: RelayPlan) -> pb.PlanReport:
    return pb.PlanReport(version=plan.version, phase=pb.PLAN_PHASE_COMMITTED, step=plan.step)


def _commit(version: int) -> pb.ControllerMessage:
    return pb.ControllerMessage(commit=pb.Commit(version=version))


def _abort(version: int, reason: str) -> pb.ControllerMessage:
    return pb.ControllerMessage(abort=pb.Abort(version=version, reason=reason))
