"""Contingency sets: the controller keeps a survivor placement for every single-rank and
single-node loss of a deployment and each scale-down it declares, planned on the decision
worker (inline here), stored, recorded in the decision history, and planned again for a
new placement or a changed declaration."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rebalancer.controller.contingency import (
    MIN_INTERVAL_SECONDS,
    check_scale_down_nodes,
    failure_domains,
    load_shift,
    scale_downs,
)
from rebalancer.controller.decide import PolicyConfig
from rebalancer.controller.metrics import ControllerMetrics
from rebalancer.controller.service import planned_loss_msg
from rebalancer.controller.state import Controller
from rebalancer.controller.store import Store
from rebalancer.errors import StateError
from rebalancer.placement import logcnt_of
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.link import Link
from rebalancer.wire.shape import ClusterShape
from tests.unit.controller.test_controller import FakeClock
from tests.unit.worker_hooks.test_agent_buffer import NoPlans
from worker_hooks.agent import AgentConfig, WorkerAgent

# An EP group for agents that never register (their shape is not read).
TINY = ClusterShape(num_layers=1, num_logical=4, num_slots=4, num_gpus=1)

# 4 ranks in 2 nodes, 3 slots a rank: a rank loss leaves 9 slots for 8 experts, a node
# loss 6, which cannot hold them.
SHAPE = ClusterShape(
    num_layers=2, num_logical=8, num_slots=12, num_gpus=4, num_nodes=2, expert_bytes=10
)
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
    assert (
        recorded["base_version"] == 0
        and recorded["node_unserved"] == 2
        and recorded["node_worst"] == 0.0
    )
    ctl.store.close()
    back = Controller(Store(tmp_path / "c.sqlite"), clock=clock)  # a restart reads it back
    again = back.contingency.get("d")
    assert again is not None and again.base_version == 0
    assert all(
        np.array_equal(a.phy2log, b.phy2log)
        for a, b in zip(made.of("rank"), again.of("rank"), strict=True)
    )
    back.store.close()


def test_a_single_gpu_has_no_loss_to_plan_for(tmp_path: Path) -> None:
    """One GPU: no failure domain, so no set is planned, stored or told, window after
    window (the check that runs at every window says so first)."""
    ctl = Controller(Store(tmp_path / "c.sqlite"), PolicyConfig(paused=True, min_windows=1))
    session, _ = ctl.register("one", 0, TINY, 0, None, "w0")
    ctl.attach(session.session_id, lambda kind, plan: None)
    dep = ctl.deployment("one")
    for seq in range(3):
        ctl.ingest(dep, 0, seq, 0, np.array([[5, 1, 1, 1]]), None)
        assert not ctl.contingency.due(dep, 1000.0 * seq)
    assert ctl.contingency.get("one") is None and ctl.store.contingency("one") is None
    ctl.store.close()


def test_a_new_placement_or_a_moved_load_is_planned_again_but_not_every_window(
    tmp_path: Path,
) -> None:
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


# -- declared scale-downs (policy scale_down_nodes) ------------------------------------------

# 8 ranks in 4 nodes of 2, 3 slots a rank: down to 2 nodes leaves 12 slots for 8 experts.
WIDE = ClusterShape(
    num_layers=2, num_logical=8, num_slots=24, num_gpus=8, num_nodes=4, expert_bytes=10
)


def wide_deployment(
    db: Path, clock: FakeClock, told: list | None = None, policy: PolicyConfig | None = None
) -> Controller:
    ctl = Controller(Store(db), policy or PolicyConfig(paused=True, min_windows=1), clock=clock)
    for rank in range(WIDE.num_gpus):
        session, _ = ctl.register("d", rank, WIDE, 0, None, f"w{rank}")
        ctl.attach(
            session.session_id,
            lambda kind, payload, rank=rank: (
                told is not None and rank == 0 and kind == "planned_loss" and told.append(payload)
            ),
        )
    return ctl


def fold_wide(ctl: Controller, seq: int) -> None:
    dep = ctl.deployment("d")
    for rank in range(WIDE.num_gpus):
        ctl.ingest(dep, rank, seq, dep.version, LOAD, None)


def test_declared_scale_downs_are_planned_on_the_tail_nodes_stored_and_told(tmp_path: Path) -> None:
    clock, told = FakeClock(100.0), []
    ctl = wide_deployment(tmp_path / "c.sqlite", clock, told)
    fold_wide(ctl, 0)
    first = ctl.contingency.get("d")
    assert first is not None and first.of("scale_down") == []  # none declared: none planned
    assert 'loss="scale_down"' not in ControllerMetrics(ctl).render().decode()
    dep = ctl.deployment("d")
    ctl.set_policy("d", dep.policy.with_settings({"scale_down_nodes": [2, 3]}))
    fold_wide(ctl, 1)  # the setting changed: planned again at once, on the same placement
    made = ctl.contingency.get("d")
    assert made is not None and made is not first and made.base_version == first.base_version
    downs = made.of("scale_down")
    # largest count first; going down to n nodes, nodes n.. go: their ranks, the tail
    assert [loss.lost for loss in downs] == [(6, 7), (4, 5, 6, 7)]
    to_two = downs[1]
    assert to_two.feasible and to_two.phy2log is not None and to_two.phy2log.shape == (2, 12)
    assert (logcnt_of(to_two.phy2log, 8) >= 1).all() and 0 < to_two.balancedness <= 1
    # down to 3 of 4 nodes is the last node's loss: the same plan
    (last_node,) = [loss for loss in made.of("node") if loss.lost == (6, 7)]
    assert np.array_equal(downs[0].phy2log, last_node.phy2log)
    assert made.summary()["scale_down_worst"] == min(loss.balancedness for loss in downs)
    text = ControllerMetrics(ctl).render().decode()
    worst = 'rebalancer_contingency_balancedness{deployment="d",loss="scale_down",stat="worst"}'
    assert f"{worst} {min(loss.balancedness for loss in downs)!r}" in text
    # told to the ranks like the other losses: a rank's survivor_map finds it by lost ranks
    assert [t.loss.lost for t in told if t.loss.kind == "scale_down"] == [(6, 7), (4, 5, 6, 7)]
    agent = WorkerAgent(
        AgentConfig(Link("127.0.0.1:1", deployment="d"), 0, TINY), NoPlans(), lambda: 0
    )
    for t in told:
        agent._deliver(
            pb.ControllerMessage(planned_loss=planned_loss_msg(t.loss, t.version, t.set_size))
        )
    taken = agent.survivor_map((4, 5, 6, 7), made.base_version)
    assert taken is not None and np.array_equal(taken, to_two.phy2log)
    ctl.store.close()
    back = Controller(Store(tmp_path / "c.sqlite"), clock=clock)  # stored: a restart reads it back
    again = back.contingency.get("d")
    assert again is not None and [loss.lost for loss in again.of("scale_down")] == [
        (6, 7),
        (4, 5, 6, 7),
    ]
    assert back.deployment("d").policy.contingency.scale_down_nodes == [2, 3]
    back.store.close()


@pytest.mark.parametrize(
    "counts, message",
    [
        (
            [5],
            "policy scale_down_nodes: 5 nodes is no scale-down "
            "of a deployment of 4 nodes (at most 3)",
        ),
        (
            [4],
            "policy scale_down_nodes: 4 nodes is no scale-down "
            "of a deployment of 4 nodes (at most 3)",
        ),
        ([0], "policy scale_down_nodes: 0 nodes: a deployment scales down to 1 node at least"),
        ([2.5], "policy scale_down_nodes: 2.5 is not a whole number of nodes"),
        ([True], "policy scale_down_nodes: True is not a whole number of nodes"),
        ([3, 3], "policy scale_down_nodes: 3 nodes given twice"),
        (3, "policy scale_down_nodes must be a list of node counts, got 3"),
    ],
)
def test_bad_scale_downs_are_refused_precisely_and_change_nothing(
    tmp_path: Path, counts: object, message: str
) -> None:
    ctl = wide_deployment(tmp_path / "c.sqlite", FakeClock(100.0))
    before = ctl.deployment("d").policy
    with pytest.raises(StateError) as err:
        ctl.set_policy("d", before.with_settings({"scale_down_nodes": counts}))
    assert err.value.code == "INVALID_ARGUMENT" and str(err.value) == message
    assert ctl.deployment("d").policy == before
    ctl.store.close()


def test_a_default_scale_down_the_shape_cannot_take_is_left_out_not_refused(tmp_path: Path) -> None:
    """TOML's [policy] is every new deployment's default: a count above a deployment's
    nodes plans nothing for it, and the deployment still pauses, resumes and plans."""
    policy = PolicyConfig(paused=True, min_windows=1).with_settings({"scale_down_nodes": [7, 2]})
    ctl = wide_deployment(tmp_path / "c.sqlite", FakeClock(100.0), policy=policy)
    ctl.set_paused("d", False)
    fold_wide(ctl, 0)
    made = ctl.contingency.get("d")
    assert made is not None and [loss.lost for loss in made.of("scale_down")] == [(4, 5, 6, 7)]
    ctl.store.close()


def test_scale_downs_are_the_tail_ranks_largest_count_first() -> None:
    assert scale_downs(WIDE, [1, 3, 2]) == [(6, 7), (4, 5, 6, 7), (2, 3, 4, 5, 6, 7)]
    assert scale_downs(WIDE, [4, 9, 0]) == []  # no scale-down of this shape: left out
    assert [kind for kind, _ in failure_domains(WIDE, [2])].count("scale_down") == 1
    assert check_scale_down_nodes((3, 1), 4) == [3, 1]
