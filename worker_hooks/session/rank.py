"""`RankSession`: the engine-neutral base of an engine adapter's rank, what every
adapter's side of a plan's life has alike.

It owns the rank's agent (registered with the shape the adapter gives, its link settings
read once per process: worker_hooks/engines/env.py), the counts windows, the plans held
(`PlanBook`), the version served and the pass count, and answers the controller's plan
messages alike on every engine: a Prepare is checked against the version served and the
rank's shape, a Commit marks the version ready, an Abort drops its staging and is
reported. An adapter keeps only its engine's glue: where the counts come from
(`windows.add`), how a plan's weights move (`stage_plan`, `dropped`) and how a map is made
live; it calls `made_live` once the engine serves the plan.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from rebalancer.errors import InputError
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from rebalancer.wire.link import Link
from rebalancer.wire.shape import ClusterShape
from worker_hooks.agent import AgentConfig, PlanHandlers, WorkerAgent
from worker_hooks.config import WindowConfig
from worker_hooks.session.agreement import NO_PLAN, all_reduce_min, held_everywhere, plan_digest
from worker_hooks.session.book import PlanBook
from worker_hooks.session.messages import PlanMessages
from worker_hooks.session.windows import CountWindows, window_due
from worker_hooks.warm import await_offer, group_holds

log = logging.getLogger("worker_hooks.session")


class LinkSettings(Protocol):
    """What every engine adapter's config has (worker_hooks/engines/env.py), read only."""

    @property
    def link(self) -> Link: ...
    @property
    def windows(self) -> WindowConfig: ...


def worker_identity(link: Link) -> str:
    """The worker id a rank registers with: the configured one or the host, and the pid
    always (the controller tells a restarted rank by it: a mixed placement clears only
    when the processes holding it are gone)."""
    return f"{link.worker_id or socket.gethostname()} pid {os.getpid()}"


def engine_agent(
    config: LinkSettings,
    rank: int,
    shape: ClusterShape,
    handlers: PlanHandlers,
    version: Callable[[], int],
    phy2log: np.ndarray,
    served_map: Callable[[], np.ndarray] | None = None,
    resized_from: tuple[int, int] | None = None,
) -> WorkerAgent:
    """An engine rank's agent (not started): one home for what an adapter registers with."""
    return WorkerAgent(
        AgentConfig(
            replace(config.link, worker_id=worker_identity(config.link)),
            rank,
            shape,
            resized_from=resized_from,
        ),
        handlers,
        version,
        initial_phy2log=phy2log.copy(),
        served_map=served_map,
    )


@dataclass
class Switch:
    """What the ranks agreed at a decision point (`RankSession.agree_switch`)."""

    agreed: int  # the MIN over the ranks of the version each can switch to
    plan: np.ndarray | None = None  # [L, P] the plan every rank holds for it (None: no switch)
    refused: str = ""  # why a newer agreed version is not switched to


@dataclass
class SessionStats:
    steps: int = 0
    prepared: int = 0
    aborted: int = 0
    commits: list[tuple[int, int]] = field(default_factory=list)  # (step, version) made live


