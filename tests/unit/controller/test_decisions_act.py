"""Acting on decisions: a store that refuses writes (disk full, read-only) does not start
the plan (it must be stored before any rank hears of it), the decision says why, and
nothing raises into the event loop; and the decision queue stays short over all
deployments (MAX_DECISIONS_IN_FLIGHT)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.wire.layout import trivial_placement
from rebalancer.wire.shape import ClusterShape

SHAPE = ClusterShape(num_layers=2, num_logical=4, num_slots=6, num_gpus=2, expert_bytes=10)


def _refuse(*_args: object, **_kwargs: object) -> None:
    raise sqlite3.OperationalError("database or disk is full")


def test_a_refused_plan_is_a_skip_and_a_refused_record_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ctl = Controller(Store(tmp_path / "s.sqlite"), PolicyConfig(min_windows=1, paused=True))
    for rank in range(2):
        session, dep = ctl.register("d", rank, SHAPE, 0, None, "", "")
        ctl.attach(session.session_id, lambda *_: None)
    rng = np.random.default_rng(0)
    # Expert 3 hot: the trivial placement holds it once, so the candidate moves slots.
    skewed = np.array([[10, 10, 10, 400], [5, 5, 20, 300]], dtype=np.int64)
    for seq in range(3):
        for rank in range(2):
            ctl.ingest(dep, rank, seq, 0, skewed + rng.integers(0, 3, skewed.shape), None)
    monkeypatch.setattr(ctl.store, "begin_plan", _refuse)
    monkeypatch.setattr(ctl.store, "record_decision", _refuse)
    decision, plan = ctl.force("d")
    assert plan is None and dep.plan is None
    assert decision.outcome == "skip_store" and "disk is full" in decision.reason
    np.testing.assert_array_equal(dep.phy2log, trivial_placement(2, 4, 6, 2))
    assert "refused a decision record" in caplog.text


def test_decisions_queue_at_most_max_in_flight_over_all_deployments(tmp_path: Path) -> None:
    """With the worker busy, deployments found due wait for a slot instead of queueing
    inputs on the event loop; each still decides once slots free up."""
    from rebalancer.controller.decision_runner import MAX_DECISIONS_IN_FLIGHT

    held: list[tuple[object, object]] = []
    ctl = Controller(
        Store(tmp_path / "s.sqlite"),
        PolicyConfig(min_windows=1),
        background=lambda fn, done: held.append((fn, done)),
    )
    deps = []
    for name in ("a", "b", "c", "d"):
        for rank in range(2):
            session, dep = ctl.register(name, rank, SHAPE, 0, None, "", "")
        deps.append(dep)
    window = np.array([[400, 10, 10, 10], [300, 20, 5, 5]], dtype=np.int64)
    for seq in range(2):
        for dep in deps:
            for rank in range(2):
                ctl.ingest(dep, rank, seq, 0, window, None)
    assert len(held) == MAX_DECISIONS_IN_FLIGHT == ctl.decisions.in_flight
    while held:  # the worker answers; the next windows give the waiting deployments their turn
        fn, done = held.pop(0)
        done(fn())  # type: ignore[operator]
        seq += 1
        for dep in deps:
            for rank in range(2):
                ctl.ingest(dep, rank, seq, 0, window, None)
        assert ctl.decisions.in_flight <= MAX_DECISIONS_IN_FLIGHT
        if all(dep.loop.last_decision is not None for dep in deps):
            break
    assert all(dep.loop.last_decision is not None for dep in deps)


def test_the_decision_worker_keeps_within_its_share_of_a_core(tmp_path: Path) -> None:
    """Each decision here takes 200 ms of the worker, and 8 deployments are due every
    second: the worker would be busy all the time. With a share of 0.25 it is busy a
    quarter of the time after the saved-up burst, and every deployment still decides."""
    from rebalancer.controller.decision_runner import DECISION_BURST_SECONDS, DecisionBudget

    now = [0.0]
    held: list[tuple[object, object, float]] = []

    def background(fn: object, done: object) -> None:
        start = max(now[0], held[-1][2] if held else now[0])
        held.append((fn, done, start + 0.200))  # the worker runs one at a time

    ctl = Controller(
        Store(tmp_path / "s.sqlite"),
        PolicyConfig(min_windows=1),
        clock=lambda: 1000.0 + now[0],
        background=background,
    )
    ctl.decisions.budget = DecisionBudget(0.25, clock=lambda: now[0])
    deps = []
    for name in "abcdefgh":
        for rank in range(2):
            ctl.register(name, rank, SHAPE, 0, None, "", "")
        deps.append(ctl.deployment(name))
    # Even load: every decision holds (no plan stops a deployment from being due).
    window = np.full((2, 4), 100, dtype=np.int64)
    busy = 0.0
    for seq in range(1000):  # 10 s of wall time
        now[0] = seq * 0.010
        while held and held[0][2] <= now[0]:
            fn, done, _ = held.pop(0)
            busy += 0.200
            done(fn())  # type: ignore[operator]
        for dep in deps:
            ctl.ingest(dep, 0, seq, 0, window, None)
            ctl.ingest(dep, 1, seq, 0, window, None)
    for dep in deps:
        assert dep.loop.last_decision is not None, dep.name
    # The burst, then a quarter of each second (one decision of slack either way).
    assert busy <= DECISION_BURST_SECONDS + 0.25 * 10 + 0.200
    assert busy >= 0.25 * 10 - 0.200
    assert all(dep.loop.last_decision.outcome == "skip_gain" for dep in deps)
    # Operators read the worker's time and the spacing it affords: 8 deciders at 0.2 s a
    # decision within a quarter of a core decide every 6.4 s.

    from rebalancer.controller.metrics import ControllerMetrics

    text = ControllerMetrics(ctl).render().decode()

    def value(name: str) -> float:
        return float(text.split(f"\n{name} ")[1].split()[0])

    # (a decision is seen back at the next 10 ms step: up to 5 % over its 0.2 s)
    assert value("rebalancer_decision_worker_busy_seconds_total") == pytest.approx(busy, rel=0.05)
    assert value("rebalancer_decision_spacing_seconds") == pytest.approx(8 * 0.2 / 0.25, rel=0.05)
