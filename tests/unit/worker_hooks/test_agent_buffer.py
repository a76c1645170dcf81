"""The agent: its window buffer stays bounded and loses no count while the controller is
away; each controller message reaches its handler; bad settings are refused by name."""

from __future__ import annotations

import numpy as np
import pytest

from rebalancer.v1 import rebalancer_pb2 as pb
from worker_hooks.agent import AgentConfig, WorkerAgent


class NoPlans:
    """PlanHandlers that ignore every plan."""

    def on_prepare(self, prepare: pb.Prepare) -> None: ...
    def on_commit(self, version: int) -> None: ...
    def on_abort(self, version: int, reason: str) -> None: ...


def test_pending_windows_merge_beyond_the_bound() -> None:
    agent = WorkerAgent(AgentConfig("127.0.0.1:1", "d", 0, pb.ModelShape(), max_pending=8), NoPlans(), lambda: 0)
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


class Recorder(NoPlans):
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def on_prepare(self, prepare: pb.Prepare) -> None:
        self.calls.append(("prepare", prepare.version))

    def on_commit(self, version: int) -> None:
        self.calls.append(("commit", version))

    def on_abort(self, version: int, reason: str) -> None:
        self.calls.append(("abort", (version, reason)))


def test_each_controller_message_reaches_its_handler() -> None:
    handlers = Recorder()
    agent = WorkerAgent(AgentConfig("127.0.0.1:1", "d", 0, pb.ModelShape()), handlers, lambda: 0)
    agent._unacked = {0: pb.Window(seq=0), 1: pb.Window(seq=1), 2: pb.Window(seq=2)}
    for msg in (
        pb.ControllerMessage(window_ack=pb.WindowAck(seq=1)),
        pb.ControllerMessage(prepare=pb.Prepare(version=3)),
        pb.ControllerMessage(commit=pb.Commit(version=3)),
        pb.ControllerMessage(abort=pb.Abort(version=4, reason="timeout")),
        pb.ControllerMessage(),  # no body: ignored
    ):
        agent._deliver(msg)
    assert handlers.calls == [("prepare", 3), ("commit", 3), ("abort", (4, "timeout"))]
    assert list(agent._unacked) == [2]


def test_bad_agent_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_pending must be >= 1"):
        AgentConfig("127.0.0.1:1", "d", 0, pb.ModelShape(), max_pending=0)
    with pytest.raises(ValueError, match="rpc_timeout_seconds must be > 0"):
        AgentConfig("127.0.0.1:1", "d", 0, pb.ModelShape(), rpc_timeout_seconds=0.0)
    with pytest.raises(ValueError, match="backoff_max_seconds"):
        AgentConfig("127.0.0.1:1", "d", 0, pb.ModelShape(), backoff_max_seconds=0.1)