class RankSession(PlanMessages, PlanHandlers):
    """One engine rank's session (module docstring). `phy2log` `[L, P]` is the map the
    engine serves at start; `stats` the adapter's (a `SessionStats` or a subclass).
    `resized_from`: (version, GPUs) of the world an elastic engine resized this group
    from; the rank serves `phy2log` under the version the controller gives it for the
    resize (`_join_resized_world`), v0 until then."""

    def __init__(
        self,
        config: LinkSettings,
        rank: int,
        shape: ClusterShape,
        phy2log: np.ndarray,
        stats: SessionStats,
        count_duplicates: int = 1,
        resized_from: tuple[int, int] | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.phy2log = np.array(phy2log, dtype=np.int64, copy=True)  # the map served
        self.num_layers, self.num_slots = self.phy2log.shape
        self.num_logical = int(shape.num_logical)
        self.num_gpus = int(shape.num_gpus)
        self.version = 0
        self.step = 0
        self.stats = stats
        self.broken: str | None = None  # why this rank takes no more plans (None: it does)
        self.plans = PlanBook()
        self.joining_resized = resized_from is not None
        self.agent = engine_agent(
            config,
            rank,
            shape,
            self,
            lambda: self.version,
            self.phy2log,
            served_map=lambda: self.phy2log.copy(),
            resized_from=resized_from,
        )
        self.windows = CountWindows(self.agent, self.num_logical, divide_by=count_duplicates)

    # ------------------------------------------------------------ serving thread

    def window_due(self) -> bool:
        """Whether the open window has run its `windows.steps` (asked at every pass)."""
        if self.joining_resized:
            self._join_resized_world()
        return window_due(self.step, self.windows.start, self.config.windows.steps)

    def _join_resized_world(self) -> None:
        """A rank of a resized group serves its map as v0 until the controller answered its
        Register: the version the controller committed the resize under, when that is the
        map served (rebalancer/controller/resize.py). The window counted before goes up as v0."""
        version = self.agent.committed_version
        placement = self.agent.committed_placement
        if version <= 0 or placement is None:
            return
        self.joining_resized = False
        if not np.array_equal(placement, self.phy2log):
            log.error(
                "rank %d: the controller holds v%d for the resized group, another map than this "
                "rank serves: it stays at v0 and takes no plan",
                self.rank,
                version,
            )
            self.broken = self.broken or "the resized group's map is not the controller's"
            return
        self.serve_version(version)
        log.info("rank %d: the resized group serves v%d", self.rank, version)

    def rejoin_resized(self, rank: int, shape: ClusterShape, phy2log: np.ndarray, why: str) -> None:
        """The engine resized this rank's group in place (SGLang's elastic EP after a rank
        fault): from this pass on the rank is rank `rank` of the world `shape`, serving
        `phy2log` `[L, P']`. The window counted on the old world is sent, the old world's
        agent stopped, and an agent of the new world registers stating the world before
        (`RegisterRequest.resized_from`): the controller takes the map served as the
        deployment's committed placement (rebalancer/controller/resize.py) and the rank
        serves it under that version (`_join_resized_world`), v0 until then. It takes no
        plan from here (`why`): the engine's groups still hold the ranks it lost."""
        self.broken = self.broken or why  # a Prepare on either agent is refused from now on
        resized_from = (self.version, self.num_gpus)
        try:
            self.windows.close(self.step, self.version, self.phy2log, wait=True)
        finally:
            self.agent.stop(timeout=1.0)
        self.rank = rank
        self.phy2log = np.array(phy2log, dtype=np.int64, copy=True)
        self.num_layers, self.num_slots = self.phy2log.shape
        self.num_gpus = int(shape.num_gpus)
        self.version = 0
        self.plans.clear()
        self.agent = engine_agent(
            self.config,
            rank,
            shape,
            self,
            lambda: self.version,
            self.phy2log,
            served_map=lambda: self.phy2log.copy(),
            resized_from=resized_from,
        )
        divide_by = self.windows.divide_by
        self.windows = CountWindows(self.agent, self.num_logical, divide_by=divide_by)
        self.windows.start = self.step
        self.joining_resized = True
        self.agent.start()
        log.warning(
            "rank %d (of %d now): the EP group was resized from %d GPUs at v%d; registering the "
            "new world with the controller",
            rank,
            self.num_gpus,
            resized_from[1],
            resized_from[0],
        )

    def serve_version(self, version: int) -> None:
        """The map served is `version` from this pass on, with no plan (a resize the
        controller took): the window counted so far goes up under the version before."""
        self.windows.close(self.step, self.version, self.phy2log)
        self.version = version

    def made_live(self, version: int, phy2log: np.ndarray) -> None:
        """The engine serves plan `version` from this pass on: the window of the old
        placement is sent first, then the commit is reported."""
        self.windows.close(self.step, self.version, self.phy2log, wait=True)
        self.phy2log[...] = phy2log
        self.version = version
        self.stats.commits.append((self.step, version))
        self.agent.report(version, pb.PLAN_PHASE_COMMITTED, step=self.step)
        log.info("rank %d: v%d live at step %d", self.rank, version, self.step)

    def agree_switch(self, serving: np.ndarray, group: Any) -> Switch:
        """At an engine's decision point, on every rank of `group` (two blocking all-reduces
        on it): the newest version every rank can switch to and, when it is newer than
        the one served, its plan, only if every rank holds the same plan for it and the
        engine serves the map the plan was built on. A version agreed and not taken is
        reported FAILED and dropped: every rank keeps its map."""
        switch = Switch(all_reduce_min([self.plans.ready(self.version)], group)[0])
        digest, plan = NO_PLAN, None
        if switch.agreed > self.version:
            plan = self.plans.get(switch.agreed)
            if plan is None:
                switch.refused = f"v{switch.agreed} is not staged here"
            elif not np.array_equal(serving, self.phy2log):
                switch.refused = "the plan is built on another map than the engine serves"
            digest = NO_PLAN if plan is None or switch.refused else plan_digest(switch.agreed, plan)
        held = held_everywhere(digest, group)
        if switch.agreed > self.version:
            if held and plan is not None:
                switch.plan = plan.copy()
            else:
                switch.refused = switch.refused or "ranks hold different plans for this version"
                log.error(
                    "rank %d: v%d not installed, every rank keeps its map: %s",
                    self.rank,
                    switch.agreed,
                    switch.refused,
                )
                self.agent.report(
                    switch.agreed,
                    pb.PLAN_PHASE_FAILED,
                    error=f"not installed: {switch.refused}"[:500],
                )
                self.plans.drop(switch.agreed)
        return switch

    def take_warm_start(self, group: Any, num_ranks: int, seconds: float) -> int:
        """A pool member still on its start map: the pool placement offered at Register
        (worker_hooks/warm.py), waited for at most `seconds`, becomes the committed plan
        of this rank when every rank of `group` holds the same offer (collective);
        returns its version, or 0 (every rank serves its map as without a pool)."""
        offered, plan = 0, None
        if self.version == 0 and seconds > 0:
            offered, plan = await_offer(
                self.agent, seconds, self.num_layers, self.num_slots, self.num_logical, self.rank
            )
        if not group_holds(offered, group, num_ranks, self.rank) or plan is None:
            log.info(
                "rank %d: no warm start (offered v%d); the engine keeps its start map",
                self.rank,
                offered,
            )
            return 0
        self.plans.stage(offered, plan, self.version)
        self.plans.commit(offered)
        return offered

    def planned_for_mapping(
        self, mapping: dict[int, int] | None, num_replicas: int, num_ranks: int, group: Any
    ) -> np.ndarray | None:
        """The controller's survivor placement `[L, num_replicas]` for the resize an
        elastic engine runs now, `mapping` old rank -> new rank (-1: lost), its slots in the
        new ranks' order; None for a resize it did not plan (a scale-up, another loss,
        another base version, no set received), and unless every rank of `group` (the
        old world's) holds the same answer: one all-reduce, which every rank runs."""
        if mapping is None or len(mapping) != self.num_gpus:
            return None
        answer, digest = None, NO_PLAN
        try:  # the same on every rank but for a defect: caught, so the collective below runs
            survivors = sorted(old for old, new in mapping.items() if new >= 0)
            lost = sorted(set(mapping) - set(survivors))
            per = self.num_slots // self.num_gpus
            planned = self.agent.survivor_map(lost, self.version) if lost else None
            if (
                planned is not None
                and len(survivors) == num_ranks
                and num_replicas == per * num_ranks
                and planned.shape == (self.num_layers, num_replicas)
                and sorted(mapping[old] for old in survivors) == list(range(num_ranks))
            ):
                # The plan's i-th block of slots is the i-th surviving old rank's.
                answer = np.empty_like(planned)
                for i, old in enumerate(survivors):
                    new = mapping[old]
                    answer[:, new * per : (new + 1) * per] = planned[:, i * per : (i + 1) * per]
                digest = plan_digest(self.version, answer)
        except Exception:
            log.exception("rank %d: the planned survivor placement was not used", self.rank)
            answer, digest = None, NO_PLAN
        try:
            held = held_everywhere(digest, group)
        except Exception:
            log.exception("rank %d: the ranks could not agree on a survivor placement", self.rank)
            return None
        return answer if held else None

    def stopped(self, version: int, what: str) -> None:
        """Plan `version` stopped half-way after the commit (`what` says where): the rank
        serves a placement no version names, takes no more plans, and tells the
        controller what it serves (a FAILED carrying the map: the deployment's mixed
        placement, cleared when the group restarts)."""
        self.broken = self.broken or what
        message = f"{what}; no more plans on this group"
        log.error("rank %d: %s", self.rank, message)
        self.agent.report(
            version, pb.PLAN_PHASE_FAILED, error=message[:500], serving=self.phy2log.copy()
        )

    def finish(self, timeout: float = 5.0) -> None:
        """At shutdown: send the last window, deliver what the agent holds within
        `timeout`, stop it."""
        try:
            self.windows.close(self.step, self.version, self.phy2log, wait=True)
        finally:
            self.agent.drain(timeout)
            self.agent.stop(timeout)

    # ------------------------------------------------------------ agent thread

    def check_prepare(self, prepare: pb.Prepare) -> np.ndarray:
        """Plan `prepare`'s map `[L, P]`, or InputError: a plan on another version than
        the one served, or a map that does not fit the rank's shape."""
        if prepare.base_version != self.version:
            raise InputError(
                f"plan is based on v{prepare.base_version}, rank serves v{self.version}"
            )
        new = codec.decode_phy2log(
            prepare.placement.phy2log, self.num_layers, self.num_slots, self.num_logical
        )
        return np.array(new, dtype=np.int64)

    def on_prepare(self, prepare: pb.Prepare) -> None:
        try:
            self.refusal()
            new = self.check_prepare(prepare)
        except InputError as exc:
            self.refuse(prepare.version, str(exc))
            return
        self.stage_plan(prepare, new)

    def refusal(self) -> None:
        """Raise InputError when this rank takes no plan now (an adapter adds its own reasons)."""
        if self.broken is not None:
            raise InputError(f"rank stopped taking plans ({self.broken})")

    def stage_plan(self, prepare: pb.Prepare, new: np.ndarray) -> None:
        """Hold a checked plan (default: its map only, reported PREPARED: the engine moves
        the weights after the commit)."""
        self.plans.stage(prepare.version, new, self.version)
        self.prepared(prepare.version)

    def prepared(self, version: int, bytes_received: int = 0, seconds: float = 0.0) -> None:
        self.stats.prepared += 1
        self.agent.report(
            version, pb.PLAN_PHASE_PREPARED, bytes_received=bytes_received, seconds=seconds
        )

    def report(self, version: int, phase: pb.PlanPhase, **fields: Any) -> None:
        self.agent.report(version, phase, **fields)
