"""Acks paced to one per ack interval per stream, not one per window (issue 32), and still
in time: every window a stream sends is acknowledged within the interval (plus the trip),
the last at once when the stream ends, and what the controller folded is exactly what
was sent."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from rebalancer.controller.config import ControllerConfig
from rebalancer.v1 import rebalancer_pb2 as pb
from tests.integration.conftest import start_controller
from tests.unit.worker_hooks.test_warm import NoPlans

L, E, P, G = 2, 4, 8, 2
SHAPE = pb.ModelShape(
    num_layers=L,
    num_logical_experts=E,
    num_physical_slots=P,
    num_gpus=G,
    num_nodes=1,
    expert_bytes=1000,
)


def test_a_rank_stops_at_once_under_the_default_interval_with_every_window_folded(
    tmp_path: Path,
) -> None:
    """A stopping rank drains until its last window is acked: it ends its stream, so the
    controller acks at once, not after its ack interval (5 s by default)."""
    from rebalancer.wire.link import Link
    from rebalancer.wire.shape import shape_of
    from worker_hooks.agent import AgentConfig, WorkerAgent

    interval = ControllerConfig().ack_interval_seconds
    assert interval >= 5.0
    ctl = start_controller(tmp_path / "c.sqlite", ack_interval_seconds=interval)
    agents = []
    try:
        assert ctl.server is not None
        for rank in range(G):
            agent = WorkerAgent(
                AgentConfig(Link(ctl.server.address, deployment="dep"), rank, shape_of(SHAPE)),
                NoPlans(),
                lambda: 0,
            )
            agent.start()
            agents.append(agent)
        windows = 6
        for seq in range(windows):
            for agent in agents:
                agent.submit_window(seq, 1, 0, np.full((L, E), seq + 1, np.int64), None)
            time.sleep(0.2)
        began = time.monotonic()
        assert all(agent.drain(10.0) for agent in agents)
        drained = time.monotonic() - began
        assert drained < interval / 2, drained
        folded = ctl.call(lambda: ctl.server.controller.deployments["dep"].stats.tokens_folded)  # type: ignore[union-attr]
        assert folded == G * L * E * sum(range(1, windows + 1))
    finally:
        for agent in agents:
            agent.stop(2.0)
        ctl.stop()
