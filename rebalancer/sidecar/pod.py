"""What the sidecar knows about its pod, shared by the ranks' side and the upstream side.

The pod's ranks register here (deployment and shape must agree, each rank once), open
one stream each, send windows (merged per seq into the bounded buffer) and plan reports
(narrowed by the relay into the group's reports). The upstream link reads the buffer and
the report queue, registers the pod as one group session once every rank has registered
(and, the first time, opened its stream), and hands down the controller's plan phases.

A rank's Register is answered at once, never waiting on the controller: with the
controller's committed placement as of the sidecar's last registration or relayed
commit, or, before the sidecar first reached the controller, the placement the rank
started with (version 0). The rank does not act on it (worker_hooks keeps it for
inspection); what keeps ranks consistent is the plan phases. `next_window_seq` is the
rank's cursor on this sidecar: windows are numbered per rank between rank and sidecar,
and the sidecar numbers the merged windows it sends upstream itself, from the
controller's cursor of the group.

Everything here runs on the sidecar's event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rebalancer.errors import StateError
from rebalancer.sidecar.config import SidecarConfig, format_ranks
from rebalancer.sidecar.relay import Actions, Event, Relay, RelayPlan
from rebalancer.sidecar.resize import PendingResize, describe
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from rebalancer.wire.codec import Statement
from rebalancer.wire.dispatch import DEFAULT_DISPATCH_MODE, DISPATCH_MODES
from rebalancer.wire.layout import trivial_placement
from rebalancer.wire.shape import shapes_agree
from rebalancer.wire.windows import BoundedWindows, CountWindow, SeqMerger

log = logging.getLogger("rebalancer.sidecar")

Send = Callable[[pb.ControllerMessage], None]


@dataclass
class RankSession:
    """A rank's session on the socket, or a follower sidecar's (`ranks`: its pod's, when
    this sidecar merges its EP group: rebalancer/sidecar/merge.py)."""

    rank: int
    session_id: str
    worker_id: str
    send: Send | None = None  # set while its stream is open
    ranks: tuple[int, ...] = ()  # a follower sidecar's ranks; () for one rank
    # A follower's ranks with a stream open to it (its ReportRanks); all of them until told.
    present: frozenset[int] = frozenset()

    @property
    def follower(self) -> bool:
        return bool(self.ranks)

    @property
    def covers(self) -> tuple[int, ...]:
        """The ranks this session speaks for."""
        return self.ranks or (self.rank,)


@dataclass
class PodStats:
    windows_in: int = 0  # rank windows received
    windows_out: int = 0  # merged windows sent upstream
    duplicate_windows: int = 0
    plans_committed: int = 0
    plans_aborted: int = 0


class Pod:
    def __init__(self, config: SidecarConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.deployment = config.link.deployment
        self.shape: pb.ModelShape | None = None
        # The ranks' dispatch mode (None until the first rank registers; a rank sending
        # none means split) and top_k (0: unknown until a rank says), sent upstream.
        self.dispatch_mode: str | None = None
        self.top_k = 0
        self.initial: pb.Placement | None = None
        self.pool = config.link.pool  # the replica pool told upstream ("" = none, or the ranks')
        # A resize of the EP group (rebalancer/sidecar/resize.py): the one being gathered,
        # the one the pod took (its ranks register into it), whether the controller still
        # has to be told it, and the new world's workers until their sessions exist.
        self.resize: PendingResize | None = None
        self.resized_from: pb.Resize | None = None
        self.tell_resize = False
        self._resize_workers: dict[int, str] = {}
        self.world = 0  # how many resizes the pod took: the upstream link renumbers from scratch
        self.stats = PodStats()
        self.changed = asyncio.Event()  # wakes the upstream link: windows, reports, ranks
        self.observers: list[Callable[[Event, RelayPlan], None]] = []
        # The pod's own ranks (on the socket) and, merging the EP group, the group's: the
        # ranks its followers may bring (rebalancer/sidecar/merge.py).
        self.own = tuple(sorted(config.ranks))
        self.group_ranks = frozenset(config.group_ranks)
        self.leader = config.merge.role == "leader"
        self.started_at = clock()
        self._new_world(self.own)

    def _new_world(self, ranks: tuple[int, ...]) -> None:
        """The pod's ranks from now on and everything kept per world: their sessions,
        windows, plans and what the controller said."""
        self.ranks = ranks
        self.sessions: dict[str, RankSession] = {}  # local session id -> session
        self.by_rank: dict[int, RankSession] = {}
        self.merge = SeqMerger(self.ranks, self.config.fold_lag)
        self.buffer = BoundedWindows(self.config.max_buffered_windows)
        self.relay = Relay(self.ranks)
        self.reports: deque[pb.PlanReport] = deque()  # for the controller, in order
        self.committed: pb.Placement | None = None  # the controller's, once known
        # The pool placement the controller offered the group (RegisterResponse.warm_start),
        # told to every rank until a plan is relayed or a version above 0 committed.
        self.warm_start: pb.Placement | None = None
        self.upstream_registered = False
        self.upstream_ranks: tuple[int, ...] = ()  # the ranks the group session names
        # A rank came back serving an older version than the group session registered (its
        # process restarted): the upstream link ends that session and registers the group
        # again once every rank is back, so the controller reconciles to what the ranks
        # serve (invariant 7) instead of planning from a placement no rank holds.
        self.resync = False
        self._confirmed_late = 0  # newest switch told upstream outside the relay's plan
        # What each rank last said it serves (version, placement digest; 0: not said),
        # from its windows: never backwards but at its Register (it may have restarted).
        self.statements: dict[int, Statement] = {}
        # The newest contingency set the controller told (lost ranks -> its message).
        self.planned: dict[tuple[int, ...], pb.ControllerMessage] = {}

    @property
    def ranks_label(self) -> str:
        return format_ranks(self.ranks)

    # ------------------------------------------------------------ the ranks

    @property
    def connected_ranks(self) -> int:
        return len(self.connected())

    def connected(self) -> frozenset[int]:
        """The ranks with a stream open here (what the controller is told: ReportRanks)."""
        # list() first: metrics read this from their own thread while the loop may add a rank.
        out: set[int] = set()
        for s in list(self.by_rank.values()):
            if s.send is not None:
                out.update(s.present if s.follower else (s.rank,))
        return frozenset(out)

    def register(self, request: pb.RegisterRequest) -> pb.RegisterResponse:
        """A rank registers on the socket: checked against the pod, answered at once."""
        rank = int(request.rank)
        if request.ranks:
            if not self.leader:
                raise StateError(
                    "INVALID_ARGUMENT",
                    "a sidecar serves single ranks, not group sessions (this one does not "
                    "merge its EP group: --merge-listen)",
                )
            return self._register_follower(request)
        resized = request.HasField("resized_from")
        if self.deployment and request.deployment != self.deployment:
            raise StateError(
                "FAILED_PRECONDITION",
                f"rank {rank} registers for deployment {request.deployment!r}, "
                f"this pod serves {self.deployment!r}",
            )
        if resized and not self._in_resized_world(request):
            self._gather_resize(request)
        if rank not in self.own:
            raise StateError(
                "INVALID_ARGUMENT",
                f"rank {rank} is not one of this pod's ranks {format_ranks(self.own)}",
            )
        mode = self._check_fits(request, f"rank {rank}")
        old = self.by_rank.get(rank)
        if old is not None and old.send is not None:
            raise StateError(
                "ALREADY_EXISTS", f"rank {rank} is already registered here with a stream open"
            )
        # Accepted: nothing above changed any state.
        learned_bytes = self._take_fit(request, mode)
        if old is not None:
            self.sessions.pop(old.session_id, None)
        session = RankSession(rank, uuid.uuid4().hex, request.worker_id)
        self.sessions[session.session_id] = self.by_rank[rank] = session
        # A rank of the resize the controller took serves its placement, as v0 until this
        # answer tells it the version (RegisterResponse.committed).
        serving = (
            self.committed.version
            if resized and self.committed is not None
            else request.placement_version
        )
        self.relay.serves(rank, serving, registering=True)
        self.statements[rank] = (serving, 0)  # its map told by its windows
        behind = self.committed is not None and serving < self.committed.version
        restarted = bool(
            old is not None
            and old.worker_id
            and request.worker_id
            and old.worker_id != request.worker_id
        )
        if self.upstream_registered and (behind or restarted):
            log.warning(
                "rank %d %s on v%d: registering the group again once every rank is back",
                rank,
                "restarted" if restarted else "came back",
                request.placement_version,
            )
            self.upstream_registered, self.resync = False, True
            if self.reports:  # of processes that are gone: a late COMMITTED of theirs is false now
                log.info(
                    "dropping %d plan report(s) of the ranks before they restarted",
                    len(self.reports),
                )
                self.reports.clear()
        elif self.upstream_registered and learned_bytes:
            log.info(
                "rank %d told the expert bytes (%d): "
                "registering the group again once every rank is back",
                rank,
                request.shape.expert_bytes,
            )
            self.upstream_registered, self.resync = False, True
        log.info("rank %d registered (worker %s, v%d)", rank, request.worker_id or "?", serving)
        self.changed.set()
        response = pb.RegisterResponse(
            session_id=session.session_id,
            committed=self._committed_for(request),
            next_window_seq=self.merge.cursor(rank),
        )
        if self.warm_start is not None and request.placement_version == 0:
            response.warm_start.CopyFrom(self.warm_start)
        return response

    def _check_fits(self, request: pb.RegisterRequest, label: str) -> str:
        """The registration of `label` (a rank, or a follower's ranks) fits the pod's
        deployment, shape, dispatch, top_k and pool (StateError else, nothing changed);
        returns its dispatch mode."""
        if self.shape is not None and not shapes_agree(request.shape, self.shape):
            raise StateError(
                "FAILED_PRECONDITION",
                f"{label} reports shape {_shape_text(request.shape)}, "
                f"the pod's ranks {_shape_text(self.shape)}",
            )
        mode = request.dispatch_mode or DEFAULT_DISPATCH_MODE
        if mode not in DISPATCH_MODES:
            raise StateError(
                "INVALID_ARGUMENT",
                f"{label} names an unknown dispatch mode {request.dispatch_mode!r}",
            )
        if self.dispatch_mode is not None and mode != self.dispatch_mode:
            raise StateError(
                "FAILED_PRECONDITION",
                f"{label} dispatches by {mode!r}, the pod's ranks by {self.dispatch_mode!r}",
            )
        if request.top_k and self.top_k and request.top_k != self.top_k:
            raise StateError(
                "FAILED_PRECONDITION",
                f"{label} reports top_k {request.top_k}, the pod's ranks {self.top_k}",
            )
        if self.pool and request.pool and request.pool != self.pool:
            raise StateError(
                "FAILED_PRECONDITION",
                f"{label} names pool {request.pool!r}, this pod's is {self.pool!r}",
            )
        if max(self.group_ranks) >= request.shape.num_gpus:
            raise StateError(
                "INVALID_ARGUMENT",
                f"this pod's ranks {format_ranks(tuple(self.group_ranks))} do not fit "
                f"{request.shape.num_gpus} GPUs",
            )
        return mode

    def _take_fit(self, request: pb.RegisterRequest, mode: str) -> bool:
        """Take what an accepted registration tells of the group; whether it told the
        expert bytes for the first time."""
        self.deployment = request.deployment
        learned_bytes = False
        if self.shape is None:
            self.shape = pb.ModelShape()
            self.shape.CopyFrom(request.shape)
        elif not self.shape.expert_bytes and request.shape.expert_bytes:
            # The ranks registered before they knew (SGLang's warm start): the controller
            # hears the bytes through the group's next registration.
            self.shape.expert_bytes = request.shape.expert_bytes
            learned_bytes = True
        self.dispatch_mode = mode
        self.top_k = self.top_k or int(request.top_k)
        self.pool = self.pool or request.pool
        if self.initial is None and request.HasField("initial_placement"):
            self.initial = pb.Placement()
            self.initial.CopyFrom(request.initial_placement)
        return learned_bytes

    # ------------------------------------------------------------ follower sidecars

    def _register_follower(self, request: pb.RegisterRequest) -> pb.RegisterResponse:
        """A follower sidecar of this EP group registers its pod's ranks as one session
        (rebalancer/sidecar/merge.py): checked like a rank, answered at once. The group
        session upstream is registered again to name them."""
        ranks = tuple(sorted(int(r) for r in request.ranks))
        label = f"follower {request.pod or request.worker_id or '?'} (ranks {format_ranks(ranks)})"
        if len(set(ranks)) != len(ranks):
            raise StateError("INVALID_ARGUMENT", f"{label} names a rank twice")
        if self.deployment and request.deployment != self.deployment:
            raise StateError(
                "FAILED_PRECONDITION",
                f"{label} registers for deployment {request.deployment!r}, "
                f"this group serves {self.deployment!r}",
            )
        if request.HasField("resized_from"):
            raise StateError(
                "FAILED_PRECONDITION",
                f"{label}: a resized EP group registers pod by pod with the controller, "
                "not through the group's merging sidecar",
            )
        own = sorted(set(ranks) & set(self.own))
        if own:
            raise StateError(
                "INVALID_ARGUMENT", f"{label}: rank {own[0]} is this leader pod's own rank"
            )
        stranger = sorted(set(ranks) - self.group_ranks)
        if stranger:
            raise StateError(
                "INVALID_ARGUMENT",
                f"{label}: rank {stranger[0]} is not one of this group's ranks "
                f"{format_ranks(tuple(self.group_ranks))}",
            )
        mode = self._check_fits(request, label)
        olds = {id(s): s for r in ranks if (s := self.by_rank.get(r)) is not None}
        for old in olds.values():
            if old.send is not None:
                raise StateError(
                    "ALREADY_EXISTS",
                    f"{label}: rank {old.covers[0]} is already registered here with a stream open",
                )
            if set(old.covers) - set(ranks):
                raise StateError(
                    "ALREADY_EXISTS",
                    f"{label}: ranks {format_ranks(old.covers)} are one follower's session here",
                )
        # Accepted: nothing above changed any state.
        self._take_fit(request, mode)
        for old in olds.values():
            self._drop_follower(old)
        session = RankSession(
            ranks[0], uuid.uuid4().hex, request.worker_id, ranks=ranks, present=frozenset(ranks)
        )
        self.sessions[session.session_id] = session
        for r in ranks:
            self.by_rank[r] = session
            self.relay.serves(r, request.placement_version, registering=True)
            self.statements[r] = (request.placement_version, 0)
        self._world_changed()
        log.info("%s registered (v%d)", label, request.placement_version)
        self.changed.set()
        response = pb.RegisterResponse(
            session_id=session.session_id,
            committed=self._committed_for(request),
            next_window_seq=max(self.merge.cursor(r) for r in ranks),
        )
        if self.warm_start is not None and request.placement_version == 0:
            response.warm_start.CopyFrom(self.warm_start)
        return response

    def _drop_follower(self, session: RankSession) -> None:
        """A follower's session ends here (its stream ended, or it registered again): its
        ranks leave the group session upstream until it comes back (it may stream
        straight to the controller meanwhile, which would refuse ranks held here)."""
        self.sessions.pop(session.session_id, None)
        for r in session.ranks:
            if self.by_rank.get(r) is session:
                del self.by_rank[r]
                self.statements.pop(r, None)
                self.relay.versions.pop(r, None)
                # Forgotten: it comes back aligned with the group's newest window.
                self.merge.next_seq.pop(r, None)

    def _world_changed(self) -> None:
        """The ranks the group session names: this pod's and its followers' now. Upstream,
        the group registers again to name them."""
        ranks = tuple(sorted(set(self.own) | set(self.by_rank)))
        if ranks == self.ranks:
            return
        self.ranks = ranks
        self.merge.ranks = frozenset(ranks)
        self.relay.ranks = frozenset(ranks)
        if self.upstream_registered:
            log.info("the group's ranks are %s now: registering it again", self.ranks_label)
            self.upstream_registered, self.resync = False, True

    def presence(self, session_id: str, connected: frozenset[int]) -> None:
        """A follower tells which of its ranks have a stream open to it."""
        session = self.session(session_id)
        stranger = sorted(connected - set(session.ranks))
        if not session.follower or stranger:
            raise StateError(
                "INVALID_ARGUMENT",
                f"rank {(stranger or [session.rank])[0]} is not one of the session's "
                "follower ranks",
            )
        session.present = connected
        self.changed.set()

    def _unique_sessions(self) -> list[RankSession]:
        return list({id(s): s for s in self.by_rank.values()}.values())

    def _in_resized_world(self, request: pb.RegisterRequest) -> bool:
        """Whether `request` is a rank of the resize the pod took; UNAVAILABLE while the
        controller has not answered it yet (the rank asks again)."""
        if (
            self.resized_from is None
            or request.resized_from != self.resized_from
            or self.shape is None
            or not shapes_agree(request.shape, self.shape)
        ):
            return False
        if not self.upstream_registered:
            raise StateError(
                "UNAVAILABLE",
                f"rank {request.rank}: the EP group's resize from "
                f"{describe(self.resized_from)} is being relayed to the controller; "
                "ask again",
            )
        return True

    def _gather_resize(self, request: pb.RegisterRequest) -> None:
        """A rank of a resize the pod has not taken yet (rebalancer/sidecar/resize.py):
        gathered; the new world taken once every old rank is accounted for. Always
        raises: UNAVAILABLE (ask again) or the refusal."""
        now = self.clock()
        pending = self.resize
        if pending is None or not pending.same_resize(request):
            pending = PendingResize.of(request, now)  # a newer resize replaces one gathered
        old_rank = next(
            (
                s.rank
                for s in self.by_rank.values()
                if request.worker_id and s.worker_id == request.worker_id
            ),
            None,
        )
        pending.add(request, old_rank)
        if self.resize is not pending:
            log.warning(
                "rank %d (rank %s before) registers a resize of the EP group from %s to %d GPUs: "
                "gathering this pod's ranks of it",
                request.rank,
                "?" if old_rank is None else old_rank,
                describe(pending.resized_from),
                pending.shape.num_gpus,
            )
        self.resize = pending
        if pending.complete(self.ranks, self.connected(), now):
            self._take_resize(pending)
        raise StateError(
            "UNAVAILABLE",
            f"rank {request.rank}: the EP group's resize from "
            f"{describe(pending.resized_from)} is being relayed to the controller; "
            "ask again",
        )

    def _take_resize(self, pending: PendingResize) -> None:
        """The pod's ranks are the new world's from now on: the old world's sessions end
        (a window on one is refused), its windows and reports not yet sent are dropped
        (the controller drops the old world's partial windows too), and the upstream link
        registers the new world resized from the old."""
        log.warning(
            "the EP group was resized from %s: this pod's ranks are %s of %d GPUs now (were %s; %d "
            "window(s) of the old world dropped); registering the new world with the controller",
            describe(pending.resized_from),
            format_ranks(pending.ranks),
            pending.shape.num_gpus,
            self.ranks_label,
            len(self.buffer),
        )
        self.own = pending.ranks
        self.group_ranks = frozenset(pending.ranks)
        self._new_world(pending.ranks)
        self.shape = pending.shape
        self.initial = pending.placement
        self.resized_from = pending.resized_from
        self.tell_resize = True
        self._resize_workers = dict(pending.workers)
        self.resize = None
        self.world += 1
        self.resync = True  # the upstream link ends the old world's session
        self.changed.set()

    def _committed_for(self, request: pb.RegisterRequest) -> pb.Placement:
        if self.committed is not None:
            return self.committed
        if self.initial is not None:  # the sidecar has not reached the controller yet
            return pb.Placement(version=0, phy2log=self.initial.phy2log)
        s = request.shape
        phy2log = trivial_placement(
            s.num_layers, s.num_logical_experts, s.num_physical_slots, s.num_gpus
        )
        return pb.Placement(version=0, phy2log=codec.encode(np.asarray(phy2log, dtype=np.int32)))

    def session(self, session_id: str) -> RankSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise StateError("NOT_FOUND", f"unknown session {session_id[:16]!r}: register first")
        return session

    def attach(self, session_id: str, send: Send) -> RankSession:
        session = self.session(session_id)
        if session.send is not None:
            raise StateError(
                "ALREADY_EXISTS", f"session of rank {session.rank} already has a stream"
            )
        session.send = send
        log.info("%s connected", _who(session))
        if self.warm_start is not None:
            send(pb.ControllerMessage(warm_start=self.warm_start))
        for planned in list(self.planned.values()):
            send(planned)
        for rank in session.covers:
            self.apply(self.relay.attached(rank))
        self.changed.set()
        return session

    def detach(self, session: RankSession) -> None:
        if self.by_rank.get(session.rank) is not session or session.send is None:
            session.send = None
            return
        session.send = None
        log.info("%s disconnected", _who(session))
        for rank in session.covers:
            self.apply(self.relay.detached(rank))
        if session.follower:
            self._drop_follower(session)
            self._world_changed()
        self.changed.set()  # the upstream link tells the controller

    def window(self, session: RankSession, w: pb.Window) -> bool:
        """One rank window: validated, merged; False for a duplicate."""
        assert self.shape is not None  # a session exists only after a registration
        if self.sessions.get(session.session_id) is not session:
            raise StateError(
                "NOT_FOUND",
                f"the session of rank {session.rank} ended (the EP group was resized): "
                "register again",
            )
        L, E, P = (
            self.shape.num_layers,
            self.shape.num_logical_experts,
            self.shape.num_physical_slots,
        )
        logical = codec.decode_counts(w.logical_count, "logical_count", (L, E))
        physical = None
        if w.HasField("physical_count"):
            physical = codec.decode_counts(w.physical_count, "physical_count", (L, P))
        fresh = self.merge.add(
            session.covers, w.seq, logical, physical, w.first_step, w.num_steps, w.placement_version
        )
        log.debug(
            "%s window seq %d (steps %d+%d, v%d)%s",
            _who(session),
            w.seq,
            w.first_step,
            w.num_steps,
            w.placement_version,
            "" if fresh else " again",
        )
        if not fresh:
            self.stats.duplicate_windows += 1
            return False
        self.stats.windows_in += len(session.covers)
        for rank in session.covers:
            self.relay.serves(rank, w.placement_version)
            if w.serving_version >= self.statements.get(rank, (0, 0))[0]:
                self.statements[rank] = (w.serving_version, w.serving_hash)
        for merged in self.merge.ready():
            self.buffer.push(merged)
        self.changed.set()
        return True

    def report(self, report: pb.PlanReport) -> None:
        session = self.session(report.session_id)
        actions = self.relay.report(session.rank, report)
        if session.follower and report.phase != pb.PLAN_PHASE_FAILED:
            # A follower reports for all its ranks at once (PREPARED only when all of them
            # prepared): each of its ranks took that step; its bytes are counted once.
            rest = pb.PlanReport()
            rest.CopyFrom(report)
            rest.bytes_received = 0
            for rank in session.ranks[1:]:
                more = self.relay.report(rank, rest)
                actions.to_ranks += more.to_ranks
                actions.upstream += more.upstream
                actions.events += more.events
                if more.drop_reports is not None:
                    actions.drop_reports = more.drop_reports
        if (
            report.phase == pb.PLAN_PHASE_COMMITTED
            and self.warm_start is not None
            and report.version >= self.warm_start.version
        ):
            self.warm_start = None  # installed: the group serves it
        # A switch the relay no longer follows (the controller gave up on the plan and
        # moved on before the ranks' agreement switched): tell the controller once, so it
        # adopts what the ranks serve instead of planning from an older version forever.
        late = (
            report.phase == pb.PLAN_PHASE_COMMITTED
            and self.committed is not None
            and report.version > max(self.committed.version, self._confirmed_late)
            and (self.relay.plan is None or self.relay.plan.version != report.version)
        )
        if late:
            self._confirmed_late = report.version
            actions.upstream.append(
                pb.PlanReport(
                    version=report.version, phase=pb.PLAN_PHASE_COMMITTED, step=report.step
                )
            )
        self.apply(actions)

    def statement(self) -> Statement:
        """What the pod's ranks serve, as the group's windows state it upstream: their
        (version, digest) when every rank states the same placement, else the lowest
        version and digest 0 (not stated): the controller adopts only what all serve."""
        said = {self.statements.get(r, (0, 0)) for r in self.ranks}
        if len(said) == 1:
            return said.pop()
        return min(v for v, _ in said), 0

    # ------------------------------------------------------------ the controller

    def upstream_ready(self) -> bool:
        """Every rank registered (and, before the first upstream registration, has its
        stream open, so that no plan finds a rank missing at the start)."""
        if (
            self.tell_resize
        ):  # the new world's ranks wait on the controller's answer to register here
            return self.shape is not None
        if self.shape is None or not set(self.own) <= set(self.by_rank):
            return False
        if not self.upstream_registered and any(s.send is None for s in self._unique_sessions()):
            return False
        # Merging the EP group: its followers are waited for a while, then the group
        # registers with the ranks it has (one that comes later registers it again).
        return (
            self.group_ranks <= set(self.by_rank)
            or self.upstream_registered
            or self.upstream_ranks != ()  # registered before: the wait is over
            or self.clock() - self.started_at >= self.config.merge.wait_seconds
        )

    def group_request(self) -> pb.RegisterRequest:
        """The pod's registration as one group session of its ranks."""
        assert self.shape is not None
        version = max((self.relay.versions.get(r, 0) for r in self.ranks), default=0)
        self.upstream_ranks = self.ranks
        request = pb.RegisterRequest(
            deployment=self.deployment,
            rank=self.ranks[0],
            ranks=self.ranks,
            shape=self.shape,
            placement_version=version,
            pod=self.config.pod,
            worker_id=self.group_worker_id(),
            dispatch_mode=self.dispatch_mode or DEFAULT_DISPATCH_MODE,
            top_k=self.top_k,
            pool=self.pool,
        )
        if self.initial is not None:
            request.initial_placement.CopyFrom(self.initial)
        if self.tell_resize and self.resized_from is not None:
            request.resized_from.CopyFrom(self.resized_from)
        return request

    def group_worker_id(self) -> str:
        """The group session's identity: this sidecar and its ranks' processes, so the
        controller tells a group whose ranks restarted from one that only reconnected (a
        mixed placement clears only when the ranks holding it are gone)."""
        named: list[str] = []
        for r in self.ranks:
            session = self.by_rank.get(r)
            if session is not None and session.follower:
                if r == session.ranks[0]:  # a follower's own identity, once
                    named.append(f"[{session.worker_id or '?'}]")
                continue
            named.append(
                (session.worker_id or "?")
                if session is not None
                else self._resize_workers.get(r, "-")
            )
        ranks = ",".join(named)
        return f"sidecar {self.config.pod} pid {os.getpid()} ranks {ranks}"

    def registered_upstream(self, response: pb.RegisterResponse) -> None:
        self.committed = pb.Placement()
        self.committed.CopyFrom(response.committed)
        # A follower that came or went while the Register was under way: the session
        # names other ranks than the group has now, so it registers again.
        moved = bool(self.upstream_ranks) and self.upstream_ranks != self.ranks
        self.upstream_registered, self.resync = True, moved
        self.tell_resize = False  # taken (or known): said once, as a rank's agent does
        if response.HasField("warm_start") and self.committed.version == 0:
            # A fresh group's ranks registered here before the sidecar could ask: tell them
            # now (a rank already serving ignores it; the contract is the proto's).
            self.warm_start = pb.Placement()
            self.warm_start.CopyFrom(response.warm_start)
            log.info(
                "pool %s: placement offered as v%d (warm start), told to ranks %s",
                self.pool,
                self.warm_start.version,
                self.ranks_label,
            )
            message = pb.ControllerMessage(warm_start=self.warm_start)
            for session in self._unique_sessions():
                if session.send is not None:
                    session.send(message)
        else:
            self.warm_start = None

    def _keep_planned(self, msg: pb.ControllerMessage) -> None:
        """One loss of the controller's contingency set: told to every rank now and to a
        rank that opens its stream later (the newest set only), so the ranks hold it with
        the controller gone."""
        loss = msg.planned_loss
        if (
            self.planned
            and next(iter(self.planned.values())).planned_loss.base_version != loss.base_version
        ):
            self.planned = {}
        self.planned[tuple(sorted(loss.lost_ranks))] = msg
        for session in self._unique_sessions():
            if session.send is not None:
                session.send(msg)

    def from_controller(self, msg: pb.ControllerMessage) -> None:
        """A plan phase from the controller, relayed to the ranks."""
        kind = msg.WhichOneof("body")
        if kind in ("prepare", "commit"):
            self.warm_start = None  # the group is past its start: no rank installs it now
        if kind == "prepare":
            log.info("plan v%d: prepare relayed to ranks %s", msg.prepare.version, self.ranks_label)
            self.apply(self.relay.prepare(msg.prepare))
        elif kind == "commit":
            log.info("plan v%d: commit relayed", msg.commit.version)
            self.apply(self.relay.commit(msg.commit.version))
        elif kind == "abort":
            log.warning("plan v%d aborted: %s", msg.abort.version, msg.abort.reason)
            self.apply(self.relay.abort(msg.abort.version, msg.abort.reason))
        elif kind == "planned_loss":
            self._keep_planned(msg)
        elif kind == "warm_start" and (self.committed is None or self.committed.version == 0):
            # A merging leader's (rebalancer/sidecar/merge.py): the pool's placement the
            # controller offered the group after this follower registered there.
            self.warm_start = pb.Placement()
            self.warm_start.CopyFrom(msg.warm_start)
            for session in self._unique_sessions():
                if session.send is not None:
                    session.send(msg)
        else:
            log.warning("controller message %r ignored", kind)

    def take_windows(self) -> list[CountWindow]:
        return self.buffer.take()

    def flush_windows(self) -> None:
        """Release every open merge slot into the buffer (shutdown: send what we have)."""
        for merged in self.merge.flush():
            self.buffer.push(merged)
        self.changed.set()

    # ------------------------------------------------------------ relay actions

    def apply(self, actions: Actions) -> None:
        told: dict[str, list[pb.ControllerMessage]] = {}  # to each follower, once per message
        for rank, message in actions.to_ranks:
            session = self.by_rank.get(rank)
            if session is None or session.send is None:
                continue
            if session.follower:
                said = told.setdefault(session.session_id, [])
                if any(m is message or m == message for m in said):
                    continue
                said.append(message)
            session.send(message)
        if actions.drop_reports is not None:
            version = actions.drop_reports
            self.reports = deque(r for r in self.reports if r.version != version)
        self.reports.extend(actions.upstream)
        for event, plan in actions.events:
            if event == "committed":
                self.stats.plans_committed += 1
                if plan.prepare is not None:
                    self.committed = pb.Placement(
                        version=plan.version, phy2log=plan.prepare.placement.phy2log
                    )
            elif event == "aborted":
                self.stats.plans_aborted += 1
            for observer in self.observers:
                observer(event, plan)
        if actions.upstream:
            self.changed.set()


def _who(session: RankSession) -> str:
    return (
        f"follower ranks {format_ranks(session.ranks)}"
        if session.follower
        else f"rank {session.rank}"
    )


def _shape_text(shape: pb.ModelShape) -> str:
    return (
        f"L={shape.num_layers} E={shape.num_logical_experts} P={shape.num_physical_slots} "
        f"G={shape.num_gpus} N={shape.num_nodes} groups={shape.num_groups} "
        f"bytes={shape.expert_bytes}"
    )
