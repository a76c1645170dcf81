"""SQLite store: what a restarted controller reads back (invariant 7)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.estimate import EstimatorConfig
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.wire.shape import ClusterShape


def test_round_trip_across_reopen(tmp_path: Path) -> None:
    db = tmp_path / "s.sqlite"
    store = Store(db)
    base = np.array([[0, 1, 2, 0], [2, 1, 0, 1]])
    store.create_deployment("d", {"num_layers": 2}, {"decay": 0.5}, 0, base, now=1.0)
    new = base[:, ::-1].copy()
    store.begin_plan("d", 1, 0, "forced", new, slots_moved=4, bytes_moved=400, now=2.0)
    store.commit_plan("d", 1, now=3.0)
    store.begin_plan("d", 2, 1, "policy", base, slots_moved=4, bytes_moved=400, now=4.0)
    store.set_plan_state("d", 2, "aborted", "rank 3 disconnected while preparing", now=5.0)
    store.record_decision("d", {"time": 1.0, "outcome": "skip_gain"})
    store.save_ingest_state("d", {"next_seq": {"0": 5}})
    store.close()

    again = Store(db)
    (row,) = again.load_deployments()
    assert row.committed_version == 1
    np.testing.assert_array_equal(row.phy2log, new)
    plans = again.plans("d")
    assert [(p.version, p.state) for p in plans] == [(2, "aborted"), (1, "committed")]
    assert plans[0].reason.startswith("rank 3")
    assert (plans[1].created, plans[1].finished, plans[0].finished) == (
        2.0,
        3.0,
        5.0,
    )  # the caller's times
    assert again.decisions("d")[0]["outcome"] == "skip_gain"
    assert again.ingest_state("d") == {"next_seq": {"0": 5}}
    assert again.max_version("d") == 2


def test_controller_restart_keeps_placement_and_voids_unfinished_plans(tmp_path: Path) -> None:
    db = tmp_path / "c.sqlite"
    shape = ClusterShape(num_layers=2, num_logical=4, num_slots=6, num_gpus=2, expert_bytes=10)
    ctl = Controller(Store(db), PolicyConfig(estimator=EstimatorConfig(decay=0.5)))
    _, dep = ctl.register("d", 0, shape, 0, None, "w0")
    ctl.ingest(dep, 0, 0, 0, np.arange(8).reshape(2, 4), None)
    ctl.ingest(dep, 1, 0, 0, np.arange(8).reshape(2, 4), None)
    new = dep.phy2log[:, [1, 0, 2, 3, 4, 5]]
    ctl.store.begin_plan("d", 1, 0, "policy", new, 2, 20, now=0.0)
    ctl.store.close()

    back = Controller(Store(db))
    d = back.deployments["d"]
    assert d.version == 0 and d.shape == shape and d.policy.estimator.decay == 0.5
    assert d.next_seq == {0: 1, 1: 1}
    assert d.estimator.windows == 1
    np.testing.assert_allclose(d.estimator.estimate().sum(), 2 * np.arange(8).sum())
    assert back.store.plans("d")[0].state == "aborted"
