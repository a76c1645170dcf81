"""A rank that stops while a plan prepares (a rolling restart, the end of a run) fails the
plan with SHUTTING_DOWN. The plan aborts on every rank as any failed plan does (all or
nothing), but it is no fault: it is counted as `rebalancer_plans_total{outcome="stopped"}`,
not in the aborts that feed RebalancerPlansAborting, logged at INFO, and the other ranks'
reports of the same stop are taken quietly (issue 34)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.metrics import ControllerMetrics
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.errors import SHUTTING_DOWN
from rebalancer.wire.shape import ClusterShape

SHAPE = ClusterShape(num_layers=2, num_logical=4, num_slots=6, num_gpus=2, expert_bytes=10)
SKEWED = np.array([[40, 2, 1, 1], [1, 1, 30, 8]])


def in_flight() -> tuple[Controller, ControllerMetrics, list[str], int]:
    """Both ranks of "d" streaming, a forced plan preparing; the sessions and its version."""
    ctl = Controller(
        Store(":memory:"), PolicyConfig(paused=True, max_moved_fraction=1.0), clock=lambda: 10.0
    )
    metrics = ControllerMetrics(ctl)
    sessions = []
    for rank in range(SHAPE.num_gpus):
        session, _ = ctl.register("d", rank, SHAPE, 0, None, f"w{rank}")
        ctl.attach(session.session_id, lambda kind, plan: None)
        sessions.append(session.session_id)
    dep = ctl.deployment("d")
    for rank in range(2):
        ctl.ingest(dep, rank, 0, 0, SKEWED, None)
    _, plan = ctl.force("d")
    assert plan is not None
    return ctl, metrics, sessions, plan.version


def series(metrics: ControllerMetrics, name: str, **labels: Any) -> float:
    text = metrics.render().decode()
    key = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "} "
    (line,) = [line for line in text.splitlines() if line.startswith(key)]
    return float(line.split()[-1])


def test_a_rank_stopping_mid_plan_aborts_it_as_a_planned_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctl, metrics, sessions, version = in_flight()
    dep = ctl.deployment("d")
    with caplog.at_level(logging.INFO, logger="rebalancer.controller"):
        ctl.report(sessions[0], version, "failed", SHUTTING_DOWN)
        ctl.report(sessions[1], version, "failed", SHUTTING_DOWN)  # its peer stops too: no refusal
    stored = ctl.store.plans("d")[0]
    assert dep.plan is None and stored.state == "aborted" and "shutting down" in stored.reason
    assert (dep.stats.plans_aborted, dep.stats.plans_stopped) == (0, 1)
    assert series(metrics, "rebalancer_plans_total", deployment="d", outcome="aborted") == 0.0
    assert series(metrics, "rebalancer_plans_total", deployment="d", outcome="stopped") == 1.0
    text = metrics.render().decode()
    aborts = [
        line for line in text.splitlines() if line.startswith("rebalancer_plan_aborts_total{")
    ]
    assert aborts and all(line.endswith(" 0.0") for line in aborts), aborts
    said = [r for r in caplog.records if f"plan v{version} aborted" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO], said
    ctl.store.close()


def test_a_rank_failing_mid_plan_is_still_an_abort(caplog: pytest.LogCaptureFixture) -> None:
    ctl, metrics, sessions, version = in_flight()
    dep = ctl.deployment("d")
    with caplog.at_level(logging.INFO, logger="rebalancer.controller"):
        ctl.report(sessions[0], version, "failed", "out of memory")
    assert (dep.stats.plans_aborted, dep.stats.plans_stopped) == (1, 0)
    assert series(metrics, "rebalancer_plans_total", deployment="d", outcome="aborted") == 1.0
    assert (
        series(metrics, "rebalancer_plan_aborts_total", deployment="d", reason="prepare_failed")
        == 1.0
    )
    said = [r for r in caplog.records if f"plan v{version} aborted" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING], said
    ctl.store.close()
