"""The controller's exposition from its first scrape: the process's own series, and a zero
series for every known label value of each counter, for the deployments read back from
the store and for one that registers later, so `rate()` and `increase()` count the first
abort or refused window instead of starting a series with it."""

from __future__ import annotations

from pathlib import Path

from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.decision_runner import RECORDED_OUTCOMES, TRIGGERS
from rebalancer.controller.metrics import ABORT_REASONS, ControllerMetrics
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.wire.shape import ClusterShape

SHAPE = ClusterShape(num_layers=2, num_logical=4, num_slots=6, num_gpus=2, expert_bytes=10)


def exposition(metrics: ControllerMetrics) -> str:
    return metrics.render().decode()


def assert_zero_series(text: str, deployment: str) -> None:
    for reason in ABORT_REASONS:
        assert (
            f'rebalancer_plan_aborts_total{{deployment="{deployment}",reason="{reason}"}} 0.0'
            in text
        ), reason
    assert f'rebalancer_ingest_refused_total{{deployment="{deployment}"}} 0.0' in text
    assert f'rebalancer_ingest_bytes_total{{deployment="{deployment}"}} 0.0' in text
    for outcome in RECORDED_OUTCOMES:
        assert (
            f'rebalancer_decisions_total{{deployment="{deployment}",outcome="{outcome}"}} 0.0'
            in text
        ), outcome
    for trigger in TRIGGERS:
        assert (
            f'rebalancer_rebalances_total{{deployment="{deployment}",trigger="{trigger}"}} 0.0'
            in text
        )


def test_zero_series_for_known_labels_and_the_process_collector(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite"
    store = Store(db)
    Controller(store).register("stored", 0, SHAPE, 0, None, "", "")
    store.close()

    ctl = Controller(Store(db), PolicyConfig(paused=True))
    metrics = ControllerMetrics(ctl)
    text = exposition(metrics)
    assert_zero_series(text, "stored")  # read back from the store at start
    for name in (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_start_time_seconds",
    ):
        assert f"\n{name} " in text, name
    for phase in ("prepare", "commit"):
        assert f'rebalancer_plan_phase_seconds_count{{phase="{phase}"}} 0.0' in text
    assert 'deployment="new"' not in text

    ctl.register("new", 0, SHAPE, 0, None, "", "")  # first seen at a Register
    assert_zero_series(exposition(metrics), "new")
    metrics.on_refused("new")
    assert 'rebalancer_ingest_refused_total{deployment="new"} 1.0' in exposition(metrics)
    ctl.store.close()


def test_the_estimated_balancedness_is_kept_until_the_placement_changes_or_it_ages() -> None:
    """Source "estimated" (the committed placement on the load estimate) is computed again
    when the placement changed, else once it aged (ESTIMATED_REFRESH_SECONDS to twice that,
    by name, so that a fleet's refreshes spread over scrapes); a scrape in between answers
    the last one, whatever windows folded since."""
    import re

    import numpy as np

    from rebalancer.controller.metrics import ESTIMATED_REFRESH_SECONDS, estimated_refresh_after

    kept = [estimated_refresh_after(f"deepseek-{i}") for i in range(1000)]
    assert ESTIMATED_REFRESH_SECONDS <= min(kept) and max(kept) < 2 * ESTIMATED_REFRESH_SECONDS
    assert np.std(kept) > ESTIMATED_REFRESH_SECONDS / 5  # spread, not one deadline for all

    class Clock:
        now = 100.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    ctl = Controller(Store(":memory:"), PolicyConfig(paused=True), clock=clock)
    shape = ClusterShape(num_layers=1, num_logical=4, num_slots=4, num_gpus=2, expert_bytes=10)
    _, dep = ctl.register("d", frozenset({0, 1}), shape, 0, None, "w", pod="p")
    metrics = ControllerMetrics(ctl)

    def estimated() -> float:
        pattern = r'rebalancer_balancedness\{deployment="d",source="estimated",stat="avg"\} (\S+)'
        found = re.search(pattern, exposition(metrics))
        assert found is not None
        return float(found.group(1))

    skewed = np.array([[90, 10, 90, 10]])  # experts 0, 1 on rank 0; 2, 3 on rank 1
    for seq in range(3):
        ctl.ingest(dep, frozenset({0, 1}), seq, 0, skewed, None)
    even = estimated()
    assert even == 1.0
    lopsided = np.array([[90, 90, 10, 10]])
    for seq in range(3, 40):
        ctl.ingest(dep, frozenset({0, 1}), seq, 0, lopsided, None)
    clock.now += ESTIMATED_REFRESH_SECONDS / 2
    assert estimated() == even  # younger than the refresh: kept
    clock.now += ESTIMATED_REFRESH_SECONDS * 1.5
    aged = estimated()
    assert aged < 0.75  # the estimate moved to the lopsided load
    for seq in range(40, 80):
        ctl.ingest(dep, frozenset({0, 1}), seq, 0, skewed, None)
    dep.phy2log = dep.phy2log.copy()  # a new placement (the same slots: a new array)
    assert estimated() > aged  # computed again at once
