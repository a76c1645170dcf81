"""The pod's ranks agree on their dispatch mode and top_k, and the group registration
upstream carries them (the controller predicts balance under that mode)."""

from __future__ import annotations

import pytest

from rebalancer.errors import StateError
from rebalancer.sidecar.config import SidecarConfig
from rebalancer.sidecar.pod import Pod
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.link import Link

SHAPE = pb.ModelShape(
    num_layers=2, num_logical_experts=4, num_physical_slots=6, num_gpus=2, expert_bytes=8
)


def request(rank: int, mode: str, top_k: int) -> pb.RegisterRequest:
    return pb.RegisterRequest(
        deployment="d", rank=rank, shape=SHAPE, dispatch_mode=mode, top_k=top_k
    )


def test_the_group_request_carries_the_ranks_mode_and_top_k() -> None:
    pod = Pod(SidecarConfig(link=Link("127.0.0.1:1"), ranks=(0, 1)))
    pod.register(request(0, "load+shared", 0))  # top_k 0: this rank does not know
    pod.register(request(1, "load+shared", 4))
    sent = pod.group_request()
    assert (sent.dispatch_mode, sent.top_k, list(sent.ranks)) == ("load+shared", 4, [0, 1])


def test_no_mode_is_split_upstream() -> None:
    pod = Pod(SidecarConfig(link=Link("127.0.0.1:1"), ranks=(0, 1)))
    pod.register(request(0, "", 0))
    pod.register(request(1, "split", 0))  # the same: split
    assert (pod.group_request().dispatch_mode, pod.group_request().top_k) == ("split", 0)


@pytest.mark.parametrize(
    ("second", "code", "match"),
    [
        (
            ("load", 4),
            "FAILED_PRECONDITION",
            "rank 1 dispatches by 'load', the pod's ranks by 'load\\+shared'",
        ),
        (("", 4), "FAILED_PRECONDITION", "dispatches by 'split'"),
        (("load+shared", 6), "FAILED_PRECONDITION", "rank 1 reports top_k 6, the pod's ranks 4"),
        (("even", 4), "INVALID_ARGUMENT", "unknown dispatch mode 'even'"),
    ],
)
def test_a_rank_that_disagrees_is_refused_and_changes_nothing(
    second: tuple[str, int], code: str, match: str
) -> None:
    pod = Pod(SidecarConfig(link=Link("127.0.0.1:1"), ranks=(0, 1)))
    pod.register(request(0, "load+shared", 4))
    with pytest.raises(StateError, match=match) as err:
        pod.register(request(1, *second))
    assert err.value.code == code
    assert set(pod.by_rank) == {0} and (pod.dispatch_mode, pod.top_k) == ("load+shared", 4)
