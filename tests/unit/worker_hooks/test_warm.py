"""The warm start's shared steps (worker_hooks/warm.py): the bounded wait for the offer an
agent received, and what it refuses. The group agreement runs with real gloo ranks in
tests/integration/test_pools.py and tests/engines/vllm/test_adapter.py."""

from __future__ import annotations

import threading
import time

import numpy as np

from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from rebalancer.wire.link import Link
from rebalancer.wire.shape import shape_of
from worker_hooks.agent import AgentConfig, PlanHandlers, WorkerAgent
from worker_hooks.warm import await_offer, group_holds

SHAPE = pb.ModelShape(
    num_layers=2, num_logical_experts=4, num_physical_slots=6, num_gpus=2, num_nodes=1
)
PLACEMENT = np.array([[3, 2, 1, 0, 0, 1], [0, 1, 2, 3, 3, 3]], dtype=np.int64)


class NoPlans:
    def on_prepare(self, prepare: pb.Prepare) -> None:
        raise AssertionError("no plan in these tests")

    def on_commit(self, version: int) -> None:
        raise AssertionError("no plan in these tests")

    def on_abort(self, version: int, reason: str) -> None:
        raise AssertionError("no plan in these tests")


def _agent() -> WorkerAgent:
    # Never started: the offer is delivered as the agent's stream would (ControllerMessage).
    handlers: PlanHandlers = NoPlans()
    return WorkerAgent(
        AgentConfig(Link("127.0.0.1:1", deployment="d"), 0, shape_of(SHAPE)), handlers, lambda: 0
    )


def _offer(version: int, phy2log: np.ndarray) -> pb.ControllerMessage:
    return pb.ControllerMessage(
        warm_start=pb.Placement(version=version, phy2log=codec.encode(phy2log.astype("int32")))
    )


def test_no_offer_returns_nothing_within_the_bound() -> None:
    started = time.monotonic()
    assert await_offer(_agent(), 0.3, 2, 6, 4, rank=0) == (0, None)
    assert 0.25 <= time.monotonic() - started < 2.0
    assert await_offer(_agent(), 0.0, 2, 6, 4, rank=0) == (0, None)


def test_an_offer_arriving_during_the_wait_is_taken() -> None:
    agent = _agent()
    threading.Timer(0.1, agent._deliver, args=(_offer(5, PLACEMENT),)).start()
    version, phy2log = await_offer(agent, 10.0, 2, 6, 4, rank=0)
    assert version == 5 and phy2log is not None and np.array_equal(phy2log, PLACEMENT)


def test_an_offer_that_does_not_fit_the_rank_is_refused() -> None:
    agent = _agent()
    missing = PLACEMENT.copy()
    missing[1] = [0, 1, 2, 0, 1, 2]  # expert 3 held nowhere on layer 1
    agent._deliver(_offer(5, missing))
    assert await_offer(agent, 1.0, 2, 6, 4, rank=0) == (0, None)
    assert await_offer(_agent_with(PLACEMENT), 1.0, 3, 6, 4, rank=0) == (0, None)  # another shape


def _agent_with(phy2log: np.ndarray) -> WorkerAgent:
    agent = _agent()
    agent._deliver(_offer(2, phy2log))
    return agent


def test_one_rank_alone_holds_only_a_real_version() -> None:
    assert group_holds(3, None, 1, rank=0)
    assert not group_holds(0, None, 1, rank=0)
