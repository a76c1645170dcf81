"""A rank's side of a plan's life, off the serving thread: the plan driver.

`PlanDriver` is what the agent calls when the controller speaks (worker_hooks/agent.py's
`PlanHandlers`), on the session's `PlanMessages` (worker_hooks/session/messages.py: a
Commit and an Abort are answered as on every engine's rank): a Prepare starts a migration thread
that takes the plan through the transfer fence, receives the rank's incoming experts
(MigrationExecutor) and stages the new dispatch maps, then reports PREPARED or FAILED; a Commit
marks the plan ready for the commit agreement; an Abort drops its staging. The serving thread asks
it which version it may switch to (`ready_version`) and, at the agreed step, takes the staged plan
(`take_commit`). The plans held are the rank session's `PlanBook` (worker_hooks/session/),
as in the engine adapters: one lock between the agent and the serving thread. Neither the driver nor
the agent holds the hook: the driver reports plan phases through the callable given to `report_to`
(the agent's `report`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from rebalancer.errors import SHUTTING_DOWN
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from worker_hooks.agent import PlanHandlers
from worker_hooks.config import HookConfig
from worker_hooks.dispatch import ReplicaDispatch
from worker_hooks.migration import MigrationExecutor
from worker_hooks.rows import replica_rows
from worker_hooks.serving import HookStats, ServedPlacement
from worker_hooks.session.book import PlanBook
from worker_hooks.session.messages import PlanMessages
from worker_hooks.weights import MigrationAborted

log = logging.getLogger("worker_hooks.plans")

# agent.WorkerAgent.report: (version, phase, step=, error=, bytes_received=, seconds=, serving=)
Report = Callable[..., None]


def dispatch_map(config: HookConfig, phy2log: np.ndarray, row_ids: np.ndarray) -> np.ndarray:
    """Dispatch's map `[L, E, R]`: each expert's replicas as row ids, -1 padded."""
    max_replicas = config.shape.num_slots - config.shape.num_logical + 1
    return replica_rows(phy2log, row_ids, config.shape.num_logical, max_replicas)


class _Stopping(RuntimeError):
    """A plan prepared while the rank stops (`PlanDriver.close`)."""


def _unconnected(version: int, phase: pb.PlanPhase, **_: object) -> None:
    raise RuntimeError(
        f"plan v{version}: no link to report phase {phase} to (PlanDriver.report_to)"
    )


class PlanDriver(PlanMessages, PlanHandlers):
    """Prepare / commit / abort of the controller's plans on one rank (module docstring).

    Subclass it to check a plan after its transfers (`after_transfers`) or to inject
    faults; `RebalanceHook(plan_driver=...)` takes the class."""

    def __init__(
        self,
        config: HookConfig,
        executor: MigrationExecutor,
        dispatch: ReplicaDispatch,
        served: ServedPlacement,
        stats: HookStats,
    ) -> None:
        self.config = config
        self.rank = config.rank
        self.executor = executor
        self.dispatch = dispatch
        self.served = served
        self.stats = stats
        self._report: Report = _unconnected
        self.migration: threading.Thread | None = None  # the newest plan's thread
        self._migrations: list[threading.Thread] = []  # those still running, newest last
        self._last_prepare = 0  # newest plan version whose Prepare came (agent thread)
        self._closing = False
        # Each staged plan's map and the newest version the controller said to commit:
        # written by the agent and migration threads, read by the serving thread.
        self.book = PlanBook()

    @property
    def commit_ready(self) -> int:
        """The newest version the controller said to commit (0: none yet)."""
        return self.book.committed

    def report_to(self, report: Report) -> None:
        """Where the plans' phases go: the agent's `report` (set once, before it starts)."""
        self._report = report

    def report(self, version: int, phase: pb.PlanPhase, **fields: object) -> None:
        self._report(version, phase, **fields)

    @property
    def plans(self) -> PlanBook:  # type: ignore[override]
        """The plans held (`book`), as the session's handlers name them."""
        return self.book

    # ------------------------------------------------------------ serving thread

    def ready_version(self) -> int:
        """The newest version this rank may switch to: one the controller said to commit
        and whose staging is here, else the version served."""
        return self.book.ready(self.served.version)

    def take_commit(self, version: int) -> tuple[np.ndarray, int]:
        """At the agreed step: make plan `version`'s weights live (the executor copies what
        found no spare row and moves the rows); returns the plan's phy2log and the experts
        copied. The caller then switches the dispatch maps and the served placement."""
        copied = self.executor.commit(version)
        phy2log = self.book.take(version)
        if phy2log is None:  # ready_version named it: only a defect gets here
            raise RuntimeError(f"plan v{version} is not staged on rank {self.config.rank}")
        return phy2log, copied

    # ------------------------------------------------------------ shutdown

    def close(self) -> None:
        """From now on a plan still runs its transfers (peers wait for them) but fails."""
        self._closing = True

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` s for every plan's thread, not only the newest: an older
        one may still wait for a peer (a daemon thread inside a gloo wait at exit aborts
        the process). True when none is left running."""
        until = time.monotonic() + timeout
        for migration in self._migrations:
            migration.join(max(0.0, until - time.monotonic()))
        return not any(m.is_alive() for m in self._migrations)

    # ------------------------------------------------------------ agent thread

    def on_prepare(self, prepare: pb.Prepare) -> None:
        # A Prepare can come twice (resent to a rank whose stream went down as it was
        # sent): its transfers run once, or the peers' messages would be taken twice.
        if prepare.version <= self._last_prepare:
            return
        self._last_prepare = prepare.version
        self.migration = threading.Thread(
            target=self._prepare, args=(prepare,), daemon=True, name=f"migrate-v{prepare.version}"
        )
        self.migration.start()
        self._migrations = [t for t in self._migrations if t.is_alive()] + [self.migration]

    def dropped(self, version: int) -> None:
        """An Abort (PlanMessages.on_abort, which then drops the plan, counts and reports
        it): the executor drops the plan's transfers and staging first, so a migration
        thread still running stages nothing after."""
        self.executor.abort(version)

    # ------------------------------------------------------------ migration thread

    def _prepare(self, prepare: pb.Prepare) -> None:
        version = prepare.version
        try:
            refusal = self._refusal(prepare)
            cfg = self.config
            new = codec.decode_phy2log(
                prepare.placement.phy2log,
                cfg.shape.num_layers,
                cfg.shape.num_slots,
                cfg.shape.num_logical,
            )
            transfers = codec.decode(prepare.transfers, "transfers")
            if refusal:
                # No rank moves this plan's weights: its peers stop waiting for this rank
                # at once (worker_hooks/fence.py) and the plan fails everywhere.
                self.executor.decline(version, refusal)
            stats = self.executor.prepare(version, transfers)
            if self._closing:
                raise _Stopping(SHUTTING_DOWN)
            self.after_transfers(version)
            rows = self.executor.staged_rows
            if (
                rows is None
            ):  # an Abort dropped the staging after the transfers (on_abort reported it)
                raise MigrationAborted(f"plan v{version} aborted while its weights were staged")
            self.dispatch.stage(dispatch_map(cfg, new, self.executor.row_map.row_ids(rows)))
            self.book.stage(version, new, self.served.version, alone=True)
        except MigrationAborted:
            return
        except _Stopping:  # a planned stop, not a failure: the plan still aborts everywhere
            self.executor.abort(version)
            log.info("rank %d: plan v%d not taken: %s", self.config.rank, version, SHUTTING_DOWN)
            self._report(version, pb.PLAN_PHASE_FAILED, error=SHUTTING_DOWN)
            return
        except Exception as exc:  # any failure aborts the plan everywhere (invariant 5)
            self.stats.failed += 1
            self.executor.abort(version)
            log.error("rank %d: preparing v%d failed: %s", self.config.rank, version, exc)
            self._report(version, pb.PLAN_PHASE_FAILED, error=str(exc)[:500])
            return
        self.stats.prepared += 1
        self.stats.bytes_received += stats.bytes_received
        self._report(
            version,
            pb.PLAN_PHASE_PREPARED,
            bytes_received=stats.bytes_received,
            seconds=stats.seconds,
        )

    def _refusal(self, prepare: pb.Prepare) -> str:
        """Why this rank cannot prepare `prepare` ("" if it can). A rank told to commit a
        staged plan keeps that staging until it switched: a later plan (the controller
        gave up waiting for confirmations) must not replace it, or the agreed switch would
        install the other plan's map (invariant 2) or find no staging."""
        serving = self.served.version
        if prepare.base_version != serving:
            return f"plan is based on v{prepare.base_version}, rank serves v{serving}"
        ready = self.book.ready(serving)
        if ready > serving:
            return f"rank is switching to v{ready}, plan v{prepare.version} must wait"
        return ""

    def after_transfers(self, version: int) -> None:
        """Called on the migration thread once a plan's weights are staged; raising
        here fails the plan. A seam for checks (and for fault injection in tests)."""
