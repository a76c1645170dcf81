"""The leader pod's sidecar merging its EP group (rebalancer/sidecar/merge.py), on the Pod
alone: a follower's session stands for its ranks; their windows are summed with the
leader's own ranks' per seq; a plan phase reaches a follower once; PREPARED goes up only
when every rank of the group (the leader's and each follower's) prepared; a follower that
leaves while preparing fails the plan and the group registers again without it; the
group waits for its followers, then registers with the ranks it has."""

from __future__ import annotations

import numpy as np

from rebalancer.sidecar.config import MergeConfig, SidecarConfig
from rebalancer.sidecar.pod import Pod
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire import codec
from rebalancer.wire.link import Link

SHAPE = pb.ModelShape(num_layers=2, num_logical_experts=4, num_physical_slots=8, num_gpus=4)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def leader(clock: Clock) -> Pod:
    merge = MergeConfig(role="leader", listen="127.0.0.1:0", group_ranks=(0, 1, 2, 3))
    return Pod(SidecarConfig(link=Link("127.0.0.1:1"), ranks=(0, 1), merge=merge), clock)


def join_rank(pod: Pod, rank: int) -> tuple[str, list[pb.ControllerMessage]]:
    reply = pod.register(pb.RegisterRequest(deployment="d", rank=rank, shape=SHAPE))
    got: list[pb.ControllerMessage] = []
    pod.attach(reply.session_id, got.append)
    return reply.session_id, got


def join_follower(pod: Pod) -> tuple[str, list[pb.ControllerMessage], int]:
    reply = pod.register(
        pb.RegisterRequest(deployment="d", rank=2, ranks=[2, 3], shape=SHAPE, pod="ns/b")
    )
    got: list[pb.ControllerMessage] = []
    pod.attach(reply.session_id, got.append)
    return reply.session_id, got, reply.next_window_seq


def window(pod: Pod, sid: str, seq: int, counts: np.ndarray) -> None:
    w = pb.Window(seq=seq, num_steps=4, logical_count=codec.encode(counts))
    pod.window(pod.session(sid), w)


def prepared(sid: str, version: int = 1, nbytes: int = 10) -> pb.PlanReport:
    return pb.PlanReport(
        session_id=sid, version=version, phase=pb.PLAN_PHASE_PREPARED, bytes_received=nbytes
    )


def test_follower_windows_are_summed_with_the_leaders_ranks_per_seq() -> None:
    pod = leader(Clock())
    (a, _), (b, _) = join_rank(pod, 0), join_rank(pod, 1)
    f, _, cursor = join_follower(pod)
    assert cursor == 0 and pod.ranks == (0, 1, 2, 3)
    assert pod.upstream_ready()  # every rank of the group is here: no wait
    assert list(pod.group_request().ranks) == [0, 1, 2, 3]
    ones = np.ones((2, 4), np.int64)
    window(pod, a, 0, ones)
    window(pod, b, 0, 2 * ones)
    assert not pod.take_windows()  # the follower's part of seq 0 is awaited
    window(pod, f, 0, 10 * ones)  # its two ranks' window, summed by the follower
    (merged,) = pod.take_windows()
    assert merged.ranks == {0, 1, 2, 3} and (merged.logical == 13).all()
    assert pod.stats.windows_in == 4  # rank windows: 1 + 1 + 2


def test_prepared_goes_up_once_every_rank_of_the_group_prepared_and_the_follower_hears_once() -> (
    None
):
    pod = leader(Clock())
    (a, to_a), (b, _) = join_rank(pod, 0), join_rank(pod, 1)
    f, to_f, _ = join_follower(pod)
    pod.registered_upstream(pb.RegisterResponse(session_id="up", committed=pb.Placement()))
    assert not pod.resync
    pod.from_controller(pb.ControllerMessage(prepare=pb.Prepare(version=1, base_version=0)))
    assert [m.WhichOneof("body") for m in to_f] == ["prepare"]  # once, not once per rank
    assert [m.WhichOneof("body") for m in to_a] == ["prepare"]
    pod.report(prepared(a))
    pod.report(prepared(f, nbytes=30))
    assert not pod.reports  # rank 1 has not prepared
    pod.report(prepared(b))
    (up,) = pod.reports
    assert up.phase == pb.PLAN_PHASE_PREPARED and up.bytes_received == 50  # follower's once
    pod.from_controller(pb.ControllerMessage(commit=pb.Commit(version=1)))
    assert [m.WhichOneof("body") for m in to_f] == ["prepare", "commit"]


