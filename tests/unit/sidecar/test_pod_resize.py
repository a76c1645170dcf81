"""The pod relays a resize of its EP group (rebalancer/sidecar/resize.py): the survivors'
registrations are gathered, told apart by worker id, answered UNAVAILABLE until the
controller took the new world, which the pod registers as one group resized from the old;
then each rank joins at the version the controller gave it. A pod of ranks 2-3 in a
world of 4 that lost rank 1: its ranks are 1-2 of 3 afterwards."""

from __future__ import annotations

import numpy as np
import pytest

from rebalancer.errors import StateError
from rebalancer.sidecar import resize
from rebalancer.sidecar.config import SidecarConfig
from rebalancer.sidecar.pod import Pod
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from rebalancer.wire.link import Link

OLD = pb.ModelShape(
    num_layers=2,
    num_logical_experts=4,
    num_physical_slots=8,
    num_gpus=4,
    num_nodes=1,
    expert_bytes=8,
)
NEW = pb.ModelShape(
    num_layers=2,
    num_logical_experts=4,
    num_physical_slots=6,
    num_gpus=3,
    num_nodes=1,
    expert_bytes=8,
)
SERVED = np.array([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 2, 3]], dtype=np.int32)
FROM = pb.Resize(version=5, num_gpus=4)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def pod_of_ranks_2_3() -> tuple[Pod, Clock]:
    clock = Clock()
    pod = Pod(SidecarConfig(link=Link("127.0.0.1:1"), ranks=(2, 3)), clock=clock)
    for rank in (2, 3):
        answer = pod.register(
            pb.RegisterRequest(
                deployment="d", rank=rank, shape=OLD, worker_id=f"w{rank}", placement_version=5
            )
        )
        pod.attach(answer.session_id, lambda msg: None)
    pod.registered_upstream(pb.RegisterResponse(committed=pb.Placement(version=5), session_id="g"))
    return pod, clock


def resized(rank: int, worker: str, served: np.ndarray = SERVED) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        deployment="d",
        rank=rank,
        shape=NEW,
        worker_id=worker,
        resized_from=FROM,
        initial_placement=pb.Placement(phy2log=codec.encode(served)),
    )


def asked_again(pod: Pod, request: pb.RegisterRequest) -> str:
    with pytest.raises(StateError) as err:
        pod.register(request)
    assert err.value.code == "UNAVAILABLE", err.value
    return str(err.value)


def test_the_survivors_are_gathered_then_the_new_world_registers_upstream_and_they_join_its_version() -> (  # noqa: E501
    None
):
    pod, _ = pod_of_ranks_2_3()
    old_session = pod.by_rank[2]
    for rank, worker in ((2, "w3"), (1, "w2")):  # old 3 is new 2, old 2 is new 1
        pod.detach(pod.by_rank[int(worker[1])])  # a survivor's agent ends its old stream first
        assert "is being relayed to the controller; ask again" in asked_again(
            pod, resized(rank, worker)
        )
    # Every old rank accounted for: the pod is the new world's ranks 1-2, told upstream once.
    assert pod.ranks == (1, 2) and pod.world == 1 and pod.resync and not pod.by_rank
    assert pod.upstream_ready()
    sent = pod.group_request()
    assert list(sent.ranks) == [1, 2] and sent.shape == NEW and sent.resized_from == FROM
    assert np.array_equal(codec.decode(sent.initial_placement.phy2log, "p"), SERVED)
    assert "w2" in sent.worker_id and "w3" in sent.worker_id
    asked_again(pod, resized(1, "w2"))  # still waiting on the controller
    with pytest.raises(StateError, match="ended"):  # the old world's session is over
        pod.window(old_session, pb.Window(seq=0))
    pod.registered_upstream(
        pb.RegisterResponse(
            committed=pb.Placement(version=6, phy2log=codec.encode(SERVED)), session_id="g2"
        )
    )
    assert not pod.group_request().HasField("resized_from")  # said once
    answers = {rank: pod.register(resized(rank, f"w{rank + 1}")) for rank in (1, 2)}
    # The ranks learn the version the controller committed the resize under, and serve it.
    assert {rank: a.committed.version for rank, a in answers.items()} == {1: 6, 2: 6}
    assert pod.relay.versions == {1: 6, 2: 6} and not pod.resync
    assert {rank: version for rank, (version, _) in pod.statements.items()} == {1: 6, 2: 6}


def test_a_rank_the_engine_lost_is_waited_for_until_it_has_been_gone_a_moment() -> None:
    """The pod of ranks 2-3 lost rank 3: only old rank 2 comes back (as rank 1)."""
    pod, clock = pod_of_ranks_2_3()
    pod.detach(pod.by_rank[2])
    asked_again(pod, resized(1, "w2"))
    clock.now += resize.SETTLE_SECONDS + 1
    asked_again(pod, resized(1, "w2"))
    assert pod.ranks == (2, 3), "old rank 3's stream is still open: it may be a survivor yet"
    pod.detach(pod.by_rank[3])
    asked_again(pod, resized(1, "w2"))
    assert pod.ranks == (1,) and pod.group_request().resized_from == FROM


def test_a_survivor_serving_another_placement_is_refused_and_changes_nothing() -> None:
    pod, _ = pod_of_ranks_2_3()
    asked_again(pod, resized(1, "w2"))
    other = SERVED.copy()
    other[0, 0] = 3
    with pytest.raises(StateError, match="serving another placement than its peers") as err:
        pod.register(resized(2, "w3", other))
    assert err.value.code == "FAILED_PRECONDITION"
    assert pod.ranks == (2, 3) and pod.resize is not None and set(pod.resize.workers) == {1}


def test_a_resized_rank_without_its_placement_or_of_another_deployment_is_refused() -> None:
    pod, _ = pod_of_ranks_2_3()
    bare = resized(1, "w2")
    bare.ClearField("initial_placement")
    with pytest.raises(StateError, match="without the placement it serves") as err:
        pod.register(bare)
    assert err.value.code == "INVALID_ARGUMENT"
    foreign = resized(1, "w2")
    foreign.deployment = "other"
    with pytest.raises(StateError, match="this pod serves 'd'") as err:
        pod.register(foreign)
    assert err.value.code == "FAILED_PRECONDITION"
    assert pod.resize is None and pod.ranks == (2, 3)
