"""The ingest cursor's save: the same state as `state_dict()`, stored as raw bytes (an old
npz blob still reads back), and staggered so deployments started together do not all
save at once, never more than `persist_seconds` apart."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.estimate import EstimatorConfig, LoadEstimator
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.wire.shape import ClusterShape

SHAPE = ClusterShape(num_layers=2, num_logical=4, num_slots=6, num_gpus=2, expert_bytes=10)


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _filled(config: EstimatorConfig) -> LoadEstimator:
    est = LoadEstimator(3, 5, config)
    rng = np.random.default_rng(0)
    for _ in range(4):
        est.add(rng.integers(0, 100, (3, 5)))
    return est


def test_estimator_state_is_state_dict_with_arrays() -> None:
    for config in (EstimatorConfig(), EstimatorConfig(window=3, shrink=False)):
        est = _filled(config)
        fast = est.state()
        assert {k: _plain(v) for k, v in fast.items()} == est.state_dict()


def test_cursor_round_trips_through_the_store(tmp_path: Path) -> None:
    est = _filled(EstimatorConfig(window=3))
    store = Store(tmp_path / "s.sqlite")
    store.save_ingest_state(
        "d", {"next_seq": {"0": 7, "1": 7}, "estimator": est.state(), "tokens_folded": 9}
    )
    store.close()
    saved = Store(tmp_path / "s.sqlite").ingest_state("d")
    assert saved is not None
    assert saved["next_seq"] == {"0": 7, "1": 7} and saved["tokens_folded"] == 9
    again = LoadEstimator(3, 5)
    again.load_state_dict(saved["estimator"])
    assert _plain(again.state_dict()) == est.state_dict()
    again.add(np.ones((3, 5)))  # restored arrays are writable


def test_an_npz_cursor_from_before_still_reads(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.sqlite")
    blob = io.BytesIO()
    np.savez(blob, a0=np.arange(6.0).reshape(2, 3))
    doc = {"next_seq": {"0": 3}, "estimator": {"weighted_sum": {"__array__": "a0"}}}
    store._db.execute(
        "INSERT INTO ingest_state VALUES (?, ?, ?)", ("d", json.dumps(doc), blob.getvalue())
    )
    saved = store.ingest_state("d")
    assert saved is not None and saved["next_seq"] == {"0": 3}
    np.testing.assert_array_equal(saved["estimator"]["weighted_sum"], np.arange(6.0).reshape(2, 3))


def test_saves_are_staggered_and_never_further_apart_than_the_period() -> None:
    now = [1000.0]
    ctl = Controller(
        Store(":memory:"),
        PolicyConfig(min_windows=10**6),
        persist_seconds=5.0,
        clock=lambda: now[0],
    )
    names = [f"dep-{i}" for i in range(40)]
    saves: dict[str, list[float]] = {name: [] for name in names}
    original = ctl.store.save_ingest_state

    def save(name: str, state: dict[str, Any], background: bool = False) -> None:
        saves[name].append(now[0])
        original(name, state, background=background)

    ctl.store.save_ingest_state = save  # type: ignore[method-assign]
    deps = {}
    for name in names:
        for rank in range(SHAPE.num_gpus):
            _, deps[name] = ctl.register(name, rank, SHAPE, 0, None, f"{name}-w{rank}")
    window = np.ones((2, 4))
    for seq in range(60):  # all deployments fold every 0.5 s, all started together
        for name in names:
            for rank in range(SHAPE.num_gpus):
                ctl.ingest(deps[name], rank, seq, 0, window, None)
        now[0] += 0.5
    for times in saves.values():
        assert times[0] == 1000.0  # the first fold saves
        assert max(np.diff(times)) <= 5.0
    second = {times[1] for times in saves.values()}
    assert len(second) >= 5  # spread over the period, not all at 1005
    ctl.persist_all()  # the drain saves everything
    assert all(times[-1] == now[0] for times in saves.values())


def test_a_fleet_whose_cursors_outrun_the_budget_saves_each_less_often() -> None:
    """Past `cursor_bytes_per_second` a deployment saves every round of the fleet's cursor
    bytes over the budget, not every `persist_seconds`: the store's writer is not flooded
    (2,048 DeepSeek-V3 cursors every 5 s are 49 MB/s)."""
    now = [1000.0]
    names = [f"dep-{i}" for i in range(20)]

    def run(budget: float) -> tuple[dict[str, list[float]], float]:
        ctl = Controller(
            Store(":memory:"),
            PolicyConfig(min_windows=10**6),
            persist_seconds=1.0,
            clock=lambda: now[0],
            cursor_bytes_per_second=budget,
        )
        saves: dict[str, list[float]] = {name: [] for name in names}
        original = ctl.store.save_ingest_state

        def save(name: str, state: dict[str, Any], background: bool = False) -> int:
            saves[name].append(now[0])
            return original(name, state, background=background)

        ctl.store.save_ingest_state = save  # type: ignore[method-assign]
        deps = {}
        for name in names:
            for rank in range(SHAPE.num_gpus):
                _, deps[name] = ctl.register(name, rank, SHAPE, 0, None, f"{name}-w{rank}")
        for seq in range(200):  # every deployment folds every 0.5 s for 100 s
            for name in names:
                for rank in range(SHAPE.num_gpus):
                    ctl.ingest(deps[name], rank, seq, 0, np.ones((2, 4)), None)
            now[0] += 0.5
        return saves, ctl.folder.persist_interval()

    ample, interval = run(1e9)
    assert interval == 1.0
    assert all(max(np.diff(t)) <= 1.0 and len(t) >= 90 for t in ample.values())
    row = Store(":memory:").save_ingest_state("x", {"next_seq": {"0": 1}, "estimator": {}})
    assert row > 0
    tight, interval = run(2000.0)  # 20 cursors of ~1 kB: one round is ~10 s at 2 kB/s
    assert interval > 5.0
    assert all(max(np.diff(t)) <= interval + 0.5 for t in tight.values())
    assert all(len(t) < len(ample[n]) / 4 for n, t in tight.items())