def test_a_follower_leaving_while_preparing_fails_the_plan_and_the_group_registers_again() -> None:
    pod = leader(Clock())
    join_rank(pod, 0)
    join_rank(pod, 1)
    f, _, _ = join_follower(pod)
    pod.group_request()
    pod.registered_upstream(pb.RegisterResponse(session_id="up", committed=pb.Placement()))
    pod.from_controller(pb.ControllerMessage(prepare=pb.Prepare(version=1, base_version=0)))
    pod.detach(pod.session(f))
    (up,) = pod.reports
    assert up.phase == pb.PLAN_PHASE_FAILED and "rank 2" in up.error
    assert pod.resync and pod.ranks == (0, 1)  # its ranks leave the group session
    assert pod.upstream_ready() and list(pod.group_request().ranks) == [0, 1]
    # It comes back aligned with the group's newest window.
    _, _, cursor = join_follower(pod)
    assert pod.ranks == (0, 1, 2, 3) and cursor == 0


def test_the_group_waits_for_its_followers_then_registers_what_it_has() -> None:
    clock = Clock()
    pod = leader(clock)
    join_rank(pod, 0)
    join_rank(pod, 1)
    assert not pod.upstream_ready()  # the follower is awaited ...
    clock.now = MergeConfig().wait_seconds
    assert pod.upstream_ready()  # ... for a while
    assert list(pod.group_request().ranks) == [0, 1]
    # A follower that registers while that Register is under way: registered again.
    join_follower(pod)
    pod.registered_upstream(pb.RegisterResponse(session_id="up", committed=pb.Placement()))
    assert pod.resync and list(pod.group_request().ranks) == [0, 1, 2, 3]


def test_the_merge_flags_in_a_leaderworkerset() -> None:
    """The leader's group is LWS_GROUP_SIZE pods of --ranks-per-pod ranks; a follower names
    the leader's address as the LeaderWorkerSet gives it."""
    from rebalancer.cli import build_parser
    from rebalancer.cli.sidecar_cmd import merge_of

    env = {"LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "0"}
    flags = ["sidecar", "--ranks-per-pod", "8", "--merge-listen", "0.0.0.0:50070"]
    merge = merge_of(build_parser().parse_args(flags), env, tuple(range(8)))
    assert (merge.role, merge.listen, merge.group_ranks) == (
        "leader",
        "0.0.0.0:50070",
        tuple(range(32)),
    )
    flags = ["sidecar", "--ranks-per-pod", "8", "--merge-leader", "lws-0.lws.ns:50070"]
    merge = merge_of(build_parser().parse_args(flags), env, tuple(range(8, 16)))
    assert (merge.role, merge.leader, merge.wait_seconds) == (
        "follower",
        "lws-0.lws.ns:50070",
        10.0,
    )
    assert merge_of(build_parser().parse_args(["sidecar"]), env, (0,)).role == "off"


def test_a_warm_start_reaches_the_followers_ranks() -> None:
    """The pool's placement the controller offers the group reaches the leader's ranks
    and, through the follower's sidecar, the follower's ranks."""
    pod = leader(Clock())
    _, to_a = join_rank(pod, 0)
    join_rank(pod, 1)
    f, to_f, _ = join_follower(pod)
    offer = pb.Placement(version=3)
    pod.registered_upstream(
        pb.RegisterResponse(session_id="up", committed=pb.Placement(), warm_start=offer)
    )
    assert (
        [m.WhichOneof("body") for m in to_f]
        == [m.WhichOneof("body") for m in to_a]
        == ["warm_start"]
    )
    follower = Pod(SidecarConfig(link=Link("127.0.0.1:1"), ranks=(2, 3)))
    (_, to_rank2), _ = join_rank(follower, 2), join_rank(follower, 3)
    follower.registered_upstream(pb.RegisterResponse(session_id=f, committed=pb.Placement()))
    follower.from_controller(to_f[0])
    assert [m.warm_start.version for m in to_rank2] == [3] and follower.warm_start is not None
