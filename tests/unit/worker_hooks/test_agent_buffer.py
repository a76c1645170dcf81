"""The agent's window buffer stays bounded and loses no count while the controller is away."""

from __future__ import annotations

import numpy as np

from rebalancer.v1 import rebalancer_pb2 as pb
from worker_hooks.agent import AgentConfig, PlanHandlers, WorkerAgent


def test_pending_windows_merge_beyond_the_bound() -> None:
    agent = WorkerAgent(AgentConfig("127.0.0.1:1", "d", 0, pb.ModelShape(), max_pending=8), PlanHandlers(), lambda: 0)
    rng = np.random.default_rng(1)
    total = np.zeros((3, 5), np.int64)
    for step in range(100):
        counts = rng.integers(0, 50, size=(3, 5))
        total += counts
        agent.submit_window(step, 1, 0, counts, None)
        assert len(agent._pending) <= 8
    assert agent.merged_windows == 92
    assert sum(w.num_steps for w in agent._pending) == 100
    np.testing.assert_array_equal(sum(w.logical for w in agent._pending), total)
    sent = agent._take_pending()
    assert [m.seq for m in sent] == list(range(8)) and not agent._pending
