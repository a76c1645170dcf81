"""Survivor placements are told to the ranks ahead of any failure (issue 30): a real
controller plans every single-rank loss once counts arrive and sends each to every rank
(ControllerMessage.planned_loss); with the controller then gone, a rank still answers
`survivor_map(lost)` with the placement the controller planned, for the version it
serves. Real controller, real worker agents on gRPC, a real SQLite store."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rebalancer.controller.decide import PolicyConfig
from rebalancer.launch.instant import InstantRank
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.shape import shape_of
from tests.integration.conftest import start_controller
from tests.unit.deploy.live import wait_for

L, E, P, G = 3, 8, 16, 4  # a rank loss leaves 12 slots for 8 experts
SHAPE = pb.ModelShape(
    num_layers=L,
    num_logical_experts=E,
    num_physical_slots=P,
    num_gpus=G,
    num_nodes=1,
    expert_bytes=1 << 20,
)


def test_the_ranks_hold_the_planned_survivor_placements_with_the_controller_gone(
    tmp_path: Path,
) -> None:
    ctl = start_controller(tmp_path / "c.sqlite", PolicyConfig(paused=True, min_windows=1))
    ranks = [InstantRank(r, ctl.server.address, "told", shape=shape_of(SHAPE)) for r in range(G)]  # type: ignore[union-attr]
    stopped = False
    try:
        for r in ranks:
            r.agent.start()
        for r in ranks:
            assert r.agent.connected.wait(30)
        rng = np.random.default_rng(5)
        for seq in range(2):
            logical = rng.integers(0, 50, (L, E)) * (1 + np.arange(E))
            for r in ranks:
                r.agent.submit_window(seq * 4, 4, 0, logical, None)
        controller = ctl.server.controller  # type: ignore[union-attr]
        wait_for(
            lambda: ctl.call(lambda: controller.contingency.get("told")) is not None,
            30,
            "contingency set",
        )
        made = ctl.call(lambda: controller.contingency.get("told"))
        planned = {loss.lost: loss.phy2log for loss in made.losses}
        assert set(planned) == {(g,) for g in range(G)}
        wait_for(
            lambda: all(r.agent.survivor_map((G - 1,), 0) is not None for r in ranks),
            30,
            "sets told",
        )
        ctl.stop()  # the controller is gone when the rank is lost
        stopped = True
        for r in ranks[:-1]:  # the survivors of losing rank G-1
            taken = r.agent.survivor_map((G - 1,), 0)
            assert taken is not None and taken.shape == (L, P // G * (G - 1))
            assert np.array_equal(taken, planned[(G - 1,)])
            assert all(set(range(E)) <= set(row.tolist()) for row in taken)  # every expert served
            assert (
                r.agent.survivor_map((G - 1,), 1) is None
            )  # planned on v0: not for another version
            assert r.agent.survivor_map((0, 1), 0) is None  # a loss nobody planned
    finally:
        for r in ranks:
            r.agent.stop()
        if not stopped:
            ctl.stop()
