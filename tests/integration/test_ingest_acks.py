"""Acks paced to one per ack interval per stream, not one per window (issue 32), and still
in time: every window a stream sends is acknowledged within the interval (plus the trip),
the last at once when the stream ends, and what the controller folded is exactly what
was sent."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np

from rebalancer.controller.config import ControllerConfig
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.v1 import rebalancer_pb2_grpc as pb_grpc
from rebalancer.wire import codec
from rebalancer.wire.channel import client_options
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


def test_one_ack_per_interval_each_window_acked_within_it_and_folded_once(tmp_path: Path) -> None:
    interval, period, windows = 0.5, 0.05, 30
    ctl = start_controller(tmp_path / "c.sqlite", ack_interval_seconds=interval)
    try:
        assert ctl.server is not None
        rng = np.random.default_rng(3)
        counts = [rng.integers(0, 1000, (L, E)).astype(np.uint32) for _ in range(windows)]
        sent: dict[int, float] = {}
        acks: list[tuple[float, int, float]] = []  # (arrival, seq, held_seconds)
        with grpc.insecure_channel(ctl.server.address, options=client_options()) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            reply = stub.Register(
                pb.RegisterRequest(deployment="dep", ranks=[0, 1], pod="ns/p", shape=SHAPE),
                timeout=5,
            )
            done = threading.Event()

            def requests() -> Iterator[pb.WorkerMessage]:
                yield pb.WorkerMessage(hello=pb.Hello(session_id=reply.session_id))
                for seq in range(windows):
                    sent[seq] = time.monotonic()
                    yield pb.WorkerMessage(
                        window=pb.Window(
                            seq=seq, num_steps=1, logical_count=codec.encode_counts(counts[seq])
                        )
                    )
                    time.sleep(period)
                done.wait(
                    2 * interval + 1
                )  # the stream stays open: paced acks, not the end's flush

            for msg in stub.Stream(requests(), timeout=30):
                if msg.WhichOneof("body") == "window_ack":
                    acks.append((time.monotonic(), msg.window_ack.seq, msg.window_ack.held_seconds))
                    if msg.window_ack.seq == windows - 1:
                        done.set()
        span = sent[windows - 1] - sent[0]
        # The first at once, then at most one per interval (+1: the stream's end may flush one).
        assert len(acks) <= 2 + span / interval + 1, acks
        assert len(acks) < windows / 3
        assert acks[-1][1] == windows - 1
        assert [seq for _, seq, _ in acks] == sorted(seq for _, seq, _ in acks)
        for seq, at in sent.items():  # each window covered by an ack within the interval
            first = next(arrival for arrival, acked, _ in acks if acked >= seq)
            assert first - at <= interval + 0.5, (seq, first - at)
        assert all(0 <= held <= interval + 0.1 for _, _, held in acks)

        def folded() -> tuple[int, int, int]:
            c = ctl.server.controller  # type: ignore[union-attr]
            dep = c.deployment("dep")
            return dep.estimator.windows, dep.stats.tokens_folded, c.folder.rank_windows_folded

        assert ctl.call(folded) == (windows, int(sum(c.sum() for c in counts)), 2 * windows)
    finally:
        ctl.stop()
