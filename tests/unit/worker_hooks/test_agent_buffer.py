"""The agent: its window buffer stays bounded and loses no count while the controller is
away; each controller message reaches its handler; bad settings are refused by name."""

from __future__ import annotations

import time

import numpy as np
import pytest

from rebalancer.errors import InputError
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.link import Link
from rebalancer.wire.shape import ClusterShape
from worker_hooks.agent import AgentConfig, WorkerAgent

# An EP group for agents that never register (their shape is not read).
TINY = ClusterShape(num_layers=1, num_logical=4, num_slots=4, num_gpus=1)


class NoPlans:
    """PlanHandlers that ignore every plan."""

    def on_prepare(self, prepare: pb.Prepare) -> None: ...
    def on_commit(self, version: int) -> None: ...
    def on_abort(self, version: int, reason: str) -> None: ...


def test_pending_windows_merge_beyond_the_bound() -> None:
    agent = WorkerAgent(
        AgentConfig(Link("127.0.0.1:1", deployment="d"), 0, TINY, max_pending=8),
        NoPlans(),
        lambda: 0,
    )
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
    agent = WorkerAgent(
        AgentConfig(Link("127.0.0.1:1", deployment="d"), 0, TINY), handlers, lambda: 0
    )
    agent._sent.unacked = {0: pb.Window(seq=0), 1: pb.Window(seq=1), 2: pb.Window(seq=2)}
    for msg in (
        pb.ControllerMessage(window_ack=pb.WindowAck(seq=1)),
        pb.ControllerMessage(prepare=pb.Prepare(version=3)),
        pb.ControllerMessage(commit=pb.Commit(version=3)),
        pb.ControllerMessage(abort=pb.Abort(version=4, reason="timeout")),
        pb.ControllerMessage(),  # no body: ignored
    ):
        agent._deliver(msg)
    assert handlers.calls == [("prepare", 3), ("commit", 3), ("abort", (4, "timeout"))]
    assert list(agent._sent.unacked) == [2]


def test_bad_agent_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_pending must be >= 1"):
        AgentConfig(Link("127.0.0.1:1", deployment="d"), 0, TINY, max_pending=0)
    with pytest.raises(ValueError, match="rpc_timeout_seconds must be > 0"):
        AgentConfig(Link("127.0.0.1:1", deployment="d"), 0, TINY, rpc_timeout_seconds=0.0)
    with pytest.raises(ValueError, match="backoff_max_seconds"):
        AgentConfig(Link("127.0.0.1:1", deployment="d"), 0, TINY, backoff_max_seconds=0.1)


def test_tls_settings_that_cannot_connect_are_refused_at_start(tmp_path) -> None:
    """Issue 20: a certificate and key without a CA were accepted, then the agent thread
    died at its first connect (InputError outside the reconnect loop's try), for good."""
    (tmp_path / "cert").write_text("x")
    (tmp_path / "key").write_text("x")
    config = AgentConfig(
        Link(
            "127.0.0.1:1",
            deployment="d",
            cert_file=str(tmp_path / "cert"),
            key_file=str(tmp_path / "key"),
        ),
        0,
        TINY,
    )
    with pytest.raises(InputError, match="a client certificate .* needs --ca as well"):
        WorkerAgent(config, NoPlans(), lambda: 0)


def test_the_agent_outlives_a_certificate_file_gone_after_start(tmp_path, caplog) -> None:
    """The CA file is removed after the agent was built (a rotation gone wrong): each
    connect attempt logs why and retries; the agent thread lives on and stops when told."""
    ca = tmp_path / "ca.pem"
    ca.write_text("not read until the connect\n")
    config = AgentConfig(
        Link("127.0.0.1:1", deployment="d", ca_file=str(ca)),
        0,
        TINY,
        backoff_initial_seconds=0.01,
        backoff_max_seconds=0.02,
    )
    agent = WorkerAgent(config, NoPlans(), lambda: 0)
    ca.unlink()
    with caplog.at_level("ERROR", logger="worker_hooks.agent"):
        agent.start()
        deadline = time.monotonic() + 30.0
        while agent.reconnects < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        alive = agent._thread.is_alive()
        agent.stop()
    assert alive and agent.reconnects >= 3
    assert not agent._thread.is_alive()
    assert any(f"{ca}: no such file" in r.getMessage() for r in caplog.records)


def test_a_stream_that_ends_under_a_write_is_a_lost_link(tmp_path, monkeypatch) -> None:
    """gRPC raises InvalidStateError ("RPC already finished") for a write on a stream that
    ended between two writes (a proxy's GOAWAY, in the short chaos campaign): the agent
    takes it as a lost link and connects again, against a real controller; its thread
    lives on (it died, and the rank never came back)."""
    import asyncio

    from grpc.aio import _call

    from tests.integration.conftest import start_controller

    write = _call.StreamStreamCall.write  # gRPC's own call class (the public one is abstract)
    failed: list[bool] = []

    async def write_once_finished(self, request):  # noqa: ANN001, ANN202
        if request.HasField("window") and not failed:
            failed.append(True)
            raise asyncio.InvalidStateError("RPC already finished.")
        return await write(self, request)

    monkeypatch.setattr(_call.StreamStreamCall, "write", write_once_finished)
    ctl = start_controller(tmp_path / "c.sqlite")
    assert ctl.server is not None
    shape = TINY
    agent = WorkerAgent(
        AgentConfig(
            Link(ctl.server.address, deployment="d"),
            0,
            shape,
            backoff_initial_seconds=0.01,
            backoff_max_seconds=0.05,
        ),
        NoPlans(),
        lambda: 0,
    )
    try:
        agent.start()
        agent.submit_window(0, 1, 0, np.ones((1, 4), np.int64), None)
        deadline = time.monotonic() + 30.0
        while (
            not (failed and agent.reconnects >= 1 and agent.connected.is_set())
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        assert failed and agent._thread.is_alive()
        assert agent.reconnects >= 1 and agent.connected.is_set()
        # The window written again on the new stream reaches the controller.
        assert agent.drain(30.0)
    finally:
        agent.stop()
        ctl.stop()
    assert not agent._thread.is_alive()
