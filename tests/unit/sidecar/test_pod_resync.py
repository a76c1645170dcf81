"""A pod whose ranks restart (a gloo group that lost a member starts again from its first
placement) while its group session upstream is registered at a later version. Found by
the chaos campaign (reliability/chaos/, sigkill_worker): the sidecar kept its group session
at v1 while the restarted ranks served v0, so every later plan was based on v1 and failed
on every rank ("plan is based on v1, rank serves v0"), and store, controller and ranks
never agreed again (invariant 7). Now the pod asks the upstream link to register the group
again once all its ranks are back, with the version they serve."""

from __future__ import annotations

from rebalancer.errors import StateError
from rebalancer.sidecar.config import SidecarConfig
from rebalancer.sidecar.pod import Pod
from rebalancer.v1 import rebalancer_pb2 as pb
from rebalancer.wire.link import Link

SHAPE = pb.ModelShape(
    num_layers=2, num_logical_experts=4, num_physical_slots=6, num_gpus=2, expert_bytes=8
)


def register(pod: Pod, rank: int, version: int) -> str:
    reply = pod.register(
        pb.RegisterRequest(deployment="d", rank=rank, shape=SHAPE, placement_version=version)
    )
    pod.attach(reply.session_id, lambda msg: None)
    return reply.session_id


def test_ranks_restarted_on_an_older_version_register_the_group_again() -> None:
    pod = Pod(SidecarConfig(link=Link("127.0.0.1:1"), ranks=(0, 1)))
    sessions = [register(pod, rank, 0) for rank in (0, 1)]
    assert pod.upstream_ready() and pod.group_request().placement_version == 0
    pod.registered_upstream(pb.RegisterResponse(session_id="up", committed=pb.Placement(version=3)))
    assert not pod.resync
    for sid in sessions:  # the group died: both ranks' streams end
        pod.detach(pod.session(sid))
    register(pod, 0, 0)  # restarted, on the placement it starts with
    assert pod.resync  # the upstream session ends ...
    assert not pod.upstream_ready()  # ... and waits for every rank to be back
    register(pod, 1, 0)
    assert pod.upstream_ready()
    assert pod.group_request().placement_version == 0  # what the ranks serve, not v3
    pod.registered_upstream(
        pb.RegisterResponse(session_id="up2", committed=pb.Placement(version=0))
    )
    assert not pod.resync


def test_a_rank_that_only_reconnects_keeps_the_group_session() -> None:
    pod = Pod(SidecarConfig(link=Link("127.0.0.1:1"), ranks=(0, 1)))
    sessions = [register(pod, rank, 0) for rank in (0, 1)]
    pod.registered_upstream(pb.RegisterResponse(session_id="up", committed=pb.Placement(version=0)))
    pod.detach(pod.session(sessions[0]))
    register(pod, 0, 0)  # its link to the sidecar broke; same version
    assert not pod.resync and pod.upstream_ready()


def test_a_rank_restarted_as_a_new_process_registers_the_group_again() -> None:
    """Same version, new process (a group restarted before a commit it had been sent could
    switch): the controller must hear of it to finish that plan (plans.Plans.registered)."""
    pod = Pod(SidecarConfig(link=Link("127.0.0.1:1"), ranks=(0, 1)))
    sessions = []
    for rank in (0, 1):
        reply = pod.register(
            pb.RegisterRequest(deployment="d", rank=rank, shape=SHAPE, worker_id=f"pid-{rank}")
        )
        pod.attach(reply.session_id, lambda msg: None)
        sessions.append(reply.session_id)
    pod.registered_upstream(pb.RegisterResponse(session_id="up", committed=pb.Placement(version=0)))
    pod.detach(pod.session(sessions[0]))
    pod.register(pb.RegisterRequest(deployment="d", rank=0, shape=SHAPE, worker_id="pid-new"))
    assert pod.resync and not pod.upstream_ready()


