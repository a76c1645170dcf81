"""A plan's weights received beside serving in groups of layers within a staging budget,
each group swapped at an agreed step of its own.

A plan whose incoming experts fit the budget on every rank is one group: staged before
PREPARED, swapped at one agreed step. A larger one is cut into groups of consecutive
layers; the first is staged before PREPARED (so an abort before the commit changes
nothing live), each later one after the swap of the one before, beside serving, and
swapped at an agreed step of its own. Between swaps every layer is on either the old or
the new placement, its map matching its weights.

The ranks agree on tickets (worker_hooks/agree.py's MIN): `ticket(v, g)` is "plan v with
its first g groups live". The weights move with `worker_hooks.migration` over the
adapter's own group; what making a group's maps live means is the engine's
(`GroupStaging.swap_next` returns the layers, the adapter updates its engine's maps).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.layout import DST_RANK, LAYER
from worker_hooks import works
from worker_hooks.migration import MigrationExecutor
from worker_hooks.session.rank import RankSession
from worker_hooks.weights import MigrationAborted

log = logging.getLogger("worker_hooks.session")

# Tickets order every swap of every plan: ticket(v, g) is "plan v with its first g groups
# swapped", and every rank agrees on the smallest ticket all are ready for (MIN).
GROUPS_PER_TICKET = 1 << 16


def ticket(version: int, groups_done: int) -> int:
    """The agreement value of plan `version` with `groups_done` groups live."""
    if not 0 <= groups_done < GROUPS_PER_TICKET:
        raise ValueError(f"groups_done must be in [0, {GROUPS_PER_TICKET}), got {groups_done}")
    return version * GROUPS_PER_TICKET + groups_done


def ticket_parts(value: int) -> tuple[int, int]:
    """(version, groups_done) of a ticket."""
    return divmod(value, GROUPS_PER_TICKET)


def layer_groups(
    transfers: np.ndarray,
    changed_layers: list[int],
    num_gpus: int,
    expert_bytes: int,
    budget_bytes: int,
) -> list[list[int]]:
    """Consecutive groups of `changed_layers` (those whose map changes and that hold
    weights, ascending) whose incoming experts fit `budget_bytes` on every rank.

    transfers: [K, 5] (layer, dst_rank, dst_slot, src_rank, src_slot), the same list on
    every rank, so every rank cuts the same groups. A layer that alone exceeds the budget
    is a group of its own (the budget is then exceeded by that one layer: the least a
    swap can move). Always at least one group when a layer changes."""
    t = np.asarray(transfers, dtype=np.int64).reshape(-1, 5)
    groups: list[list[int]] = []
    held = np.zeros(num_gpus, dtype=np.int64)
    for layer in changed_layers:
        rows = t[t[:, LAYER] == layer]
        incoming = (
            np.bincount(rows[:, DST_RANK], minlength=num_gpus).astype(np.int64) * expert_bytes
        )
        if groups and (held + incoming).max() <= budget_bytes:
            groups[-1].append(layer)
            held += incoming
        else:
            groups.append([layer])
            held = incoming.copy()
    return groups


@dataclass
class StagedPlan:
    """A plan being staged: its groups of layers, how many are staged and swapped."""

    version: int
    new: np.ndarray  # [L, P] the plan's placement
    transfers: np.ndarray  # [K, 5] of the layers holding weights
    groups: list[list[int]]  # layers per group, in swap order
    weightless: list[int]  # changed layers without weights: maps only, with the first group
    target: Any = None  # the engine's own form of `new` (first_group's answer)
    staged: int = 0  # groups staged so far
    swapped: int = 0  # groups live so far
    thread: threading.Thread | None = None


class GroupStaging:
    """The plan a rank stages in layer groups (at most one at a time) for `session`.

    `first_group(plan)` runs on the staging thread before the first group's transfers
    (the engine builds its form of the target map there); raising fails the plan."""

    def __init__(
        self,
        session: RankSession,
        executor: MigrationExecutor | None,
        weight_layers: list[int],
        num_gpus: int,
        expert_bytes: int,
        budget_bytes: int,
        first_group: Callable[[StagedPlan], None],
    ) -> None:
        self.session = session
        self.executor = executor
        self.weight_layers = weight_layers
        self.num_gpus = num_gpus
        self.expert_bytes = expert_bytes
        self.budget_bytes = budget_bytes
        self.first_group = first_group
        self.plan: StagedPlan | None = None
        self.bytes_received = 0
        self._lock = threading.Lock()

    def begin(self, version: int, new: np.ndarray, transfers: np.ndarray) -> None:
        """Cut plan `version` into layer groups (the same on every rank) and stage the
        first beside serving: PREPARED once it is staged."""
        serving = self.session.phy2log
        with_weights = set(self.weight_layers)
        changed = [int(layer) for layer in np.flatnonzero((new != serving).any(axis=1))]
        moves = transfers[np.isin(transfers[:, LAYER], sorted(with_weights))]
        groups = layer_groups(
            moves,
            [x for x in changed if x in with_weights],
            self.num_gpus,
            self.expert_bytes,
            self.budget_bytes,
        )
        plan = StagedPlan(
            version, new, moves, groups, [x for x in changed if x not in with_weights]
        )
        with self._lock:
            self.plan = plan
        self._start(plan, 0)

    def ready_ticket(self, committed: int, live: int) -> int | None:
        """The ticket of the next staged group of a plan the controller said to commit;
        `live` while a plan is staged but not ready; None: no plan here."""
        with self._lock:
            plan = self.plan
            if plan is None:
                return None
            return (
                ticket(plan.version, plan.staged)
                if plan.version <= committed and plan.staged > plan.swapped
                else live
            )

    def swap_next(self) -> tuple[StagedPlan, list[int], bool]:
        """At the agreed step: the next group's staged experts are copied into the live
        rows (local copies); returns the plan, the layers whose maps now change (the
        first group takes the weightless ones too) and whether the plan is done (else the
        next group is staged beside serving)."""
        plan = self.plan
        assert plan is not None
        group = plan.swapped
        layers = list(plan.groups[group]) if plan.groups else []
        if plan.groups:
            assert self.executor is not None
            self.executor.commit(ticket(plan.version, group + 1))
        if group == 0:
            layers += plan.weightless
        with self._lock:
            plan.swapped = group + 1
            done = plan.swapped >= max(1, len(plan.groups))
            if done:
                self.plan = None
        if not done:
            self._start(plan, plan.swapped)
        return plan, sorted(layers), done

    def abort(self, version: int) -> None:
        """Drop plan `version`'s staging, also mid-transfer, unless a group of it is live."""
        with self._lock:
            plan = self.plan
            if plan is None or plan.version != version or plan.swapped > 0:
                return
            self.plan = None
        if self.executor is not None:
            self.executor.abort(ticket(version, 1))

    def _start(self, plan: StagedPlan, group: int) -> None:
        plan.thread = threading.Thread(
            target=self._stage,
            args=(plan, group),
            daemon=True,
            name=f"stage-v{plan.version}-g{group}",
        )
        plan.thread.start()

    def _stage(self, plan: StagedPlan, group: int) -> None:
        """Staging thread: receive group `group`'s incoming experts over the adapter's own
        group (after the transfer fence). Group 0 ends in PREPARED; a later group in a
        swap at an agreed step or, a peer lost, in FAILED with the mixed placement served."""
        key = ticket(plan.version, group + 1)
        try:
            if group == 0:
                self.first_group(plan)
            self.before_staging(plan.version, group)
            received, seconds = 0, 0.0
            if plan.groups:
                assert self.executor is not None
                layers = np.asarray(plan.groups[group])
                stats = self.executor.prepare(
                    key, plan.transfers[np.isin(plan.transfers[:, LAYER], layers)]
                )
                self.bytes_received += stats.bytes_received
                received, seconds = stats.bytes_received, stats.seconds
        except MigrationAborted:
            return  # the Abort dropped it and reported
        except Exception as exc:
            if self.executor is not None:
                self.executor.abort(key)
            self._failed(plan, group, works.reason(exc))
            return
        with self._lock:
            if self.plan is not plan:  # aborted meanwhile
                return
            plan.staged = group + 1
        if group == 0:
            self.session.prepared(plan.version, bytes_received=received, seconds=seconds)

    def _failed(self, plan: StagedPlan, group: int, error: str) -> None:
        session = self.session
        with self._lock:
            if self.plan is plan:
                self.plan = None
        if group == 0:  # before the commit: the plan aborts everywhere, nothing live changed
            log.error("rank %d: staging v%d failed: %s", session.rank, plan.version, error)
            session.agent.report(plan.version, pb.PLAN_PHASE_FAILED, error=error[:500])
            return
        # After the commit (a later group): the swapped groups stay, every map matching
        # its weights; the controller records the mixed placement.
        live = [x for g in plan.groups[:group] for x in g]
        session.stopped(
            plan.version,
            f"staging layer group {group} of v{plan.version} failed ({error}); layers "
            f"{live} are on v{plan.version}, the others on v{session.version}",
        )

    def before_staging(self, version: int, group: int) -> None:
        """Called on the staging thread before each group's transfers; raising fails the
        group. A seam for fault injection in tests."""
