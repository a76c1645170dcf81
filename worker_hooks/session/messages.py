"""`PlanMessages`: the controller's plan messages answered alike on every rank, the
project's hook (worker_hooks/plans.py `PlanDriver`) and every engine adapter
(`RankSession`) alike.

A Commit marks its version ready in the rank's `PlanBook`; an Abort drops what the rank
staged for the plan (`dropped`, first: a transfer still running must not stage after the
book dropped the plan), then the plan itself, is counted and reported ABORTED; a plan the
rank cannot take is reported FAILED with the reason (`refuse`). Where the reports go
(`report`) and how a Prepare is taken (`on_prepare`: a migration thread behind the
transfer fence, a layer-group staging, a map only) are the subclass's.
"""

from __future__ import annotations

import logging
from typing import Any

from rebalancer.errors import SHUTTING_DOWN
from rebalancer.v1 import rebalancer_pb2 as pb
from worker_hooks.session.book import PlanBook

log = logging.getLogger("worker_hooks.session")


class PlanMessages:
    """`plans`: the plans this rank holds; `rank` and `stats` (with an `aborted` count)
    are set by the subclass."""

    rank: int
    stats: Any
    plans: PlanBook

    def report(self, version: int, phase: pb.PlanPhase, **fields: Any) -> None:
        """Tell the controller a plan's phase (the agent's `report`: `error=`, `step=`,
        `bytes_received=`, `seconds=`, `serving=`)."""
        raise NotImplementedError

    def on_prepare(self, prepare: pb.Prepare) -> None:
        raise NotImplementedError

    def on_commit(self, version: int) -> None:
        self.plans.commit(version)

    def on_abort(self, version: int, reason: str) -> None:
        self.dropped(version)
        self.plans.drop(version)
        self.stats.aborted += 1
        # A peer's planned stop is no fault: INFO (rebalancer.errors.SHUTTING_DOWN).
        log.log(
            logging.INFO if SHUTTING_DOWN in reason else logging.WARNING,
            "rank %d: plan v%d aborted: %s",
            self.rank,
            version,
            reason,
        )
        self.report(version, pb.PLAN_PHASE_ABORTED)

    def dropped(self, version: int) -> None:
        """An Abort of `version`: drop what was staged for it beyond its map (weights,
        transfers under way). Default: nothing."""

    def refuse(self, version: int, why: str) -> None:
        """This rank does not take plan `version`: FAILED with the reason (the plan fails
        everywhere, invariant 5)."""
        log.error("rank %d: plan v%d refused: %s", self.rank, version, why)
        self.report(version, pb.PLAN_PHASE_FAILED, error=why[:500])
