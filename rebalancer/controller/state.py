"""The controller's state of every deployment, behind one façade for the gRPC layer.

The work is split by concern, each module on the same store, clock and observers:
registry.py (deployments, sessions; reconcile.py when a rank's version differs),
fold.py (windows in, folded into the estimate), decision_runner.py (the policy's decisions off
the event loop, acting on any decision), plans.py (a plan's life and fan-out to the
ranks), operate.py (an operator's force, policy, pause) and replica_pools/ (pools of
deployments). They do the I/O, timing and store writes; what changes a deployment is its
own verb (deployment.py), a pool's its own (replica_pools/replica_pool.py). `Controller`
wires them, all in its constructor, and is what service.py, admin.py, metrics.py and the
server call; it adds no logic.

Everything here runs on the controller's event loop thread; nothing blocks for long
(numpy on [L, E] arrays, a few SQLite writes per plan).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from rebalancer.controller.clock import Clock, system_clock
from rebalancer.controller.contingency import TAKE_BYTES_PER_SECOND, ContingencyPlanner
from rebalancer.controller.coordinate import Plan
from rebalancer.controller.decide import Decision, PolicyConfig
from rebalancer.controller.decision_runner import (
    Background,
    DecisionBudget,
    DecisionRunner,
    run_inline,
)
from rebalancer.controller.deployment import Deployment, Observers, Resize, Send, Session
from rebalancer.controller.fold import DEFAULT_CURSOR_BYTES_PER_SECOND, Folder
from rebalancer.controller.operate import Operations
from rebalancer.controller.plans import Plans
from rebalancer.controller.registry import Registry
from rebalancer.controller.replica_pools import DEFAULT_MAX_MOVING, DivergenceConfig, Fleet
from rebalancer.controller.store import Store
from rebalancer.wire.codec import Statement
from rebalancer.wire.shape import ClusterShape
from rebalancer.wire.windows import Ranks, rank_set

# Deployments whose plan timeouts one step of `Controller.tick_steps` checks.
TICK_STEP_DEPLOYMENTS = 256


class Controller:
    """All deployments, the store, the one clock, and the observers of what happens.

    `clock` is read for every time the controller keeps or stores (default: epoch seconds
    that never go back); `background` runs the policy's decisions (default: inline; the
    server passes its decision process, decision_process.py) within `decision_cpu_share`
    of its time (DecisionBudget; default 1: no limit, as inline), less what the controller's
    own CPU leaves of `cpu_cores` (0: no such bound)."""

    def __init__(
        self,
        store: Store,
        default_policy: PolicyConfig | None = None,
        persist_seconds: float = 5.0,
        clock: Clock | None = None,
        background: Background = run_inline,
        pool_max_moving: int = DEFAULT_MAX_MOVING,
        divergence: DivergenceConfig | None = None,
        cursor_bytes_per_second: float = DEFAULT_CURSOR_BYTES_PER_SECOND,
        decision_cpu_share: float = 1.0,
        contingency_take_bytes_per_second: float = TAKE_BYTES_PER_SECOND,
        cpu_cores: float = 0.0,
    ) -> None:
        self.store = store
        self.clock: Clock = clock or system_clock()
        self.observers = Observers()
        self.registry = Registry(
            store, self.clock, default_policy or PolicyConfig(), self.observers
        )
        self.plans = Plans(store, self.clock, self.observers)
        self.decisions = DecisionRunner(
            store,
            self.clock,
            self.plans,
            self.observers,
            background,
            DecisionBudget(decision_cpu_share, cores=cpu_cores),
        )
        self.operations = Operations(store, self.clock, self.registry, self.decisions)
        self.fleet = Fleet(
            store,
            self.clock,
            self.registry,
            self.decisions,
            self.plans,
            self.registry.default_policy,
            pool_max_moving,
            divergence,
        )
        self.folder = Folder(
            store,
            self.clock,
            self.decisions,
            self.observers,
            persist_seconds,
            self.fleet.folded,
            cursor_bytes_per_second,
        )
        self.contingency = ContingencyPlanner(
            store,
            self.clock,
            self.decisions.submit,
            lambda: self.decisions.in_flight == 0 and self.decisions.budget.allows(),
            self.fleet.sharing_pool,
            contingency_take_bytes_per_second,
        )
        self.registry.load()
        self.fleet.load()
        self.contingency.load(list(self.registry.deployments))

    @property
    def deployments(self) -> dict[str, Deployment]:
        return self.registry.deployments

    # ------------------------------------------------------------ ranks

    def register(
        self,
        name: str,
        rank: Ranks,
        shape: ClusterShape,
        version: int,
        initial: np.ndarray | None,
        worker_id: str,
        pod: str = "",
        pool: str = "",
        unknown: frozenset[str] = frozenset(),
        resized_from: Resize | None = None,
    ) -> tuple[Session, Deployment]:
        """One rank, or a group of ranks (a sequence: a pod's sidecar speaking for them),
        of a deployment in `pool` ("": none); `unknown`: shape fields it does not know yet;
        `resized_from`: the world an elastic engine resized the group from (it serves
        `initial`, rebalancer/controller/resize.py). The warm start to offer: `warm_offer`."""
        self.fleet.check_join(name, pool, shape, unknown)
        session, dep = self.registry.register(
            name, rank, shape, version, initial, worker_id, pod, unknown, resized_from
        )
        if resized_from is not None:
            version = dep.version  # the resize taken: the version of what the ranks serve
        self.fleet.joined(dep, pool)
        self.plans.registered(dep, session, version)
        return session, dep

    def warm_offer(self, dep: Deployment, version: int) -> tuple[int, np.ndarray] | None:
        """The pool placement a fresh member registering with `version` may install
        (version W, placement), or None (proto: RegisterResponse.warm_start)."""
        return self.fleet.warm_offer(dep, version)

    def session(self, session_id: str) -> tuple[Deployment, Session]:
        return self.registry.session(session_id)

    def attach(self, session_id: str, send: Send) -> tuple[Deployment, Session]:
        dep, session = self.registry.attach(session_id, send)
        self.plans.catch_up(dep, session)
        self.contingency.tell(dep, [session])
        return dep, session

    def presence(self, session_id: str, connected: frozenset[int]) -> None:
        """Which of a group session's ranks have a stream open to its sidecar."""
        self.registry.presence(session_id, connected)

    def detach(self, session_id: str) -> None:
        gone = self.registry.detach(session_id)
        if gone is not None:
            self.plans.disconnected(*gone)

    def ingest(
        self,
        dep: Deployment,
        rank: Ranks,
        seq: int,
        version: int,
        logical: np.ndarray,
        physical: np.ndarray | None,
        serving: Statement = (0, 0),
    ) -> bool:
        """Merge one session's window (a group's: summed over its ranks) and fold what
        became complete; False for a duplicate. `serving`: the (version, digest) its ranks
        state they serve (reconciled even on a duplicate; digest 0: not stated)."""
        fresh = self.folder.ingest(dep, rank, seq, version, logical, physical)
        if serving[1]:
            self.plans.serving(dep, tuple(sorted(rank_set(rank))), *serving)
        if fresh:
            self.contingency.refresh(dep, self.clock())
        return fresh

    def report(
        self,
        session_id: str,
        version: int,
        phase: str,
        error: str = "",
        serving: np.ndarray | None = None,
    ) -> None:
        """A session's plan progress (for all its ranks): prepared / failed / committed / aborted;
        `serving`: the placement its ranks serve after a plan applied in part."""
        dep, session = self.registry.session(session_id)
        self.plans.report(dep, session, version, phase, error, serving)

    # ------------------------------------------------------------ time and shutdown

    def tick(self, now: float | None = None) -> None:
        """Plan timeouts of every deployment and the pools' roll-outs (decisions run as
        windows fold)."""
        for _ in self.tick_steps(now):
            pass

    def tick_steps(self, now: float | None = None) -> Iterator[None]:
        """`tick` in steps: it yields after every TICK_STEP_DEPLOYMENTS deployments and
        after each pool that started plans, so the server lets windows in between (a
        tick that started a plan for each of hundreds of pools held the event loop for
        hundreds of milliseconds)."""
        now = self.clock() if now is None else now
        for i, dep in enumerate(list(self.deployments.values()), 1):
            self.plans.tick(dep, now)
            if i % TICK_STEP_DEPLOYMENTS == 0:
                yield
        yield from self.fleet.tick_steps(now)

    def persist_all(self) -> None:
        """Save every deployment's ingest cursor (the drain path before the store closes)."""
        for dep in self.deployments.values():
            self.folder.persist(dep, background=True)
        self.store.flush_ingest_states()

    # ------------------------------------------------------------ operators

    def deployment(self, name: str) -> Deployment:
        return self.registry.deployment(name)

    def force(
        self, name: str, dry_run: bool = False, max_moved_fraction: float = 0.0
    ) -> tuple[Decision, Plan | None]:
        return self.operations.force(name, dry_run, max_moved_fraction)

    def force_pool(
        self, pool: str, dry_run: bool = False, max_moved_fraction: float = 0.0
    ) -> tuple[Decision, list[Plan]]:
        return self.fleet.force(pool, dry_run, max_moved_fraction)

    def set_policy(self, name: str, policy: PolicyConfig) -> PolicyConfig:
        return self.operations.set_policy(name, policy)

    def set_paused(self, name: str, paused: bool) -> None:
        self.operations.set_paused(name, paused)