def test_a_switch_the_relay_no_longer_follows_is_told_upstream_once() -> None:
    """Found by the chaos campaign (links dropped at commit_sent): the controller finished
    v2 as unconfirmed and sent Prepare v3; the ranks' agreement then switched to v2, and
    their COMMITTED reports stopped at the sidecar (v3 was the relay's plan). The
    controller stayed at v1 and every later plan failed on every rank ("plan is based on
    v1, rank serves v2") until a reconnection. Now the pod tells the controller once."""
    pod = Pod(SidecarConfig(link=Link("127.0.0.1:1"), ranks=(0, 1)))
    sessions = [register(pod, rank, 1) for rank in (0, 1)]
    pod.registered_upstream(pb.RegisterResponse(session_id="up", committed=pb.Placement(version=1)))
    pod.from_controller(pb.ControllerMessage(prepare=pb.Prepare(version=2, base_version=1)))
    pod.from_controller(pb.ControllerMessage(commit=pb.Commit(version=2)))
    pod.report(
        pb.PlanReport(session_id=sessions[0], version=2, phase=pb.PLAN_PHASE_COMMITTED, step=40)
    )
    assert not pod.reports  # the relay waits for rank 1: nothing early
    pod.from_controller(pb.ControllerMessage(prepare=pb.Prepare(version=3, base_version=1)))
    pod.report(
        pb.PlanReport(session_id=sessions[1], version=2, phase=pb.PLAN_PHASE_COMMITTED, step=40)
    )
    late = [(r.version, r.phase) for r in pod.reports if r.phase == pb.PLAN_PHASE_COMMITTED]
    assert late == [(2, pb.PLAN_PHASE_COMMITTED)]
    pod.report(
        pb.PlanReport(session_id=sessions[0], version=2, phase=pb.PLAN_PHASE_COMMITTED, step=40)
    )
    assert [r.version for r in pod.reports if r.phase == pb.PLAN_PHASE_COMMITTED] == [2]  # once


def test_the_group_identity_names_the_ranks_processes() -> None:
    """The controller clears a mixed placement (a plan applied in part) only when the
    ranks holding it are gone: behind a sidecar it tells that from the group's worker id."""
    pod = Pod(SidecarConfig(link=Link("127.0.0.1:1"), ranks=(0, 1)))
    sessions = []
    for rank in (0, 1):
        reply = pod.register(
            pb.RegisterRequest(deployment="d", rank=rank, shape=SHAPE, worker_id=f"pid-{rank}")
        )
        pod.attach(reply.session_id, lambda msg: None)
        sessions.append(reply.session_id)
    before = pod.group_request().worker_id
    assert before.endswith(" ranks pid-0,pid-1")
    pod.detach(pod.session(sessions[0]))
    pod.register(
        pb.RegisterRequest(deployment="d", rank=0, shape=SHAPE, worker_id="pid-0")
    )  # reconnected
    assert pod.group_request().worker_id == before
    pod.detach(pod.session(sessions[1]))
    pod.register(
        pb.RegisterRequest(deployment="d", rank=1, shape=SHAPE, worker_id="pid-new")
    )  # restarted
    assert pod.group_request().worker_id.endswith(" ranks pid-0,pid-new")


def test_ranks_that_learn_their_expert_bytes_register_the_group_again() -> None:
    """Issue 24: SGLang's warm start registers each rank before its weights are loaded,
    with expert bytes 0 ("not known yet"); the adapter registers the same processes later
    with the real bytes. The pod refused that as another shape; now it takes the bytes
    and registers the group again, so the controller learns them."""
    early = pb.ModelShape()
    early.CopyFrom(SHAPE)
    early.expert_bytes = 0
    pod = Pod(SidecarConfig(link=Link("127.0.0.1:1"), ranks=(0, 1)))
    sessions = []
    for rank in (0, 1):
        reply = pod.register(
            pb.RegisterRequest(deployment="d", rank=rank, shape=early, worker_id=f"pid-{rank}")
        )
        pod.attach(reply.session_id, lambda msg: None)
        sessions.append(reply.session_id)
    assert pod.group_request().shape.expert_bytes == 0
    pod.registered_upstream(pb.RegisterResponse(session_id="up", committed=pb.Placement(version=0)))
    for sid in sessions:  # the early sessions end
        pod.detach(pod.session(sid))
    for rank in (0, 1):
        reply = pod.register(
            pb.RegisterRequest(deployment="d", rank=rank, shape=SHAPE, worker_id=f"pid-{rank}")
        )
        pod.attach(reply.session_id, lambda msg: None)
        assert pod.resync
    assert pod.upstream_ready() and pod.group_request().shape == SHAPE
    # Known now: another rank's bytes are another shape; bytes 0 still fit.
    other = pb.ModelShape()
    other.CopyFrom(SHAPE)
    other.expert_bytes = 16
    pod.detach(pod.session(reply.session_id))
    try:
        pod.register(pb.RegisterRequest(deployment="d", rank=1, shape=other, worker_id="pid-1"))
        raise AssertionError("another expert_bytes was accepted")
    except StateError as exc:
        assert exc.code == "FAILED_PRECONDITION" and "bytes=16" in str(exc)
    assert pod.shape == SHAPE
    pod.register(pb.RegisterRequest(deployment="d", rank=1, shape=early, worker_id="pid-1"))
