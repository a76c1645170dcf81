"""Deployments and the ranks' sessions: who is registered, who has a stream open.

At start the deployments are read back from the store (a plan that never reached commit
is void). A rank registers (creating its deployment on first sight, or checking its
shape against it, reconciling a differing placement version), gets a session, attaches
one stream to it, and detaches when the stream ends.

A group session (a pod's sidecar) registers several ranks at once: each must be free (no
other live session holds it) and the session is held under each of them, so counting
connected ranks and checking "every rank is there" stay per rank; its stream ending
detaches all of them. Its sidecar also tells which of its ranks have a stream open to it
(`presence`, the ReportRanks call): a rank whose engine exited is not connected, though
the group's stream stays open.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, cast

import numpy as np

from rebalancer import placement
from rebalancer.controller import reconcile, resize
from rebalancer.controller.clock import Clock
from rebalancer.controller.coordinate import Aborted, Unconfirmed
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.deployment import (
    Deployment,
    Observers,
    Resize,
    Send,
    Session,
)
from rebalancer.controller.regimes import RegimeLibrary
from rebalancer.controller.store import Store
from rebalancer.errors import StateError
from rebalancer.wire.shape import (
    LATER_SHAPE_FIELDS,
    ClusterShape,
    merge_shape,
    shape_key,
    stored_shape,
)
from rebalancer.wire.windows import Ranks, rank_set, who

log = logging.getLogger("rebalancer.controller")

# A rank's earlier session without a stream blocks a new registration this long (the
# stream of a registration that just succeeded may still be on its way).
REREGISTER_SECONDS = 10.0


class Registry:
    def __init__(
        self,
        store: Store,
        clock: Clock,
        default_policy: PolicyConfig,
        observers: Observers | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.default_policy = default_policy
        self.observers = observers or Observers()
        self.deployments: dict[str, Deployment] = {}
        self.sessions: dict[str, tuple[str, Session]] = {}  # session id -> (deployment, session)

    def load(self) -> None:
        """Read every deployment back from the store (a controller restart)."""
        now = self.clock()
        for row in self.store.load_deployments():
            # Stored as JSON: ints, and the dispatch mode's name (absent in older stores).
            shape = ClusterShape(**cast(dict[str, Any], row.shape))
            policy = PolicyConfig.from_dict(row.policy)
            dep = Deployment(row.name, shape, policy, row.committed_version, row.phy2log)
            dep.mark_unknown(frozenset(f for f in LATER_SHAPE_FIELDS if f not in row.shape))
            saved = self.store.ingest_state(row.name)
            if saved:
                dep.restore(
                    {int(k): int(v) for k, v in saved["next_seq"].items()},
                    saved["estimator"],
                    int(saved.get("tokens_folded", 0)),
                )
            for plan in self.store.unfinished_plans(row.name):
                if plan.state == "committing":
                    # Its Commit went out before the restart: ranks may have switched, or
                    # hold it staged waiting for a peer's Commit. Never aborted (an Abort
                    # after a Commit could split the ranks): unconfirmed, its Commit told
                    # again, adopted once ranks serve it (reconcile).
                    self.store.set_plan_state(
                        row.name,
                        plan.version,
                        "unconfirmed",
                        "controller restarted after its Commit went out",
                        now=now,
                    )
                else:
                    # Never reached commit: void; ranks that staged it drop their staging
                    # when told of it again (plans.catch_up).
                    self.store.set_plan_state(
                        row.name, plan.version, "aborted", "controller restarted", now=now
                    )
            # A session reconnecting is told of the newest plan if it ended unfinished
            # above the committed version: its ranks may hold staging of it.
            newest = self.store.plans(row.name, 1)
            if newest and newest[0].version > dep.version:
                if newest[0].state == "aborted":
                    dep.remember_unfinished(Aborted(newest[0].version, newest[0].reason))
                elif newest[0].state == "unconfirmed":
                    dep.remember_unfinished(Unconfirmed(newest[0].version))
            regimes = self.store.regimes(row.name)
            if regimes is not None:
                try:
                    dep.restore_regimes(RegimeLibrary.from_rows(*regimes))
                except (KeyError, ValueError, TypeError) as exc:  # a row this code cannot read
                    log.error(
                        "deployment %s: the stored regime library is unreadable (%s): "
                        "starting an empty one",
                        row.name,
                        exc,
                    )
            mixed = self.store.mixed(row.name)
            if mixed is not None:
                dep.serve_mixed(mixed)
                log.error(
                    "deployment %s: the ranks serve a mixed placement: %s",
                    row.name,
                    mixed.describe(),
                )
            self.deployments[row.name] = dep
            log.info("loaded deployment %s at placement v%d", row.name, row.committed_version)

    def deployment(self, name: str) -> Deployment:
        dep = self.deployments.get(name)
        if dep is None:
            raise StateError("NOT_FOUND", f"unknown deployment {name!r}")
        return dep

    def register(
        self,
        name: str,
        rank: Ranks,
        shape: ClusterShape,
        version: int,
        initial: np.ndarray | None,
        worker_id: str,
        pod: str = "",
        unknown: frozenset[str] = frozenset(),
        resized_from: Resize | None = None,
    ) -> tuple[Session, Deployment]:
        """Register one rank, or a group of ranks (a sequence: a pod's sidecar). `unknown`:
        shape fields the registration does not know yet (wire/shape.py UNKNOWN_EXPERT_BYTES).
        `resized_from`: an elastic engine resized the group (rebalancer/controller/resize.py); the
        ranks serve `initial`, at the deployment's version once the resize is taken."""
        now = self.clock()
        ranks = tuple(sorted(rank_set(rank)))
        label = who(rank, pod)
        dep = self.deployments.get(name)
        created = dep is None
        if dep is None:
            phy2log = (
                initial
                if initial is not None
                else placement.trivial_placement(
                    shape.num_layers, shape.num_logical, shape.num_slots, shape.num_gpus
                )
            )
            dep = Deployment(name, shape, self.default_policy, version, phy2log)
            dep.mark_unknown(unknown)
            self.store.create_deployment(
                name,
                stored_shape(shape, unknown),
                dep.policy.to_stored(),
                version,
                phy2log,
                now=now,
            )
            self.deployments[name] = dep
            log.info("new deployment %s: %s", name, shape_key(shape))
            for observer in self.observers.deployment:
                observer(name)
        if resized_from is not None and not created:
            if initial is None:
                raise StateError(
                    "INVALID_ARGUMENT",
                    f"{label} of {name!r}: a resized registration "
                    "carries the placement it serves (initial_placement)",
                )
            old_world = dep.live_sessions()
            resize.take(self.store, dep, label, shape, initial, resized_from, unknown, now)
            for ended in old_world:
                if ended.ended_by_resize:
                    self.sessions.pop(ended.session_id, None)
            version = dep.version
        merged: ClusterShape | None = dep.shape
        still_unknown = dep.unknown_fields & unknown  # neither the store nor this rank knows
        if not created:
            merged = merge_shape(dep.shape, shape, dep.unknown_fields, unknown)
            if merged is None:
                raise StateError(
                    "FAILED_PRECONDITION",
                    f"deployment {name!r} is registered with shape {shape_key(dep.shape)}, {label} "
                    f"reports {shape_key(shape)}",
                )
        olds = {}
        for r in ranks:
            old = dep.session_of(r)
            if old is None:
                continue
            if old.streaming or now - old.registered_at < REREGISTER_SECONDS:
                held_by = f", {old.label}" if old.group else ""
                raise StateError(
                    "ALREADY_EXISTS",
                    f"rank {r} of {name!r} is already registered (session "
                    f"{old.session_id[:8]}{held_by})",
                )
            olds[old.session_id] = old
        if merged is not None and (
            merged != dep.shape or dep.unknown_fields != still_unknown
        ):  # unknown fields, now known: kept
            self.store.set_shape(name, stored_shape(merged, still_unknown))
            dep.reshape(merged, still_unknown)
            log.info(
                "deployment %s: %s set the shape's unknown fields: %s",
                name,
                label,
                shape_key(merged),
            )
        if dep.mixed is not None and self._group_restarted(dep, worker_id):
            self._clear_mixed(dep, label)
        if version != dep.version:
            reconcile.reconcile(self.store, dep, label, version, now)
        for old in olds.values():  # expired registrations that never streamed: replaced whole
            self._forget(dep, old)
        session = Session(
            uuid.uuid4().hex, ranks[0], worker_id, registered_at=now, ranks=ranks, pod=pod
        )
        dep.add_session(session)
        dep.state_serving(ranks, version, 0, registering=True)
        self.sessions[session.session_id] = (name, session)
        log.info("%s of %s registered (worker %s, v%d)", label, name, worker_id or "?", version)
        return session, dep

    @staticmethod
    def _group_restarted(dep: Deployment, worker_id: str) -> bool:
        """Whether a registration from `worker_id` shows that the ranks holding the mixed
        placement are gone: it is not one of them, and none of them has a session left.
        (A rank's worker id names its process, so a restarted rank registers under a new
        one; the survivors reconnecting after a controller restart keep theirs.)"""
        assert dep.mixed is not None
        holders = dep.mixed.workers
        return worker_id not in holders and not any(
            s.worker_id in holders for s in dep.live_sessions()
        )

    def _clear_mixed(self, dep: Deployment, label: str) -> None:
        assert dep.mixed is not None
        self.store.clear_mixed(dep.name)
        log.warning(
            "%s: the ranks that served a mixed placement (%s) are gone; %s registered: "
            "back to v%d, plans resume",
            dep.name,
            dep.mixed.describe(),
            label,
            dep.version,
        )
        dep.end_mixed(self.store.placement(dep.name, dep.version))

    def _forget(self, dep: Deployment, session: Session) -> None:
        """Drop a session under every rank it holds."""
        self.sessions.pop(session.session_id, None)
        dep.drop_session(session)

    def session(self, session_id: str) -> tuple[Deployment, Session]:
        entry = self.sessions.get(session_id)
        if entry is None:
            raise StateError("NOT_FOUND", f"unknown session {session_id[:16]!r}: register first")
        name, session = entry
        return self.deployments[name], session

    def attach(self, session_id: str, send: Send) -> tuple[Deployment, Session]:
        """Open the session's one stream: plan phases go to `send` from now on."""
        dep, session = self.session(session_id)
        if session.streaming:
            raise StateError("ALREADY_EXISTS", f"session of {session.label} already has a stream")
        session.send, session.streaming = send, True
        return dep, session

    def presence(self, session_id: str, connected: frozenset[int]) -> tuple[Deployment, Session]:
        """A group's sidecar tells which of the session's ranks have a stream open to it;
        the others are absent (not connected) until it tells otherwise."""
        dep, session = self.session(session_id)
        stranger = sorted(connected - set(session.ranks))
        if stranger:
            raise StateError(
                "INVALID_ARGUMENT",
                f"rank {stranger[0]} is not one of the session's {session.label}",
            )
        absent = frozenset(session.ranks) - connected
        if absent != session.absent:
            if absent:
                log.warning(
                    "%s of %s: %s not connected to the sidecar",
                    session.label,
                    dep.name,
                    who(sorted(absent)),
                )
            else:
                log.info("%s of %s: every rank connected to the sidecar", session.label, dep.name)
        session.absent = absent
        return dep, session

    def detach(self, session_id: str) -> tuple[Deployment, Session] | None:
        """End the session (all its ranks); returns its deployment and the session (None
        if it was gone)."""
        entry = self.sessions.get(session_id)
        if entry is None:
            return None
        name, session = entry
        dep = self.deployments[name]
        self._forget(dep, session)
        log.info("%s of %s disconnected", session.label, name)
        return dep, session
