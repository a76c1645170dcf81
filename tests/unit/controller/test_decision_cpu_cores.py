"""`[server] cpu_cores` (issue 32): the cores the controller process and its decision worker
may use together. The worker's share is what the controller's own CPU leaves of them,
between MIN_DECISION_CPU_SHARE and decision_cpu_share, so ingest comes first and the pair
stays within a pod's one core while a large fleet's first plans are computed."""

from __future__ import annotations

import pytest

from rebalancer.controller.decision_runner import MIN_DECISION_CPU_SHARE, DecisionBudget

DECISION_SECONDS = 0.2  # each decision holds the worker this long


class Process:
    """A wall clock and the controller process's CPU seconds, advanced together."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cpu = 0.0

    def clock(self) -> float:
        return self.now

    def process_cpu(self) -> float:
        return self.cpu


def worker_share(budget: DecisionBudget, process: Process, cores: float, seconds: float) -> float:
    """Run decisions back to back as the budget allows while the controller itself takes
    `cores`; the share of the last half of `seconds` the worker was busy."""
    handed: float | None = None
    busy = 0.0
    end = process.now + seconds
    while process.now < end:
        process.now += 0.01
        process.cpu += cores * 0.01
        if handed is not None and process.now >= handed + DECISION_SECONDS:
            budget.spend(handed)
            if process.now > end - seconds / 2:
                busy += DECISION_SECONDS
            handed = None
        if handed is None and budget.allows():
            handed = process.now
    return busy / (seconds / 2)


def test_the_worker_takes_what_the_controller_leaves_of_the_cores() -> None:
    process = Process()
    budget = DecisionBudget(0.5, process.clock, cores=1.0, process_cpu=process.process_cpu)
    assert budget.share == 0.5  # nothing measured yet
    # A busy controller (0.8 of a core): the worker gets the 0.2 left, not its 0.5.
    busy = worker_share(budget, process, 0.8, 120)
    assert budget.controller_cores == pytest.approx(0.8, abs=0.01)
    assert budget.share == pytest.approx(0.2, abs=0.01)
    assert busy == pytest.approx(0.2, abs=0.03)
    # The controller quiet again: the worker back at its own share, no more.
    busy = worker_share(budget, process, 0.1, 120)
    assert budget.share == 0.5 and busy == pytest.approx(0.5, abs=0.03)
    # The controller takes every core and more: the worker still decides, at the floor.
    busy = worker_share(budget, process, 1.3, 120)
    assert budget.share == MIN_DECISION_CPU_SHARE
    assert 0 < busy <= MIN_DECISION_CPU_SHARE + 0.03


def test_without_cpu_cores_the_share_is_decision_cpu_share() -> None:
    process = Process()
    budget = DecisionBudget(0.5, process.clock, process_cpu=process.process_cpu)
    busy = worker_share(budget, process, 0.8, 120)
    assert budget.share == 0.5 and busy == pytest.approx(0.5, abs=0.03)
