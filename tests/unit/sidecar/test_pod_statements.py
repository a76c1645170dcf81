"""What a pod's sidecar says upstream about its ranks, and what it tells them: the placement
its ranks serve (level-triggered reconciliation: one (version, digest) when every rank
states the same, else the lowest version and no digest), and the controller's planned
survivor placements (every rank, and a rank that opens its stream later)."""

from __future__ import annotations

import numpy as np

from rebalancer.sidecar.config import SidecarConfig
from rebalancer.sidecar.pod import Pod
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from rebalancer.wire.link import Link

SHAPE = pb.ModelShape(
    num_layers=2, num_logical_experts=4, num_physical_slots=6, num_gpus=2, expert_bytes=8
)
COUNTS = codec.encode_counts(np.ones((2, 4), dtype=np.uint32))


def attach(pod: Pod, rank: int, version: int = 0) -> tuple[str, list[pb.ControllerMessage]]:
    got: list[pb.ControllerMessage] = []
    reply = pod.register(
        pb.RegisterRequest(deployment="d", rank=rank, shape=SHAPE, placement_version=version)
    )
    pod.attach(reply.session_id, got.append)
    return reply.session_id, got


def window(pod: Pod, sid: str, seq: int, serving: tuple[int, int]) -> None:
    pod.window(
        pod.session(sid),
        pb.Window(
            seq=seq,
            num_steps=1,
            placement_version=serving[0],
            logical_count=COUNTS,
            serving_version=serving[0],
            serving_hash=serving[1],
        ),
    )


def test_the_pod_states_a_placement_only_when_every_rank_states_it() -> None:
    pod = Pod(SidecarConfig(link=Link("127.0.0.1:1"), ranks=(0, 1)))
    (s0, _), (s1, _) = attach(pod, 0), attach(pod, 1)
    assert pod.statement() == (0, 0)  # registered: the version, no digest yet
    window(pod, s0, 0, (3, 77))
    assert pod.statement() == (0, 0)  # rank 1 has not said it serves v3
    window(pod, s1, 0, (3, 77))
    assert pod.statement() == (3, 77)
    window(pod, s1, 1, (3, 78))  # another map under the same number: not stated
    assert pod.statement() == (3, 0)
    window(pod, s0, 1, (2, 11))  # a window resent late says less: never backwards
    assert pod.statements[0] == (3, 77)


def test_planned_losses_reach_every_rank_and_one_that_comes_later() -> None:
    pod = Pod(SidecarConfig(link=Link("127.0.0.1:1"), ranks=(0, 1)))
    _, got0 = attach(pod, 0)
    for lost, base in (((0,), 4), ((1,), 4)):
        pod.from_controller(
            pb.ControllerMessage(
                planned_loss=pb.PlannedLoss(
                    kind="rank", lost_ranks=lost, base_version=base, set_size=2
                )
            )
        )
    assert [m.planned_loss.lost_ranks[0] for m in got0 if m.HasField("planned_loss")] == [0, 1]
    _, got1 = attach(pod, 1)  # opens its stream after the set was told
    assert sorted(m.planned_loss.lost_ranks[0] for m in got1 if m.HasField("planned_loss")) == [
        0,
        1,
    ]
    pod.from_controller(
        pb.ControllerMessage(
            planned_loss=pb.PlannedLoss(kind="rank", lost_ranks=(1,), base_version=5, set_size=2)
        )
    )
    assert list(pod.planned) == [(1,)]  # a newer set replaces the older whole


def test_reports_of_ranks_that_restarted_are_dropped() -> None:
    """Seed 213 of the short campaign: a COMMITTED queued here before the group restarted
    reached the controller after the group came back on v0."""
    pod = Pod(SidecarConfig(link=Link("127.0.0.1:1"), ranks=(0,)))
    sid, _ = attach(pod, 0, 9)
    pod.registered_upstream(pb.RegisterResponse(session_id="up", committed=pb.Placement(version=9)))
    pod.reports.append(pb.PlanReport(version=10, phase=pb.PLAN_PHASE_COMMITTED))  # not sent yet
    pod.detach(pod.session(sid))
    attach(pod, 0, 0)  # the process restarted on v0
    assert pod.resync and not pod.reports
