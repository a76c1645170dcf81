"""The Controller façade on its parts: one injected clock for every time it keeps or
stores, a forced plan with its own migration budget recorded on the deployment's loop,
resent windows counted once."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.errors import StateError
from rebalancer.wire.shape import ClusterShape

SHAPE = ClusterShape(num_layers=2, num_logical=4, num_slots=6, num_gpus=2, expert_bytes=10)
SKEWED = np.array([[40, 2, 1, 1], [1, 1, 30, 8]])


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def connected(
    clock: FakeClock, policy: PolicyConfig | None = None
) -> tuple[Controller, list[tuple[int, str, int]]]:
    """A controller on `clock` with both ranks of deployment "d" streaming."""
    ctl = Controller(Store(":memory:"), policy or PolicyConfig(min_windows=1), clock=clock)
    sent: list[tuple[int, str, int]] = []
    for rank in range(SHAPE.num_gpus):
        session, _ = ctl.register("d", rank, SHAPE, 0, None, f"w{rank}")

        def send(kind: str, plan: Any, rank: int = rank) -> None:
            if kind != "planned_loss":  # told ahead of failures: test_contingency.py
                sent.append((rank, kind, plan.version))

        ctl.attach(session.session_id, send)
    return ctl, sent


def test_one_clock_for_sessions_plans_and_history() -> None:
    clock = FakeClock(1000.0)
    ctl, sent = connected(clock, PolicyConfig(paused=True, prepare_timeout_seconds=30.0))
    dep = ctl.deployment("d")
    assert {s.registered_at for s in dep.sessions.values()} == {1000.0}
    for rank in range(2):
        ctl.ingest(dep, rank, 0, 0, SKEWED, None)
    clock.now = 1010.0
    decision, plan = ctl.force("d")
    assert decision.outcome == "forced" and plan is not None
    assert (plan.created, plan.started_at, plan.deadline) == (1010.0, 1010.0, 1040.0)
    assert sorted(sent) == [(0, "prepare", plan.version), (1, "prepare", plan.version)]
    stored = ctl.store.plans("d")[0]
    assert stored.created == 1010.0 and ctl.store.decisions("d")[0]["time"] == 1010.0
    clock.now = 1040.5  # past the deadline on the injected clock: the plan aborts
    ctl.tick()
    assert dep.plan is None and ctl.store.plans("d")[0].finished == 1040.5


def test_a_rank_without_stream_is_replaced_after_the_grace_on_the_clock() -> None:
    clock = FakeClock(50.0)
    ctl = Controller(Store(":memory:"), clock=clock)
    ctl.register("d", 0, SHAPE, 0, None, "w0")
    clock.now = 55.0
    with pytest.raises(StateError) as info:
        ctl.register("d", 0, SHAPE, 0, None, "w0")
    assert info.value.code == "ALREADY_EXISTS"
    clock.now = 61.0
    session, _ = ctl.register("d", 0, SHAPE, 0, None, "w0")
    assert session.registered_at == 61.0


def test_forced_budget_is_recorded_on_the_deployments_loop() -> None:
    clock = FakeClock(7.0)
    ctl, _ = connected(clock, PolicyConfig(paused=True, max_moved_fraction=1.0))
    dep = ctl.deployment("d")
    for rank in range(2):
        ctl.ingest(dep, rank, 0, 0, SKEWED, None)
    decision, plan = ctl.force("d", max_moved_fraction=0.2)
    assert plan is not None and decision.moved_fraction <= 0.2
    assert dep.loop.last_decision is decision and dep.loop.last_rebalance == 7.0
    assert dep.policy.max_moved_fraction == 1.0  # the override was for this plan only
    with pytest.raises(StateError) as info:
        ctl.force("d", dry_run=True, max_moved_fraction=1.5)
    assert info.value.code == "INVALID_ARGUMENT"


def test_a_resent_window_is_counted_once() -> None:
    ctl, _ = connected(FakeClock(0.0))
    dep = ctl.deployment("d")
    assert ctl.ingest(dep, 0, 0, 0, SKEWED, None)
    assert not ctl.ingest(dep, 0, 0, 0, SKEWED, None)
    assert (dep.stats.windows_ingested, dep.stats.duplicate_windows) == (1, 1)


def test_repeated_decisions_log_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    """The policy decides every period: the same outcome again is a DEBUG line, so INFO
    gets one line per change (it got one per decision per deployment per second); an
    operator's force is always INFO."""
    import logging

    clock = FakeClock(1000.0)
    ctl, _ = connected(clock, PolicyConfig(min_windows=1, decision_period_seconds=1.0))
    dep = ctl.deployment("d")
    even = np.full((2, 4), 50)  # the trivial placement balances it: skip_gain every time
    with caplog.at_level(logging.DEBUG, logger="rebalancer.controller"):
        for seq in range(6):
            clock.now += 1.5
            for rank in range(SHAPE.num_gpus):
                ctl.ingest(dep, rank, seq, 0, even, None)
        ctl.force("d")
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if " decision: " in r.getMessage()]
    assert [m.split(" (")[0] for level, m in lines if level == logging.DEBUG] == [
        "d decision: skip_gain"
    ] * 5
    assert [m.split(" (")[0] for level, m in lines if level == logging.INFO] == [
        "d decision: skip_gain"
    ] * 2
    assert "forced, but the candidate equals" in lines[-1][1] and len(lines) == 7


def test_a_take_that_could_not_start_is_not_the_last_rebalance() -> None:
    """A take stored as skip_ranks (a rank not connected) is no rebalance: the history
    must not hold the next decision back by min_interval counted from it (issue 34)."""
    clock = FakeClock(100.0)
    policy = PolicyConfig(
        min_windows=1,
        decision_period_seconds=1.0,
        min_interval_seconds=60.0,
        max_moved_fraction=1.0,
    )
    ctl = Controller(Store(":memory:"), policy, clock=clock)
    sessions = [
        ctl.register("d", rank, SHAPE, 0, None, f"w{rank}")[0] for rank in range(SHAPE.num_gpus)
    ]
    dep = ctl.deployment("d")
    ctl.attach(sessions[0].session_id, lambda kind, plan: None)  # rank 1 has no stream
    for rank in range(2):
        ctl.ingest(dep, rank, 0, 0, SKEWED * 100, None)
    first = ctl.store.decisions("d", 10)[0]
    assert first["outcome"] == "skip_ranks" and first["plan_version"] == 0
    assert dep.loop.last_rebalance is None
    ctl.attach(sessions[1].session_id, lambda kind, plan: None)  # rank 1 is back
    clock.now = 102.0
    for rank in range(2):
        ctl.ingest(dep, rank, 1, 0, SKEWED * 100, None)
    latest = ctl.store.decisions("d", 10)[0]
    assert latest["outcome"] == "rebalance" and latest["plan_version"] == 1, latest
    assert dep.plan is not None and dep.loop.last_rebalance == 102.0
