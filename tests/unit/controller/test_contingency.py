"""Contingency sets: the controller keeps a survivor placement for every single-rank and
single-node loss of a deployment, planned on the decision worker (inline here), stored,
recorded in the decision history, and planned again for a new placement."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rebalancer.controller.contingency import MIN_INTERVAL_SECONDS, load_shift
from rebalancer.controller.decide import ClusterShape, PolicyConfig
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.placement import logcnt_of
from tests.unit.controller.test_controller import FakeClock

# 4 ranks in 2 nodes, 3 slots a rank: a rank loss leaves 9 slots for 8 experts, a node
# loss 6, which cannot hold them.
SHAPE = ClusterShape(num_layers=2, num_logical=8, num_slots=12, num_gpus=4, num_nodes=2, expert_bytes=10)
LOAD = np.array([[40, 2, 1, 1, 9, 3, 5, 1], [1, 1, 30, 8, 2, 2, 6, 4]])


def deployment(db: Path, clock: FakeClock) -> Controller:
    ctl = Controller(Store(db), PolicyConfig(paused=True, min_windows=1), clock=clock)
    for rank in range(SHAPE.num_gpus):
        session, _ = ctl.register("d", rank, SHAPE, 0, None, f"w{rank}")
        ctl.attach(session.session_id, lambda kind, plan: None)
    return ctl


def fold(ctl: Controller, seq: int, load: np.ndarray = LOAD) -> None:
    dep = ctl.deployment("d")
    for rank in range(SHAPE.num_gpus):
        ctl.ingest(dep, rank, seq, dep.version, load, None)


def test_every_single_loss_is_planned_stored_and_recorded(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    ctl = deployment(tmp_path / "c.sqlite", clock)
    assert ctl.contingency.get("d") is None  # nothing to plan on before counts
    fold(ctl, 0)
    made = ctl.contingency.get("d")
    assert made is not None and made.base_version == 0
    assert [loss.lost for loss in made.of("rank")] == [(0,), (1,), (2,), (3,)]
    assert [loss.lost for loss in made.of("node")] == [(0, 1), (2, 3)]
    for loss in made.of("rank"):
        assert loss.phy2log is not None and loss.phy2log.shape == (2, 9)
        assert (logcnt_of(loss.phy2log, 8) >= 1).all()
        assert 0 < loss.balancedness <= 1
    for loss in made.of("node"):
        assert loss.phy2log is None and loss.unserved == 2
    assert made.summary()["node_unserved"] == 2
    (recorded,) = ctl.store.contingency_history("d")
    assert recorded["base_version"] == 0 and recorded["node_unserved"] == 2 and recorded["node_worst"] == 0.0
    ctl.store.close()
    back = Controller(Store(tmp_path / "c.sqlite"), clock=clock)  # a restart reads it back
    again = back.contingency.get("d")
    assert again is not None and again.base_version == 0
    assert all(np.array_equal(a.phy2log, b.phy2log) for a, b in zip(made.of("rank"), again.of("rank"), strict=True))
    back.store.close()


def test_a_new_placement_or_a_moved_load_is_planned_again_but_not_every_window(tmp_path: Path) -> None:
    clock = FakeClock(100.0)
    ctl = deployment(tmp_path / "c.sqlite", clock)
    fold(ctl, 0)
    first = ctl.contingency.get("d")
    fold(ctl, 1)
    assert ctl.contingency.get("d") is first  # same placement, same load: kept
    for seq in (2, 3):  # the load moved to other experts; looked at once per interval
        clock.now += MIN_INTERVAL_SECONDS
        fold(ctl, seq, LOAD[:, ::-1].copy())
    assert ctl.contingency.get("d") is not first
    second = ctl.contingency.get("d")
    dep = ctl.deployment("d")
    _, plan = ctl.force("d")
    assert plan is not None
    for sid in {s.session_id for s in dep.live_sessions()}:
        ctl.report(sid, plan.version, "prepared")
    for sid in {s.session_id for s in dep.live_sessions()}:
        ctl.report(sid, plan.version, "committed")
    assert dep.version == plan.version
    fold(ctl, 4)
    latest = ctl.contingency.get("d")
    assert latest is not second and latest is not None and latest.base_version == plan.version
    ctl.store.close()


def test_load_shift_is_the_share_of_load_that_changed_experts() -> None:
    a = np.array([[1.0, 1.0, 0.0, 0.0]])
    assert load_shift(a, a * 7) == 0.0
    assert load_shift(a, np.array([[0.0, 0.0, 1.0, 1.0]])) == 1.0
    assert abs(load_shift(a, np.array([[1.0, 0.0, 1.0, 0.0]])) - 0.5) < 1e-12
