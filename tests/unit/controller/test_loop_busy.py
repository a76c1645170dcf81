"""The controller's loop busy share and folded rank windows (issue 32: a bench that tells the
truth when the controller lags): the timed selector counts waiting apart from running, the
metrics export both, and a scrape restricted to them does not run the per-deployment
collector."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from rebalancer.controller import metrics as metrics_module
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.loop_busy import for_loop, timed_loop
from rebalancer.controller.metrics import LOOP_BUSY, RANK_WINDOWS_FOLDED, ControllerMetrics
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.wire.shape import ClusterShape

SHAPE = ClusterShape(num_layers=2, num_logical=4, num_slots=8, num_gpus=4, expert_bytes=10)


def run_on_timed_loop(coro_fn):  # type: ignore[no-untyped-def]
    with asyncio.Runner(loop_factory=timed_loop) as runner:
        return runner.run(coro_fn())


def test_waiting_is_not_busy_and_running_is() -> None:
    async def main() -> tuple[float, float]:
        selector = for_loop(asyncio.get_running_loop())
        assert selector is not None
        b0 = selector.busy_seconds()
        await asyncio.sleep(0.3)  # the loop waits in select
        b1 = selector.busy_seconds()
        end = time.monotonic() + 0.2
        while time.monotonic() < end:  # a callback that holds the loop
            pass
        return b1 - b0, selector.busy_seconds() - b1

    waiting, running = run_on_timed_loop(main)
    assert waiting < 0.1
    assert running >= 0.18


def test_each_iteration_is_counted_by_how_long_it_held_the_loop(tmp_path: Path) -> None:
    """One callback that holds the loop 0.2 s is one iteration in the (0.1, 0.25] bucket;
    the loop's short iterations stay in the small buckets; the metrics export them as a
    histogram."""
    from rebalancer.controller.loop_busy import ITERATION_BUCKETS
    from rebalancer.controller.metrics import LOOP_ITERATION

    ctl = Controller(Store(tmp_path / "c.sqlite"), PolicyConfig(paused=True))

    async def main() -> tuple[list[int], list[int], str]:
        selector = for_loop(asyncio.get_running_loop())
        assert selector is not None
        for _ in range(20):
            await asyncio.sleep(0)  # short iterations
        before = list(selector.iterations)
        end = time.monotonic() + 0.2
        while time.monotonic() < end:  # one callback that holds the loop
            pass
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        text = ControllerMetrics(ctl).render().decode()
        return before, list(selector.iterations), text

    before, after, text = run_on_timed_loop(main)
    long_bucket = ITERATION_BUCKETS.index(0.25)
    added = [a - b for a, b in zip(after, before, strict=True)]
    assert added[long_bucket] == 1 and sum(added[long_bucket + 1 :]) == 0
    assert sum(before[ITERATION_BUCKETS.index(0.05) :]) == 0  # nothing long before it
    assert sum(before) >= 20
    assert f'{LOOP_ITERATION}_bucket{{le="0.25"}}' in text
    assert f'{LOOP_ITERATION}_bucket{{le="+Inf"}}' in text and f"{LOOP_ITERATION}_sum" in text
    ctl.store.close()


def test_a_loop_made_elsewhere_has_no_timed_selector() -> None:
    async def main() -> object:
        return for_loop(asyncio.get_running_loop())

    assert asyncio.run(main()) is None


def _window_of(ctl: Controller, name: str, ranks: tuple[int, ...], seq: int) -> None:
    dep = ctl.deployment(name)
    ctl.ingest(dep, ranks, seq, 0, np.ones((2, 4), np.uint32) * len(ranks), None)


def test_rank_windows_folded_count_every_rank_of_a_merged_window(tmp_path: Path) -> None:
    ctl = Controller(Store(tmp_path / "c.sqlite"), PolicyConfig(paused=True))
    for pod in ((0, 1), (2, 3)):
        ctl.register("dep", pod, SHAPE, 0, None, "", f"ns/pod-{pod[0]}")
    for seq in range(3):
        _window_of(ctl, "dep", (0, 1), seq)
        assert ctl.folder.rank_windows_folded == 4 * seq  # half a window: not folded yet
        _window_of(ctl, "dep", (2, 3), seq)
        assert ctl.folder.rank_windows_folded == 4 * (seq + 1)
    _window_of(ctl, "dep", (2, 3), 2)  # resent: dropped, not counted again
    assert ctl.folder.rank_windows_folded == 12
    assert ctl.deployment("dep").estimator.windows == 3
    ctl.store.close()


def test_metrics_export_both_and_a_restricted_scrape_skips_the_deployments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl = Controller(Store(tmp_path / "c.sqlite"), PolicyConfig(paused=True))
    for pod in ((0, 1), (2, 3)):
        ctl.register("dep", pod, SHAPE, 0, None, "", f"ns/pod-{pod[0]}")
        _window_of(ctl, "dep", pod, 0)

    async def main() -> tuple[str, str]:
        metrics = ControllerMetrics(ctl)  # made on the loop `rebalancer serve` runs
        full = metrics.render().decode()

        def refuse(self: object) -> object:
            raise AssertionError("the per-deployment series were read for a restricted scrape")

        monkeypatch.setattr(metrics_module._FleetSeries, "_balancedness", refuse)
        names = [f"{RANK_WINDOWS_FOLDED}_total", f"{LOOP_BUSY}_total"]
        restricted = metrics.render(names).decode()
        monkeypatch.undo()
        return full, restricted

    full, restricted = run_on_timed_loop(main)
    for text in (full, restricted):
        assert f"\n{RANK_WINDOWS_FOLDED}_total 4.0" in text
        assert f"\n{LOOP_BUSY}_total " in text
    assert (
        "rebalancer_placement_version" in full and "rebalancer_placement_version" not in restricted
    )
    # Off a timed loop (tests, the embedded controller): no busy series, the count still there.
    plain = ControllerMetrics(ctl).render().decode()
    assert LOOP_BUSY not in plain and f"\n{RANK_WINDOWS_FOLDED}_total 4.0" in plain
    ctl.store.close()
